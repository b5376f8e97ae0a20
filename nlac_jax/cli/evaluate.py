"""Evaluate a checkpoint of an NLAC run, or any supported HF model, on the held-out tasks of its gin-configured task.

    python -m nlac_jax.evaluate --gin_file=F [--gin_param='x.y = z' ...] --checkpoint=DIR [--params policy|target]
        [--workdir OUT]
    python -m nlac_jax.evaluate --gin_file=F [--gin_param=...] --model_dir=HF_DIR [--workdir OUT]

--checkpoint restores θ (or θ̄) from an orbax checkpoint directory (a run's WORKDIR/checkpoints; pass the run's own
gin files). --model_dir evaluates an HF directory (config.json + safetensors + tokenizer) as it is, e.g. the
instruct model before NLAC: it stands in for the gin's model (build_model.model_dir; the gin model file's hf_config
is not checked against it), acts as θ and judges as θ̄, and no TrainState or checkpoint is built; the evaluation
seed is the one the loop uses before training (its `eval_before_training` row). Either way the loop's own
held-out evaluation runs (NLACRun.evaluate): success rate, mean return, episode length, and the critic diagnostics
(calibration, verdict accuracy). Prints one JSON line and writes it to OUT/eval.json (OUT defaults to the run's
WORKDIR/eval for --checkpoint, runs/eval_<model directory name> for --model_dir).

Exit codes: 0 done; 2 usage or configuration error (e.g. no such --checkpoint directory, a gin mistake); 1 any
other error (e.g. a checkpoint that cannot be restored onto this model); --debug shows the full traceback.
"""

from __future__ import annotations

import json
import math

from nlac_jax.cli import common as cli
from nlac_jax.storage import fs

PROG = "python -m nlac_jax.evaluate"


def build_parser():
    """The evaluate CLI's parser."""
    from nlac_jax.cli import setup
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    setup.add_gin_flags(p, "where eval.json is written (default: an 'eval' directory next to the checkpoint "
                           "directory, i.e. the run's WORKDIR/eval)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", metavar="DIR",
                       help="orbax checkpoint directory of a run (WORKDIR/checkpoints); its latest step is evaluated")
    which.add_argument("--model_dir", metavar="DIR",
                       help="an HF model directory (config.json, safetensors, tokenizer) evaluated as it is, "
                            "without a checkpoint")
    p.add_argument("--params", choices=("policy", "target"), default="policy",
                   help="which weights act: policy = θ (default), target = θ̄ (the EMA target network); with "
                        "--model_dir both are the directory's weights")
    p.add_argument("--multihost", action="store_true",
                   help="initialise jax.distributed even when no environment variable gives the process count "
                        "(as for nlac_jax.train; one process never initialises)")
    return p


def parse_flags(argv=None):
    """The evaluate CLI's flags."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """The evaluate CLI (see the module docstring); errors propagate (run through `cli.run` for one-line errors)."""
    from nlac_jax.cli import setup
    flags = parse_flags(argv)
    setup.setup_logging()
    source = flags.checkpoint or flags.model_dir
    cli.require_dir(source, "--checkpoint" if flags.checkpoint else "--model_dir")
    from nlac_jax.parallel import distributed
    distributed.initialize(requested=flags.multihost)
    params = list(flags.gin_param)
    if flags.model_dir:  # after the run's own bindings, so it wins over the gin model file's directory
        params += [f"build_model.model_dir = {fs.abspath(flags.model_dir)!r}", "build_model.hf_config = None"]
    setup.load_gin(flags.gin_file, params)
    if flags.checkpoint:
        workdir = flags.workdir or fs.join(fs.dirname(fs.abspath(flags.checkpoint)), "eval")
    else:
        workdir = flags.workdir or fs.join("runs", "eval_" + fs.basename(flags.model_dir.rstrip("/")))
    setup.check_writable_dir(workdir)
    setup.enable_compilation_cache(flags.compilation_cache)
    from nlac_jax.runner import loop
    if flags.model_dir:
        r = loop.NLACRun(workdir, restore=False, model_only=True)
        m = r.evaluate(-1, params=flags.params)  # -1: the loop's evaluation before training (its seed)
    else:
        r = loop.NLACRun(workdir, checkpoint=flags.checkpoint)
        try:
            m = r.evaluate(r.start_iteration, params=flags.params)
        finally:  # wait for / release orbax's background work on every path
            r.checkpointer.close()
    m = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    if flags.model_dir:
        m["model_dir"] = fs.abspath(flags.model_dir)
    else:
        m["checkpoint_iteration"] = r.start_iteration
    if not r.processes.is_main:  # every process evaluated its share; process 0 reports
        return 0
    line = json.dumps(m, sort_keys=True)
    print(line)
    fs.write_atomic(fs.join(r.workdir, "eval.json"), line + "\n")
    return 0
