"""The seqio Task names of the NLAC environments: defined apart from the package so that `seqio_tasks` (imported
lazily by the package, for its optional TensorFlow dependency) and the package read them from one place."""

from nlac_jax.envs.registry import ENV_NAMES

SEQIO_TASK_PREFIX = 'nlac_'
SEQIO_TASK_NAMES = tuple(SEQIO_TASK_PREFIX + e for e in ENV_NAMES)
