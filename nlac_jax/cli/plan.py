"""Plan a run before renting the slice: compile its executables for a TPU topology on this CPU and say whether the
loop fits, per chip.

    python -m nlac_jax.plan --gin_file=gin/runs/qwen2_5_7b_tau_retail.gin [--gin_param=...]   # its slice, v5p-64
    python -m nlac_jax.plan --gin_file=gin/runs/qwen2_5_7b_tau_retail.gin --gin_file=gin/hardware/v4_32.gin
    python -m nlac_jax.plan --gin_file=... --topology=v5p-64 --cpu-devices 32     # quick check, no libtpu

The slice is the one the gin files are sized for (SLICE, bound by their gin/hardware/ file); --topology may restate
it (a different slice is a usage error naming the hardware file to add) and is required when no file binds one.

It builds what `python -m nlac_jax.train` would build from the same gin files, without weights and without
allocating anything: the model config (`build_model`; the config.json numbers come from the gin model file's
`build_model.hf_config`, so MODEL_DIR is not needed), the mesh (`make_mesh.*`) over the slice's devices, and the
abstract train state. It then ahead-of-time compiles, for the slice (`jax.experimental.topologies`; libtpu from
requirements-tpu.txt compiles TPU executables on a CPU):
  - the train step (`make_train_step.*`: the batch is LoopConfig.batch_size rows of LoopConfig.max_len tokens);
  - the sampler's prefill and decode loop at every distinct (batch, prompt, new-token) bucket the roles use at the
    run's largest sampler batch (LoopConfig.sampler_max_batch, prompts fitted to max_len minus each role's budget,
    nlac.RoleSampling.max_new_tokens); smaller calls (evaluation, shrinking rollouts) use smaller buckets of the
    same executables, whose memory is bounded by these;
  - the frozen user / oracle model (`ExternalModel`) when the environment needs one.

The judge server (`python -m nlac_jax.serve`) is planned with --serve and the server's own flags:

    python -m nlac_jax.plan --serve --gin_file=gin/models/qwen2_5_7b.gin --topology=v5p-8 --tensor 4 [--fsdp 1] \
        --dtype bfloat16 --max_batch 32 --prompt_len 16384 --new_tokens 1024

It reads only the gin model file's `build_model.hf_config` (the server reads the same numbers from config.json), at
--dtype for weights and compute as the server loads them (`serve.config_overrides`), builds the server's mesh
(`serve.make_mesh`) and Sampler (`judges.server.make_sampler`), and compiles its prefill and decode at its largest
bucket (--max_batch rows of --prompt_len prompt and --new_tokens new tokens; more waiting requests reuse those rows by
continuous batching). It prints the per-chip weights, decode state (KV cache) and each executable's bytes against the
chip's usable HBM; exit 1 and one line when the peak does not fit. The serve flags mean what they mean to the server
(they are defined once, in `serve.add_model_flags`); given without --serve they are a usage error.

It prints, per executable, the per-chip bytes XLA reports (arguments, outputs, temporaries, aliased) and the loop's
peak on a chip (the train state and the external model stay resident while the samplers run), against the chip's
HBM (nlac_jax/planning/tpu_specs.py); the analytic FLOPs of a train step and of a generated token; and a roofline estimate
of step time and decode tokens/s (peak FLOP/s or HBM bandwidth, whichever binds; no communication: an estimate,
not a measurement). When something does not fit it exits 1 with one line on stderr saying what and by how much.

With a task gin that states what its prompts look like (`planning.Workload`, e.g. gin/tasks/tau_retail.gin) it also
prints a per-iteration estimate (planning/iteration.py): each phase's prompts, prompt tokens presented and computed
with and without computing shared prefixes once, generated tokens, and roofline seconds both ways. `--estimate`
prints only that table and compiles nothing:

    python -m nlac_jax.plan --gin_file=gin/runs/qwen2_5_7b_tau_retail.gin --topology=v5p-64 --estimate

Exit codes: 0 fits; 1 does not fit (or another handled error); 2 usage or configuration error (a bad --topology,
a gin mistake); --debug shows tracebacks (nlac_jax/cli/common.py).
"""

from __future__ import annotations

import argparse
import os
import re

from nlac_jax.cli import common as cli
from nlac_jax.planning import planner, tpu_specs

PROG = "python -m nlac_jax.plan"


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    cli.add_gin_file_flags(p, "gin/runs/qwen2_5_7b_tau_retail.gin")
    p.add_argument("--topology", default=None, metavar="SLICE",
                   help="Cloud TPU slice as Cloud TPU names it: v4-32, v5p-64, v5e-256, v6e-64, ... (default: the "
                        "slice the gin files are sized for, their SLICE from gin/hardware/; a different one is an "
                        "error: add that slice's gin/hardware/ file instead)")
    p.add_argument("--cpu-devices", "--cpu_devices", dest="cpu_devices", type=cli.int_at_least(1), default=None,
                   metavar="N", help="compile for N simulated CPU devices instead of the TPU topology (no libtpu; "
                                     "the HBM and roofline numbers stay the slice's)")
    p.add_argument("--estimate", action="store_true",
                   help="print only the per-iteration estimate (planning/iteration.py: the task gin's "
                        "planning.Workload), compiling nothing: seconds instead of minutes")
    g = p.add_argument_group("--serve: plan the judge server (python -m nlac_jax.serve) instead of the training loop")
    g.add_argument("--serve", action="store_true",
                   help="plan `python -m nlac_jax.serve` for the model of --gin_file (its build_model.hf_config) with "
                        "the serve flags below, which mean what they mean to the server")
    from nlac_jax.cli import serve
    serve.add_model_flags(g, defaults=False)
    g.add_argument("--prompt_len", type=cli.int_at_least(1), default=argparse.SUPPRESS, metavar="TOKENS",
                   help="longest prompt the server must take (with --serve; required)")
    g.add_argument("--new_tokens", type=cli.int_at_least(1), default=argparse.SUPPRESS, metavar="TOKENS",
                   help="largest max_tokens a request sends (with --serve; default: the server's "
                        "--default_max_tokens)")
    return p


# the planner's flags that only --serve reads
SERVE_FLAGS = ("dtype", "tensor", "fsdp", "max_batch", "prompt_len", "new_tokens")


# ----------------------------------------------------------------------------- devices
def _setup_platform(cpu_devices: int | None) -> None:
    """The planner itself never runs on an accelerator: CPU backend, and N CPU devices for --cpu-devices (set before
    JAX starts its backends; in a process that already started them, the existing CPU devices are used)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax._src import xla_bridge  # noqa: F401  (jax.config needs the backend flags registered)
    if cpu_devices is not None and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))


def _serve_plan(flags, slc, devices, where) -> planner.ServePlan:
    """make_serve_plan for the CLI's flags: the model of the gin files' build_model.hf_config, the serve flags'
    values, or the server's own defaults for those not given."""
    from nlac_jax.cli import serve
    source = f"{', '.join(flags.gin_file)}: build_model.hf_config"
    hf = planner.gin_value("build_model.hf_config", None)
    if not isinstance(hf, dict):
        raise cli.UsageError(f"--serve: {', '.join(flags.gin_file)} bind no build_model.hf_config (the model's "
                             f"config.json fields; the gin model files in gin/models/ carry them)")
    defaults = serve.build_parser()
    v = {k: getattr(flags, k, None) for k in SERVE_FLAGS}
    for k in ("dtype", "tensor", "fsdp", "max_batch"):
        v[k] = defaults.get_default(k) if v[k] is None else v[k]
    if v["new_tokens"] is None:
        v["new_tokens"] = defaults.get_default("default_max_tokens")
    cfg = planner.serve_config(hf, v["dtype"], source)
    return planner.make_serve_plan(slc, devices, where, cfg, tensor=v["tensor"], fsdp=v["fsdp"],
                                   max_batch=v["max_batch"], prompt_len=v["prompt_len"], new_tokens=v["new_tokens"],
                                   source=source)


def _slice(flags) -> tpu_specs.Slice:
    """The slice to plan for: --topology, which must be the SLICE the gin files are sized for (gin/hardware/) when
    they bind one, or that SLICE when --topology is not given. --serve plans a server, which no hardware file sizes:
    its --topology alone counts."""
    from nlac_jax.planning import planner
    sized_for = None if flags.serve else planner.gin_value("%SLICE", None)
    files, one = ", ".join(flags.gin_file), len(flags.gin_file) == 1
    try:
        sized = None if sized_for in (None, "cpu") else tpu_specs.parse_slice(sized_for, what="SLICE")
        asked = None if flags.topology is None else tpu_specs.parse_slice(flags.topology)
    except tpu_specs.TopologyError as e:
        raise cli.UsageError(f"{files}: {e}" if "SLICE" in str(e) else str(e)) from None
    if asked is None:
        if sized is None:
            raise cli.UsageError(f"--topology is required: {files} {'binds' if one else 'bind'} no TPU SLICE (a "
                                 f"run's gin/hardware/ file does"
                                 f"{'; cpu.gin sizes a CPU run' if sized_for == 'cpu' else ''})")
        return sized
    if sized is not None and asked.name != sized.name:
        raise cli.UsageError(f"--topology={flags.topology} but {files} {'is' if one else 'are'} "
                             f"sized for SLICE = {sized_for!r}: add "
                             f"--gin_file=gin/hardware/{asked.name.replace('-', '_')}.gin after "
                             f"{'it' if one else 'them'} (or write that slice's file from one in gin/hardware/)")
    return asked


def main(argv=None) -> int:
    """The planner CLI (module docstring); errors propagate (run it through `cli.run` for one-line errors)."""
    flags = build_parser().parse_args(argv)
    given = [k for k in SERVE_FLAGS if hasattr(flags, k)]
    if given and not flags.serve:
        raise cli.UsageError(f"--{given[0]} plans the judge server: add --serve (the training plan takes its sizes "
                             f"from the gin files)")
    if flags.serve and not hasattr(flags, "prompt_len"):
        raise cli.UsageError("--serve needs --prompt_len TOKENS: the longest prompt the server must take")
    if flags.topology is not None:
        try:
            tpu_specs.parse_slice(flags.topology)  # a bad flag fails before the gin files load
        except tpu_specs.TopologyError as e:
            raise cli.UsageError(str(e)) from None
    _setup_platform(flags.cpu_devices)
    import logging
    from nlac_jax.cli import setup
    setup.setup_logging()  # its filter drops gin's per-file lookup records
    logging.getLogger().setLevel(logging.WARNING)  # the table is the output; INFO lines would bury it
    params = list(flags.gin_param)
    if not any(re.match(r"\s*MODEL_DIR\s*=", b) for b in params):
        params.insert(0, "MODEL_DIR = None")  # planning reads build_model.hf_config, never the weights
    for macro, stand_in in (("JUDGE_URL", "'http://judge.invalid/v1'"), ("JUDGE_MODEL", "'judge'")):
        if not any(re.match(rf"\s*{macro}\s*=", b) for b in params):  # planning never calls the judge endpoint
            params.insert(0, f"{macro} = {stand_in}")
    setup.load_gin(flags.gin_file, params, check_mesh=False, check_run=not flags.serve)
    slc = _slice(flags)
    if flags.cpu_devices is not None:
        devices, where = planner.cpu_devices(flags.cpu_devices), f"{flags.cpu_devices} simulated CPU devices"
    else:
        import jax
        # compile-only TPU executables cannot be read back from the persistent cache (no TPU client to load them)
        jax.config.update("jax_enable_compilation_cache", False)
        devices, where = planner.topology_devices(slc), f"TPU topology {slc.topology_name}"
    if flags.estimate and not flags.serve:
        from nlac_jax.parallel import sharding
        from nlac_jax.planning import iteration
        from nlac_jax.runner import building
        cfg, _, _ = building.build_model()
        mesh = sharding.make_mesh(devices=devices)
        work, rows, note = planner.iteration_estimate(slc, cfg, mesh)
        if not rows:
            raise cli.UsageError("--estimate needs a task gin that states planning.Workload (e.g. "
                                 "gin/tasks/tau_retail.gin): none is bound")
        print(f"{slc.name}, mesh {dict(mesh.shape)}: "
              f"{iteration.report(rows, work)}\nnote: {note}", flush=True)
        return 0
    if flags.serve:
        plan = _serve_plan(flags, slc, devices, where)
    else:
        plan = planner.make_plan(slc, devices, where)
    print(plan.report(), flush=True)
    plan.check()
    return 0
