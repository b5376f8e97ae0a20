"""The run's metrics output: `MetricsWriter` (workdir/metrics.jsonl, one line per finished iteration, plus
TensorBoard events when tensorboardX is installed) and `summary_table` (the fixed-width table the loop prints at
the end, with a footnote per reason a cell is empty).

Rows are flat dicts: {"iteration": i, "<phase>/<name>": number, ...} (see loop.NLACRun.iteration for the keys).
"""

from __future__ import annotations

import io
import json
import math
import sys

from nlac_jax.storage import fs


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard events) in the workdir, process 0 only. On resume, lines of iterations that
    will be re-run are dropped, so the file always holds exactly one line per finished iteration."""

    def __init__(self, workdir: str, start_iteration: int, enabled: bool = True):
        self.enabled = enabled
        self.path = fs.join(workdir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        if fs.exists(self.path):
            # a fresh start (start_iteration 0) re-runs everything, the evaluation before training included
            keep = [ln for ln in fs.read_text(self.path).split("\n") if ln.strip()
                    and start_iteration > 0 and json.loads(ln).get("iteration", 0) <= start_iteration]
            fs.write_atomic(self.path, "".join(ln + "\n" for ln in keep))
        try:
            SummaryWriter, record_writer = _import_tensorboardx()
            # tensorboardX's own gs:// writer is google-cloud-storage with its credential search: events go through
            # the one filesystem layer instead
            record_writer.register_writer_factory("gs", _EventFileFactory())
            self.tb = SummaryWriter(fs.join(workdir, "tb"))
        except ImportError:  # optional
            self.tb = None

    def write(self, m: dict) -> None:
        """Append one row (non-finite floats become null: JSON has no NaN) and its finite scalars to TensorBoard."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
        fs.append_text(self.path, json.dumps(clean, sort_keys=True) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "iteration" and math.isfinite(v):
                    self.tb.add_scalar(k, v, m["iteration"])
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def _import_tensorboardx():
    """(SummaryWriter, record_writer) from tensorboardX, without importing torch: tensorboardX's writer imports torch
    when it is installed, only to accept torch tensors, which we never pass, and that import costs a loop run 2-3 s
    of start-up (most of a resumed tiny run's). Raises ImportError without tensorboardX."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX's modules load
    try:
        from tensorboardX import SummaryWriter, record_writer
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter, record_writer


class _EventFile:
    """A TensorBoard event file on gs://: the events so far, uploaded whole at every flush (GCS has no append; a
    run writes one small row per iteration)."""

    def __init__(self, path: str):
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        fs.write_atomic(self.path, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _EventFileFactory:
    """tensorboardX's writer-factory interface (record_writer.register_writer_factory) over nlac_jax.storage.fs."""

    def open(self, path: str) -> _EventFile:
        return _EventFile(path)

    def directory_check(self, path: str) -> None:
        fs.makedirs(path)


SUMMARY_KEYS = (("collect/success_rate", "train success"), ("collect/mean_return", "train return"),
                ("train/l1", "L1 critic"), ("train/l2", "L2 policy"), ("nlac/frac_optimal", "judged optimal"),
                ("eval/success_rate", "eval success"), ("eval/mean_return", "eval return"),
                ("eval/calib/return_mae", "calib MAE"), ("eval/verdict/accuracy", "verdict acc"),
                ("time/collect", "t collect"), ("time/targets", "t targets"), ("time/train", "t train"),
                ("time/eval", "t eval"))


_EVAL_KEYS = ("eval/success_rate", "eval/mean_return", "eval/calib/return_mae", "eval/verdict/accuracy", "time/eval")


def _why_empty(key: str, row: dict, missing: bool, eval_every: int | None) -> str:
    """Why the summary cell of `key` in `row` shows '-' (missing) or nan (measured on nothing)."""
    if missing:
        if key in _EVAL_KEYS:
            when = f" (every {eval_every} iterations and after the last: LoopConfig.eval_every)" if eval_every else ""
            return f"no evaluation this iteration{when}"
        if row.get("iteration") == 0:
            return "iteration 0 is the starting policy's evaluation, before any training"
        if key in ("train/l1", "train/l2"):
            return "no train step this iteration (no examples)"
        return "not measured this iteration"
    if key == "nlac/frac_optimal":
        return "no evaluator verdict parsed (no policy example, or every critique lacked a verdict line: " \
               "nlac/verdict_unparsable)"
    if key == "eval/calib/return_mae":
        return "no successor summary had a readable 'Outcome: ...; Return: ...' line (eval/calib/parse_rate)"
    if key == "eval/verdict/accuracy":
        if row.get("eval/verdict/n") == 0:
            return "no held-out action whose optimality the task knows (eval/verdict/n = 0)"
        return "no evaluator verdict parsed on the held-out actions (eval/verdict/parse_rate)"
    if key in ("train/l1", "train/l2"):
        return "no finite loss (no example of this kind, or a non-finite step)"
    return "nothing to measure this iteration"


def summary_table(rows: list[dict], eval_every: int | None = None) -> str:
    """A fixed-width table of the key metrics, one row per iteration, with a footnote line per reason a cell is
    empty ('-': not measured this iteration; nan: measured on nothing), naming the columns it applies to."""
    cols = [(k, n) for k, n in SUMMARY_KEYS if any(k in r for r in rows)]
    head = "iter | " + " | ".join(f"{n:>14}" for _, n in cols)
    lines = [head, "-" * len(head)]
    notes: dict[tuple[str, str], list[str]] = {}  # (mark, reason) -> column names, in column order
    for r in rows:
        cells = []
        for k, name in cols:
            v = r.get(k)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            cells.append(f"{v:>14.3f}" if number else f"{'-':>14}")
            if not number or not math.isfinite(v):
                mark = "-" if not number else "nan"
                names = notes.setdefault((mark, _why_empty(k, r, not number, eval_every)), [])
                if name not in names:
                    names.append(name)
        lines.append(f"{r['iteration']:>4} | " + " | ".join(cells))
    for (mark, reason), names in notes.items():
        lines.append(f"  {mark} in {', '.join(names)}: {reason}")
    return "\n".join(lines)
