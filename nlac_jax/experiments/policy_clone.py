"""How far a warm start's policy is from the scripted behaviour it clones, state by state.

A learned-critic experiment needs a warm start whose policy plays its behaviour's moves: the warm starts of issues 22
and 25 win about half as often as their behaviours (the toy 0.26-0.33 against 0.56-0.58, 20 Questions 0.07-0.16
against 0.47-0.53), and held-out success alone cannot say whether that is missing data, missing capacity or a
skill the model never learned. This module reads the policy's distribution directly: at states the behaviour itself
reaches in the RL game (on the train tasks and on the held-out ones), every legal-looking action is scored, the
scores are normalised over that action set, and the result is compared with the behaviour's exact distribution
(`corpus_forecast.jitter_distribution`, `corpus_twenty_questions_forecast.behaviour_distribution`):

    kl          KL(behaviour || clone) in nats, averaged over states
    overlap     1 - total variation: the probability that the clone and the behaviour pick the same action
    scored_mass the clone's probability of playing one of these actions and ending its turn (the rest: other text)
    <category>  the clone's and the behaviour's mass on a kind of action (e.g. repeats, excluded guesses)

    python -m nlac_jax.experiments.policy_clone WARM_DIR --game twenty_questions   # or --game toy (--test_every 3)
    # prompts changed by gin (e.g. nlac.PromptSet.template_dirs): pass the run's --gin_file / --gin_param too

One JSON object per split is printed. Nothing here trains or samples: one scoring pass, from the policy's parameters.
"""

from __future__ import annotations

import json
import random
from typing import Callable, Optional, Sequence

import numpy as np

from nlac_jax.experiments import corpus_forecast as toy_corpus
from nlac_jax.experiments import corpus_twenty_questions_forecast as tq_corpus
from nlac_jax.experiments.corpus import consistent_interval, play_episode
from nlac_jax.nlac.prompts import PromptSet

__all__ = ["clone_gap", "toy_categories", "twenty_questions_categories", "behaviour_states", "main"]

# a category: (state, action) -> whether the action is of that kind
Category = Callable[[Sequence[dict], str], bool]


def clone_gap(sampler, prompts: PromptSet, states: Sequence[list], actions: Sequence[str],
              behaviour: Callable[[Sequence[dict]], dict], categories: Optional[dict[str, Category]] = None,
              params: str = "policy", end: str = "") -> dict:
    """The clone's distance from the behaviour over ``states`` (module docstring), from one ``sampler.score`` call.

    states: S public states (message lists); actions: the A actions scored at every state (every action the
      behaviour can take must be among them: refused otherwise). behaviour(state) -> {action: probability}.
    categories: {name: (state, action) -> bool}; each gives `clone/<name>` and `behaviour/<name>`, the mass on
      the actions of that kind, averaged over states. Returns floats keyed 'states', 'kl', 'overlap',
      'scored_mass' and the categories'; the clone's distribution is its scores normalised over ``actions``.
    end: appended to every action when scored: the turn-end token's text (`main`), so that "1" is scored as the
      whole action "1" and not as the first digit of "12" (actions that are prefixes of others).
    """
    categories = dict(categories or {})
    if not states:
        raise ValueError("clone_gap: no states")
    msgs = [prompts.policy(s) for s in states]
    lp = np.asarray(sampler.score([m for m in msgs for _ in actions], [a + end for a in actions] * len(msgs), params,
                                  "policy"),
                    np.float64).reshape(len(msgs), len(actions))
    if not np.all(np.isfinite(lp)):
        raise ValueError("clone_gap: the sampler returned non-finite scores")
    sums: dict = {"kl": 0.0, "overlap": 0.0, "scored_mass": 0.0}
    index = {a: i for i, a in enumerate(actions)}
    for state, row in zip(states, lp):
        b = np.zeros(len(actions))
        for a, p in behaviour(state).items():
            if a not in index:
                raise ValueError(f"clone_gap: the behaviour's action {a!r} is not among the scored actions")
            b[index[a]] += p
        q = np.exp(row - row.max())
        sums["scored_mass"] += float(np.exp(row).sum())
        q /= q.sum()
        on = b > 0
        sums["kl"] += float(np.sum(b[on] * (np.log(b[on]) - np.log(np.maximum(q[on], 1e-300)))))
        sums["overlap"] += float(np.minimum(b, q).sum())
        for name, is_kind in categories.items():
            kind = np.array([bool(is_kind(state, a)) for a in actions])
            sums[f"clone/{name}"] = sums.get(f"clone/{name}", 0.0) + float(q[kind].sum())
            sums[f"behaviour/{name}"] = sums.get(f"behaviour/{name}", 0.0) + float(b[kind].sum())
    return {"states": float(len(states)), **{k: v / len(states) for k, v in sums.items()}}


def behaviour_states(env, tasks, chooser_for: Callable[[random.Random], Callable], episodes_per_task: int,
                     seed: int, task_name: str) -> list[list]:
    """Every state of ``episodes_per_task`` behaviour episodes per task in ``env`` (each episode's rng from
    (seed, task, episode)): the states whose actions the clone was trained to copy, in the RL game."""
    out = []
    for task in tasks:
        for e in range(episodes_per_task):
            rng = random.Random(f"policy-clone:{seed}:{task.id}:{e}")
            out += [tr.state for tr in play_episode(env, task, chooser_for(rng), task_name)]
    return out


def toy_categories(n: int) -> dict[str, Category]:
    """The toy game's kinds of action the behaviour never or seldom takes: outside the range the replies allow, and
    a number guessed before (a wasted guess leaves the range as it was, so the behaviour can repeat one)."""
    def outside(state, a):
        lo, hi, _, _ = consistent_interval(state, n)
        return not lo <= int(a) <= hi

    def repeat(state, a):
        return int(a) in consistent_interval(state, n)[3]
    return {"outside_range": outside, "repeat": repeat}


def twenty_questions_categories(table) -> dict[str, Category]:
    """20 Questions' kinds of action: a guess of an object the answers exclude, a question or guess asked
    before, and a question among the public best splits (`even_splits`, the behaviour's preferred move)."""
    objects = {f"{o.name}?" for o in table.objects}

    def excluded(state, a):
        return a in objects and a[:-1] not in tq_corpus.candidates(state, table)[0]

    def repeat(state, a):
        return a in set(tq_corpus.candidates(state, table)[1])

    def best_split(state, a):
        return a[:-1] in set(tq_corpus.even_splits(state, table))
    return {"excluded_guess": excluded, "repeat": repeat, "best_split": best_split}


def _setup(game: str, n: int, test_every: int, wasted: str, jitter: float):
    """(prompt set, actions, behaviour, categories, task source, RL env, chooser_for(rng), task name) of one game;
    the env plays the RL game's rule (toy: ``wasted``; 20 Questions: RL_REFUSED)."""
    if game == "toy":
        from nlac_jax.envs.toy import GuessNumberTaskSource
        env = toy_corpus._env(n, None, 0, toy_corpus.rule_numbers(wasted, n))
        source = GuessNumberTaskSource(n, test_every)
        actions = [str(g) for g in range(1, n + 1)]
        behaviour = lambda s: toy_corpus.jitter_distribution(s, n, jitter)  # noqa: E731
        chooser = lambda rng: toy_corpus._chooser(n, rng, jitter)  # noqa: E731
        return (PromptSet(task="toy", prompt_set=toy_corpus.PROMPT_SET), actions, behaviour, toy_categories(n),
                source, env, chooser, "toy")
    from nlac_jax.envs.twenty_questions import TwentyQuestionsTaskSource
    source = TwentyQuestionsTaskSource(tq_corpus.WORLD)
    table = source.table
    env = tq_corpus.make_env(table, tq_corpus.MAX_QUESTIONS, tq_corpus.RL_REFUSED)
    actions = [f"{a}?" for a in tq_corpus.bank(table)] + [f"{o.name}?" for o in table.objects]
    behaviour = lambda s: tq_corpus.behaviour_distribution(s, table)  # noqa: E731
    chooser = lambda rng: tq_corpus._chooser(table, rng, tq_corpus.DEFAULT_MIX)  # noqa: E731
    return (PromptSet(task=tq_corpus.TASK_NAME, prompt_set=tq_corpus.PROMPT_SET), actions, behaviour,
            twenty_questions_categories(table), source, env, chooser, tq_corpus.TASK_NAME)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nlac_jax.experiments.policy_clone WARM_DIR --game {toy,twenty_questions}``: the clone gap of a
    saved warm start's policy on the train and the held-out tasks (module docstring), one JSON line."""
    import argparse
    from nlac_jax import sampling, text
    from nlac_jax.cli.setup import GinConfigError, load_gin
    from nlac_jax.experiments import warm_start
    from nlac_jax.nlac.model_roles import ModelRoleSampler
    from nlac_jax.rl.roles import RoleSampling
    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("warm_dir", help="a warm start saved by unit_scale (WORKDIR/warm_start_seed_<s>)")
    p.add_argument("--game", choices=("toy", "twenty_questions"), default="twenty_questions")
    p.add_argument("--episodes_per_task", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=32, help="toy: numbers 1..n")
    p.add_argument("--test_every", type=int, default=3, help="toy: every k-th number is held out (split 3: 3)")
    p.add_argument("--wasted", default="odd", help=f"toy: the RL game's rule, one of {sorted(toy_corpus.WASTE_RULES)}")
    p.add_argument("--jitter", type=float, default=0.25, help="toy: the behaviour's jitter (forecast_corpus.jitter)")
    p.add_argument("--gin_file", action="append", default=[],
                   help="the run's gin files, for its prompt bindings (e.g. nlac.PromptSet.template_dirs)")
    p.add_argument("--gin_param", action="append", default=[], help="gin bindings, as for the run")
    args = p.parse_args(argv)
    if args.episodes_per_task < 1:
        p.error(f"--episodes_per_task must be >= 1, got {args.episodes_per_task}")
    if args.game == "toy" and args.wasted not in toy_corpus.WASTE_RULES:
        p.error(f"--wasted: expected one of {sorted(toy_corpus.WASTE_RULES)}, got {args.wasted!r}")
    if args.gin_file or args.gin_param:  # the prompts must be the ones the warm start was trained on
        try:
            load_gin(args.gin_file, args.gin_param)
        except GinConfigError as e:
            p.error(str(e))
    ps, actions, behaviour, categories, source, env, chooser, task_name = _setup(
        args.game, args.n, args.test_every, args.wasted, args.jitter)
    cfg, tok, params = warm_start.load_warm_start(args.warm_dir, dtype="bfloat16")
    roles = ModelRoleSampler(sampling.Sampler(cfg), tok, get_params=lambda _: params, settings=RoleSampling())
    end = tok.convert_ids_to_tokens(text.turn_end_token_id(tok))  # its text encodes to that one id (tested)
    out = {}
    for split in ("train", "test"):
        states = behaviour_states(env, source.tasks(split), chooser, args.episodes_per_task, args.seed, task_name)
        gap = clone_gap(roles, ps, states, actions, behaviour, categories, end=end)  # finite: it refuses otherwise
        out[split] = {k: round(v, 4) for k, v in gap.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
