"""The planner's library half: ahead-of-time compiles of a run's executables (the train step, in its prefix-tree
packed form when the run packs; sampler buckets and their shared-prefix executables; the frozen external model) or
of the judge server for a device list (a TPU topology or simulated CPU devices), and the per-chip fit. The command
line, platform set-up and flag handling live in `cli/plan.py`.
"""

from __future__ import annotations

import dataclasses
import os
import re

from nlac_jax import envs, models, sampling, training
from nlac_jax.judges import server
from nlac_jax.nlac import prompts as prompts_lib
from nlac_jax.parallel import sharding
from nlac_jax.planning import footprint, iteration, tpu_specs
from nlac_jax.planning.footprint import fmt_bytes
from nlac_jax.nlac.targets import TargetConfig
from nlac_jax.rl.roles import CHAT_ROLES, RoleSampling
from nlac_jax.runner import building
from nlac_jax.runner.loop import LoopConfig
from nlac_jax.sampling import decode
from nlac_jax.training import prefix_packing
from nlac_jax.training.step import PACKED_KEYS
from nlac_jax.planning.footprint import DoesNotFit  # defined there: the CLI reports it in one line


class PlanError(ValueError):
    """A plan that cannot be built from these flags and gin bindings (a usage error: exit 2, one line naming the
    flag or key)."""


def topology_devices(slc: tpu_specs.Slice) -> list:
    """Compile-only TPU devices of the slice (one per chip). Needs libtpu (requirements-tpu.txt)."""
    from jax.experimental import topologies
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise PlanError(f"--topology={slc.name}: compiling for a TPU topology needs libtpu (pip install -r "
                        f"requirements-tpu.txt), or pass --cpu-devices {slc.chips} for a CPU-only check") from None
    # libtpu looks for a TPU VM's metadata when it loads and logs a screenful of warnings without it; the topology
    # below is given explicitly, so these only quiet the loader (read once, when the plugin loads)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", slc.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # compile-only: no chip is opened, so several planners (or a planner beside the tests) may load libtpu at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kw = {"chip_config_name": "megacore"} if slc.chip.cores_per_chip == 2 else {}
    topo = topologies.get_topology_desc(topology_name=slc.topology_name, platform="tpu", **kw)
    if len(topo.devices) != slc.chips:
        raise RuntimeError(f"--topology={slc.name}: libtpu's topology {slc.topology_name!r} has "
                           f"{len(topo.devices)} devices, the table says {slc.chips} chips")
    return list(topo.devices)


def cpu_devices(n: int) -> list:
    import jax
    devs = jax.devices("cpu")
    if len(devs) < n:
        raise PlanError(f"--cpu-devices {n}: this process has only {len(devs)} CPU devices (JAX was started "
                        f"before the planner could ask for more)")
    return devs[:n]


# ----------------------------------------------------------------------------- compiled executables
@dataclasses.dataclass
class Executable:
    """One compiled executable's per-chip memory (XLA's memory_analysis) and where it sits in the loop.

    resident: bytes that stay on the chip while this executable runs but are not among its arguments (the train
    state while a sampler runs, the external model's weights). shared_args: bytes of its arguments that ARE the
    resident state (the sampler's θ), counted once."""

    name: str
    shape: str
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    code: int
    resident: int = 0
    shared_args: int = 0
    compiled: object = dataclasses.field(default=None, repr=False, compare=False)  # jax Compiled
    args: tuple = dataclasses.field(default=None, repr=False, compare=False)  # the abstract arguments it compiled for

    @property
    def own_peak(self) -> int:
        """Arguments + outputs (less the donated, aliased ones) + temporaries + code: what XLA needs for it alone."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @property
    def loop_peak(self) -> int:
        """own_peak plus what else the loop keeps on the chip meanwhile."""
        return self.own_peak + self.resident - self.shared_args


_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|exceeds the (?:available|memory)", re.I)


def compile_one(name: str, shape: str, lower) -> tuple[Executable, object]:
    """lower() -> jax Lowered; compile it and read its per-chip memory. A compile that runs out of HBM (the TPU
    compiler knows the chip's size) raises DoesNotFit with the compiler's own numbers."""
    try:
        compiled = lower().compile()
    except Exception as e:  # noqa: BLE001  XlaRuntimeError's class moves between jaxlib versions
        msg = " ".join(str(e).split())
        if _OOM.search(msg):
            raise DoesNotFit(f"does not fit: {name} ({shape}): the TPU compiler ran out of HBM: {msg[:400]}") from None
        raise
    m = compiled.memory_analysis()
    ex = Executable(name, shape, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                    int(m.temp_size_in_bytes), int(m.alias_size_in_bytes), int(m.generated_code_size_in_bytes),
                    compiled=compiled)
    return ex, compiled


def _rep(mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P())


def abstract_batch(mesh, batch: int, length: int, packed: bool = False) -> dict:
    """The token batch of the train step as sharded ShapeDtypeStructs (docs/ARCHITECTURE.md, "Token batches");
    `packed`: a prefix-tree packed batch (training/prefix_packing.py), whose node ids and kind, weight and loss
    denominators are per token, all [batch, length]."""
    import jax
    shardings = sharding.batch_shardings(mesh)
    out = {}
    for k, dtype in _BATCH_DTYPE.items():
        shape = (batch, length) if packed or len(sharding.BATCH_LOGICAL_AXES[k]) == 2 else (batch,)
        out[k] = jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
    for k in PACKED_KEYS if packed else ():
        out[k] = jax.ShapeDtypeStruct((batch, length), "int32", sharding=shardings[k])
    return out


# the token-batch contract's dtypes (docs/ARCHITECTURE.md; training.step.BATCH_KEYS in this order)
_BATCH_DTYPE = {"input_ids": "int32", "attention_mask": "int32", "positions": "int32", "loss_mask": "float32",
                "kind": "int32", "weight": "float32", "denom_tokens": "float32", "denom_examples": "float32"}


def sampler_args(cfg, mesh, params, batch: int, prompt: int):
    """Abstract (params, ids, mask, live, key, controls) for Sampler.prefill at this bucket."""
    import jax
    import jax.numpy as jnp
    rows = sharding.named_sharding(("batch", "length"), (batch, prompt), mesh)
    ids = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=rows)
    live = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=sharding.named_sharding(("batch",), (batch,), mesh))
    rep = _rep(mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    ctl = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), jax.eval_shape(decode.controls))
    return params, ids, ids, live, key, ctl


def compile_sampler(label: str, sampler, cfg, mesh, params, batch: int, prompt: int, new: int) -> list[Executable]:
    """Prefill + decode of `sampler` at bucket (batch, prompt, new) with abstract `params`; each Executable keeps its
    compiled object and abstract arguments (decode's: params, the decode state prefill returns, the controls)."""
    import jax
    args = sampler_args(cfg, mesh, params, batch, prompt)
    shape = f"B={batch} prompt={prompt} new={new} cache={prompt + new}"
    with sharding.use_mesh(mesh):
        pre, pre_c = compile_one(f"{label} prefill", shape, lambda: sampler.prefill.lower(*args, new_bucket=new))
        st = jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s), pre_c.out_info,
                          pre_c.output_shardings)
        dec, _ = compile_one(f"{label} decode", shape, lambda: sampler.decode.lower(params, st, args[-1]))
    pre.args, dec.args = args, (params, st, args[-1])
    return [pre, dec]


def compile_shared(label: str, sampler, cfg, mesh, params, batch: int, prompt: int, new: int) -> list[Executable]:
    """The shared-prefix path of `sampler` at bucket (batch, prompt, new), each executable at its own worst case:
    the common prefix prefilled once on D data-parallel rows (`Sampler.prefix`, at the longest prefix the bucket can
    share: the most activations) and fitted to the call's cache (`Sampler.fit`), the prefill of every prompt's rest
    from that prefix cache (at the shortest shared prefix, `min_shared_prefix`: the widest rests); with
    `trunk_rows`, the trunks (`Sampler.trunk`, G rows at the widest width of the grid), the prefill from the
    trunks' cache (at the narrowest trunk: the widest rests) and the G prompt rows a call without trunks of its own
    keeps from its prefilled cache (`Sampler.pack`, `StartCaches.keep_prompts`). The start caches are arguments of
    the executables that read them, so their bytes are in the table; what is not planned: continuous batching's refill and its
    kept prompts (`Sampler.keep_into`), which the loop runs when a call has more prompts than
    `sampler_max_batch` (a refill prefills fewer rows than the one-batch prefill planned here). [] when the sampler shares nothing here (no minimum, a sliding-window config, or a bucket too
    short for any prefix)."""
    import jax
    import jax.numpy as jnp
    shortest = sampler.min_shared_prefix
    if not shortest or cfg.has_sliding_layers or prompt <= shortest:
        return []
    D, cache_len = sampler.data_parallel, prompt + new
    _, _, _, live, key, ctl = sampler_args(cfg, mesh, params, batch, prompt)

    def rows(n: int, width: int | None = None):
        if width is None:
            return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding.named_sharding(("batch",), (n,), mesh))
        s = sharding.named_sharding(("batch", "length"), (n, width), mesh)
        return (jax.ShapeDtypeStruct((n, width), jnp.int32, sharding=s),) * 2

    def abstract(compiled):
        return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s), compiled.out_info,
                            compiled.output_shardings)

    def prefill(name, start, start_rows, width):
        start = dict(cache=start, src=rows(batch), keep=rows(batch))
        args = (params, *rows(batch, width), live, key, ctl, None, start)
        ex, compiled = compile_one(f"{label} {name}",
                                   f"B={batch} rest={width} start rows={start_rows} cache={cache_len}",
                                   lambda: sampler.prefill.lower(*args, new_bucket=new))
        ex.args = args
        return ex, compiled

    longest = sampling.prefix_to_share(prompt - 1, (), shortest)
    out = []
    with sharding.use_mesh(mesh):
        args = (params, *rows(D, longest))
        ex, own_c = compile_one(f"{label} prefix", f"B={D} prefix={longest}",
                                lambda: sampler.prefix.lower(*args, cache_len=longest))
        ex.args = args
        out.append(ex)
        # the prefix is kept at its own length (Sampler.prefix_store) and fitted to each call's cache
        args = (abstract(own_c),)
        ex, pre_c = compile_one(f"{label} prefix fit", f"B={D} prefix={longest} cache={cache_len}",
                                lambda: sampler.fit.lower(*args, cache_len=cache_len))
        ex.args = args
        out.append(ex)
        out.append(prefill("prefill from prefix", abstract(pre_c), D, prompt - shortest)[0])
        grid = sampling.trunk_grid(sampler.min_trunk, prompt - shortest) if sampler.trunk_rows else []
        if grid:
            G = -(-sampler.trunk_rows // D) * D
            start = dict(cache=abstract(pre_c), src=rows(G), keep=rows(G))
            args = (params, *rows(G, grid[-1]), start)
            ex, trunk_c = compile_one(f"{label} trunk", f"B={G} trunk={grid[-1]} cache={cache_len}",
                                      lambda: sampler.trunk.lower(*args, cache_len=cache_len))
            ex.args = args
            out.append(ex)
            ex, from_trunks_c = prefill("prefill from trunks", abstract(trunk_c), G, prompt - shortest - grid[0])
            out.append(ex)
            # a call without trunks of its own keeps G of its prompts' rows for the next call (StartCaches.keep_prompts)
            args = (abstract(from_trunks_c).cache, rows(G), jax.ShapeDtypeStruct((), jnp.int32))
            ex, _ = compile_one(f"{label} keep prompts", f"B={batch} kept={G} cache={cache_len}",
                                lambda: sampler.pack.lower(*args))
            ex.args = args
            out.append(ex)
    return out


# ----------------------------------------------------------------------------- the plan
def decode_line(flops_per_token: float, batch: int, est) -> str:
    """The report's decode line (training plan and server plan alike): analytic FLOPs and the roofline tokens/s."""
    return (f"decode: {flops_per_token:.3e} FLOPs per generated token (analytic, full cache); roofline estimate "
            f"{batch / est.seconds:,.0f} tokens/s at B={batch} ({est.bound}-bound, estimate)")


@dataclasses.dataclass
class Plan:
    """Everything the planner found (the table is `report()`)."""

    slice: tpu_specs.Slice
    where: str
    mesh_shape: dict
    cfg: object
    state_bytes: dict
    executables: list
    notes: list
    train_flops: float
    train_est: object
    decode_flops_per_token: float
    decode_est: object
    decode_batch: int
    iteration: list = dataclasses.field(default_factory=list)  # iteration.estimate's rows ([] without a Workload)
    workload: object = None

    @property
    def hbm(self) -> int:
        """What a program may use of a chip's HBM (tpu_specs.USABLE_HBM_FRACTION)."""
        return self.slice.chip.usable_hbm_bytes

    @property
    def peak(self) -> Executable:
        return max(self.executables, key=lambda e: e.loop_peak)

    def report(self) -> str:
        c = self.cfg
        sb = self.state_bytes
        lines = [
            f"plan: {self.slice.name} ({self.slice.chips} chips, {fmt_bytes(self.slice.chip.hbm_bytes)} HBM of "
            f"which programs get {fmt_bytes(self.hbm)}, "
            f"{self.slice.chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 and {self.slice.chip.hbm_bandwidth / 1e9:.0f} "
            f"GB/s per chip; {self.slice.chip.source}), compiled for {self.where}",
            f"model: {c.model_type} {c.num_params / 1e9:.2f}B params, {c.num_layers} layers, dtype {c.dtype}, "
            f"params {c.param_dtype}, remat {c.remat}; mesh {self.mesh_shape}",
            f"train state per chip: θ {fmt_bytes(sb['params'])}, θ̄ {fmt_bytes(sb['target_params'])}, optimiser "
            f"{fmt_bytes(sb['opt_state'])}, total {fmt_bytes(sb['total'])}"
            + (f"; external model {fmt_bytes(sb['external'])}" if sb.get("external") else ""),
            "",
            "| executable | shape | arguments | outputs | temporaries | aliased | its own peak | loop peak | usable HBM | fits |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in self.executables:
            lines.append(f"| {e.name} | {e.shape} | {fmt_bytes(e.arguments)} | {fmt_bytes(e.outputs)} | "
                         f"{fmt_bytes(e.temporaries)} | {fmt_bytes(e.aliased)} | {fmt_bytes(e.own_peak)} | "
                         f"{fmt_bytes(e.loop_peak)} | {fmt_bytes(self.hbm)} | "
                         f"{'yes' if e.loop_peak <= self.hbm else 'NO'} |")
        p = self.peak
        lines += [
            "",
            f"loop peak per chip: {fmt_bytes(p.loop_peak)} of {fmt_bytes(self.hbm)} ({100 * p.loop_peak / self.hbm:.0f}%)"
            f" during {p.name}",
            f"train step: {self.train_flops:.3e} FLOPs (analytic); roofline estimate {self.train_est.seconds:.2f} s "
            f"per step ({self.train_est.bound}-bound, 100% of peak, no communication)",
            decode_line(self.decode_flops_per_token, self.decode_batch, self.decode_est),
        ]
        if self.iteration:
            lines += ["", iteration.report(self.iteration, self.workload)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise DoesNotFit (one line) when the loop's peak exceeds a chip's HBM."""
        p = self.peak
        if p.loop_peak > self.hbm:
            raise DoesNotFit(
                f"does not fit: {p.name} ({p.shape}) needs {fmt_bytes(p.loop_peak)} per chip at the loop's peak "
                f"(its own {fmt_bytes(p.own_peak)} + resident {fmt_bytes(p.resident - p.shared_args)}), "
                f"a program may use {fmt_bytes(self.hbm)} of a {self.slice.name} chip: over by {fmt_bytes(p.loop_peak - self.hbm)}")


def state_bytes(state, compiled_step) -> dict:
    """Per-chip bytes of the train state's parts {params, opt_state, target_params, total}, in the device layouts
    of the compiled train step (its first argument), so they add up to what the chip holds."""
    fmt = compiled_step.input_formats[0][0]
    out = {k: footprint.bytes_per_chip(getattr(state, k), getattr(fmt, k)) for k in
           ("params", "opt_state", "target_params")}
    out["total"] = footprint.bytes_per_chip(state, fmt)
    return out


def _needs_external_model(env_factory) -> bool:
    """Whether the loop loads a local ExternalModel onto the chips: the environment plays against a model that is not
    behind an endpoint (external_model.kind = 'openai' runs it elsewhere)."""
    return env_factory.needs_model and gin_value("external_model.kind", "local") == "local"


def make_plan(slc: tpu_specs.Slice, devices, where: str) -> Plan:
    """Build and compile everything for `devices` under the parsed gin config (see the module docstring)."""
    import jax

    loop, rs = LoopConfig(), RoleSampling()
    cfg, _, _ = building.build_model()
    mesh = sharding.make_mesh(devices=devices)
    optimizer = training.make_optimizer()
    step = training.make_train_step(cfg, mesh, optimizer)
    dp, m = sharding.data_parallel_size(mesh), step.config.num_microbatches
    B, T = loop.batch_size, loop.max_len
    if B % dp or B % m:
        raise PlanError(f"LoopConfig.batch_size = {B} must be a multiple of the data-parallel size {dp} (mesh "
                        f"{dict(mesh.shape)}) and of make_train_step.num_microbatches = {m}")
    notes = []
    if (B // m) % dp:
        notes.append(f"a micro-batch of {B // m} rows does not split over the {dp} data-parallel shards: it is "
                     f"replicated (raise LoopConfig.batch_size or lower make_train_step.num_microbatches)")

    # the train state: resident for the whole run (bytes as the device stores them: TPU layouts are tiled)
    state = training.abstract_train_state(cfg, mesh, optimizer)
    if loop.share_prefixes:  # every batch is packed by prefix trees: only that executable runs, at its most rows
        rows = prefix_packing.max_rows(B, step.packed_row_multiple)
        name, shape, jitted = ("train step, prefix-tree packed", f"B<={rows} T<={T} micro-batches={m}",
                               step.packed_jitted)
        batch = abstract_batch(mesh, rows, T, packed=True)
        notes.append(f"LoopConfig.share_prefixes packs each step's {B} examples into prefix-tree rows: the packed "
                     f"train step is planned at its most rows ({rows}: one per example, rounded up to "
                     f"{step.packed_row_multiple} x a power of two) and T = max_len; sharing gives fewer rows or "
                     f"a shorter bucket, each its own executable (compiled when first met), never a larger one")
    else:
        name, shape, jitted = "train step", f"B={B} T={T} micro-batches={m}", step.jitted
        batch = abstract_batch(mesh, B, T)
    with sharding.use_mesh(mesh):
        train, train_c = compile_one(name, shape, lambda: jitted.lower(state, batch))
    sb = state_bytes(state, train_c)
    exes = [train]

    # the frozen user / oracle model: resident for the whole run (its weights as ExternalModel loads them)
    ext_bytes, ext_cfg = 0, None
    if _needs_external_model(envs.make_env_factory()):
        ext_dtype = gin_value("ExternalModel.dtype", "bfloat16")
        ext_cfg = cfg.replace(dtype=ext_dtype, param_dtype=ext_dtype)
        ext_params = footprint.with_shardings(models.abstract_params(ext_cfg), models.param_shardings(ext_cfg, mesh))
        ext_bytes = footprint.bytes_per_chip(ext_params)
        notes.append("the external model (user simulator / oracle) is assumed to be the run's model architecture "
                     "(ExternalModel.model_dir = MODEL_DIR in the shipped runs), sharded on the run's mesh")
    sb["external"] = ext_bytes
    train.resident = ext_bytes

    # the samplers: every distinct bucket the roles use at the largest sampler batch, with θ (θ̄ has the same shapes)
    # the loop's sampler settings (runner.loop builds it with these): the shared-prefix and trunk executables too
    sampler = sampling.Sampler(cfg, mesh=mesh, min_batch_bucket=loop.sampler_min_batch,
                               min_shared_prefix=loop.sampler_shared_prefix, trunk_rows=loop.sampler_trunk_rows,
                               min_trunk=max(1, loop.sampler_shared_prefix), prefix_store=loop.sampler_prefix_store)
    budgets = prompts_lib.prompt_budgets(T, rs.max_new_tokens)
    buckets: dict = {}
    for role in CHAT_ROLES:
        buckets.setdefault(sampler.buckets(loop.sampler_max_batch, max(1, budgets[role]), rs.budget(role)),
                           []).append(role)
    # the sampler reads θ and θ̄ as inference copies (matmul weights in the compute dtype, Sampler.run_params),
    # made once per update and released before the train step: resident while sampling, beside the train state
    params = sampler.weights_for_inference(state.params)
    copied = jax.tree.leaves(params) != jax.tree.leaves(state.params)
    sampler_exes = [e for (bb, tb, nb), roles in sorted(buckets.items())
                    for e in compile_sampler(f"sampler {'/'.join(roles)}", sampler, cfg, mesh, params, bb, tb, nb)]
    # one copy's bytes as the decode executable stores it (its first argument; TPU layouts are tiled)
    p_bytes = footprint.bytes_per_chip(params, sampler_exes[1].compiled.input_formats[0][0]) if copied \
        else sb["params"]
    copies = 2 * p_bytes if copied else 0
    if copied:
        notes.append(f"the sampler decodes from {cfg.dtype} copies of θ and θ̄ (matmul weights; made once per update, "
                     f"released before the train step): {footprint.fmt_bytes(copies)} per chip while sampling")
    shared_exes = [e for (bb, tb, nb), roles in sorted(buckets.items())
                   for e in compile_shared(f"sampler {'/'.join(roles)}", sampler, cfg, mesh, params, bb, tb, nb)]
    if shared_exes:
        notes.append(f"prompts sharing >= {loop.sampler_shared_prefix} tokens (LoopConfig.sampler_shared_prefix) "
                     f"prefill them once: the prefix"
                     + (f" and trunk ({loop.sampler_trunk_rows} rows, LoopConfig.sampler_trunk_rows)"
                        if loop.sampler_trunk_rows else "")
                     + " executables and the prefills that start from their caches are planned at each one's worst "
                       "case (compile_shared)")
    # the prefixes (and trunk sets) kept across calls (Sampler.prefix_store): each at most the longest prefix a
    # bucket shares (a trunk set: at most a whole trunk cache; it is kept cut to its filled slots)
    def largest(suffix):
        return max((e.outputs for e in shared_exes if e.name.endswith(suffix)), default=0)
    stored = loop.sampler_prefix_store * (largest(" prefix") + largest(" trunk"))
    if stored:
        notes.append(f"up to {loop.sampler_prefix_store} shared prefixes"
                     + (" and trunk sets" if largest(" trunk") else "")
                     + " are kept across sampler calls (LoopConfig.sampler_prefix_store; emptied before the train "
                     f"step): at most {footprint.fmt_bytes(stored)} per chip while sampling")
    for e in sampler_exes + shared_exes:
        e.resident, e.shared_args = sb["total"] + ext_bytes + copies + stored, p_bytes
        exes.append(e)
    eb = sampler.buckets(min(loop.eval_episodes, loop.sampler_max_batch) or 1, 1, 1)[0]
    notes.append(f"evaluation and shrinking rollouts call the same executables at batch buckets <= "
                 f"{max(b[0] for b in buckets)} (held-out evaluation: {eb} rows); their memory is bounded by these")
    if ext_cfg is not None:
        ext_sampler = sampling.Sampler(ext_cfg, mesh=mesh)
        ext_new = gin_value("ExternalModel.max_new_tokens", 128)
        ext_batch = gin_value("ExternalModel.max_batch", 64)
        eb, et, en = ext_sampler.buckets(ext_batch, T, ext_new)
        notes.append(f"external model prompts assumed <= LoopConfig.max_len = {T} tokens (bucket {et})")
        for e in compile_sampler("external model", ext_sampler, ext_cfg, mesh, ext_params, eb, et, en):
            e.resident, e.shared_args = sb["total"] + ext_bytes, ext_bytes
            exes.append(e)

    # FLOPs and the roofline estimates
    chips = len(devices)
    chip = slc.chip
    tflops = footprint.train_step_flops(cfg, B, T, step.config.loss_chunk)
    t_est = footprint.roofline(tflops, footprint.train_step_hbm_bytes(cfg, mesh, m, sb["total"]), chips,
                               chip.peak_bf16_flops, chip.hbm_bandwidth)
    (db, dt, dn) = max(buckets)
    cache = dt + dn
    dflops = footprint.decode_flops_per_token(cfg, cache)
    read_dtype = cfg.dtype if sampler.weights == "compute" else cfg.param_dtype  # the weights decode streams
    d_est = footprint.roofline(db * dflops, footprint.decode_step_hbm_bytes(cfg, mesh, db, cache, read_dtype),
                               chips, chip.peak_bf16_flops, chip.hbm_bandwidth)
    if chips != slc.chips:
        notes.append(f"compiled for {chips} devices, the slice has {slc.chips} chips")
    work, rows, note = iteration_estimate(slc, cfg, mesh)
    notes += [note] if note else []
    return Plan(slc, where, dict(mesh.shape), cfg, sb, exes, notes, tflops, t_est, dflops, d_est, db, rows, work)


def iteration_estimate(slc: tpu_specs.Slice, cfg, mesh) -> tuple:
    """(Workload, iteration.estimate's rows, a note) for the parsed gin config on ``mesh``: one iteration's work
    with and without computing shared prompt prefixes once. ([] and no note when no task gin states a Workload.)"""
    loop, work = LoopConfig(), iteration.Workload()
    if not (work.shared_tokens or work.turn_tokens):
        return work, [], ""
    rows = iteration.estimate(cfg, loop, RoleSampling(), TargetConfig(), work, slc.chips, slc.chip.peak_bf16_flops,
                              slc.chip.hbm_bandwidth, dict(mesh.shape))
    trunks = (f"trunks (LoopConfig.sampler_trunk_rows = {loop.sampler_trunk_rows}) over blocks of "
              f"LoopConfig.buffer_episode_blocks = {loop.buffer_episode_blocks} transitions of one episode"
              if loop.sampler_trunk_rows and loop.buffer_episode_blocks > 1 else
              f"no trunks (they need LoopConfig.sampler_trunk_rows > 0, now {loop.sampler_trunk_rows}, and "
              f"LoopConfig.buffer_episode_blocks > 1, now {loop.buffer_episode_blocks}: uniform draws from the buffer "
              f"rarely share an episode)")
    store = (f"kept across calls, once per parameter set (LoopConfig.sampler_prefix_store = "
             f"{loop.sampler_prefix_store}; kept trunks reused by a later call are not modelled: an upper bound)"
             if loop.sampler_prefix_store else "once per call (LoopConfig.sampler_prefix_store = 0)")
    return work, rows, (f"the per-iteration estimate's shared column is what the sampler's shared prefix "
                        f"(LoopConfig.sampler_shared_prefix = {loop.sampler_shared_prefix}; {store}), {trunks}, and "
                        f"train-row packing (LoopConfig.share_prefixes = {loop.share_prefixes}) compute")


# ----------------------------------------------------------------------------- the judge server's plan (--serve)
@dataclasses.dataclass
class ServePlan:
    """What `plan --serve` found for `python -m nlac_jax.serve` (the table is `report()`). Per-chip bytes, in the
    device layouts of the compiled decode: weights (its first argument), decode state (the KV cache and the rows'
    buffers prefill returns) and the sampling controls; decode's arguments are exactly these three."""

    slice: tpu_specs.Slice
    where: str
    mesh_shape: dict
    flags: str
    cfg: object
    weights: int
    decode_state: int
    kv_cache: int
    controls: int
    executables: list
    notes: list
    decode_flops_per_token: float
    decode_est: object
    decode_batch: int
    iteration: list = dataclasses.field(default_factory=list)  # iteration.estimate's rows ([] without a Workload)
    workload: object = None

    @property
    def hbm(self) -> int:
        return self.slice.chip.usable_hbm_bytes

    @property
    def peak(self) -> Executable:
        """The weights are every executable's argument, so each one's own peak is the server's peak meanwhile."""
        return max(self.executables, key=lambda e: e.own_peak)

    def report(self) -> str:
        c, chip = self.cfg, self.slice.chip
        lines = [
            f"serve plan: {self.slice.name} ({self.slice.chips} chips, {fmt_bytes(chip.hbm_bytes)} HBM of which "
            f"programs get {fmt_bytes(self.hbm)}; {chip.source}), compiled for {self.where}",
            f"server: python -m nlac_jax.serve {self.flags}; mesh {self.mesh_shape}",
            f"model: {c.model_type} {c.num_params / 1e9:.3g}B params, {c.num_layers} layers, {c.num_heads} heads / "
            f"{c.num_kv_heads} KV heads of {c.head_dim}, weights and compute {c.param_dtype}",
            f"per chip: weights {fmt_bytes(self.weights)}, decode state {fmt_bytes(self.decode_state)} (KV cache "
            f"{fmt_bytes(self.kv_cache)}), sampling controls {fmt_bytes(self.controls)}",
            "",
            "| executable | shape | arguments | outputs | temporaries | aliased | peak | usable HBM | fits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in self.executables:
            lines.append(f"| {e.name} | {e.shape} | {fmt_bytes(e.arguments)} | {fmt_bytes(e.outputs)} | "
                         f"{fmt_bytes(e.temporaries)} | {fmt_bytes(e.aliased)} | {fmt_bytes(e.own_peak)} | "
                         f"{fmt_bytes(self.hbm)} | {'yes' if e.own_peak <= self.hbm else 'NO'} |")
        p = self.peak
        lines += [
            "",
            f"server peak per chip: {fmt_bytes(p.own_peak)} of {fmt_bytes(self.hbm)} "
            f"({100 * p.own_peak / self.hbm:.0f}%) during {p.name}",
            decode_line(self.decode_flops_per_token, self.decode_batch, self.decode_est),
        ]
        if self.iteration:
            lines += ["", iteration.report(self.iteration, self.workload)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise DoesNotFit (one line) when the server's peak exceeds a chip's usable HBM."""
        p = self.peak
        if p.own_peak > self.hbm:
            raise DoesNotFit(
                f"does not fit: {p.name} ({p.shape}) needs {fmt_bytes(p.own_peak)} per chip (weights "
                f"{fmt_bytes(self.weights)}, decode state {fmt_bytes(self.decode_state)}, temporaries "
                f"{fmt_bytes(p.temporaries)}), a program may use {fmt_bytes(self.hbm)} of a {self.slice.name} chip: "
                f"over by {fmt_bytes(p.own_peak - self.hbm)}")


def serve_config(hf_config: dict, dtype: str, source: str):
    """The ModelConfig the server builds from this config.json content at --dtype (server.config_overrides)."""
    return models.ModelConfig.from_hf_dict(dict(hf_config), source=source, **server.config_overrides(dtype))


def make_serve_plan(slc: tpu_specs.Slice, devices, where: str, cfg, *, tensor: int, fsdp: int, max_batch: int,
                    prompt_len: int, new_tokens: int, source: str = "the model config") -> ServePlan:
    """Compile the server's prefill and decode at its largest bucket (`max_batch` rows of `prompt_len` prompt and
    `new_tokens` new tokens) on `devices`, with abstract weights of `cfg` (serve_config) sharded as the server shards
    them: the server's own mesh (server.make_mesh) and Sampler (judges.server.make_sampler)."""
    server.check_tensor(cfg, tensor, source)
    context = cfg.max_position_embeddings
    if prompt_len + new_tokens > context:  # the server refuses such a request (HTTP 400): nothing to plan
        raise PlanError(f"--prompt_len {prompt_len} + --new_tokens {new_tokens} = {prompt_len + new_tokens} "
                        f"exceeds the model's context of {context} tokens ({source}: max_position_embeddings)")
    notes = []
    mesh = server.make_mesh(tensor, fsdp, devices)
    if mesh is None:  # the server then uses one device without a mesh; a 1-device mesh holds the same bytes
        mesh = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=list(devices)[:1])
    if tensor * fsdp < len(devices):
        notes.append(f"the server uses {tensor * fsdp} of the {len(devices)} devices (the first ones)")
    if cfg.num_kv_heads % tensor:
        notes.append(f"{cfg.num_kv_heads} KV heads do not split over --tensor {tensor}: the KV projections and "
                     f"cache are replicated on the tensor devices")
    sampler = server.make_sampler(cfg, mesh)
    bb, tb, nb = sampler.buckets(max_batch, prompt_len, new_tokens)
    params = footprint.with_shardings(models.abstract_params(cfg), models.param_shardings(cfg, mesh))
    exes = compile_sampler("serve", sampler, cfg, mesh, params, bb, tb, nb)
    dec = exes[1]
    fmts = dec.compiled.input_formats[0]  # (params, decode state, controls) as the chip stores them (tiled)
    _, st, ctl = dec.args
    weights = footprint.bytes_per_chip(params, fmts[0])
    state = footprint.bytes_per_chip(st, fmts[1])
    kv = footprint.bytes_per_chip(st.cache, fmts[1].cache)
    controls = footprint.bytes_per_chip(ctl, fmts[2])
    notes.append(f"more than {bb} waiting requests are decoded by continuous batching: finished rows are refilled a "
                 f"few prompts at a time by a refill executable smaller than this prefill; smaller calls use smaller "
                 f"buckets of the same executables")
    cache = tb + nb
    chips = tensor * fsdp
    dflops = footprint.decode_flops_per_token(cfg, cache)
    d_est = footprint.roofline(bb * dflops, footprint.decode_step_hbm_bytes(cfg, mesh, bb, cache, cfg.param_dtype),
                               chips, slc.chip.peak_bf16_flops, slc.chip.hbm_bandwidth)
    flags = f"--dtype {cfg.param_dtype} --tensor {tensor} --fsdp {fsdp} --max_batch {max_batch}"
    return ServePlan(slc, where, dict(mesh.shape), flags, cfg, weights, state, kv, controls, exes, notes, dflops,
                     d_est, bb)


def gin_value(name: str, default):
    import gin
    try:
        v = gin.query_parameter(name)
    except ValueError:
        return default
    return default if v is None else v
