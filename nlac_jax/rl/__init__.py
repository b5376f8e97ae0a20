"""Reinforcement-learning data plumbing: one-step transitions and the replay buffer."""

from nlac_jax.rl.buffer import ReplayBuffer, rng_from_seed
from nlac_jax.rl.transitions import Transition, next_observation, to_jsonable, transitions_from_episode

__all__ = [
    "ReplayBuffer",
    "Transition",
    "next_observation",
    "rng_from_seed",
    "to_jsonable",
    "transitions_from_episode",
]
