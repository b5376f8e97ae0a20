"""The sharded NLAC train step: L1 + L2 over one mixed batch, gradient accumulation, AdamW, EMA target.

    opt = training.make_optimizer()
    state = training.create_train_state(cfg, mesh, opt, params=model.params)
    step = training.make_train_step(cfg, mesh, opt)          # gin: make_train_step.*
    state, metrics = step(state, batch)                      # batch: batching.pack_examples(...).as_dict()

`step` wraps `jax.jit(train_step, in_shardings=(state, batch), out_shardings=(state, replicated),
donate_argnums=(0,))` and enters the mesh (`sharding.use_mesh`) around the call so activation constraints apply
while tracing. Metrics (replicated float/int scalars, METRIC_KEYS) are those of the parameters BEFORE the update.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from nlac_jax import models
from nlac_jax.models.config import ModelConfig
from nlac_jax.models.decoder import CausalLM
from nlac_jax.parallel import sharding, xla_options
from nlac_jax.parallel.distributed import replicated_to_global
from nlac_jax.training import batching, loss as loss_lib
from nlac_jax.training.optim import Optimizer, make_optimizer
from nlac_jax.training.state import TrainState, state_shardings

BATCH_KEYS = ("input_ids", "attention_mask", "positions", "loss_mask", "kind", "weight", "denom_tokens",
              "denom_examples")
_BATCH_DTYPES = {"input_ids": np.int32, "attention_mask": np.int32, "positions": np.int32,
                 "loss_mask": np.float32, "kind": np.int32, "weight": np.float32, "denom_tokens": np.float32,
                 "denom_examples": np.float32}
_DENOM_KEYS = ("denom_tokens", "denom_examples")
# a prefix-tree packed batch (training/prefix_packing.py) adds these; its kind, weight, denominators are [B, T]
PACKED_KEYS = ("node_ids", "node_ends")
_BATCH_DTYPES.update({k: np.int32 for k in PACKED_KEYS})


def batch_keys(batch: Mapping) -> tuple[str, ...]:
    """The contract keys of this batch: BATCH_KEYS, plus PACKED_KEYS for a packed batch (both or neither)."""
    have = [k for k in PACKED_KEYS if k in batch]
    if have and len(have) != len(PACKED_KEYS):
        raise KeyError(f"packed train batch has {have} but not {[k for k in PACKED_KEYS if k not in have]}")
    return BATCH_KEYS + (PACKED_KEYS if have else ())

METRIC_KEYS = ("loss", "l1", "l2", "critic_tokens", "policy_tokens", "critic_examples", "policy_examples",
               "num_tokens", "grad_norm", "learning_rate", "skipped", "skipped_total", "consecutive_skips", "step")


def _with_denominators(batch: Mapping) -> dict:
    """The host batch with its loss denominators: a batch without them (built by hand, not by text.pack_*) is its
    own iteration, so they are its own counts (batching.kind_counts, as the loss counts). Needs the WHOLE batch."""
    batch = dict(batch)
    missing = [k for k in _DENOM_KEYS if k not in batch]
    if len(missing) == 1:
        raise KeyError(f"train batch has {[k for k in _DENOM_KEYS if k in batch]} but not {missing}")
    if missing:
        if any(isinstance(batch[k], jax.Array) for k in ("loss_mask", "kind")):
            raise KeyError(f"train batch of jax.Arrays is missing {list(_DENOM_KEYS)} "
                           f"(batching.share_loss_denominators)")
        lm, kind = np.asarray(batch["loss_mask"]), np.asarray(batch["kind"])
        br = np.asarray(batch["node_ids"]) if "node_ids" in batch else None
        counts = batching.kind_counts(lm, kind, br)
        batch["denom_tokens"], batch["denom_examples"] = batching.row_denominators(counts, kind)
    return batch


class NonFiniteError(FloatingPointError):
    """Too many consecutive train steps with a non-finite loss or gradient."""


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """How the step combines and reduces the losses (see training/loss.py for the exact formulas)."""

    critic_weight: float = 1.0
    policy_weight: float = 1.0
    normalisation: str = "token"
    num_microbatches: int = 1
    loss_chunk: int = 0
    loss_positions: int = 0
    ema_decay: float = 0.99
    max_consecutive_skips: int = 10


# ----------------------------------------------------------------------------- pure functions (traced)
def _microbatch_loss(params, mb, cfg: ModelConfig, sc: StepConfig):
    """Σ coef·nll over one micro-batch: (total, [L1 part, L2 part])."""
    segments = (mb["node_ids"], mb["node_ends"]) if "node_ids" in mb else None
    hidden, _ = CausalLM(cfg).apply({"params": params}, mb["input_ids"], mb["positions"], mb["attention_mask"],
                                    return_hidden=True, segments=segments)
    if sc.loss_positions:
        parts = loss_lib.target_position_losses(cfg, hidden, params, mb["labels"], mb["coef"], sc.loss_positions,
                                                chunk=sc.loss_chunk)
    else:
        parts = loss_lib.weighted_losses(loss_lib.token_nll(cfg, hidden, params, mb["labels"], chunk=sc.loss_chunk),
                                         mb["coef"])
    return sc.critic_weight * parts[0] + sc.policy_weight * parts[1], parts


def _split_microbatches(x, m: int):
    """[B, ...] -> [m, B/m, ...] with micro-batch i = rows i, i+m, i+2m, ...: each data shard keeps its own rows."""
    b = x.shape[0]
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)


def loss_and_grads(params, batch: Mapping[str, jax.Array], cfg: ModelConfig, sc: StepConfig, param_shardings=None):
    """(total loss, grads (float32, like params), info) for a token batch; accumulation over sc.num_microbatches.

    info: l1, l2 and the per-kind counts of loss_lib.loss_coefficients, plus num_tokens (real tokens in the batch).
    """
    coef, counts = loss_lib.loss_coefficients(batch["loss_mask"], batch["kind"], batch["weight"], sc.normalisation,
                                              batch["denom_tokens"], batch["denom_examples"], batch.get("node_ids"))
    labels, _ = loss_lib.shift_targets(batch["input_ids"], batch["loss_mask"])
    data = {"input_ids": batch["input_ids"], "positions": batch["positions"],
            "attention_mask": batch["attention_mask"], "labels": labels, "coef": coef.swapaxes(0, 1)}  # coef [B,2,T]
    data.update({k: batch[k] for k in PACKED_KEYS if k in batch})
    grad_fn = jax.value_and_grad(
        lambda p, mb: _microbatch_loss(p, {**mb, "coef": mb["coef"].swapaxes(0, 1)}, cfg, sc), has_aux=True)
    to_f32 = lambda t: jax.tree.map(lambda g: g.astype(jnp.float32), t)  # noqa: E731
    m = sc.num_microbatches
    if m <= 1:
        (total, parts), grads = grad_fn(params, data)
        grads = to_f32(grads)
    else:
        mbs = jax.tree.map(lambda x: _split_microbatches(x, m), data)

        def body(carry, mb):
            g_acc, tot_acc, parts_acc = carry
            mb = {k: sharding.constrain(v, ("batch",) + ("length",) * (v.ndim - 1) if k != "coef"
                                        else ("batch", None, "length")) for k, v in mb.items()}
            (tot, parts), g = grad_fn(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return (g_acc, tot_acc + tot, parts_acc + parts), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if param_shardings is not None and sharding.active_mesh() is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((2,), jnp.float32))
        (grads, total, parts), _ = jax.lax.scan(body, init, mbs)
    info = dict(counts, l1=parts[0], l2=parts[1],
                num_tokens=jnp.sum(batch["attention_mask"]).astype(jnp.float32))
    return total, grads, info


def train_step(state: TrainState, batch, cfg: ModelConfig, optimizer: Optimizer, sc: StepConfig,
               param_shardings=None) -> tuple[TrainState, dict]:
    """One update (pure; jit it via make_train_step). Non-finite loss or grad norm -> θ, opt_state, θ̄ unchanged."""
    total, grads, info = loss_and_grads(state.params, batch, cfg, sc, param_shardings)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    lr = optimizer.schedule(state.applied_updates)
    tau = sc.ema_decay

    def apply(operands):
        params, opt_state, target, grads = operands
        updates, new_opt = optimizer.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_target = jax.tree.map(lambda t, p: (tau * t + (1.0 - tau) * p).astype(t.dtype), target, new_params)
        return new_params, new_opt, new_target

    def keep(operands):
        return operands[:3]

    # lax.cond, not a jnp.where per leaf: the skip test costs no extra pass over θ, the Adam moments and θ̄
    new_params, new_opt, new_target = jax.lax.cond(
        finite, apply, keep, (state.params, state.opt_state, state.target_params, grads))
    skipped = (~finite).astype(jnp.int32)
    rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
    new_state = TrainState(
        params=new_params, opt_state=new_opt, target_params=new_target,
        step=state.step + 1, rng=rng, skipped=state.skipped + skipped,
        consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1))
    metrics = dict(info, loss=total, grad_norm=grad_norm, learning_rate=lr, skipped=skipped,
                   skipped_total=new_state.skipped, consecutive_skips=new_state.consecutive_skips, step=state.step)
    return new_state, metrics


# ----------------------------------------------------------------------------- host side
def check_finite(metrics: Mapping[str, Any], max_consecutive_skips: int) -> None:
    """Raise NonFiniteError when `metrics['consecutive_skips']` reached `max_consecutive_skips` (<= 0: never)."""
    if max_consecutive_skips <= 0:
        return
    n = int(metrics["consecutive_skips"])
    if n >= max_consecutive_skips:
        raise NonFiniteError(
            f"{n} consecutive train steps had a non-finite loss or gradient norm and were skipped (limit "
            f"make_train_step.max_consecutive_skips={max_consecutive_skips}); last step {int(metrics['step'])}: "
            f"loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}, "
            f"total skipped={int(metrics['skipped_total'])}. Lower the learning rate, check the batch for empty or "
            f"broken targets, or restore the last checkpoint.")


def tokens_per_second(num_tokens: float, seconds: float) -> float:
    """Throughput helper: tokens (e.g. metrics['num_tokens'], real tokens incl. prompts) per wall-clock second."""
    return float(num_tokens) / max(float(seconds), 1e-12)


class Throughput:
    """Host-side tokens/s meter: `t = Throughput(); ...; t.update(metrics['num_tokens']); t.tokens_per_second`.

    Measures wall time between `update` calls (block on the metrics first for honest numbers)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._t0, self.tokens, self.seconds = time.perf_counter(), 0.0, 0.0

    def update(self, num_tokens) -> float:
        now = time.perf_counter()
        dt, self._t0 = now - self._t0, now
        self.tokens += float(num_tokens)
        self.seconds += dt
        return tokens_per_second(num_tokens, dt)

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.tokens, self.seconds)


class TrainStep:
    """Callable `step(state, batch) -> (new_state, metrics)`; `state` is donated (do not reuse it).

    batch: a dict (or anything with `.as_dict()`, e.g. batching.PackedBatch) with the arrays of the token-batch contract
    (docs/ARCHITECTURE.md). B must be divisible by num_microbatches and by the data-parallel size (data × fsdp).
    With several processes, NumPy arrays are this process's rows of the global batch.
    Non-finite guard: after each call, the PREVIOUS call's metrics are checked (so the check never stalls the
    pipeline) and NonFiniteError is raised once `max_consecutive_skips` updates in a row were skipped.
    """

    def __init__(self, cfg: ModelConfig, mesh, optimizer: Optimizer, sc: StepConfig, rules=None,
                 compiler_options: Mapping[str, str] | None = None):
        self.cfg, self.mesh, self.optimizer, self.config, self.rules = cfg, mesh, optimizer, sc, rules
        self.max_consecutive_skips = sc.max_consecutive_skips  # host-side guard; may be changed between calls
        self.state_shardings = state_shardings(cfg, mesh, optimizer, rules)
        every = sharding.batch_shardings(mesh, rules)
        self.batch_shardings = {k: every[k] for k in BATCH_KEYS}
        self.packed_batch_shardings = {k: every[k] for k in BATCH_KEYS + PACKED_KEYS}
        self.data_parallel = sharding.data_parallel_size(mesh, rules)
        rep = NamedSharding(mesh, P())
        fn = lambda state, batch: train_step(state, batch, cfg, optimizer, sc,  # noqa: E731
                                             self.state_shardings.params)
        if compiler_options is None:
            compiler_options = default_compiler_options(cfg, mesh)
        self.compiler_options = dict(compiler_options)
        # one jit per batch layout (the in_shardings tree must match the batch's keys); the packed one compiles
        # only if a packed batch arrives
        self.jitted, self.packed_jitted = (
            jax.jit(fn, in_shardings=(self.state_shardings, bs), out_shardings=(self.state_shardings, rep),
                    donate_argnums=(0,), compiler_options=self.compiler_options or None)
            for bs in (self.batch_shardings, self.packed_batch_shardings))
        self._pending = None

    @property
    def packed_row_multiple(self) -> int:
        """Rows of a prefix-tree packed batch come in multiples of this (prefix_packing.pack_shared_prefix's
        row_multiple): every micro-batch splits over the data-parallel shards."""
        return math.lcm(self.data_parallel, max(1, self.config.num_microbatches))

    def _jit_for(self, batch: Mapping):
        return self.packed_jitted if "node_ids" in batch else self.jitted

    def prepare_batch(self, batch) -> dict:
        """Validate and convert a host batch (dict or PackedBatch) to the contract dtypes."""
        if hasattr(batch, "as_dict"):
            batch = batch.as_dict()
        if jax.process_count() == 1:  # several processes pass their own rows: counts of those would be wrong
            batch = _with_denominators(batch)
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise KeyError(f"train batch is missing {missing} (contract: {BATCH_KEYS})")
        out = {k: (batch[k] if isinstance(batch[k], jax.Array) else np.asarray(batch[k], _BATCH_DTYPES[k]))
               for k in batch_keys(batch)}
        if jax.process_count() > 1:  # multi-host: each process passes ITS rows; assemble the global batch
            out = {k: v if isinstance(v, jax.Array) else
                   jax.make_array_from_process_local_data(self.packed_batch_shardings[k], v) for k, v in out.items()}
        B = out["input_ids"].shape[0]
        m = self.config.num_microbatches
        if B % max(m, 1):
            raise ValueError(f"batch size {B} is not divisible by num_microbatches={m}")
        if B % self.data_parallel:
            raise ValueError(f"batch size {B} is not divisible by the data-parallel size {self.data_parallel} "
                             f"(mesh {dict(self.mesh.shape)})")
        return out

    def from_replicated(self, batch) -> dict:
        """A batch that every process holds IN FULL (the NLAC loop's packed batches are the same on every process)
        as global arrays in the step's batch shardings; unchanged with one process, where NumPy rows are already
        the whole batch. (Without this, several processes passing NumPy would each be read as their own rows.)"""
        if jax.process_count() == 1:
            return batch
        if hasattr(batch, "as_dict"):
            batch = batch.as_dict()
        batch = _with_denominators(batch)
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise KeyError(f"train batch is missing {missing} (contract: {BATCH_KEYS})")
        host = {k: np.asarray(batch[k], _BATCH_DTYPES[k]) for k in batch_keys(batch)}
        return replicated_to_global(host, {k: self.packed_batch_shardings[k] for k in host})

    def lower(self, state, batch):
        batch = self.prepare_batch(batch)
        with sharding.use_mesh(self.mesh, self.rules):
            return self._jit_for(batch).lower(state, batch)

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        batch = self.prepare_batch(batch)
        with sharding.use_mesh(self.mesh, self.rules):
            new_state, metrics = self._jit_for(batch)(state, batch)
        prev, self._pending = self._pending, metrics
        if prev is not None:
            check_finite(prev, self.max_consecutive_skips)
        return new_state, metrics

    def check(self) -> None:
        """Check the latest metrics now (blocking)."""
        if self._pending is not None:
            check_finite(self._pending, self.max_consecutive_skips)


def default_compiler_options(cfg: ModelConfig, mesh) -> dict[str, str]:
    """XLA options of the train step's executable (nlac_jax/parallel/xla_options.py: float32 on CPU gets some)."""
    return xla_options.for_executable("train_step", cfg.dtype, mesh.devices.flat[0].platform)


@gin.configurable
def make_train_step(cfg: ModelConfig, mesh, optimizer: Optimizer | None = None, *, critic_weight: float = 1.0,
                    policy_weight: float = 1.0, normalisation: str = "token", num_microbatches: int = 1,
                    loss_chunk: int = 0, loss_positions: int = 0, ema_decay: float = 0.99,
                    max_consecutive_skips: int = 10, rules=None,
                    compiler_options: Mapping[str, str] | None = None) -> TrainStep:
    """The jitted, sharded NLAC train step for model `cfg` on `mesh`.

    critic_weight, policy_weight: total = critic_weight·L1 + policy_weight·L2.
    normalisation: 'token' | 'sequence' (exact formulas in training/loss.py).
    num_microbatches: gradient accumulation inside the jitted step (lax.scan, float32 accumulators); identical to
      one big batch because the per-token loss coefficients are computed from the whole batch first.
    loss_chunk: sequence positions per logits chunk (0 = all at once); bounds the float32 logits to
      [B/num_microbatches, loss_chunk, vocab].
    loss_positions: K > 0 runs the LM head only on each row's first K target positions (NLAC targets are short next
      to their prompts: the head over prompt tokens is wasted work), falling back to every position for a batch
      with a row of more than K targets (`lax.cond`); the loss is the same either way (0 = every position).
    ema_decay: τ of the target update θ̄ ← τ·θ̄ + (1−τ)·θ, applied after every applied optimiser update.
    max_consecutive_skips: raise NonFiniteError after this many skipped (non-finite) updates in a row (0 = never).
    compiler_options: XLA options for the step's executable (None: `default_compiler_options`; {} for none).
    Compute dtype and remat come from cfg (cfg.dtype, cfg.remat); master weights are float32.
    """
    if normalisation not in loss_lib.NORMALISATIONS:
        raise ValueError(f"make_train_step.normalisation={normalisation!r}: expected {loss_lib.NORMALISATIONS}")
    if not 0.0 <= ema_decay <= 1.0:
        raise ValueError(f"make_train_step.ema_decay={ema_decay}: expected 0 <= τ <= 1")
    if loss_positions < 0:
        raise ValueError(f"make_train_step.loss_positions={loss_positions}: expected >= 0 (0 = every position)")
    sc = StepConfig(critic_weight=critic_weight, policy_weight=policy_weight, normalisation=normalisation,
                    num_microbatches=num_microbatches, loss_chunk=loss_chunk, loss_positions=loss_positions,
                    ema_decay=ema_decay, max_consecutive_skips=max_consecutive_skips)
    return TrainStep(cfg, mesh, optimizer if optimizer is not None else make_optimizer(), sc, rules,
                     compiler_options)


def make_grad_fn(cfg: ModelConfig, mesh, *, critic_weight: float = 1.0, policy_weight: float = 1.0,
                 normalisation: str = "token", num_microbatches: int = 1, loss_chunk: int = 0,
                 loss_positions: int = 0, rules=None):
    """Jitted `(params, batch) -> (loss, grads, info)` with the step's exact loss (tests, diagnostics)."""
    sc = StepConfig(critic_weight=critic_weight, policy_weight=policy_weight, normalisation=normalisation,
                    num_microbatches=num_microbatches, loss_chunk=loss_chunk, loss_positions=loss_positions)
    ps = models.param_shardings(cfg, mesh, rules)
    every = sharding.batch_shardings(mesh, rules)
    rep = NamedSharding(mesh, P())
    fn = lambda p, b: loss_and_grads(p, b, cfg, sc, ps)  # noqa: E731
    jitted = {keys: jax.jit(fn, in_shardings=(ps, {k: every[k] for k in keys}), out_shardings=(rep, ps, rep))
              for keys in (BATCH_KEYS, BATCH_KEYS + PACKED_KEYS)}

    def run(params, batch):
        batch = _with_denominators(batch.as_dict() if hasattr(batch, "as_dict") else batch)
        keys = batch_keys(batch)
        batch = {k: np.asarray(batch[k], _BATCH_DTYPES[k]) for k in keys}
        with sharding.use_mesh(mesh, rules):
            return jitted[keys](jax.device_put(params, ps), batch)
    return run
