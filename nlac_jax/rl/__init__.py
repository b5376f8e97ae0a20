"""Reinforcement-learning data plumbing: episodes -> one-step transitions, the replay buffer, rollouts.

Data flows one way: envs -> rl -> nlac. Nothing in this package imports ``nlac_jax.nlac`` (a test parses every
module here to hold that); the Transition class itself lives upstream in ``nlac_jax.envs.transition``.
"""

from nlac_jax.rl.buffer import ReplayBuffer, rng_from_seed
from nlac_jax.rl.transitions import transitions_from_episode

__all__ = [
    "ReplayBuffer",
    "rng_from_seed",
    "transitions_from_episode",
]
