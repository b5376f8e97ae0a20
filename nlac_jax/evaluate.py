"""`python -m nlac_jax.evaluate --gin_file=... --checkpoint=DIR [--params policy|target] [--workdir DIR]`.

Restores θ (or θ̄) from an orbax checkpoint directory (the run's workdir/checkpoints) and runs the held-out
evaluation of the gin-configured task: success rate, mean return, episode length, and the critic diagnostics
(calibration, verdict accuracy). Prints one JSON line and writes it to WORKDIR/eval.json.
"""

from __future__ import annotations

import json
import math
import os
import sys


def main(argv=None) -> int:
    from nlac_jax import train

    def extra(p):
        p.add_argument("--checkpoint", required=True, help="orbax checkpoint directory (workdir/checkpoints)")
        p.add_argument("--params", choices=("policy", "target"), default="policy", help="θ (policy) or θ̄ (target)")
    flags = train.parse_flags(argv, prog="python -m nlac_jax.evaluate", extra=extra)
    train.setup_logging()
    if not os.path.isdir(flags.checkpoint):
        raise SystemExit(f"--checkpoint {flags.checkpoint}: no such directory")
    train.load_gin(flags.gin_file, flags.gin_param)
    train.enable_compilation_cache(flags.compilation_cache)
    from nlac_jax import loop
    workdir = flags.workdir or os.path.join(os.path.dirname(os.path.abspath(flags.checkpoint)), "eval")
    r = loop.NLACRun(workdir, checkpoint=flags.checkpoint)
    m = r.evaluate(r.start_iteration, params=flags.params)
    m = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    m["checkpoint_iteration"] = r.start_iteration
    line = json.dumps(m, sort_keys=True)
    print(line)
    with open(os.path.join(r.workdir, "eval.json"), "w") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
