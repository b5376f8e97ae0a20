"""Evaluate a checkpoint of an NLAC run on the held-out tasks of its gin-configured task.

    python -m nlac_jax.evaluate --gin_file=F [--gin_param='x.y = z' ...] --checkpoint=DIR [--params policy|target]
        [--workdir OUT]

Restores θ (or θ̄) from an orbax checkpoint directory (a run's WORKDIR/checkpoints; pass the run's own gin files)
and runs the held-out evaluation: success rate, mean return, episode length, and the critic diagnostics
(calibration, verdict accuracy). Prints one JSON line and writes it to OUT/eval.json.

Exit codes: 0 done; 2 usage or configuration error (e.g. no such --checkpoint directory, a gin mistake); 1 any
other error (e.g. a checkpoint that cannot be restored onto this model); --debug shows the full traceback.
"""

from __future__ import annotations

import json
import math
import sys

from nlac_jax import cli, fs

PROG = "python -m nlac_jax.evaluate"


def build_parser():
    """The evaluate CLI's parser."""
    from nlac_jax import train
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    train.add_gin_flags(p, "where eval.json is written (default: an 'eval' directory next to the checkpoint "
                           "directory, i.e. the run's WORKDIR/eval)")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="orbax checkpoint directory of a run (WORKDIR/checkpoints); its latest step is evaluated")
    p.add_argument("--params", choices=("policy", "target"), default="policy",
                   help="which weights act: policy = θ (default), target = θ̄ (the EMA target network)")
    p.add_argument("--multihost", action="store_true",
                   help="initialise jax.distributed even when no environment variable gives the process count "
                        "(as for nlac_jax.train; one process never initialises)")
    return p


def parse_flags(argv=None):
    """The evaluate CLI's flags."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """The evaluate CLI (see the module docstring); errors propagate (run through `cli.run` for one-line errors)."""
    from nlac_jax import train
    flags = parse_flags(argv)
    train.setup_logging()
    cli.require_dir(flags.checkpoint, "--checkpoint")
    from nlac_jax import distributed
    distributed.initialize(requested=flags.multihost)
    train.load_gin(flags.gin_file, flags.gin_param)
    workdir = flags.workdir or fs.join(fs.dirname(fs.abspath(flags.checkpoint)), "eval")
    train.check_writable_dir(workdir)
    train.enable_compilation_cache(flags.compilation_cache)
    from nlac_jax import loop
    r = loop.NLACRun(workdir, checkpoint=flags.checkpoint)
    try:
        m = r.evaluate(r.start_iteration, params=flags.params)
    finally:  # wait for / release orbax's background work on every path
        r.checkpointer.close()
    m = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    m["checkpoint_iteration"] = r.start_iteration
    if not r.processes.is_main:  # every process evaluated its share; process 0 reports
        return 0
    line = json.dumps(m, sort_keys=True)
    print(line)
    fs.write_atomic(fs.join(r.workdir, "eval.json"), line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, prog=PROG))
