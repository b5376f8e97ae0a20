"""Learning-curve PNGs of a run from its metrics.jsonl (CLI: `python -m nlac_jax.plot`)."""

from __future__ import annotations

import io
import math

from nlac_jax.storage import fs

PANELS = (
    ("success rate", ("collect/success_rate", "eval/success_rate")),
    ("critic: scored P(success) vs held-out outcomes", ("eval/critic_auc", "eval/critic_brier",
                                                        "eval/critic_brier_base")),
    ("mean return", ("collect/mean_return", "eval/mean_return")),
    ("losses", ("train/l1", "train/l2")),
    ("critic: judged optimal / verdict accuracy", ("nlac/frac_optimal", "eval/verdict/accuracy")),
    ("calibration: predicted vs actual return-to-go", ("eval/calib/predicted_return", "eval/calib/actual_return_to_go")),
    ("seconds per phase", ("time/collect", "time/targets", "time/train", "time/eval")),
)


def read_metrics(workdir: str) -> list[dict]:
    """The rows of `workdir`/metrics.jsonl (FileNotFoundError naming the file; ValueError naming a bad line)."""
    path = fs.join(workdir, "metrics.jsonl")
    if not fs.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics file (run nlac_jax.train with --workdir {workdir} first)")
    rows = []
    for n, row in fs.read_jsonl(path):
        if not isinstance(row, dict) or "iteration" not in row:
            raise ValueError(f"{path} line {n}: expected a JSON object with an 'iteration'")
        rows.append(row)
    return rows


def plot_workdir(workdir: str, out: str | None = None) -> str:
    """Write the learning curves of `workdir` to `out` (default DIR/learning_curves.png); returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    out = out or fs.join(workdir, "learning_curves.png")
    cols = -(-len(PANELS) // 2)
    fig, axes = plt.subplots(2, cols, figsize=(5 * cols, 8))
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
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
    fig.suptitle(fs.basename(fs.abspath(workdir)))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    fs.write_atomic(out, png.getvalue())
    return out
