"""Train (or resume) the gin-configured NLAC loop of `nlac_jax.runner.loop`.

    python -m nlac_jax.train --gin_file=F [--gin_file=G ...] [--gin_param='x.y = z' ...] [--workdir DIR]

Re-running the same command with the same DIR resumes from its latest checkpoint; a run whose iterations are all
done says so and exits 0. Everything that can be checked before a model is built is checked at start-up (gin typos,
missing required bindings, malformed files, values of the wrong type or out of range, a batch size the mesh cannot
split, a tokenizer that does not fit the model): the run stops with one line naming the key or value.

Exit codes: 0 done; 2 usage or configuration error; 1 any other error (a file that cannot be read or written, a
checkpoint that cannot be restored, ...); --debug shows the full traceback instead of one line (nlac_jax/cli/common.py).
"""

from __future__ import annotations


from nlac_jax.cli import common as cli
from nlac_jax.cli import setup

PROG = "python -m nlac_jax.train"


def build_parser() -> cli.ArgumentParser:
    """The train CLI's parser (each CLI has its own: `--help` describes that CLI)."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    setup.add_gin_flags(p, "run directory: checkpoints, metrics, examples, config.gin (default runs/<first gin file "
                                 "name>); "
                     "an existing one is resumed")
    p.add_argument("--multihost", action="store_true",
                   help="initialise jax.distributed even when no environment variable says how many processes "
                        "the run has (GCE TPU pods: every worker runs the same command); a run with more than one "
                        "process (JAX_NUM_PROCESSES, a GKE TPU pod's worker list) initialises without it, a run "
                        "with one never does")
    return p


def parse_flags(argv=None):
    """The train CLI's flags."""
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """The train CLI (see the module docstring); errors propagate (run through `cli.run` for one-line errors)."""
    flags = parse_flags(argv)
    setup.setup_logging()
    from nlac_jax.parallel import distributed  # before anything touches the devices (load_gin builds the mesh)
    distributed.initialize(requested=flags.multihost)
    setup.enable_compilation_cache(flags.compilation_cache)  # before load_gin compiles anything
    setup.load_gin(flags.gin_file, flags.gin_param)
    workdir = flags.workdir or setup.default_workdir(flags.gin_file)
    setup.check_writable_dir(workdir)
    from nlac_jax.runner import interrupts
    from nlac_jax.runner import loop
    try:
        loop.run(workdir)
    except loop.Preempted:  # saved, and said so in one line: rerunning the command resumes there
        return interrupts.EXIT_PREEMPTED
    return 0
