"""Warm-start corpus for the learned-critic experiment (gin/experiments/unit_toy_learned_critic.gin).

The experiment asks whether a critic learned by language Bellman backups carries knowledge that the policy can
only get through it. So the corpus teaches SKILLS and one piece of deliberately wrong KNOWLEDGE, and the RL game
rewards knowledge that only its real transitions reveal (README, "Does NLAC learn?"):

* the **corpus game** (``corpus_waste_every``, default 2) wastes every even guess: the judge answers "no answer"
  and the turn is gone (``GuessNumberEnv``'s waste rule). The **RL game** wastes multiples of 3 instead
  (``GuessNumberEnv.waste_every = 3`` in the experiment's gin file). Nothing in any prompt says which rule holds.
* **policy** examples clone a waste-blind behaviour policy (jittered bisection, always inside the possible range),
  and **successor** examples summarise the real futures of the corpus game: the warm-start successor therefore
  forecasts "no answer" for even guesses, the corpus's knowledge, wrong in the RL game.
* **backup**, **evaluator** and **refiner** examples come from **skill games**: each episode wastes a fresh random
  set of numbers (``skill_waste_p``), so whether a reply is "no answer" is independent of the guess. The backup
  learns to copy the REAL reply into the forecast (not to recall a rule), the evaluator learns to judge from what
  the FORECAST says (the only cue that predicts its target), and the refiner learns to act on the critique:
  "Forecast reply: no answer. Guess 15 is wasted: try 16." / "Verdict: suboptimal" -> 16.

So a warm start that keeps its successor (the frozen critic) flags even guesses and moves them to odd
neighbours, several of which the RL game wastes; only a successor corrected by L1 over real transitions flags the
multiples of 3, and only its critiques make the refiner's target better than the policy's own guess.

Summary format (outcome FIRST: the critic metrics score P(success | s, a) as the continuation "Outcome: success"
against "Outcome: failure" right after the successor prompt)::

    Outcome: failure; Return: 0
    Reply: no answer.

Nothing is invented: every future is played by the real ``GuessNumberEnv``; examples come from TRAIN tasks only.
"""

from __future__ import annotations

import math
import random
import re
from typing import Optional, Sequence

import gin
import numpy as np

from nlac_jax import sampling
from nlac_jax.envs.base import Task, TaskCursor
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource, WASTED_REPLY, is_wasted, parse_guess
from nlac_jax.envs.transition import Transition
from nlac_jax.experiments import warm_start
from nlac_jax.experiments.corpus import (CorpusExample, backup_example, consistent_interval, greedy_settings,
                                         play_episode, prefixed_chooser, terminal_summary)
from nlac_jax.nlac import evaluation
from nlac_jax.nlac.critic_scores import success_probabilities
from nlac_jax.nlac.model_roles import ModelRoleSampler
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.targets import TargetConfig, truncate_summary
from nlac_jax.nlac.verdict import outcome_line, parse_verdict
from nlac_jax.rl.roles import RoleSampling, check_samples, group

__all__ = [
    "PROMPT_SET",
    "DETAIL_GUESSES",
    "jitter_action",
    "jitter_distribution",
    "reply_word",
    "forecast",
    "forecast_reply",
    "critique",
    "skill_episode",
    "build_forecast_examples",
    "forecast_corpus",
    "reference_success_rates",
    "waste_probe",
    "waste_probabilities",
    "pair_waste_probabilities",
    "endgame_states",
    "endgame_probe",
    "named_guess",
    "skill_probe",
    "WASTE_RULES",
    "rule_numbers",
]

PROMPT_SET = "toy_forecast"
# "Next <g>: <reply>" items after the first reply. 0: the forecast is the outcome line and the guess's own reply,
# the two things the critic is read for; each item more is a number and a reply the backup must copy from the
# middle of its prompt, which the 1.1M-parameter warm start did not learn in 800 steps (README, "Does NLAC learn?")
DETAIL_GUESSES = 0
_NON_NUMBERS = ("higher", "I am not sure.", "my guess", "?")


# ------------------------------------------------------------------------------------------- behaviour


def jitter_action(history: Sequence[dict], n: int, rng: random.Random, jitter: float = 0.25) -> str:
    """The waste-blind behaviour policy: the midpoint of the consistent interval (ties at random) plus a uniform
    offset of at most ``jitter`` x the interval's width, clipped into the interval (from the feedback only)."""
    lo, hi, _, _ = consistent_interval(history, n)
    if lo > hi:  # cannot happen with truthful feedback; stay total anyway
        lo, hi = 1, n
    mid = (lo + hi) // 2 + (rng.randint(0, 1) if (hi - lo) % 2 else 0)
    w = int((hi - lo) * jitter)
    return str(min(max(mid + rng.randint(-w, w), lo), hi))


def jitter_distribution(history: Sequence[dict], n: int, jitter: float = 0.25) -> dict[str, float]:
    """The exact distribution of :func:`jitter_action` at ``history``: {action: probability} (the midpoint's coin,
    then the uniform offset, then the clip), for reading how closely a clone copies it (`policy_clone`)."""
    lo, hi, _, _ = consistent_interval(history, n)
    if lo > hi:
        lo, hi = 1, n
    mids = [(lo + hi) // 2, (lo + hi) // 2 + 1] if (hi - lo) % 2 else [(lo + hi) // 2]
    w = int((hi - lo) * jitter)
    out: dict[str, float] = {}
    for mid in mids:
        for off in range(-w, w + 1):
            g = str(min(max(mid + off, lo), hi))
            out[g] = out.get(g, 0.0) + 1.0 / (len(mids) * (2 * w + 1))
    return out


def _chooser(n: int, rng: random.Random, jitter: float, prefix: Sequence[str] = ()):
    return prefixed_chooser(lambda history: jitter_action(history, n, rng, jitter), prefix)


# ------------------------------------------------------------------------------------------- summaries


def reply_word(t: Transition) -> str:
    """The judge's reply to one guess: correct / higher / lower / no answer / error."""
    if t.info.get("success"):
        return "correct"
    if t.info.get("error"):
        return "error"
    obs = " ".join(m.get("content", "") for m in t.next_observation).strip().lower()
    for word in ("higher", "lower", WASTED_REPLY):
        if obs.startswith(word):
            return word
    return "error"


def _short(a: str) -> str:
    g = parse_guess(a)
    return str(g) if g is not None and a.strip() == str(g) else (" ".join(a.split())[:20] or "(empty)")


def forecast(future: Sequence[Transition], ps: PromptSet, cfg: Optional[TargetConfig] = None) -> str:
    """The successor target for (s_t, a_t) from the real transitions a_t .. the end of the episode: the prompt set's
    terminal summary for a terminal step (exactly as ``targets.build_critic_examples`` builds it), else
    ``Outcome: ...; Return: ...`` then ``Reply: <r>.`` (and ``Next <g>: <r>.`` per ``DETAIL_GUESSES``)."""
    cfg = cfg or TargetConfig()
    if not future or not future[-1].done:
        raise ValueError("forecast needs a finished episode (its last transition terminal)")
    first = future[0]
    if first.done:
        return terminal_summary(first, ps, cfg)
    parts = [f"Reply: {reply_word(first)}."]
    for t in list(future[1:])[:DETAIL_GUESSES]:
        parts.append(f"Next {_short(t.action)}: {reply_word(t)}.")
    ret = sum(float(t.reward) for t in future)
    return truncate_summary(outcome_line(bool(future[-1].success), ret) + "\n" + " ".join(parts),
                            cfg.max_summary_chars)


def forecast_reply(text: str) -> Optional[str]:
    """The reply a forecast predicts for the guess itself (its first ``Reply: <word>``), lower-case; None if none."""
    for line in (text or "").split("\n"):
        s = line.strip()
        if s.lower().startswith("reply:"):
            word = s[len("reply:"):].strip().split(".")[0].strip().lower()
            return word or None
    return None


# ------------------------------------------------------------------------------------------- critique


def critique(state: Sequence[dict], action: str, future_text: str, n: int,
             judge_range: bool = False, judge_single: bool = False,
             judge_repeat: bool = False) -> tuple[str, bool, str]:
    """The scripted evaluator and refiner: (critique, verdict, refined guess), from the PUBLIC state and the
    forecast only. A forecast reply "no answer" means the guess is wasted: move it to a neighbour (the guess + 1,
    or - 1 when + 1 is above the possible range); "error" means it is not a number: try the middle of the range.
    Any other forecast reply means the guess gets an answer (optimal: the refiner keeps it).

    judge_range: a guess outside the public "Possible now" interval (a repeat of an answered guess is one) is
      suboptimal whatever the forecast says: "Guess 22 is outside 23 to 29: try 26." (the middle). This reads only
      the public state line the policy reads too: a skill, no knowledge of any waste rule.
    judge_single: where "Possible now" is one number, guessing it is optimal whatever the forecast says ("Guess 15
      is the only number possible."), and any other number is outside ("Guess 14 is outside 15 to 15: try 15."):
      the hidden number is always answered "correct", in every game, so this too reads only the public state.
    judge_repeat: a guess the transcript shows was guessed before is suboptimal whatever the forecast says ("Guess
      15 was guessed before: try 16."): the nearest number not guessed yet inside the possible interval (from the
      guess, upwards first; from the interval's middle when the guess lies outside it). A repeat is answered as it
      was the first time in every game, so it is never better than a fresh guess: it reads the public history
      alone (a string match, where the range critique needs a numeric comparison), no knowledge of any rule."""
    lo, hi, _, guessed = consistent_interval(state, n)
    word = forecast_reply(future_text) or "unknown"
    g = parse_guess(action)
    head = f"Forecast reply: {word}."
    if g is None or word == "error":
        shown = " ".join(str(action).split())[:20] or "(empty)"
        better = str((lo + hi) // 2)
        return f"{head} Guess {shown} is not a number: try {better}.\nVerdict: suboptimal", False, better
    if judge_single and lo == hi and g == lo:
        return f"{head} Guess {g} is the only number possible.\nVerdict: optimal", True, str(g)
    if (judge_range or (judge_single and lo == hi)) and not lo <= g <= hi and lo <= hi:
        better = str((lo + hi) // 2)
        return f"{head} Guess {g} is outside {lo} to {hi}: try {better}.\nVerdict: suboptimal", False, better
    if judge_repeat and g in guessed and lo <= hi:
        better = str(_fresh_near(g if lo <= g <= hi else (lo + hi) // 2, lo, hi, guessed))
        return f"{head} Guess {g} was guessed before: try {better}.\nVerdict: suboptimal", False, better
    if word == WASTED_REPLY:
        better = g + 1 if g + 1 <= hi else g - 1 if g - 1 >= lo else g
        return f"{head} Guess {g} is wasted: try {better}.\nVerdict: suboptimal", False, str(better)
    return f"{head} Guess {g} gets an answer.\nVerdict: optimal", True, str(g)


def _fresh_near(x: int, lo: int, hi: int, guessed) -> int:
    """The number in [lo, hi] not in ``guessed`` nearest to ``x`` (x itself, then x + 1, x - 1, x + 2, ...);
    x when every number there was guessed."""
    for d in range(0, hi - lo + 1):
        for y in ((x,) if d == 0 else (x + d, x - d)):
            if lo <= y <= hi and y not in guessed:
                return y
    return x


# ------------------------------------------------------------------------------------------- the corpus


def _env(n: int, max_turns: Optional[int], waste_every: int = 0, wasted: Sequence[int] = ()) -> GuessNumberEnv:
    # every argument explicit: gin bindings on GuessNumberEnv (the RL game's rule) must never reach the corpus
    return GuessNumberEnv(n=n, max_turns=max_turns, waste_every=waste_every, wasted_numbers=tuple(wasted))


def _judge_examples(ps: PromptSet, n: int, task: Task, state: list, action: str, future_text: str,
                    meta: dict, judge_range: bool = False, judge_single: bool = False,
                    judge_repeat: bool = False) -> list[CorpusExample]:
    text, verdict, refined = critique(state, action, future_text, n, judge_range, judge_single, judge_repeat)
    lo, hi, _, guessed = consistent_interval(state, n)
    g = parse_guess(action)
    m = dict(meta, verdict=verdict, refined=refined, out_of_range=g is not None and not lo <= g <= hi,
             repeat=g is not None and g in guessed)
    return [CorpusExample("evaluator", ps.evaluator(state, action, [future_text]), text, task.id, state, action, m),
            CorpusExample("refiner", ps.refiner(state, action, text, []), refined, task.id, state, action, m)]


def _alternative(state: list, taken: str, n: int, rng: random.Random, jitter: float, p_non_number: float,
                 p_out_of_range: float = 0.0, p_repeat: float = 0.0) -> str:
    if rng.random() < p_non_number:
        return rng.choice(_NON_NUMBERS)
    if p_repeat > 0 and rng.random() < p_repeat:  # (no draw at 0: the old corpora stay bit-identical)
        asked = sorted(set(consistent_interval(state, n)[3]))
        if asked:  # any earlier guess, answered or wasted
            return str(rng.choice(asked))
    if p_out_of_range > 0 and rng.random() < p_out_of_range:  # (no draw at 0: the old corpora stay bit-identical)
        lo, hi, _, _ = consistent_interval(state, n)
        outside = [g for g in range(1, n + 1) if not lo <= g <= hi]
        # half of them repeat an answered guess: the mistake a small policy makes most (README, "Does NLAC learn?")
        asked = [int(m["content"]) for m in state if m.get("role") == "assistant"
                 and m.get("content", "").strip().isdigit() and int(m["content"]) in outside]
        if asked and rng.random() < 0.5:
            return str(rng.choice(asked))
        if outside:
            return str(rng.choice(outside))
    a = taken
    for _ in range(8):
        a = jitter_action(state, n, rng, max(jitter, 0.5))
        if a != taken:
            break
    return a


def skill_episode(task: Task, n: int, seed: int, ep: int, skill_waste_p: float = 0.35, jitter: float = 0.25,
                  max_turns: Optional[int] = None) -> tuple[GuessNumberEnv, random.Random, list[Transition]]:
    """Skill-game episode ``ep`` of corpus seed ``seed``: (its env, with a fresh random waste set; the RNG that
    continues the episode's stream; the behaviour's Transitions)."""
    rng = random.Random(f"toy-forecast-skill:{seed}:{ep}")
    env = _env(n, max_turns, 0, [x for x in range(1, n + 1) if rng.random() < skill_waste_p])
    return env, rng, play_episode(env, task, _chooser(n, rng, jitter))


def endgame_episode(task: Task, n: int, seed: int, ep: int, waste_p: float = 0.35, jitter: float = 0.25,
                    max_turns: Optional[int] = None
                    ) -> Optional[tuple[GuessNumberEnv, random.Random, list[Transition], int]]:
    """Endgame episode ``ep`` of corpus seed ``seed`` (the ``endgame_episodes`` of :func:`build_forecast_examples`):
    a game with its own random waste set (every number with ``waste_p``), played by a scripted cornering behaviour
    that guesses, near the middle of the public range (jittered), numbers the game answers other than the target,
    until the range is the target alone, then guesses it. Returns (env, the RNG that continues the episode's
    stream, the Transitions, the cornered step t: ``Possible now`` is one number and a_t guesses it), or None when
    the episode wins or ends before it corners the target. The behaviour knows the target and the waste set; the
    states it reaches are public transcripts like any other."""
    rng = random.Random(f"toy-forecast-endgame:{seed}:{ep}")
    env = _env(n, max_turns, 0, [x for x in range(1, n + 1) if rng.random() < waste_p])
    target = int(task.payload["target"])

    def act(history: list) -> str:
        lo, hi, _, _ = consistent_interval(history, n)
        spared = [x for x in range(lo, hi + 1) if x != target and not env.wasted(x)]
        if lo >= hi or not spared:
            return str(target)
        mid = (lo + hi) / 2 + rng.uniform(-jitter, jitter) * (hi - lo)
        return str(min(spared, key=lambda x: (abs(x - mid), x)))

    traj = play_episode(env, task, act)
    for t, tr in enumerate(traj):
        lo, hi, _, _ = consistent_interval(tr.state, n)
        if lo == hi == target and parse_guess(tr.action) == target and tr.success:
            return env, rng, traj, t
    return None


def build_forecast_examples(tasks: Sequence[Task], n: int, episodes: int, skill_episodes: int, seed: int,
                            corpus_waste_every: int = 2, skill_waste_p: float = 0.35, jitter: float = 0.25,
                            max_turns: Optional[int] = None, p_non_number: float = 0.02,
                            prompts: Optional[PromptSet] = None,
                            target_cfg: Optional[TargetConfig] = None,
                            corpus_waste_p: Optional[float] = None,
                            p_out_of_range: float = 0.0,
                            corpus_wasted_numbers: Sequence[int] = (),
                            endgame_episodes: int = 0, p_repeat: float = 0.0) -> list[CorpusExample]:
    """Examples over ``tasks`` (cycled, reshuffled per epoch from ``seed``); deterministic given the arguments.

    episodes: corpus-game episodes (waste = multiples of ``corpus_waste_every``): per step a policy example and
      successor examples for the taken action and one alternative (its future played out counterfactually).
    corpus_wasted_numbers: numbers the corpus game wastes besides the multiples of ``corpus_waste_every`` (e.g. the
      odd numbers with ``corpus_waste_every = 0``: a corpus that teaches the RL game's own rule, the "knowing
      critic" upper reference of gin/experiments/unit_toy_learned_critic_knowing.gin).
    corpus_waste_p: None, or the corpus game holds NO rule: each corpus-game episode wastes its own random set
      (every number with this probability; ``corpus_waste_every`` is then unused), so the successor learns the
      forecast format and the base rate of "no answer", and no knowledge of which numbers are wasted.
    skill_episodes: skill-game episodes (each wastes its own random set, every number with ``skill_waste_p``): per
      step backup examples (non-terminal steps) and evaluator + refiner examples for the taken action and one
      alternative (its future played out counterfactually), judged from the real future's forecast.
    p_out_of_range: > 0 turns on the range critique (:func:`critique`'s ``judge_range``) and makes each skill-game
      alternative, with this probability, a guess outside the possible range (half of them a repeat of an answered
      guess when there is one), so the evaluator sees what it judges. 0: the waste-only critique.
    p_repeat: > 0 turns on the repeat critique (:func:`critique`'s ``judge_repeat``, every evaluator example) and
      makes each skill-game alternative, with this probability, a repeat of an earlier guess (answered or wasted)
      when there is one. The behaviour's own repeats (a waste-blind bisection after "no answer" may guess the same
      number again) are judged by it too. 0: no repeat critique, and the corpora of earlier runs stay bit-identical.
    endgame_episodes: > 0 turns on the single-number critique (:func:`critique`'s ``judge_single``, in the skill
      games too) and adds this many :func:`endgame_episode` games (random waste sets, the TRAIN tasks; ``game``
      "skill", ``source`` "endgame"). At each one's cornered state: a policy example (guess the one number), the
      successor's real forecast for it, and evaluator + refiner examples for it (with its real forecast and with a
      forecast of "no answer": the verdict reads the public range, not the forecast) and for one other number (its
      counterfactual future). What it teaches holds in every game: the hidden number is always answered. 0: no
      such games, and the corpora of earlier runs stay bit-identical.
    """
    if corpus_waste_p is not None and corpus_wasted_numbers:
        raise ValueError("forecast_corpus: corpus_wasted_numbers lists a rule and corpus_waste_p asks for none; "
                         "bind one of them")
    ps = prompts if prompts is not None else PromptSet(task="toy", prompt_set=PROMPT_SET)
    cfg = target_cfg or TargetConfig()
    out: list[CorpusExample] = []
    fixed_env = _env(n, max_turns, corpus_waste_every, corpus_wasted_numbers)
    for ep, task in enumerate(TaskCursor(list(tasks), "forecast-corpus", seed).take(max(episodes, 0))):
        rng = random.Random(f"toy-forecast-corpus:{seed}:{ep}")
        corpus_env = fixed_env
        if corpus_waste_p is not None:  # a rule-free corpus game: this episode's own random waste set
            wrng = random.Random(f"toy-forecast-corpus-waste:{seed}:{ep}")
            corpus_env = _env(n, max_turns, 0, [x for x in range(1, n + 1) if wrng.random() < corpus_waste_p])
        traj = play_episode(corpus_env, task, _chooser(n, rng, jitter))
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            meta = dict(episode=ep, step=t, game="corpus", source="behaviour", episode_success=bool(traj[-1].success),
                        episode_length=len(traj))
            d_t = forecast(traj[t:], ps, cfg)
            out.append(CorpusExample("policy", ps.policy(tr.state), tr.action, task.id, tr.state, "", dict(meta)))
            out.append(CorpusExample("successor", ps.successor(tr.state, tr.action), d_t, task.id, tr.state,
                                     tr.action, dict(meta, terminal=tr.done)))
            alt = _alternative(tr.state, tr.action, n, rng, jitter, 0.0)
            cf = play_episode(corpus_env, task, _chooser(n, rng, jitter, prefix=actions[:t] + [alt]))
            assert cf[t].state == tr.state  # deterministic env: same prefix, same state
            out.append(CorpusExample("successor", ps.successor(tr.state, alt), forecast(cf[t:], ps, cfg), task.id,
                                     tr.state, alt, dict(meta, source="alternative", terminal=cf[t].done)))
    judge_range, judge_single, judge_repeat = p_out_of_range > 0, endgame_episodes > 0, p_repeat > 0
    for ep, task in enumerate(TaskCursor(list(tasks), "forecast-skill", seed).take(max(skill_episodes, 0))):
        env, rng, traj = skill_episode(task, n, seed, ep, skill_waste_p, jitter, max_turns)
        summaries = [forecast(traj[t:], ps, cfg) for t in range(len(traj))]
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            meta = dict(episode=ep, step=t, game="skill", source="behaviour", episode_success=bool(traj[-1].success),
                        episode_length=len(traj))
            if not tr.done:
                out.append(backup_example(ps, cfg, traj, summaries, t, task.id, meta))
            out += _judge_examples(ps, n, task, tr.state, tr.action, summaries[t], meta, judge_range, judge_single,
                                   judge_repeat)
            alt = _alternative(tr.state, tr.action, n, rng, jitter, p_non_number, p_out_of_range, p_repeat)
            cf = play_episode(env, task, _chooser(n, rng, jitter, prefix=actions[:t] + [alt]))
            cf_summaries = [None] * t + [forecast(cf[i:], ps, cfg) for i in range(t, len(cf))]
            ameta = dict(meta, source="alternative")
            if not cf[t].done:  # the counterfactual step's backup too: the skill is the longest prompt to learn
                out.append(backup_example(ps, cfg, cf, cf_summaries, t, task.id, ameta))
            out += _judge_examples(ps, n, task, tr.state, alt, cf_summaries[t], ameta, judge_range, judge_single,
                                   judge_repeat)
    for ep, task in enumerate(TaskCursor(list(tasks), "forecast-endgame", seed).take(max(endgame_episodes, 0))):
        got = endgame_episode(task, n, seed, ep, skill_waste_p, jitter, max_turns)
        if got is None:
            continue
        env, rng, traj, t = got
        tr, actions = traj[t], [x.action for x in traj]
        meta = dict(episode=ep, step=t, game="skill", source="endgame", episode_success=True,
                    episode_length=len(traj))
        d_t = forecast(traj[t:], ps, cfg)
        out.append(CorpusExample("policy", ps.policy(tr.state), tr.action, task.id, tr.state, "", dict(meta)))
        out.append(CorpusExample("successor", ps.successor(tr.state, tr.action), d_t, task.id, tr.state,
                                 tr.action, dict(meta, terminal=True)))
        out += _judge_examples(ps, n, task, tr.state, tr.action, d_t, meta, judge_range, True, judge_repeat)
        wrong = outcome_line(False, 0.0) + f"\nReply: {WASTED_REPLY}."
        out += _judge_examples(ps, n, task, tr.state, tr.action, wrong, dict(meta, source="endgame_no_answer"),
                               judge_range, True, judge_repeat)
        # every other number is outside the range: a repeat of an answered guess half the time when there is one
        alt = _alternative(tr.state, tr.action, n, rng, jitter, p_non_number, p_out_of_range=1.0)
        cf = play_episode(env, task, _chooser(n, rng, jitter, prefix=actions[:t] + [alt]))
        out += _judge_examples(ps, n, task, tr.state, alt, forecast(cf[t:], ps, cfg),
                               dict(meta, source="endgame_alternative"), judge_range, True, judge_repeat)
    return out


def _train_tasks(n: int, task_source: Optional[GuessNumberTaskSource]) -> list[Task]:
    source = task_source if task_source is not None else GuessNumberTaskSource(n)
    if source.n != n:
        raise ValueError(f"task_source has n={source.n}, the corpus n={n}")
    tasks = source.tasks("train")
    held_out = {t.id for t in source.tasks("test")}
    assert all(t.split == "train" and t.id not in held_out for t in tasks), "corpus must use train tasks only"
    return tasks


@gin.configurable(module="experiments", denylist=["n", "episodes", "seed", "task_source"])
def forecast_corpus(n: int, episodes: int, seed: int, skill_episodes: int = 200, corpus_waste_every: int = 2,
                    skill_waste_p: float = 0.35, jitter: float = 0.25, max_turns: Optional[int] = None,
                    task_source: Optional[GuessNumberTaskSource] = None,
                    corpus_waste_p: Optional[float] = None, p_out_of_range: float = 0.0,
                    corpus_wasted_numbers: Sequence[int] = (), endgame_episodes: int = 0,
                    p_repeat: float = 0.0) -> list[CorpusExample]:
    """The learned-critic warm-start corpus (:func:`build_forecast_examples`) over the TRAIN split only (asserted:
    no held-out task id can appear). The knobs are gin bindings (``experiments.forecast_corpus.*``)."""
    return build_forecast_examples(_train_tasks(n, task_source), n, episodes, skill_episodes, seed,
                                   corpus_waste_every=corpus_waste_every, skill_waste_p=skill_waste_p,
                                   jitter=jitter, max_turns=max_turns, corpus_waste_p=corpus_waste_p,
                                   p_out_of_range=p_out_of_range, corpus_wasted_numbers=corpus_wasted_numbers,
                                   endgame_episodes=endgame_episodes, p_repeat=p_repeat)


def reference_success_rates(n: int, tasks: Sequence[Task], waste_every: int, seed: int = 0, jitter: float = 0.25,
                            max_turns: Optional[int] = None, episodes_per_task: int = 8,
                            wasted_numbers: Sequence[int] = (), corpus_waste_every: int = 2) -> dict:
    """Scripted references in a game that wastes multiples of ``waste_every`` and ``wasted_numbers``: the behaviour
    policy (waste-blind), the behaviour with the corpus's refinement rule applied by a critic that knows the true
    rule ("oracle refiner": a wasted guess moves to its neighbour), and the same with the corpus rule (multiples of
    ``corpus_waste_every``; 0: the corpus game holds no rule, and this reference is left out) instead."""
    env = _env(n, max_turns, waste_every, wasted_numbers)
    out = {}
    refiners = [("behaviour", None), ("oracle_refiner", env.wasted)]
    if corpus_waste_every:
        refiners.append(("corpus_rule_refiner", lambda g: is_wasted(g, corpus_waste_every)))
    for name, rule in refiners:
        wins = 0
        for i, task in enumerate(tasks):
            for j in range(episodes_per_task):
                rng = random.Random(f"toy-forecast-reference:{seed}:{i}:{j}")

                def act(h, rng=rng, rule=rule):
                    a = jitter_action(h, n, rng, jitter)
                    if rule is None or not rule(int(a)):
                        return a
                    return critique(h, a, f"Reply: {WASTED_REPLY}.", n)[2]
                wins += bool(play_episode(env, task, act)[-1].success)
        out[name] = wins / max(1, len(tasks) * episodes_per_task)
    out["episodes"] = len(tasks) * episodes_per_task
    return out


def waste_probe(sampler, prompts: PromptSet, n: int, waste_every: int, corpus_waste_every: int = 2,
                samples: int = 1, max_turns: Optional[int] = None, params: str = "policy",
                greedy: bool = True, wasted_numbers: Sequence[int] = (),
                corpus_wasted_numbers: Sequence[int] = ()) -> dict:
    """What the critic KNOWS about the waste rule: for every first guess g in 1..n (the game's opening state),
    ``samples`` forecasts of the successor, and the fraction whose reply is "no answer".

    greedy (default): the successor decodes at temperature 0, so the probe is a deterministic function of the
      parameters: a change between two evaluations is a change of the critic, not sampling noise (4 samples at
      T = 1 over 32 numbers moved by +-0.1 with fixed parameters). False: the sampler's own settings.

    Returns probe/wasted_said_rl (mean over the RL game's wasted numbers: multiples of ``waste_every`` and
    ``wasted_numbers``), probe/wasted_said_corpus (over numbers only the corpus rule, multiples of
    ``corpus_waste_every`` and ``corpus_wasted_numbers``, wastes; NaN when the corpus holds no rule),
    probe/wasted_said_other (over numbers neither rule wastes), probe/knowledge_accuracy (over all g: the majority
    forecast agrees with the RL rule), and the scored probabilities probe/p_wasted_{rl,corpus,other} over the same
    groups; probe/p_gap_rl and probe/p_gap_corpus: P(wasted) averaged over the numbers the RL (corpus) rule wastes
    minus over the numbers it spares (NaN for a rule that wastes nothing). A critic that learned the RL game reads
    high on _rl and low on _other; a rule-free warm start reads the same base rate on both.
    """
    env = _env(n, max_turns)
    state = env.reset(Task(id=f"probe-{n}", split="probe", payload={"target": 1, "n": n}))
    rl_wasted = _env(n, max_turns, waste_every, wasted_numbers).wasted
    corpus_wasted = _env(n, max_turns, corpus_waste_every, corpus_wasted_numbers).wasted
    guesses = list(range(1, n + 1))
    settings = greedy_settings(sampler, ("successor",)) if greedy else None
    out = check_samples(sampler.sample([prompts.successor(state, str(g)) for g in guesses], params, "successor",
                                       n=samples, settings=settings), n * samples, "successor")
    said = {g: sum(forecast_reply(c.text) == WASTED_REPLY for c in grp) / samples
            for g, grp in zip(guesses, group(out, samples))}

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else float("nan")
    rl = [g for g in guesses if rl_wasted(g)]
    corpus = [g for g in guesses if corpus_wasted(g) and not rl_wasted(g)]
    other = [g for g in guesses if not corpus_wasted(g) and not rl_wasted(g)]
    p = waste_probabilities(sampler, prompts, state, guesses, params)
    return {"probe/wasted_said_rl": mean(said[g] for g in rl),
            "probe/wasted_said_corpus": mean(said[g] for g in corpus),
            "probe/wasted_said_other": mean(said[g] for g in other),
            "probe/knowledge_accuracy": mean((said[g] > 0.5) == rl_wasted(g) for g in guesses),
            "probe/p_wasted_rl": mean(p[g] for g in rl),
            "probe/p_wasted_corpus": mean(p[g] for g in corpus),
            "probe/p_wasted_other": mean(p[g] for g in other),
            # what the premise reads: P(wasted) on the numbers a rule wastes minus on the numbers it spares
            "probe/p_gap_rl": mean(p[g] for g in guesses if rl_wasted(g)) - mean(
                p[g] for g in guesses if not rl_wasted(g)),
            "probe/p_gap_corpus": mean(p[g] for g in guesses if corpus_wasted(g)) - mean(
                p[g] for g in guesses if not corpus_wasted(g))}


def endgame_states(n: int, max_turns: Optional[int], waste_every: int = 0,
                   wasted_numbers: Sequence[int] = ()) -> list[tuple[int, list]]:
    """(g, state) for every number g the RL game's waste rule wastes and a bisection can corner: the state an
    ideal player reaches on target g by bisecting with the numbers the rule spares (the spared number nearest the
    middle of the possible range, the lower on a tie) until the range is g alone, with guesses left. There, g is
    the only number still possible and guessing it wins, though the rule wastes it everywhere else: the states a
    policy that learned "never guess a wasted number" loses. Targets the bisection cannot corner (the range keeps
    two wasted numbers, or the turns run out) are left out. Deterministic; the transcript is the runner's."""
    out = []
    for g in range(1, n + 1):
        env = _env(n, max_turns, waste_every, wasted_numbers)
        if not env.wasted(g):
            continue
        state = env.reset(Task(id=f"endgame-{g}", split="probe", payload={"target": g, "n": n}))
        while env.lo < env.hi and not env.done:
            spared = [x for x in range(env.lo, env.hi + 1) if not env.wasted(x)]
            if not spared:
                break
            mid = (env.lo + env.hi) / 2
            guess = min(spared, key=lambda x: (abs(x - mid), x))
            r = env.step(str(guess))
            state = state + [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": r.observation}]
        if not env.done and env.lo == env.hi == g:
            out.append((g, state))
    return out


def endgame_probe(sampler, prompts: PromptSet, n: int, waste_every: int = 0, wasted_numbers: Sequence[int] = (),
                  max_turns: Optional[int] = None, policy_samples: int = 8, params: str = "policy") -> dict:
    """Where "never guess a wasted number" is wrong: at each :func:`endgame_states` state (the range is one
    number, which the rule wastes elsewhere; guessing it wins), what each role does with that number.

    Returns endgame/states (how many), and means over them of
      endgame/p_wasted: the successor's scored P(reply "no answer") for guessing it
        (:func:`pair_waste_probabilities`; right: 0);
      endgame/p_success: its scored P(success) (``critic_scores.success_probabilities``; right: 1);
      endgame/verdict_optimal: the evaluator, reading the successor's greedy forecast, judges it optimal (right: 1);
      endgame/policy_greedy: the policy's greedy guess is it;
      endgame/policy_sampled: the fraction of ``policy_samples`` guesses at the sampler's own settings (the acting
        policy's) that are it.
    A critic that knows the exception and a policy that learned only "avoid wasted numbers" read low p_wasted, high
    verdict_optimal and low policy_*: the policy side loses it. Empty (states 0, NaN means) when no state exists."""
    items = endgame_states(n, max_turns, waste_every, wasted_numbers)
    out = {"endgame/states": len(items)}
    keys = ("p_wasted", "p_success", "verdict_optimal", "policy_greedy", "policy_sampled")
    if not items:
        return {**out, **{f"endgame/{k}": math.nan for k in keys}}
    states, acts = [s for _, s in items], [str(g) for g, _ in items]
    p_w = pair_waste_probabilities(sampler, prompts, [(s, g) for g, s in items], params)
    p_s = success_probabilities(sampler, prompts, list(zip(states, acts)), params)
    greedy = greedy_settings(sampler, ("successor", "evaluator", "policy"))
    futures = [c.text for c in check_samples(sampler.sample([prompts.successor(s, a) for s, a in zip(states, acts)],
                                                            params, "successor", settings=greedy), len(items),
                                             "successor")]
    crit = [c.text for c in check_samples(sampler.sample([prompts.evaluator(s, a, [f]) for s, a, f in
                                                          zip(states, acts, futures)], params, "evaluator",
                                                         settings=greedy), len(items), "evaluator")]
    pol = [prompts.policy(s) for s in states]
    g_out = check_samples(sampler.sample(pol, params, "policy", settings=greedy), len(items), "policy")
    s_out = check_samples(sampler.sample(pol, params, "policy", n=policy_samples), len(items) * policy_samples,
                          "policy")
    out.update({
        "endgame/p_wasted": float(np.mean(p_w)), "endgame/p_success": float(np.mean(p_s)),
        "endgame/verdict_optimal": float(np.mean([parse_verdict(c) is True for c in crit])),
        "endgame/policy_greedy": float(np.mean([parse_guess(c.text) == int(a) for c, a in zip(g_out, acts)])),
        "endgame/policy_sampled": float(np.mean([parse_guess(c.text) == int(a) for grp, a in
                                                 zip(group(s_out, policy_samples), acts) for c in grp]))})
    return out


WASTE_RULES = {"odd": lambda g: g % 2 == 1, "even": lambda g: g % 2 == 0, "mult3": lambda g: g % 3 == 0}


def rule_numbers(rule: str, n: int) -> tuple[int, ...]:
    """The numbers 1..n that ``rule`` (a key of :data:`WASTE_RULES`) wastes: a ``GuessNumberEnv.wasted_numbers``."""
    if rule not in WASTE_RULES:
        raise ValueError(f"unknown rule {rule!r}; rules are {sorted(WASTE_RULES)}")
    return tuple(g for g in range(1, n + 1) if WASTE_RULES[rule](g))


SKILL_ROLES = ("backup", "evaluator", "refiner")  # the roles whose corpus skills are copying and reading
_NAMED_GUESS = re.compile(r"\bGuess (.+?) "
                          r"(?:is wasted|gets an answer|is not a number|is outside|is the only|was guessed before)")


def named_guess(critique_text: str) -> Optional[str]:
    """The guess a toy_forecast critique names ("... Guess 15 is wasted: ..." -> "15"); None if it names none."""
    m = _NAMED_GUESS.search(critique_text or "")
    return m.group(1) if m else None


def skill_probe(sampler, prompts: PromptSet, n: int, seed: int = 99, per_role: int = 48,
                params: str = "policy", p_out_of_range: float = 0.0, p_repeat: float = 0.0) -> dict:
    """What the critic roles CAN DO, independent of any waste rule: greedy outputs on ``per_role`` fresh skill-game
    examples (corpus seed ``seed``: other episodes than any warm start's) of each of :data:`SKILL_ROLES`, against
    the scripted targets. In a skill game the waste set is random, so only reading the prompt gets these right.

    Returns skill/backup_reply (the backup's forecast gives the REAL reply of its prompt), skill/backup_outcome
    (its first line is the target's Bellman line), skill/evaluator_guess (the critique names the guess under
    judgment), skill/evaluator_verdict (the verdict follows the forecast's reply), skill/evaluator_exact, and
    skill/refiner (the refiner plays the guess the critique names).
    p_out_of_range > 0 (the corpus's range critique, :func:`build_forecast_examples`): the probe's corpus has it
    too, and skill/evaluator_range is the verdict's accuracy on up to ``per_role`` evaluator prompts whose guess is
    outside the possible range (an extra call). p_repeat > 0 (the repeat critique): likewise, and
    skill/evaluator_repeat is the verdict's accuracy on evaluator prompts whose guess repeats an earlier one."""
    ex = build_forecast_examples(_train_tasks(n, None), n, 0, max(8, per_role // 2), seed, prompts=prompts,
                                 p_out_of_range=p_out_of_range, p_repeat=p_repeat)
    rng = random.Random(f"toy-forecast-skill-probe:{seed}")
    greedy = greedy_settings(sampler, SKILL_ROLES)
    got: dict = {}
    special = {"evaluator_range": "out_of_range", "evaluator_repeat": "repeat"}  # evaluator prompts of one kind
    roles = (list(SKILL_ROLES) + (["evaluator_range"] if p_out_of_range > 0 else [])
             + (["evaluator_repeat"] if p_repeat > 0 else []))
    for name in roles:
        role = "evaluator" if name in special else name
        pool = [e for e in ex if e.role == role and (name not in special or e.meta[special[name]])]
        if not pool:
            continue
        xs = rng.sample(pool, min(per_role, len(pool)))
        outs = [c.text.strip() for c in check_samples(
            sampler.sample([e.prompt_messages for e in xs], params, role, settings=greedy), len(xs), role)]
        pairs = list(zip(outs, [e.target_text.strip() for e in xs], xs))

        def frac(pred):
            return sum(bool(pred(o, t, e)) for o, t, e in pairs) / max(1, len(pairs))
        if name in special:
            got[f"skill/{name}"] = frac(lambda o, t, e: o.split("\n")[-1] == t.split("\n")[-1])
        elif role == "backup":
            got["skill/backup_reply"] = frac(lambda o, t, e: forecast_reply(o) == forecast_reply(t))
            got["skill/backup_outcome"] = frac(lambda o, t, e: o.split("\n")[0] == t.split("\n")[0])
        elif role == "evaluator":
            got["skill/evaluator_guess"] = frac(lambda o, t, e: named_guess(o) is not None
                                                and named_guess(o) == named_guess(t))
            got["skill/evaluator_verdict"] = frac(lambda o, t, e: o.split("\n")[-1] == t.split("\n")[-1])
            got["skill/evaluator_exact"] = frac(lambda o, t, e: o == t)
        else:
            got["skill/refiner"] = frac(lambda o, t, e: o == t)
    return got


PROBE_REPLIES = ("no answer", "higher", "lower", "correct", "error")  # every first reply a forecast can give
PROBE_OUTCOMES = ((True, 1.0), (False, 0.0))  # the toy game's returns: 1 for a win, 0 otherwise


def waste_probabilities(sampler, prompts: PromptSet, state: list, guesses: Sequence[int],
                        params: str = "policy") -> dict:
    """P(the successor's forecast for guess g at ``state`` replies "no answer") per g (:func:`pair_waste_probabilities`
    for one state and several guesses); {g: probability}."""
    return dict(zip(guesses, pair_waste_probabilities(sampler, prompts, [(state, g) for g in guesses], params)))


def pair_waste_probabilities(sampler, prompts: PromptSet, pairs: Sequence[tuple[list, int]],
                             params: str = "policy") -> list[float]:
    """P(the successor's forecast for guess g at state s replies "no answer") per (s, g) pair, read from the model's
    distribution instead of samples: the forecast's first two lines "Outcome: <o>; Return: <r>" / "Reply: <w>." are
    scored for both outcomes and every reply word (one ``sampler.score`` call for all pairs), and

        P(wasted | s, g) = sum_o pi(o, "no answer") / sum_(o, w) pi(o, w)

    (normalised over those continuations; they tokenize as prefixes of the trained targets). NaN where a score is
    not finite (e.g. a scripted sampler without scores)."""
    conts = [outcome_line(o, r) + f"\nReply: {w}." for o, r in PROBE_OUTCOMES for w in PROBE_REPLIES]
    msgs = [prompts.successor(s, str(g)) for s, g in pairs]
    if not msgs:
        return []
    lp = np.asarray(sampler.score([m for m in msgs for _ in conts], conts * len(msgs), params, "successor"),
                    np.float64).reshape(len(msgs), len(conts))
    wasted = np.asarray([w == WASTED_REPLY for _ in PROBE_OUTCOMES for w in PROBE_REPLIES])
    with np.errstate(invalid="ignore"):
        top = lp.max(axis=1, keepdims=True)
        e = np.exp(lp - top)
        p = e[:, wasted].sum(1) / e.sum(1)
    return [float(v) if np.all(np.isfinite(row)) else math.nan for v, row in zip(p, lp)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m nlac_jax.experiments.corpus_forecast WARM_DIR [--n 32 --wasted odd --corpus_waste_every 2]``: the
    knowledge probe (:func:`waste_probe`, greedy readouts and scored probabilities) and the skill probe
    (:func:`skill_probe`) of a saved warm start, as one JSON line. Defaults: the learned-critic experiment's games."""
    import argparse
    import json
    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("warm_dir", help="a warm start saved by unit_scale (WORKDIR/warm_start_seed_<s>)")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--wasted", default="odd",
                   help=f"the RL game's wasted numbers: one of {sorted(WASTE_RULES)} or a comma list "
                        "(GuessNumberEnv.wasted_numbers)")
    p.add_argument("--waste_every", type=int, default=0, help="the RL game's rule: multiples of this (0: none)")
    p.add_argument("--corpus_waste_every", type=int, default=2, help="the corpus game's rule (0: rule-free)")
    p.add_argument("--successor_tokens", type=int, default=40)
    p.add_argument("--policy_episodes", type=int, default=0,
                   help="> 0: also play this many episodes per held-out task in the RL game with the warm start's "
                        "policy (--policy_temperature) and print its success and action breakdown (evaluation.action_breakdown)")
    p.add_argument("--policy_temperature", type=float, default=1.0, help="the policy's temperature (0: greedy)")
    p.add_argument("--p_out_of_range", type=float, default=0.0,
                   help="the skill probe's corpus judges the range too (forecast_corpus.p_out_of_range)")
    p.add_argument("--p_repeat", type=float, default=0.0,
                   help="the skill probe's corpus judges repeated guesses too (forecast_corpus.p_repeat)")
    args = p.parse_args(argv)
    try:
        wasted = (rule_numbers(args.wasted, args.n) if args.wasted in WASTE_RULES
                  else [int(x) for x in args.wasted.split(",") if x.strip()])
    except ValueError:
        p.error(f"--wasted: expected one of {sorted(WASTE_RULES)} or a comma list of whole numbers, "
                f"got {args.wasted!r}")
    cfg, tok, params = warm_start.load_warm_start(args.warm_dir, dtype="bfloat16")
    settings = RoleSampling(temperatures={"policy": args.policy_temperature},
                            max_new_tokens={"policy": 6, "successor": args.successor_tokens,
                                            "backup": args.successor_tokens, "evaluator": 48, "refiner": 6})
    roles = ModelRoleSampler(sampling.Sampler(cfg), tok, get_params=lambda _: params, settings=settings)
    ps = PromptSet(task="toy", prompt_set=PROMPT_SET)
    out = waste_probe(roles, ps, args.n, args.waste_every, args.corpus_waste_every, wasted_numbers=wasted)
    out.update(skill_probe(roles, ps, args.n, p_out_of_range=args.p_out_of_range, p_repeat=args.p_repeat))
    if args.policy_episodes > 0:
        tasks = [t for t in GuessNumberTaskSource(args.n).tasks("test") for _ in range(args.policy_episodes)]
        envs = [_env(args.n, None, args.waste_every, wasted) for _ in range(min(len(tasks), 64))]
        m, _ = evaluation.evaluate(envs, tasks, roles, ps, _env(args.n, None, args.waste_every, wasted),
                                   calibration_transitions=0, score_transitions=0)
        out.update({f"policy/{k[len('eval/'):]}": v for k, v in m.items()
                    if k == "eval/success_rate" or k.startswith("eval/actions/")})
    print(json.dumps({k: round(v, 4) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
