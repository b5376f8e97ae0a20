"""TrainState: θ (float32 master), optimiser state, θ̄ (EMA target, sharded like θ), counters, PRNG key.

All arrays are born sharded: `create_train_state` runs a jitted init with `out_shardings=state_shardings(...)`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from nlac_jax import models
from nlac_jax.models.config import ModelConfig
from nlac_jax.parallel import sharding
from nlac_jax.training.optim import Optimizer


@flax.struct.dataclass
class TrainState:
    """One training state (a pytree; every field is an array or a tree of arrays).

    params:            θ, float32 master weights (the model casts to cfg.dtype for compute)
    opt_state:         optax state of the Optimizer
    target_params:     θ̄, EMA of θ (θ̄ ← τ·θ̄ + (1−τ)·θ after each applied update), float32, sharded like θ
    step:              int32, number of train-step calls (applied + skipped)
    rng:               uint32 [2] raw PRNG key data (jax.random.key_data); advanced by every step
    skipped:           int32, total updates skipped because the loss or gradients were non-finite
    consecutive_skips: int32, skipped updates in a row (reset to 0 by an applied update)
    """

    params: Any
    opt_state: Any
    target_params: Any
    step: jax.Array
    rng: jax.Array
    skipped: jax.Array
    consecutive_skips: jax.Array

    @property
    def applied_updates(self) -> jax.Array:
        """Number of optimiser updates actually applied (the schedule's count)."""
        return self.step - self.skipped


def _as_f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def abstract_params(cfg: ModelConfig):
    """ShapeDtypeStruct tree of the float32 master parameters."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), models.abstract_params(cfg))


def state_shardings(cfg: ModelConfig, mesh, optimizer: Optimizer, rules=None) -> TrainState:
    """TrainState of NamedSharding: θ and θ̄ from the rules table; optimiser moments like θ; scalars replicated."""
    ps = models.param_shardings(cfg, mesh, rules)
    rep = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params(cfg))
    opt = optax.tree_map_params(optimizer.tx, lambda _, s: s, abstract_opt, ps, transform_non_params=lambda _: rep)
    return TrainState(params=ps, opt_state=opt, target_params=ps, step=rep, rng=rep, skipped=rep,
                      consecutive_skips=rep)


def abstract_train_state(cfg: ModelConfig, mesh, optimizer: Optimizer, rules=None) -> TrainState:
    """TrainState of jax.ShapeDtypeStruct carrying the target shardings (for orbax restore onto `mesh`)."""
    shapes = jax.eval_shape(lambda: _init_state(abstract_zeros(cfg), optimizer, jnp.zeros((2,), jnp.uint32)))
    shard = state_shardings(cfg, mesh, optimizer, rules)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shard)


def abstract_zeros(cfg):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg))


def _init_state(params, optimizer: Optimizer, rng) -> TrainState:
    params = _as_f32(params)
    # jnp.copy: θ̄ must own its buffers (the state is donated to the step; aliased leaves would be donated twice)
    return TrainState(params=params, opt_state=optimizer.init(params), target_params=jax.tree.map(jnp.copy, params),
                      step=jnp.zeros((), jnp.int32), rng=jnp.asarray(rng, jnp.uint32),
                      skipped=jnp.zeros((), jnp.int32), consecutive_skips=jnp.zeros((), jnp.int32))


def create_train_state(cfg: ModelConfig, mesh, optimizer: Optimizer, params=None, seed: int = 0,
                       rng_seed: int | None = None, rules=None, donate_params: bool = False) -> TrainState:
    """A sharded TrainState on `mesh`: θ = `params` (cast to float32; e.g. from models.load_pretrained) or a random
    init from `seed`; θ̄ = a copy of θ; optimiser state from `optimizer`; rng from `rng_seed` (default: seed).

    donate_params: let the new state take over the buffers of `params` (the given arrays become invalid).
    """
    shard = state_shardings(cfg, mesh, optimizer, rules)
    rng = jax.random.key_data(jax.random.key(seed if rng_seed is None else rng_seed))
    with sharding.use_mesh(mesh, rules):
        if params is None:
            def init(key, rng):
                p = models.CausalLM(cfg).init(key, *models.dummy_inputs())["params"]
                return _init_state(nn.unbox(p), optimizer, rng)
            return jax.jit(init, out_shardings=shard)(jax.random.key(seed), rng)
        params = jax.device_put(params, shard.params)
        fn = jax.jit(lambda p, r: _init_state(p, optimizer, r), out_shardings=shard,
                     donate_argnums=(0,) if donate_params else ())
        return fn(params, rng)
