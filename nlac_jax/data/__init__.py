"""Optional seqio tasks for the NLAC environments (``nlac_jax.data.seqio_tasks``, needs requirements-seqio.txt).

Importing this package is cheap and never imports TensorFlow or seqio: everything seqio-specific lives in
``seqio_tasks`` and is imported on first use, either explicitly or through the lazy attributes below
(``nlac_jax.data.register_seqio_tasks``, ``nlac_jax.data.math_accuracy`` ...).

Registered seqio Task names (``SEQIO_TASK_NAMES``): 'nlac_toy', 'nlac_twenty_questions', 'nlac_math',
'nlac_tau_retail', 'nlac_tau_airline'. Pick one from gin / the command line with

    --gin_param="nlac_jax.data.task_source_from_seqio.name = 'nlac_math'"

``task_source_from_seqio()`` then returns an ``nlac_jax.envs.TaskSource`` whose tasks are read through the seqio
Task (optionally only this host's shard, via ``seqio.ShardInfo``); ``env_name_from_seqio(name)`` gives the
matching ``make_env_factory`` env name.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import gin

# The registry imports nothing itself; importing it runs nlac_jax.envs/__init__, which is standard library + gin
# only (no TensorFlow, seqio, tau2 or JAX).
from nlac_jax.data.names import SEQIO_TASK_NAMES, SEQIO_TASK_PREFIX
from nlac_jax.envs.registry import check_env_name

# Public names of seqio_tasks, resolved lazily by __getattr__ (importing seqio / TensorFlow on first access).
_LAZY = ('register_seqio_tasks', 'register_task_source', 'registered_env_name', 'SeqioTaskSource',
         'TaskSourceDataSource', 'OUTPUT_FEATURES', 'shard_tasks', 'example_to_task', 'task_to_example',
         'success_rate', 'mean_return', 'pass_hat_k_metric', 'math_accuracy', 'evaluate_episodes',
         'episode_outcome', 'get_seqio_task')

__all__ = ['SEQIO_TASK_PREFIX', 'SEQIO_TASK_NAMES', 'seqio_available', 'seqio_task_name', 'env_name_from_seqio',
           'task_source_from_seqio', *_LAZY]


def seqio_available() -> bool:
    """Whether seqio (and so TensorFlow) can be imported, without importing it."""
    return importlib.util.find_spec('seqio') is not None


def seqio_task_name(env_name: str) -> str:
    """The seqio Task name registered for an ``nlac_jax.envs`` env name ('math' -> 'nlac_math')."""
    return SEQIO_TASK_PREFIX + check_env_name(env_name)


def env_name_from_seqio(name: str) -> str:
    """The env name (for ``make_env_factory``) behind seqio Task ``name``; no seqio import for the built-in names."""
    if name in SEQIO_TASK_NAMES:
        return name[len(SEQIO_TASK_PREFIX):]
    from nlac_jax.data import seqio_tasks
    return seqio_tasks.registered_env_name(name)


@gin.configurable(module='nlac_jax.data')
def task_source_from_seqio(name: str = gin.REQUIRED, train_split: Optional[str] = None,
                           eval_split: Optional[str] = None, shard_by_process: bool = False,
                           shard_index: Optional[int] = None, num_shards: Optional[int] = None,
                           train_on_eval_split: bool = False):
    """An ``nlac_jax.envs.TaskSource`` reading its tasks through the seqio Task ``name`` (imports seqio lazily).

    Args:
      name: a registered seqio Task name, e.g. 'nlac_math' (see SEQIO_TASK_NAMES).
      train_split, eval_split: set as ``.train_split`` / ``.eval_split`` on the result (as ``make_task_source``
        does); None = the underlying env source's choice for built-in tasks, else 'train' / 'test'.
      shard_by_process: read only this host's shard, ``seqio.ShardInfo(jax.process_index(), jax.process_count())``.
      shard_index, num_shards: an explicit shard instead (both or neither; overrides ``shard_by_process``).
      train_on_eval_split: allow train_split == eval_split (refused otherwise, as by ``envs.make_task_source``:
        held-out numbers from such a run would not be held out).
    """
    from nlac_jax.data import seqio_tasks
    return seqio_tasks.SeqioTaskSource(name, train_split=train_split, eval_split=eval_split,
                                       shard_by_process=shard_by_process, shard_index=shard_index,
                                       num_shards=num_shards, train_on_eval_split=train_on_eval_split)


def __getattr__(attr):
    if attr in _LAZY:
        from nlac_jax.data import seqio_tasks
        return getattr(seqio_tasks, attr)
    raise AttributeError(f"module 'nlac_jax.data' has no attribute {attr!r}")
