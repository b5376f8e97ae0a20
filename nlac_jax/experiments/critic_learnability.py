"""How many optimiser steps does the successor need to learn a waste rule from real transitions?

    python -m nlac_jax.experiments.critic_learnability WARM_DIR --rule odd --lrs 1e-4,3e-4,1e-3 --steps 48,192,500
    python -m nlac_jax.experiments.critic_learnability WARM_DIR --rule odd --prior even:500:1e-3 --lrs 1e-4,3e-4

The learned-critic experiment (README, "Does NLAC learn?") needs L1 to learn, within the RL phase's budget, a rule
that the warm start does not know. This measures the best case of that: from a saved warm start, ``steps`` updates of
batch 16 at a constant learning rate, each batch ``--successor_share`` successor examples whose targets are the TRUE
forecasts of the rule's game (what perfect Bellman backups converge to; no backup error, no bootstrapping) and the
rest the corpus's policy examples (the other roles' share of a real batch). Then the knowledge probe
(``corpus_forecast.waste_probe``): the successor's scored P(wasted) on the numbers the rule wastes and on the others.

``--prior RULE:STEPS:LR`` first trains a prior rule the same way (a warm start that knew another rule, the design
in which L1 re-maps a feature the network already has instead of building one). Every cell starts from the same
parameters; nothing is saved. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Optional, Sequence

import numpy as np

from nlac_jax import sampling
from nlac_jax.envs.base import TaskCursor
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
from nlac_jax.experiments import corpus_forecast as F, warm_start
from nlac_jax.experiments.corpus import CorpusExample, play_episode
from nlac_jax.nlac.model_roles import ModelRoleSampler
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.rl.roles import RoleSampling

RULES = F.WASTE_RULES
BATCH = 16


def wasted_numbers(rule: str, n: int) -> tuple[int, ...]:
    """The numbers 1..n that ``rule`` (a key of :data:`RULES`) wastes (``corpus_forecast.rule_numbers``)."""
    return F.rule_numbers(rule, n)


def true_successor_examples(rule: str, n: int, episodes: int = 400, seed: int = 0,
                            prompts: Optional[PromptSet] = None) -> list[CorpusExample]:
    """Successor examples of the game that wastes ``rule``'s numbers: the corpus's waste-blind behaviour on the
    TRAIN tasks, each step's target the forecast of its real future (``corpus_forecast.forecast``)."""
    ps = prompts or PromptSet(task="toy", prompt_set=F.PROMPT_SET)
    env = GuessNumberEnv(n=n, wasted_numbers=wasted_numbers(rule, n))
    tasks = GuessNumberTaskSource(n).tasks("train")
    out = []
    for ep, task in enumerate(TaskCursor(tasks, f"learnability:{rule}", seed).take(episodes)):
        traj = play_episode(env, task, F._chooser(n, random.Random(f"learnability:{seed}:{ep}"), 0.25))
        out += [CorpusExample("successor", ps.successor(tr.state, tr.action), F.forecast(traj[t:], ps), task.id,
                              tr.state, tr.action) for t, tr in enumerate(traj)]
    return out


def mixture(successor: Sequence, policy: Sequence, steps: int, share: float, seed: int = 0) -> list:
    """``steps`` batches' worth of examples: per batch round(16 x share) successor examples, the rest policy ones."""
    rng = np.random.default_rng(seed)
    k = int(round(BATCH * share))
    out: list = []
    for _ in range(steps):
        out += [successor[j] for j in rng.choice(len(successor), k)] if k else []
        out += [policy[j] for j in rng.choice(len(policy), BATCH - k)] if k < BATCH else []
    return out


def train(cfg, tok, params, examples: Sequence, steps: int, lr: float):
    """``steps`` updates of batch 16 at constant ``lr`` from ``params`` (host arrays); returns the new params."""
    import jax
    state = warm_start.train_warm_start(cfg, tok, examples, steps, BATCH, lr, 0, 320, params=params, warmup_steps=1,
                                        end_lr_ratio=1.0, bucket_multiple=320, log_every=10 ** 9)
    return jax.device_get(state.params)


def probe(cfg, tok, params, rule: str, n: int) -> dict:
    """The successor's scored P(wasted) on ``rule``'s numbers (``_rl``) and on the others, at the opening state."""
    roles = ModelRoleSampler(sampling.Sampler(cfg), tok, get_params=lambda _: params,
                             settings=RoleSampling(max_new_tokens={"policy": 6, "successor": 40}))
    out = F.waste_probe(roles, PromptSet(task="toy", prompt_set=F.PROMPT_SET), n, 0, 0,
                        wasted_numbers=wasted_numbers(rule, n))
    return {k: out[k] for k in ("probe/p_wasted_rl", "probe/p_wasted_other")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The CLI (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("warm_dir", help="a warm start saved by unit_scale (WORKDIR/warm_start_seed_<s>)")
    p.add_argument("--rule", default="odd", choices=sorted(RULES), help="the rule to learn")
    p.add_argument("--lrs", default="1e-4,3e-4,1e-3")
    p.add_argument("--steps", default="48,192,500")
    p.add_argument("--successor_share", type=float, default=0.5, help="successor examples' share of a batch")
    p.add_argument("--prior", default="", metavar="RULE:STEPS:LR", help="train this rule first (the same way)")
    p.add_argument("--n", type=int, default=32)
    args = p.parse_args(argv)
    import jax
    cfg, tok, params = warm_start.load_warm_start(args.warm_dir, dtype="bfloat16")
    params = jax.device_get(params)
    policy = [e for e in F.forecast_corpus(args.n, 100, 5, skill_episodes=0, corpus_waste_p=0.35)
              if e.role == "policy"]
    rows = [("warm start", "", "", probe(cfg, tok, params, args.rule, args.n))]
    if args.prior:
        rule, steps, lr = args.prior.split(":")
        ex = mixture(true_successor_examples(rule, args.n), policy, int(steps), args.successor_share)
        params = train(cfg, tok, params, ex, int(steps), float(lr))
        rows.append((f"after prior '{rule}'", steps, lr, probe(cfg, tok, params, args.rule, args.n)))
    succ = true_successor_examples(args.rule, args.n)
    for lr in [float(x) for x in args.lrs.split(",") if x]:
        for steps in [int(x) for x in args.steps.split(",") if x]:
            new = train(cfg, tok, params, mixture(succ, policy, steps, args.successor_share), steps, lr)
            rows.append((f"rule '{args.rule}'", str(steps), f"{lr:g}", probe(cfg, tok, new, args.rule, args.n)))
            print(f"# {rows[-1][0]}, {steps} steps at lr {lr:g}: {rows[-1][3]}", flush=True)
    print(f"\n| trained on | steps | lr | P(wasted) on '{args.rule}' numbers | P(wasted) on the others | gap |")
    print("|---|---|---|---|---|---|")
    for what, steps, lr, m in rows:
        rl, other = m["probe/p_wasted_rl"], m["probe/p_wasted_other"]
        print(f"| {what} | {steps} | {lr} | {rl:.3f} | {other:.3f} | {rl - other:+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
