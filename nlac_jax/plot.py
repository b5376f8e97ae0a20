"""`python -m nlac_jax.plot --workdir DIR`: PNG learning curves from DIR/metrics.jsonl."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

PANELS = (
    ("success rate", ("collect/success_rate", "eval/success_rate")),
    ("mean return", ("collect/mean_return", "eval/mean_return")),
    ("losses", ("train/l1", "train/l2")),
    ("critic: judged optimal / verdict accuracy", ("nlac/frac_optimal", "eval/verdict/accuracy")),
    ("calibration: predicted vs actual return-to-go", ("eval/calib/predicted_return", "eval/calib/actual_return_to_go")),
    ("seconds per phase", ("time/collect", "time/targets", "time/train", "time/eval")),
)


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics file (run nlac_jax.train with --workdir {workdir} first)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_workdir(workdir: str, out: str | None = None) -> str:
    """Write the learning curves of `workdir` to `out` (default DIR/learning_curves.png); returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    out = out or os.path.join(workdir, "learning_curves.png")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for k in keys:
            pts = [(r["iteration"], r[k]) for r in rows
                   if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=k)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.abspath(workdir)))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nlac_jax.plot", description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(plot_workdir(a.workdir, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
