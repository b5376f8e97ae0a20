"""`python -m nlac_jax.experiments.pool OUT DIR [DIR ...]`: one table and one set of curves over the seeds of several
unit-scale workdirs.

A replication on fresh seeds runs in a workdir of its own (`experiments.unit_scale`); this pools the finished
(arm, seed) pairs of every DIR, as if one run had held them all: `OUT/results.md` (`unit_scale.results_table` and,
where the arms have it, the final evaluation's paired table `unit_scale.final_table`), the same figures, and each
seed's premise line. Nothing is trained or evaluated; it reads `arms/<arm>/seed_<s>/{metrics.jsonl,done.json}`,
`premise_seed_<s>.json` and `config.gin`. The workdirs must agree on the corpus (`UnitScaleConfig.corpus`, which names
the table's columns), and an (arm, seed) pair may come from one workdir only.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Sequence

from nlac_jax.cli import common as cli
from nlac_jax.experiments import unit_scale
from nlac_jax.experiments.arms import ARMS

PROG = "python -m nlac_jax.experiments.pool"
_CORPUS = re.compile(r"^(?:experiments\.)?UnitScaleConfig\.corpus\s*=\s*'([^']*)'", re.M)


def workdir_corpus(workdir: str) -> str:
    """The corpus a unit-scale workdir ran (its `config.gin`, written at start-up; 'toy' when unbound, the
    UnitScaleConfig default)."""
    path = os.path.join(workdir, "config.gin")
    if not os.path.isfile(path):
        raise ValueError(f"{workdir}: no config.gin: not a unit-scale workdir")
    with open(path) as f:
        m = _CORPUS.search(f.read())
    return m.group(1) if m else "toy"


def read_workdir(workdir: str) -> tuple[dict, dict, dict]:
    """(results {arm: {seed: rows}}, seconds {arm: {seed: s}}, premise {seed: (passed, line)}) of the finished
    (arm, seed) pairs of one unit-scale workdir (those with `done.json`)."""
    arms_dir = os.path.join(workdir, "arms")
    if not os.path.isdir(arms_dir):
        raise ValueError(f"{workdir}: no arms/ directory: no arm has run there")
    results: dict = {}
    seconds: dict = {}
    for arm in sorted(os.listdir(arms_dir)):
        for name in sorted(os.listdir(os.path.join(arms_dir, arm))):
            d = os.path.join(arms_dir, arm, name)
            if not (name.startswith("seed_") and os.path.isfile(os.path.join(d, unit_scale.DONE))):
                continue  # a pair still running, or killed: not finished
            seed = int(name[len("seed_"):])
            results.setdefault(arm, {})[seed] = unit_scale._read_rows(os.path.join(d, "metrics.jsonl"))
            with open(os.path.join(d, unit_scale.DONE)) as f:
                seconds.setdefault(arm, {})[seed] = json.load(f)["seconds"]
    premise = {}
    for name in os.listdir(workdir):
        m = re.fullmatch(r"premise_seed_(\d+)\.json", name)
        if m:
            with open(os.path.join(workdir, name)) as f:
                premise[int(m.group(1))] = tuple(json.load(f))
    return results, seconds, premise


def pool(workdirs: Sequence[str], arms: Sequence[str] | None = None) -> tuple[dict, dict, dict, str]:
    """The finished pairs of every workdir, merged: (results, seconds, premise, corpus). Arms in ``arms`` order
    (default: `arms.ARMS` order, those present), seeds ascending. ValueError (one line) when the workdirs ran
    different corpora, or the same (arm, seed) pair, or a seed's premise differs between them."""
    if not workdirs:
        raise ValueError("no workdir given")
    corpora = {d: workdir_corpus(d) for d in workdirs}
    if len(set(corpora.values())) > 1:
        raise ValueError("the workdirs ran different corpora: " + ", ".join(f"{d}: {c}" for d, c in corpora.items()))
    results: dict = {}
    seconds: dict = {}
    premise: dict = {}
    source: dict = {}
    for d in workdirs:
        res, secs, prem = read_workdir(d)
        for arm, per_seed in res.items():
            for seed, rows in per_seed.items():
                if (arm, seed) in source:
                    raise ValueError(f"({arm}, seed {seed}) finished in both {source[arm, seed]} and {d}: pool "
                                     f"each pair from one workdir")
                source[arm, seed] = d
                results.setdefault(arm, {})[seed] = rows
                seconds.setdefault(arm, {})[seed] = secs[arm][seed]
        for seed, verdict in prem.items():
            if seed in premise and premise[seed] != verdict:
                raise ValueError(f"seed {seed}'s premise differs between the workdirs ({d}: {verdict[1]!r})")
            premise[seed] = verdict
    order = list(arms) if arms else [a for a in ARMS if a in results]
    missing = [a for a in order if a not in results]
    if missing:
        raise ValueError(f"arm(s) {missing} finished in none of the workdirs (finished: {sorted(results)})")
    results = {a: dict(sorted(results[a].items())) for a in order}
    seconds = {a: dict(sorted(seconds[a].items())) for a in order}
    return results, seconds, dict(sorted(premise.items())), next(iter(corpora.values()))


def write_report(out: str, workdirs: Sequence[str], arms: Sequence[str] | None = None) -> str:
    """Pool ``workdirs`` (`pool`) into ``out``: results.md and the figures of `unit_scale.plot_results`. Returns
    the table (as results.md holds it)."""
    results, seconds, premise, corpus = pool(workdirs, arms)
    os.makedirs(out, exist_ok=True)
    table = unit_scale.report_table(results, seconds, None, unit_scale.table_keys(corpus), premise)
    curves, critic = unit_scale.plot_results(results, out)
    sources = "\n".join(f"- `{d}`" for d in workdirs)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# Unit-scale experiment, pooled over {len(workdirs)} workdirs\n\n{sources}\n\n{table}\n\n"
                f"![learning curves]({os.path.basename(curves)})\n![critic curves]({os.path.basename(critic)})\n")
    return table


def build_parser():
    """The pooling CLI's parser."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("out", metavar="OUT", help="directory for the pooled results.md and figures")
    p.add_argument("workdirs", nargs="+", metavar="DIR", help="unit-scale workdirs (--workdir of each run)")
    p.add_argument("--arms", default="", help="comma-separated arms, in table order (default: every arm found)")
    return p


def main(argv=None) -> int:
    """The CLI (module docstring): one line per error, exit code 1."""
    flags = build_parser().parse_args(argv)
    for d in flags.workdirs:
        cli.require_dir(d, "DIR")
    arms = [a.strip() for a in flags.arms.split(",") if a.strip()] or None
    print(write_report(flags.out, flags.workdirs, arms))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, prog=PROG))
