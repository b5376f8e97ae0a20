"""Rollouts with the current policy θ: a RoleSampler acts for the agent in a pool of environments.

Generic over the algorithm: the caller says how a history becomes the policy's chat prompt and how a generated
text becomes an action (NLAC's prompt set and action cleaner, see ``nlac.evaluation.make_policy_fn``), so this
module never imports ``nlac_jax.nlac`` (data flows envs -> rl -> nlac). Held-out evaluation with NLAC's critic
diagnostics lives in ``nlac.evaluation``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from nlac_jax.envs.base import BatchedRunner, Episode
from nlac_jax.envs.transition import Transition
from nlac_jax.rl.roles import RoleSampler, RoleSampling, check_samples
from nlac_jax.rl.transitions import transitions_from_episode


def make_policy_fn(sampler: RoleSampler, policy_prompt: Callable[[list], list[dict]],
                   to_action: Callable[[str], str], params: str = "policy",
                   settings: RoleSampling | None = None) -> Callable[[list], list]:
    """BatchedRunner policy: histories -> actions, one batched sampler call per turn (role 'policy').

    policy_prompt: history -> the policy's chat messages; to_action: generated text -> the action played.
    settings: sampling settings for the call (None: the sampler's own).
    """
    def policy_fn(histories: list) -> list:
        batch = [policy_prompt(h) for h in histories]
        outs = sampler.sample(batch, params, "policy", settings=settings)
        # a cut-off action is still acted on: the environment decides what an incomplete utterance is worth
        return [to_action(c.text) for c in check_samples(outs, len(batch), "policy")]
    return policy_fn


def collect(envs: Sequence, tasks: Sequence, policy_fn: Callable, task_name: str | None = None,
            max_turns: int | None = None, processes=None) -> tuple[list[Episode], list[Transition]]:
    """Play `tasks` with `policy_fn` over the env pool; returns (episodes, their one-step transitions).

    processes: a `nlac_jax.parallel.distributed.Processes` of several processes (None or one process: play everything
    here). Then `tasks` is the global list, the same on every process; each process plays its contiguous share
    in its own `envs`, every policy turn is one collective round (`Processes.collective_policy`), and the
    returned episodes are every process's, in the order of `tasks` (collective: every process must call it).
    """
    if processes is None or processes.count == 1:
        episodes = BatchedRunner(envs, policy_fn, max_turns=max_turns).run(tasks)
    else:
        collective = processes.collective_policy(policy_fn)
        mine = BatchedRunner(envs, collective, max_turns=max_turns).run(processes.share(tasks))
        collective.finish()  # the other processes' episodes may still be running: keep answering their rounds
        episodes = processes.gather(mine, encode=Episode.to_dict, decode=Episode.from_dict)  # JSON, not pickle
    transitions = [t for ep in episodes for t in transitions_from_episode(ep, task=task_name)]
    return episodes, transitions
