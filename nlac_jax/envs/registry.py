"""The one list of environment names (``ENV_NAMES``) and the checks on them.

``nlac_jax.envs`` (``make_env_factory`` / ``make_task_source``) and ``nlac_jax.data`` (the seqio Task names) both read
the names from here. This module imports nothing, so ``nlac_jax.data`` can use it without pulling in TensorFlow,
seqio or tau2; which classes build each env stays in ``nlac_jax.envs`` (``EnvFactory``), where the τ-bench modules
are imported only when a 'tau_*' env is actually built.
"""

from __future__ import annotations

ENV_NAMES = ('toy', 'twenty_questions', 'math', 'tau_retail', 'tau_airline')
TAU_ENV_PREFIX = 'tau_'  # 'tau_<domain>' names a τ-bench domain ('tau_retail' -> 'retail')


def check_env_name(env_name: str) -> str:
    """``env_name`` itself when it is one of ``ENV_NAMES``; ValueError otherwise."""
    if env_name not in ENV_NAMES:
        raise ValueError(f"unknown env_name {env_name!r}; known: {list(ENV_NAMES)}")
    return env_name


def tau_domain(env_name: str) -> str:
    """The τ-bench domain of a 'tau_*' env name ('tau_airline' -> 'airline')."""
    if not check_env_name(env_name).startswith(TAU_ENV_PREFIX):
        raise ValueError(f"{env_name!r} is not a τ-bench env")
    return env_name[len(TAU_ENV_PREFIX):]
