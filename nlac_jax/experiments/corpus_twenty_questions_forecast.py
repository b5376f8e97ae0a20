"""Warm-start corpus for the unit-scale 20 Questions learned-critic experiment (issue 25; gin/experiments/unit_20q.gin).

The 20 Questions port of ``corpus_forecast`` (the toy learned-critic corpus), with the same separation of SKILLS
(taught where no rule predicts them) from one piece of deliberately wrong KNOWLEDGE (README, "Does NLAC learn?"):

* **The world** is the synthetic 'unit' object set (``envs/data/twenty_questions_unit.json``): 16 objects, 8
  attributes in a fixed public **bank order**, any two objects differ in >= 4 attributes. Every role and the policy
  read the same public state line (``templates/twenty_questions_forecast/_state.txt``: history, the objects still
  possible, the questions left); nothing states which attributes are refused, and no prompt names the hidden object.
* **The hidden rule**: the oracle refuses some attributes ("I can't answer that."; the question costs -1 and tells
  nothing: ``ScriptedOracle.refused_attributes``). The **corpus game** refuses C (``corpus_refused``, 3 attributes),
  the **RL game** refuses R (``rl_refused``, 3 others, in the experiment's gin file); 2 attributes are refused by
  neither.
* **Partners**: C and R are paired in order, partner(C_i) = R_i and partner(R_i) = C_i. The critique's alternative
  to a wasted question (the forecast says "can't answer" or "error") is its partner when not yet asked, else the
  first unasked attribute in bank order (a neither-refused attribute has no partner), else a guess of the first
  possible object. So the warm-start critic, which learned the corpus rule, flags C questions and moves them to
  their R partners, which the RL game refuses: a frozen critic is actively wrong in the RL game, and only L1 over
  real transitions (the backup copies the real "can't answer") corrects it.
* **policy** examples clone a refusal-blind, deliberately suboptimal behaviour (TRAIN objects only): per turn, with
  weights ``mix`` = (best, random, guess, repeat), the unasked attribute that best splits the possible objects, a
  random unasked attribute, a guess of a random possible object (premature while several remain), or a repeat of
  an asked attribute question; it guesses when one object remains. **successor** examples summarise the real
  futures of the corpus game for the taken action and one counterfactual alternative: the warm-start successor
  therefore forecasts "can't answer" for C questions, the corpus's knowledge, wrong in the RL game.
* **backup**, **evaluator** and **refiner** examples come from **skill games**: each episode refuses its own random
  attribute set (each attribute with ``skill_refuse_p``), so whether an answer is "can't answer" is independent of
  the attribute, and only reading the forecast (evaluator) or the real answer (backup) predicts the target.

Actions are compact: an attribute question is the bare attribute word ("alive?", 4 tokens at the unit model's
tokenizer), a guess the bare object name ("cat?"); both are in the env's grammar for the 'unit' world.

Summary format (outcome FIRST: the critic metrics score P(success | s, a) as the continuation "Outcome: success"
against "Outcome: failure" right after the successor prompt)::

    Outcome: failure; Return: -7
    Answer: can't answer.

Critique format (the question under judgment is named; the refiner plays the question after "ask")::

    Forecast answer: can't answer. Question metal? is wasted: ask edible?
    Verdict: suboptimal

Nothing is invented: every future is played by the real ``TwentyQuestionsEnv`` with the ``ScriptedOracle``.
"""

from __future__ import annotations

import math
import random
import re
from typing import Optional, Sequence

import gin
import numpy as np

from nlac_jax.envs.base import Task, TaskCursor
from nlac_jax.envs.transition import Transition
from nlac_jax.envs.twenty_questions import (ObjectTable, ScriptedOracle, TwentyQuestionsEnv,
                                            TwentyQuestionsTaskSource, canonical_question, load_object_table)
from nlac_jax.envs.twenty_questions_state import (ANSWER_WORDS, answer_word, asked_attributes, attribute_order,
                                                 candidates, even_splits)
from nlac_jax.experiments.corpus import (CorpusExample, backup_example, greedy_settings, play_episode,
                                         prefixed_chooser, terminal_summary)
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.targets import TargetConfig, truncate_summary
from nlac_jax.nlac.verdict import outcome_line
from nlac_jax.rl.roles import check_samples

__all__ = [
    "PROMPT_SET",
    "TASK_NAME",
    "WORLD",
    "DEFAULT_MIX",
    "CORPUS_REFUSED",
    "RL_REFUSED",
    "MAX_QUESTIONS",
    "SKILL_ROLES",
    "bank",
    "partners",
    "attribute_of",
    "behaviour_action",
    "behaviour_distribution",
    "forecast",
    "forecast_answer",
    "alternative_question",
    "critique",
    "make_env",
    "skill_episode",
    "build_forecast_examples",
    "twenty_questions_forecast_corpus",
    "train_tasks",
    "reference_success_rates",
    "refusal_probabilities",
    "refusal_probe",
    "named_question",
    "skill_probe",
]

PROMPT_SET = "twenty_questions_forecast"
TASK_NAME = "twenty_questions"
WORLD = "unit"
DEFAULT_MIX = (0.45, 0.25, 0.25, 0.05)  # (best split, random attribute, premature guess, repeat)
# defaults of the experiment's gin file (unit_20q.gin sets them by name); partners pair them in this order
CORPUS_REFUSED = ("metal", "heavy", "round")
RL_REFUSED = ("edible", "soft", "wooden")
MAX_QUESTIONS = 7  # 4 bisecting questions + the guess = 5: two wasted questions still leave a win
SKILL_ROLES = ("backup", "evaluator", "refiner")
WASTED_WORDS = ("can't answer", "error")


# ------------------------------------------------------------------------------------------- the world


def bank(table: ObjectTable) -> tuple[str, ...]:
    """The attributes in the table's (public, fixed) order: the bank order of the critique's alternatives."""
    return attribute_order(table)


def partners(table: ObjectTable, corpus_refused: Sequence[str], rl_refused: Sequence[str]) -> dict:
    """{attribute: partner}: corpus_refused[i] <-> rl_refused[i] (checked: attributes of the table, equal lengths,
    disjoint)."""
    attrs = set(bank(table))
    c, r = tuple(corpus_refused), tuple(rl_refused)
    unknown = sorted((set(c) | set(r)) - attrs)
    if unknown:
        raise ValueError(f"refused attributes {unknown} are not attributes of the table ({sorted(attrs)})")
    if len(c) != len(r) or set(c) & set(r) or len(set(c)) != len(c) or len(set(r)) != len(r):
        raise ValueError(f"corpus_refused {c} and rl_refused {r} must be disjoint lists of distinct attributes of "
                         "equal length (they are paired in order)")
    return {**dict(zip(c, r)), **dict(zip(r, c))}


def attribute_of(question: str, table: ObjectTable) -> Optional[str]:
    """The attribute a question asks about (either phrasing), or None (a guess or anything else)."""
    return table.attribute_questions.get(canonical_question(question))


def _asked_attributes(state: Sequence[dict], table: ObjectTable) -> set:
    return asked_attributes(state, table)


def behaviour_action(state: Sequence[dict], table: ObjectTable, rng: random.Random,
                     mix: Sequence[float] = DEFAULT_MIX) -> str:
    """One action of the refusal-blind behaviour policy, from the public state only (module docstring)."""
    p_best, p_random, p_guess, p_repeat = (float(x) for x in mix)
    names, asked = candidates(state, table)
    pool = names or [o.name for o in table.objects]  # no candidate cannot happen with a truthful oracle
    if len(names) == 1:
        return f"{names[0]}?"
    asked_attrs = _asked_attributes(state, table)
    unasked = [a for a in bank(table) if a not in asked_attrs]
    u = rng.random() * (p_best + p_random + p_guess + p_repeat)
    if u < p_best and unasked:
        best = even_splits(state, table)  # the public "Even splits" line's attributes (when the prompts show it)
        if best:  # an attribute that splits the candidates at all
            return f"{rng.choice(best)}?"
    elif u < p_best + p_random and unasked:
        return f"{rng.choice(unasked)}?"
    elif u >= p_best + p_random + p_guess:
        repeatable = [q for q in asked if attribute_of(q, table) is not None]
        if repeatable:
            return rng.choice(repeatable)
    return f"{rng.choice(pool)}?"


def behaviour_distribution(state: Sequence[dict], table: ObjectTable,
                           mix: Sequence[float] = DEFAULT_MIX) -> dict[str, float]:
    """The exact distribution of :func:`behaviour_action` at ``state``: {action: probability}, each branch of the
    mix with its fall-backs (no split, nothing unasked, nothing to repeat: a possible object), for reading how
    closely a clone copies it (`policy_clone`)."""
    names, asked = candidates(state, table)
    pool = [f"{o}?" for o in (names or [o.name for o in table.objects])]
    if len(names) == 1:
        return {pool[0]: 1.0}
    asked_attrs = _asked_attributes(state, table)
    unasked = [a for a in bank(table) if a not in asked_attrs]
    total = sum(float(x) for x in mix)
    w_best, w_random, w_guess, w_repeat = (float(x) / total for x in mix)
    out: dict[str, float] = {}

    def spread(actions, w):
        for a in actions:
            out[a] = out.get(a, 0.0) + w / len(actions)
    best = even_splits(state, table) if unasked else []
    spread([f"{a}?" for a in best] or pool, w_best)
    spread([f"{a}?" for a in unasked] or pool, w_random)
    spread(pool, w_guess)
    spread([q for q in asked if attribute_of(q, table) is not None] or pool, w_repeat)
    return out


def _chooser(table: ObjectTable, rng: random.Random, mix, prefix: Sequence[str] = ()):
    return prefixed_chooser(lambda history: behaviour_action(history, table, rng, mix), prefix)


# ------------------------------------------------------------------------------------------- summaries


def _answer(t: Transition) -> str:
    if t.info.get("success"):
        return "correct"
    return answer_word(" ".join(m.get("content", "") for m in t.next_observation))


def forecast(future: Sequence[Transition], ps: PromptSet, cfg: Optional[TargetConfig] = None) -> str:
    """The successor target for (s_t, a_t) from the real transitions a_t .. the end: the prompt set's terminal
    summary for a terminal step (exactly as ``targets.build_critic_examples`` builds it), else ``Outcome: ...;
    Return: ...`` then ``Answer: <word>.``"""
    cfg = cfg or TargetConfig()
    if not future or not future[-1].done:
        raise ValueError("forecast needs a finished episode (its last transition terminal)")
    first = future[0]
    if first.done:
        return terminal_summary(first, ps, cfg)
    ret = sum(float(t.reward) for t in future)
    return truncate_summary(f"{outcome_line(bool(future[-1].success), ret)}\nAnswer: {_answer(first)}.",
                            cfg.max_summary_chars)


def forecast_answer(text: str) -> Optional[str]:
    """The answer a forecast predicts for the question itself (its first ``Answer: <word>``); None if none."""
    for line in (text or "").split("\n"):
        s = line.strip()
        if s.lower().startswith("answer:"):
            return s[len("answer:"):].strip().split(".")[0].strip().lower() or None
    return None


# ------------------------------------------------------------------------------------------- critique


def _shown(action: str) -> str:
    return " ".join(str(action).split())[:24] or "(empty)"


def alternative_question(state: Sequence[dict], action: str, table: ObjectTable, partner: dict) -> str:
    """The question the critique proposes instead of a wasted ``action``: its partner attribute if not yet asked,
    else the first unasked attribute in bank order, else a guess of the first possible object (public state only)."""
    asked = _asked_attributes(state, table)
    this = attribute_of(action, table)
    p = partner.get(this)
    if p is not None and p not in asked:
        return f"{p}?"
    for a in bank(table):
        if a not in asked and a != this:
            return f"{a}?"
    names, _ = candidates(state, table)
    return f"{names[0]}?" if names else action.strip()


def critique(state: Sequence[dict], action: str, future_text: str, table: ObjectTable,
             partner: dict) -> tuple[str, bool, str]:
    """The scripted evaluator and refiner: (critique, verdict, refined action), from the PUBLIC state and the
    forecast only. A forecast answer "can't answer" or "error" means the question is wasted: ask
    :func:`alternative_question`; any other answer means it gets one (optimal: the refiner keeps the action)."""
    word = forecast_answer(future_text) or "unknown"
    head = f"Forecast answer: {word}. Question {_shown(action)}"
    if word in WASTED_WORDS:
        better = alternative_question(state, action, table, partner)
        return f"{head} is wasted: ask {better}\nVerdict: suboptimal", False, better
    return f"{head} gets an answer.\nVerdict: optimal", True, action.strip()


_NAMED = re.compile(r"\bQuestion (.+?) (?:is wasted|gets an answer)")


def named_question(critique_text: str) -> Optional[str]:
    """The question a critique names ("... Question metal? is wasted: ..." -> "metal?"); None if it names none."""
    m = _NAMED.search(critique_text or "")
    return m.group(1) if m else None


# ------------------------------------------------------------------------------------------- the corpus


def make_env(table: ObjectTable, max_questions: int, refused: Sequence[str] = ()) -> TwentyQuestionsEnv:
    """A game in ``table``'s world refusing ``refused``. Every argument explicit: gin bindings of the RL game
    (``ScriptedOracle.refused_attributes``, ``TwentyQuestionsEnv.*``) must never reach the corpus's games."""
    return TwentyQuestionsEnv(ScriptedOracle(table, refused_attributes=tuple(refused)),
                              max_questions=int(max_questions), max_action_chars=1000)


def _judge_examples(ps: PromptSet, table: ObjectTable, partner: dict, task: Task, state: list, action: str,
                    future_text: str, meta: dict) -> list[CorpusExample]:
    text, verdict, refined = critique(state, action, future_text, table, partner)
    m = dict(meta, verdict=verdict, refined=refined, attribute=attribute_of(action, table), future=future_text)
    return [CorpusExample("evaluator", ps.evaluator(state, action, [future_text]), text, task.id, state, action, m),
            CorpusExample("refiner", ps.refiner(state, action, text, []), refined, task.id, state, action, m)]


def _alternative(state: list, taken: str, table: ObjectTable, rng: random.Random, mix) -> str:
    """A counterfactual action: the behaviour's, or half the time a uniformly random attribute question (so every
    attribute's forecast is seen at every stage), different from ``taken`` when it can be."""
    a = taken
    for _ in range(8):
        a = f"{rng.choice(bank(table))}?" if rng.random() < 0.5 else behaviour_action(state, table, rng, mix)
        if a != taken:
            break
    return a


def skill_episode(task: Task, table: ObjectTable, seed: int, ep: int, skill_refuse_p: float = 0.35,
                  mix: Sequence[float] = DEFAULT_MIX, max_questions: int = MAX_QUESTIONS
                  ) -> tuple[TwentyQuestionsEnv, random.Random, list[Transition]]:
    """Skill-game episode ``ep`` of corpus seed ``seed``: (its env, refusing a fresh random attribute set; the RNG
    that continues the episode's stream; the behaviour's Transitions)."""
    rng = random.Random(f"20q-forecast-skill:{seed}:{ep}")
    env = make_env(table, max_questions, [a for a in bank(table) if rng.random() < skill_refuse_p])
    return env, rng, play_episode(env, task, _chooser(table, rng, mix), TASK_NAME)


def build_forecast_examples(tasks: Sequence[Task], table: ObjectTable, episodes: int, skill_episodes: int, seed: int,
                            corpus_refused: Sequence[str] = CORPUS_REFUSED, rl_refused: Sequence[str] = RL_REFUSED,
                            skill_refuse_p: float = 0.35, mix: Sequence[float] = DEFAULT_MIX,
                            max_questions: int = MAX_QUESTIONS, prompts: Optional[PromptSet] = None,
                            target_cfg: Optional[TargetConfig] = None) -> list[CorpusExample]:
    """Examples over ``tasks`` (cycled, reshuffled per epoch from ``seed``); deterministic given the arguments.

    episodes: corpus-game episodes (refusing ``corpus_refused``): per step a policy example and successor examples
      for the taken action and one alternative (its future played out counterfactually).
    skill_episodes: skill-game episodes (each refuses its own random set, every attribute with ``skill_refuse_p``):
      per step backup examples (non-terminal steps) and evaluator + refiner examples for the taken action and one
      alternative, judged from the real future's forecast.
    rl_refused: only the partners of the critique (``partners``); no RL-game future is ever played here."""
    if len(mix) != 4 or min(mix) < 0 or sum(mix) <= 0:
        raise ValueError(f"mix must be 4 non-negative weights (best, random, guess, repeat), got {tuple(mix)}")
    partner = partners(table, corpus_refused, rl_refused)
    ps = prompts if prompts is not None else PromptSet(task=TASK_NAME, prompt_set=PROMPT_SET)
    cfg = target_cfg or TargetConfig()
    out: list[CorpusExample] = []
    corpus_env = make_env(table, max_questions, corpus_refused)
    for ep, task in enumerate(TaskCursor(list(tasks), "20q-forecast-corpus", seed).take(max(episodes, 0))):
        rng = random.Random(f"20q-forecast-corpus:{seed}:{ep}")
        traj = play_episode(corpus_env, task, _chooser(table, rng, mix), TASK_NAME)
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            meta = dict(episode=ep, step=t, game="corpus", source="behaviour", episode_success=bool(traj[-1].success),
                        episode_length=len(traj), hidden=task.payload["name"])
            out.append(CorpusExample("policy", ps.policy(tr.state), tr.action, task.id, tr.state, "", dict(meta)))
            out.append(CorpusExample("successor", ps.successor(tr.state, tr.action), forecast(traj[t:], ps, cfg),
                                     task.id, tr.state, tr.action, dict(meta, terminal=tr.done)))
            alt = _alternative(tr.state, tr.action, table, rng, mix)
            cf = play_episode(corpus_env, task, _chooser(table, rng, mix, prefix=actions[:t] + [alt]), TASK_NAME)
            assert cf[t].state == tr.state  # deterministic env: same prefix, same state
            out.append(CorpusExample("successor", ps.successor(tr.state, alt), forecast(cf[t:], ps, cfg), task.id,
                                     tr.state, alt, dict(meta, source="alternative", terminal=cf[t].done)))
    for ep, task in enumerate(TaskCursor(list(tasks), "20q-forecast-skill", seed).take(max(skill_episodes, 0))):
        env, rng, traj = skill_episode(task, table, seed, ep, skill_refuse_p, mix, max_questions)
        refused = sorted(env.oracle.refused_attributes)
        summaries = [forecast(traj[t:], ps, cfg) for t in range(len(traj))]
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            meta = dict(episode=ep, step=t, game="skill", source="behaviour", episode_success=bool(traj[-1].success),
                        episode_length=len(traj), hidden=task.payload["name"], refused=refused)
            if not tr.done:
                out.append(backup_example(ps, cfg, traj, summaries, t, task.id, meta))
            out += _judge_examples(ps, table, partner, task, tr.state, tr.action, summaries[t], meta)
            alt = _alternative(tr.state, tr.action, table, rng, mix)
            cf = play_episode(env, task, _chooser(table, rng, mix, prefix=actions[:t] + [alt]), TASK_NAME)
            cf_summaries = [None] * t + [forecast(cf[i:], ps, cfg) for i in range(t, len(cf))]
            ameta = dict(meta, source="alternative")
            if not cf[t].done:
                out.append(backup_example(ps, cfg, cf, cf_summaries, t, task.id, ameta))
            out += _judge_examples(ps, table, partner, task, tr.state, alt, cf_summaries[t], ameta)
    return out


def train_tasks(source: Optional[TwentyQuestionsTaskSource] = None) -> list[Task]:
    """The TRAIN objects of the world (asserted: no held-out object among them)."""
    source = source if source is not None else TwentyQuestionsTaskSource(WORLD)
    tasks = source.tasks("train")
    held_out = {t.id for t in source.tasks("test")}
    assert all(t.split == "train" and t.id not in held_out for t in tasks), "corpus must use train objects only"
    return tasks


@gin.configurable(module="experiments", denylist=["episodes", "seed", "task_source"])
def twenty_questions_forecast_corpus(episodes: int, seed: int, skill_episodes: int = 200,
                                     corpus_refused: Sequence[str] = CORPUS_REFUSED,
                                     rl_refused: Sequence[str] = RL_REFUSED, skill_refuse_p: float = 0.35,
                                     mix: Sequence[float] = DEFAULT_MIX, max_questions: int = MAX_QUESTIONS,
                                     task_source: Optional[TwentyQuestionsTaskSource] = None
                                     ) -> list[CorpusExample]:
    """The 20 Questions learned-critic warm-start corpus (:func:`build_forecast_examples`) over the TRAIN objects of
    the 'unit' world only. The knobs are gin bindings (``experiments.twenty_questions_forecast_corpus.*``)."""
    source = task_source if task_source is not None else TwentyQuestionsTaskSource(WORLD)
    return build_forecast_examples(train_tasks(source), source.table, episodes, skill_episodes, seed,
                                   corpus_refused=corpus_refused, rl_refused=rl_refused,
                                   skill_refuse_p=skill_refuse_p, mix=mix, max_questions=max_questions)


# ------------------------------------------------------------------------------------------- references and probes


def reference_success_rates(tasks: Sequence[Task], rl_refused: Sequence[str] = RL_REFUSED,
                            corpus_refused: Sequence[str] = CORPUS_REFUSED, seed: int = 0,
                            mix: Sequence[float] = DEFAULT_MIX, max_questions: int = MAX_QUESTIONS,
                            episodes_per_task: int = 8, table: Optional[ObjectTable] = None) -> dict:
    """Scripted references in the RL game (refusing ``rl_refused``) on ``tasks``: the behaviour (refusal-blind);
    the behaviour corrected by a critic that knows the RL rule ("oracle_refiner": a refused question is replaced by
    the critique's alternative); and by a critic that holds the corpus rule ("corpus_rule_refiner")."""
    table = table if table is not None else load_object_table(WORLD)
    partner = partners(table, corpus_refused, rl_refused)
    env = make_env(table, max_questions, rl_refused)
    out = {}
    for name, rule in (("behaviour", ()), ("oracle_refiner", tuple(rl_refused)),
                       ("corpus_rule_refiner", tuple(corpus_refused))):
        wins = 0
        for i, task in enumerate(tasks):
            for j in range(episodes_per_task):
                rng = random.Random(f"20q-forecast-reference:{seed}:{i}:{j}")

                def act(h, rng=rng, rule=rule):
                    a = behaviour_action(h, table, rng, mix)
                    if attribute_of(a, table) not in rule:
                        return a
                    return critique(h, a, "Outcome: failure; Return: -1\nAnswer: can't answer.", table, partner)[2]
                wins += bool(play_episode(env, task, act, TASK_NAME)[-1].success)
        out[name] = wins / max(1, len(tasks) * episodes_per_task)
    out["episodes"] = len(tasks) * episodes_per_task
    return out


def _outcomes(max_questions: int) -> list[tuple[bool, float]]:
    # every return a forecast can give: a win after k wrong questions returns -k; a loss uses every question
    return [(True, -float(k)) for k in range(max_questions)] + [(False, -float(max_questions))]


def refusal_probabilities(sampler, prompts: PromptSet, state: list, questions: Sequence[str],
                          max_questions: int = MAX_QUESTIONS, params: str = "policy") -> dict:
    """P(the successor's forecast for question q at ``state`` says "can't answer") per q, read from the model's
    distribution: the forecast's two lines "Outcome: <o>; Return: <r>" / "Answer: <w>." are scored for every
    outcome and return and every answer word (one ``sampler.score`` call), and

        P(refused | q) = sum_o pi(o, "can't answer") / sum_(o, w) pi(o, w)

    NaN where a score is not finite (e.g. a scripted sampler without scores)."""
    outcomes = _outcomes(max_questions)
    conts = [outcome_line(o, r) + f"\nAnswer: {w}." for o, r in outcomes for w in ANSWER_WORDS]
    msgs = [prompts.successor(state, q) for q in questions]
    lp = np.asarray(sampler.score([m for m in msgs for _ in conts], conts * len(msgs), params, "successor"),
                    np.float64).reshape(len(msgs), len(conts))
    refused = np.asarray([w == "can't answer" for _ in outcomes for w in ANSWER_WORDS])
    with np.errstate(invalid="ignore"):
        e = np.exp(lp - lp.max(axis=1, keepdims=True))
        p = e[:, refused].sum(1) / e.sum(1)
    return {q: float(v) if np.all(np.isfinite(row)) else math.nan for q, v, row in zip(questions, p, lp)}


def refusal_probe(sampler, prompts: PromptSet, rl_refused: Sequence[str] = RL_REFUSED,
                  corpus_refused: Sequence[str] = CORPUS_REFUSED, max_questions: int = MAX_QUESTIONS,
                  params: str = "policy", table: Optional[ObjectTable] = None) -> dict:
    """What the critic KNOWS about the refusal rule: for every attribute question at the game's opening state, the
    scored P(forecast answer = can't answer) (:func:`refusal_probabilities`).

    Returns probe/p_refused_{rl,corpus,other} (means over R, over C, over the attributes neither refuses);
    probe/p_gap_rl = mean over R minus mean over every other attribute (-1 ... +1; +1: the critic knows the RL
    rule), probe/p_gap_corpus = mean over C minus over the others (the names ``unit_scale.premise_check`` reads);
    probe/knowledge_accuracy: the fraction of attributes whose P > 0.5 agrees with the RL rule."""
    table = table if table is not None else load_object_table(WORLD)
    attrs = bank(table)
    env = make_env(table, max_questions)
    state = env.reset(Task(id="probe", split="probe", payload=table.objects[0].to_payload()))
    p = refusal_probabilities(sampler, prompts, state, [f"{a}?" for a in attrs], max_questions, params)
    p = {a: p[f"{a}?"] for a in attrs}
    rl, corpus = set(rl_refused), set(corpus_refused)

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else math.nan
    return {"probe/p_refused_rl": mean(p[a] for a in attrs if a in rl),
            "probe/p_refused_corpus": mean(p[a] for a in attrs if a in corpus),
            "probe/p_refused_other": mean(p[a] for a in attrs if a not in rl | corpus),
            "probe/p_gap_rl": mean(p[a] for a in attrs if a in rl) - mean(p[a] for a in attrs if a not in rl),
            "probe/p_gap_corpus": mean(p[a] for a in attrs if a in corpus) - mean(
                p[a] for a in attrs if a not in corpus),
            "probe/knowledge_accuracy": mean((p[a] > 0.5) == (a in rl) for a in attrs)}


def skill_probe(sampler, prompts: PromptSet, seed: int = 99, per_role: int = 48, params: str = "policy",
                corpus_refused: Sequence[str] = CORPUS_REFUSED, rl_refused: Sequence[str] = RL_REFUSED,
                max_questions: int = MAX_QUESTIONS, task_source: Optional[TwentyQuestionsTaskSource] = None) -> dict:
    """What the critic roles CAN DO, independent of any refusal rule: greedy outputs on ``per_role`` fresh skill-game
    examples (corpus seed ``seed``) of each of :data:`SKILL_ROLES`, against the scripted targets.

    Returns skill/backup_reply (the backup's forecast gives the REAL answer of its prompt; the toy's key, so the
    results table reads it), skill/backup_outcome (its first line is the Bellman line), skill/evaluator_guess (the
    critique names the question under judgment; the toy's key), skill/evaluator_verdict, skill/evaluator_exact,
    and skill/refiner (the refiner plays the question the critique names)."""
    source = task_source if task_source is not None else TwentyQuestionsTaskSource(WORLD)
    ex = build_forecast_examples(train_tasks(source), source.table, 0, max(8, per_role // 2), seed,
                                 corpus_refused=corpus_refused, rl_refused=rl_refused, max_questions=max_questions,
                                 prompts=prompts)
    rng = random.Random(f"20q-forecast-skill-probe:{seed}")
    greedy = greedy_settings(sampler, SKILL_ROLES)
    got: dict = {}
    for role in SKILL_ROLES:
        pool = [e for e in ex if e.role == role]
        xs = rng.sample(pool, min(per_role, len(pool)))
        outs = [c.text.strip() for c in check_samples(
            sampler.sample([e.prompt_messages for e in xs], params, role, settings=greedy), len(xs), role)]
        pairs = list(zip(outs, [e.target_text.strip() for e in xs]))

        def frac(pred):
            return sum(bool(pred(o, t)) for o, t in pairs) / max(1, len(pairs))
        if role == "backup":
            got["skill/backup_reply"] = frac(lambda o, t: forecast_answer(o) == forecast_answer(t))
            got["skill/backup_outcome"] = frac(lambda o, t: o.split("\n")[0] == t.split("\n")[0])
        elif role == "evaluator":
            got["skill/evaluator_guess"] = frac(lambda o, t: named_question(o) is not None
                                                and named_question(o) == named_question(t))
            got["skill/evaluator_verdict"] = frac(lambda o, t: o.split("\n")[-1] == t.split("\n")[-1])
            got["skill/evaluator_exact"] = frac(lambda o, t: o == t)
        else:
            got["skill/refiner"] = frac(lambda o, t: o == t)
    return got
