"""Optimiser: AdamW with a decoupled weight-decay mask, warmup + constant/cosine schedule, global-norm clipping.

Everything is gin-configurable (`make_schedule.*`, `make_optimizer.*`). The schedule is evaluated at the number of
APPLIED updates (the optimiser's own count; steps skipped for non-finite gradients do not advance it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import gin
import jax
import jax.numpy as jnp
import optax

# parameter leaves whose last path key is one of these are not weight-decayed (RMSNorm scales, q/k/v biases)
NO_DECAY_KEYS = ("scale", "bias")


@gin.configurable
def make_schedule(learning_rate: float = 1e-5, warmup_steps: int = 0, decay: str = "constant",
                  total_steps: int = 0, end_lr_ratio: float = 0.0, boost_steps: int = 0,
                  boost_factor: float = 1.0) -> Callable[[Any], jax.Array]:
    """Learning rate as a function of the applied-update count c = 0, 1, 2, ...

    warmup: lr(c) = learning_rate * (c + 1) / warmup_steps for c < warmup_steps (the first update is already
      non-zero; the peak is reached at c = warmup_steps - 1).
    decay='constant': lr(c) = learning_rate after warmup.
    decay='cosine': after warmup, cosine from learning_rate down to learning_rate * end_lr_ratio at
      c = total_steps (and constant afterwards); needs total_steps > warmup_steps.
    boost: lr(c) is multiplied by boost_factor for c < boost_steps (the runner sets it from
      LoopConfig.critic_warmup_lr_scale, to speed up a critic-only warm-up; off by default).
    """
    if decay not in ("constant", "cosine"):
        raise ValueError(f"make_schedule.decay={decay!r}: expected 'constant' or 'cosine'")
    if decay == "cosine" and total_steps <= warmup_steps:
        raise ValueError(f"cosine decay needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})")
    if boost_steps < 0 or boost_factor <= 0:
        raise ValueError(f"make_schedule: boost_steps={boost_steps} must be >= 0 and boost_factor={boost_factor} > 0")
    peak = float(learning_rate)

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        lr = jnp.asarray(peak, jnp.float32)
        if decay == "cosine":
            frac = jnp.clip((c - warmup_steps) / float(total_steps - warmup_steps), 0.0, 1.0)
            lr = peak * (end_lr_ratio + (1.0 - end_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
        if warmup_steps > 0:
            lr = jnp.where(c < warmup_steps, peak * (c + 1.0) / warmup_steps, lr)
        if boost_steps > 0 and boost_factor != 1.0:
            lr = jnp.where(c < boost_steps, lr * boost_factor, lr)
        return lr

    return schedule


def decay_mask(params) -> Any:
    """True for leaves that get weight decay: everything except norm scales and biases."""
    def keep(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", None))
        return name not in NO_DECAY_KEYS
    return jax.tree_util.tree_map_with_path(keep, params)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax transformation plus the schedule it uses (the train step reports lr = schedule(applied updates))."""

    tx: optax.GradientTransformation
    schedule: Callable[[Any], jax.Array]

    def init(self, params):
        return self.tx.init(params)


@gin.configurable
def make_optimizer(schedule: Callable | None = None, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   weight_decay: float = 0.0, clip_norm: float = 1.0) -> Optimizer:
    """clip_by_global_norm(clip_norm) (off when clip_norm <= 0) -> AdamW(schedule, b1, b2, eps, weight_decay,
    mask=decay_mask). `schedule` defaults to `make_schedule()` (gin-configured)."""
    schedule = schedule if schedule is not None else make_schedule()
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    parts.append(optax.adamw(learning_rate=schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                             mask=decay_mask))
    return Optimizer(optax.chain(*parts), schedule)
