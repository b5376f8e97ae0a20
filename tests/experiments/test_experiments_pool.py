"""experiments.pool: the finished (arm, seed) pairs of several unit-scale workdirs in one table (hand-built workdirs,
hand-computed cells), and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from nlac_jax.experiments import pool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _workdir(root, name, pairs, corpus="toy_forecast", premise=None, unfinished=()):
    """A unit-scale workdir holding ``pairs`` {(arm, seed): (last held-out success, final success or None)}."""
    d = root / name
    (d / "arms").mkdir(parents=True)
    (d / "config.gin").write_text(f"# Parameters for UnitScaleConfig:\nUnitScaleConfig.corpus = '{corpus}'\n"
                                  "UnitScaleConfig.n = %N\n")
    for (arm, seed), (last, final) in pairs.items():
        s = d / "arms" / arm / f"seed_{seed}"
        s.mkdir(parents=True)
        rows = [{"iteration": 0, "eval/success_rate": 0.1}, {"iteration": 24, "eval/success_rate": last}]
        if final is not None:
            rows[-1].update({"final/success_rate": final, "final/num_episodes": 100})
        s.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        s.joinpath("done.json").write_text(json.dumps({"seconds": 10.0 * seed}))
    for arm, seed in unfinished:  # a pair that was killed: metrics but no done.json
        s = d / "arms" / arm / f"seed_{seed}"
        s.mkdir(parents=True)
        s.joinpath("metrics.jsonl").write_text(json.dumps({"iteration": 0, "eval/success_rate": 0.9}) + "\n")
    for seed, verdict in (premise or {}).items():
        (d / f"premise_seed_{seed}.json").write_text(json.dumps(list(verdict)))
    return str(d)


def _cells(table: str, arm: str, header_prefix: str = "| arm | seeds |") -> dict:
    lines = table.splitlines()
    head = next(ln for ln in lines if ln.startswith(header_prefix))
    row = next(ln for ln in lines[lines.index(head):] if ln.startswith(f"| {arm} |"))
    return dict(zip([c.strip() for c in head.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))


def test_pooled_table_holds_every_workdirs_seeds(tmp_path):
    ok = (True, "premise holds: fine")
    a = _workdir(tmp_path, "a", {("warm_start", 1): (0.3, 0.30), ("nlac", 1): (0.5, 0.40)}, premise={1: ok},
                 unfinished=[("nlac", 3)])
    b = _workdir(tmp_path, "b", {("warm_start", 2): (0.4, 0.50), ("nlac", 2): (0.6, 0.70), ("rft", 2): (0.2, None)},
                 premise={2: ok})
    out = str(tmp_path / "out")
    table = pool.write_report(out, [a, b])
    # held-out success: the last evaluation, mean ± population std over seeds 1 (from a) and 2 (from b)
    assert _cells(table, "nlac")["held-out success"] == "0.550 ± 0.050"
    assert _cells(table, "nlac")["seeds"] == "2" and _cells(table, "rft")["seeds"] == "1"  # seed 3: not finished
    assert _cells(table, "warm_start")["seconds per seed"] == "15.000 ± 5.000"
    # the final evaluation's paired table: nlac - warm start per seed = +10.0 / +20.0 points
    fin = _cells(table, "nlac", "| arm | episodes per seed |")
    assert fin["per seed"] == "0.400 / 0.700" and fin["− warm start, per seed (points)"] == "+10.0 / +20.0"
    assert fin["mean ± std (points)"] == "+15.0 ± 5.0"
    assert "Seed 1: premise holds: fine." in table and "Seed 2: premise holds: fine." in table
    assert [ln.split("|")[1].strip() for ln in table.splitlines()[2:5]] == ["warm_start", "nlac", "rft"]  # ARMS order
    text = open(os.path.join(out, "results.md")).read()
    assert f"- `{a}`" in text and f"- `{b}`" in text and table in text
    for png in ("learning_curves.png", "critic_curves.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # --arms picks and orders
    results, *_ = pool.pool([a, b], ["nlac", "warm_start"])
    assert list(results) == ["nlac", "warm_start"] and list(results["nlac"]) == [1, 2]


def test_pool_refuses_what_it_cannot_merge(tmp_path):
    a = _workdir(tmp_path, "a", {("nlac", 1): (0.5, None)}, premise={1: (True, "holds")})
    with pytest.raises(ValueError, match=r"\(nlac, seed 1\) finished in both"):
        pool.pool([a, _workdir(tmp_path, "b", {("nlac", 1): (0.5, None)})])
    with pytest.raises(ValueError, match="ran different corpora"):
        pool.pool([a, _workdir(tmp_path, "c", {("nlac", 2): (0.5, None)}, corpus="twenty_questions_forecast")])
    with pytest.raises(ValueError, match="seed 1's premise differs"):
        pool.pool([a, _workdir(tmp_path, "d", {("rft", 1): (0.5, None)}, premise={1: (False, "failed")})])
    with pytest.raises(ValueError, match=r"arm\(s\) \['grpo'\] finished in none"):
        pool.pool([a], ["grpo"])
    (tmp_path / "e").mkdir()
    with pytest.raises(ValueError, match="no config.gin"):
        pool.pool([str(tmp_path / "e")])


def test_cli_names_the_missing_directory_in_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "nlac_jax.experiments.pool", str(tmp_path / "out"),
                          str(tmp_path / "nowhere")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere: no such directory" in lines[0], res.stderr
