"""Imports every module that registers gin configurables, so gin files can name them before anything runs."""

from nlac_jax import data, envs, training  # noqa: F401  (data: no TF import until used)

from nlac_jax.runner import loop
from nlac_jax.rl import roles
from nlac_jax.parallel import sharding
from nlac_jax.judges import client  # noqa: F401
from nlac_jax.runner import building  # noqa: F401
from nlac_jax.nlac import prompts, targets  # noqa: F401
from nlac_jax.rl import buffer  # noqa: F401
