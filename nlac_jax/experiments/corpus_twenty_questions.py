"""Scripted warm-start corpus for 20 Questions (scripted oracle): every NLAC role, from real games.

The same construction as the toy corpus (``experiments.corpus``), for ``TwentyQuestionsEnv`` with the
``ScriptedOracle``:

* a deliberately suboptimal **behaviour policy** plays TRAIN objects only. Per question: the best split of the
  remaining candidates (``best``), a random attribute / category question, often uninformative (``random``), or
  a premature guess of a random candidate (``guess``), mixed with weights ``mix``;
* **policy** examples clone its questions; **successor** / **backup** examples summarise the REAL rest of the game
  (backup prompts built exactly as ``targets.build_critic_examples`` builds them);
* **evaluator** examples name the candidate count, how many candidates the question can leave and a best
  question; **refiner** examples keep a good question and otherwise ask that best question.

Candidates are the objects of the whole table consistent with the answers so far (the player does not know the
split; hidden objects are drawn from the train split only). The oracle's answers are reproduced exactly: a
question is classified once (attribute, category, guess of an object, or unanswerable) into the set of objects
it gets "Yes." for, and ``ScriptedOracle.answer`` agrees with that set (tested).

20 Questions has no exact optimality rule in the env, so the scripted critic uses this one: a question's score
is the number of candidates it can leave in the worst case (for a guess of a candidate: the rest, since "yes"
wins; for an unanswerable question: all of them). A question is **optimal** iff its score is at most the best
score over the question bank (every attribute question, every category question, a guess of every candidate)
plus ``slack`` (default: 10% of the candidates). Ties for the best question prefer a guess (it can win at once),
then the most balanced split, then the bank order.

Summary format (non-terminal question; near future in detail, far future condensed)::

    Answer: no. Next question "Is it alive?": yes. Next question "Is it an animal?": yes.
    Next question "Is it a mammal?": no. Then 4 more questions. Final question "Is it a parrot?": correct.
    Outcome: success; Return: -7

(the first two lines are one line in the real text).
"""

from __future__ import annotations

import functools
import json
import random
from typing import Optional, Sequence

from nlac_jax.envs.base import Task, TaskCursor
from nlac_jax.envs.twenty_questions import (CANT, DEFAULT_OBJECTS_PATH, NO, YES, ObjectTable, ScriptedOracle,
                                            TwentyQuestionsEnv, TwentyQuestionsTaskSource, canonical_question,
                                            load_object_table, names_object)
from nlac_jax.experiments.corpus import (DETAIL_GUESSES, CorpusExample, check_mix, play_episode,
                                         critic_and_policy_examples, terminal_summary)
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.targets import TargetConfig, truncate_summary
from nlac_jax.nlac.verdict import outcome_line
from nlac_jax.envs.transition import Transition

__all__ = [
    "TASK_NAME",
    "DEFAULT_MIX",
    "QuestionBank",
    "candidates",
    "critique",
    "behaviour_question",
    "future_summary",
    "play_behaviour_games",
    "twenty_questions_corpus",
    "twenty_questions_reference",
]

TASK_NAME = "twenty_questions"
DEFAULT_MIX = (0.4, 0.4, 0.2)  # (best split, random question, premature guess)
_MASS_NOUNS = {"furniture", "clothing", "sports equipment", "kitchenware", "food"}


def _article(phrase: str) -> str:
    if phrase in _MASS_NOUNS or (phrase.endswith("s") and not phrase.endswith("ss")):
        return phrase
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


class QuestionBank:
    """The scripted players' questions over an object table, and the oracle's yes-sets.

    ``questions``: (text, kind, yes-set) for one phrasing of every attribute ("Is it alive?"), every category
    ("Is it a bird?") and a guess of every object ("Is it a cat?"); kind is 'attribute', 'category' or 'guess'.
    """

    def __init__(self, table: Optional[ObjectTable] = None, path: Optional[str] = None):
        self.table = table if table is not None else load_object_table(path)
        self.objects = list(self.table.objects)
        if any(o.attributes is None or not o.category for o in self.objects):
            raise ValueError("the 20 Questions corpus needs an attribute and a category for every object")
        with open(path or DEFAULT_OBJECTS_PATH, encoding="utf-8") as f:
            raw = json.load(f)
        self.questions: list[tuple[str, str, frozenset]] = []
        for attr, phrasings in raw["attributes"].items():
            text = phrasings[0][0].upper() + phrasings[0][1:] + "?"
            self.questions.append((text, "attribute", self._yes(text)))
        for cat, phrases in raw["categories"].items():
            text = f"Is it {_article(phrases[0])}?"
            self.questions.append((text, "category", self._yes(text)))
        self.guess_index = {}
        for i, o in enumerate(self.objects):
            text = f"Is it {_article(o.name)}?"
            self.guess_index[i] = len(self.questions)
            self.questions.append((text, "guess", frozenset([i])))
        self.all = frozenset(range(len(self.objects)))

    @functools.lru_cache(maxsize=4096)
    def _yes(self, question: str) -> Optional[frozenset]:
        """Indices of the objects the scripted oracle answers "Yes." for; None when it cannot answer at all."""
        q = canonical_question(question)
        attr = self.table.attribute_questions.get(q)
        if attr is not None:
            return frozenset(i for i, o in enumerate(self.objects) if attr in o.attributes)
        if q.startswith("is it "):
            cat = self.table.category_phrases.get(q[len("is it "):])
            if cat is not None:
                return frozenset(i for i, o in enumerate(self.objects) if o.category == cat)
        named = frozenset(i for i, o in enumerate(self.objects) if names_object(question, o))
        return named or None

    def yes_set(self, question: str) -> Optional[frozenset]:
        """Public form of the oracle's yes-set for ``question`` (None: "I can't answer that." for every object)."""
        return self._yes(question)

    @functools.lru_cache(maxsize=4096)
    def is_guess(self, question: str) -> bool:
        """Whether the oracle reads ``question`` as naming an object (not an attribute or category question)."""
        q = canonical_question(question)
        if q in self.table.attribute_questions:
            return False
        if q.startswith("is it ") and q[len("is it "):] in self.table.category_phrases:
            return False
        return self._yes(question) is not None


def candidates(bank: QuestionBank, history: Sequence[dict]) -> frozenset:
    """Objects (indices into ``bank.objects``) consistent with every answer in ``history``."""
    cand, last = bank.all, None
    for m in history:
        if m.get("role") == "assistant":
            last = m.get("content", "")
        elif m.get("role") == "user" and last is not None:
            ys = bank.yes_set(last)
            answer = m.get("content", "").strip()
            if ys is not None and answer.startswith(YES):
                cand = cand & ys
            elif ys is not None and answer.startswith(NO):
                cand = cand - ys
            last = None
    return cand


def _score(bank: QuestionBank, cand: frozenset, question: str) -> int:
    """Candidates the question can leave in the worst case (a guess wins on "yes")."""
    ys = bank.yes_set(question)
    if ys is None:
        return len(cand)
    yes = len(cand & ys)
    if bank.is_guess(question):
        return len(cand) - yes
    return max(yes, len(cand) - yes)


def _bank_scores(bank: QuestionBank, cand: frozenset) -> list[tuple[tuple, str, int]]:
    """(sort key, question, score) for every bank question worth asking (guesses of excluded objects are not)."""
    out = []
    for idx, (text, kind, ys) in enumerate(bank.questions):
        yes = len(cand & ys)
        if kind == "guess":
            if not yes:
                continue
            s = len(cand) - yes
        else:
            s = max(yes, len(cand) - yes)
        out.append(((s, kind != "guess", abs(2 * yes - len(cand)), idx), text, s))
    return out


def _best(bank: QuestionBank, cand: frozenset) -> tuple[str, int]:
    """(best question, its score) over the bank; ties: guesses, then the most balanced split, then bank order."""
    _, text, s = min(_bank_scores(bank, cand))
    return text, s


def _slack(n_cand: int) -> int:
    return n_cand // 10


def critique(bank: QuestionBank, state: Sequence[dict], question: str) -> tuple[str, bool, str]:
    """The scripted evaluator: (critique text, verdict, best question); rule in the module docstring.

    Text: ``Candidates left: <c>[ (a, b, c)]. This question leaves at most <m>. Best: "<q>" leaves at most <b>.``
    then ``Verdict: optimal|suboptimal``.
    """
    cand = candidates(bank, state)
    best_q, best_s = _best(bank, cand)
    s = _score(bank, cand, question)
    verdict = s <= best_s + _slack(len(cand))
    names = ""
    if len(cand) <= 4:
        names = " (" + ", ".join(sorted(bank.objects[i].name for i in cand)) + ")"
    text = (f"Candidates left: {len(cand)}{names}. This question leaves at most {s}. "
            f'Best: "{best_q}" leaves at most {best_s}.\nVerdict: {"optimal" if verdict else "suboptimal"}')
    return text, verdict, best_q


def behaviour_question(bank: QuestionBank, history: Sequence[dict], rng: random.Random,
                       mix: Sequence[float] = DEFAULT_MIX) -> str:
    """One question of the suboptimal behaviour policy, from the answers in ``history`` only."""
    p_best, p_random, p_guess = check_mix(mix)
    cand = candidates(bank, history)
    u = rng.random() * (p_best + p_random + p_guess)
    if u < p_best:
        scored = _bank_scores(bank, cand)
        best_s = min(s for _, _, s in scored)
        return rng.choice([q for _, q, s in scored if s == best_s])
    if u < p_best + p_random:
        return rng.choice([q for q, k, _ in bank.questions if k != "guess"])
    pool = sorted(cand) or sorted(bank.all)
    return bank.questions[bank.guess_index[rng.choice(pool)]][0]


def _answer_word(t: Transition) -> str:
    if t.info.get("success"):
        return "correct"
    if t.info.get("error"):
        word = "invalid"
    else:
        a = str(t.info.get("answer", ""))
        word = {YES: "yes", NO: "no", CANT: "can't answer"}.get(a, a.lower().rstrip(".") or "no answer")
    return f"{word}, out of questions" if t.done else word


def future_summary(future: Sequence[Transition], ps: PromptSet, cfg: Optional[TargetConfig] = None) -> str:
    """The successor target for (s_t, a_t) from the real rest of the game (format in the module docstring)."""
    cfg = cfg or TargetConfig()
    first, last = future[0], future[-1]
    if not last.done:
        raise ValueError("future_summary needs a finished game")
    if first.done:
        return terminal_summary(first, ps, cfg)
    parts = [f"Answer: {_answer_word(first)}."]
    nexts = list(future[1:])
    for t in nexts[:DETAIL_GUESSES]:
        parts.append(f'Next question "{t.action}": {_answer_word(t)}.')
    rest = nexts[DETAIL_GUESSES:]
    if rest:
        k = len(rest)
        parts.append(f"Then {k} more {'question' if k == 1 else 'questions'}. "
                     f'Final question "{rest[-1].action}": {_answer_word(rest[-1])}.')
    ret = sum(float(t.reward) for t in future)
    return truncate_summary(" ".join(parts) + "\n" + outcome_line(bool(last.success), ret), cfg.max_summary_chars)


def _chooser(bank: QuestionBank, rng: random.Random, mix, prefix: Sequence[str] = ()):
    def choose(history: list) -> str:
        turn = sum(1 for m in history if m.get("role") == "assistant")
        return prefix[turn] if turn < len(prefix) else behaviour_question(bank, history, rng, mix)
    return choose


def _train_tasks(source: TwentyQuestionsTaskSource) -> list[Task]:
    tasks = source.tasks("train")
    held_out = {t.id for t in source.tasks("test")}
    assert all(t.split == "train" and t.id not in held_out for t in tasks), "corpus must use train objects only"
    return tasks


def play_behaviour_games(tasks: Sequence[Task], num_episodes: int, seed: int, mix: Sequence[float] = DEFAULT_MIX,
                         max_questions: int = 20, task_source: Optional[TwentyQuestionsTaskSource] = None
                         ) -> list[tuple[Task, list[Transition]]]:
    """The corpus's behaviour games: (task, NLAC Transitions) for ``num_episodes`` tasks drawn from ``tasks``
    (cycled, reshuffled every epoch from ``seed``); game i uses its own RNG stream."""
    mix = check_mix(mix)
    source = task_source if task_source is not None else TwentyQuestionsTaskSource()
    bank = QuestionBank(source.table)
    env = TwentyQuestionsEnv(ScriptedOracle(source.table), max_questions=max_questions)
    out = []
    for ep, task in enumerate(TaskCursor(list(tasks), "corpus", seed).take(max(num_episodes, 0))):
        rng = random.Random(f"20q-corpus:{seed}:{ep}")
        out.append((task, play_episode(env, task, _chooser(bank, rng, mix), TASK_NAME)))
    return out


def twenty_questions_corpus(num_episodes: int, seed: int, mix: Sequence[float] = DEFAULT_MIX,
                            max_questions: int = 20, alternatives_per_state: int = 1,
                            task_source: Optional[TwentyQuestionsTaskSource] = None,
                            tasks: Optional[Sequence[Task]] = None, prompts: Optional[PromptSet] = None,
                            target_cfg: Optional[TargetConfig] = None) -> list[CorpusExample]:
    """Examples for every role from ``num_episodes`` behaviour games on TRAIN objects (deterministic given the
    arguments). ``tasks`` overrides the task list (evaluation on held-out objects only: never train on those).
    Alternatives get evaluator + refiner examples with counterfactually played futures, as in the toy corpus."""
    mix = check_mix(mix)
    source = task_source if task_source is not None else TwentyQuestionsTaskSource()
    tasks = list(tasks) if tasks is not None else _train_tasks(source)
    bank = QuestionBank(source.table)
    ps = prompts if prompts is not None else PromptSet(task=TASK_NAME)
    cfg = target_cfg or TargetConfig()
    env = TwentyQuestionsEnv(ScriptedOracle(source.table), max_questions=max_questions)
    out: list[CorpusExample] = []
    if num_episodes <= 0:
        return out
    for ep, (task, traj) in enumerate(play_behaviour_games(tasks, num_episodes, seed, mix, max_questions, source)):
        summaries = [future_summary(traj[t:], ps, cfg) for t in range(len(traj))]
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            meta = dict(episode=ep, step=t, source="behaviour", episode_success=bool(traj[-1].success),
                        episode_length=len(traj), return_to_go=sum(float(x.reward) for x in traj[t:]))
            out += critic_and_policy_examples(ps, cfg, traj, summaries, t, task.id, meta)
            out += _critic_refiner(ps, bank, task, tr.state, tr.action, summaries[t], meta)
            for j in range(alternatives_per_state):
                arng = random.Random(f"20q-corpus:{seed}:{ep}:{t}:alt{j}")
                alt = tr.action
                for _ in range(8):
                    alt = behaviour_question(bank, tr.state, arng, mix)
                    if alt != tr.action:
                        break
                cf = play_episode(env, task, _chooser(bank, arng, mix, prefix=actions[:t] + [alt]), TASK_NAME)
                assert cf[t].state == tr.state
                ameta = dict(meta, source="alternative", episode_success=bool(cf[-1].success),
                             return_to_go=sum(float(x.reward) for x in cf[t:]))
                out += _critic_refiner(ps, bank, task, tr.state, alt, future_summary(cf[t:], ps, cfg), ameta)
    return out


def _critic_refiner(ps: PromptSet, bank: QuestionBank, task: Task, state: list, action: str, future: str,
                    meta: dict) -> list[CorpusExample]:
    text, verdict, best_q = critique(bank, state, action)
    refined = action if verdict else best_q
    m = dict(meta, verdict=verdict, best_question=best_q)
    return [CorpusExample("evaluator", ps.evaluator(state, action, [future]), text, task.id, state, action, m),
            CorpusExample("refiner", ps.refiner(state, action, text, []), refined, task.id, state, action, m)]


def twenty_questions_reference(tasks: Sequence[Task], seed: int = 0, mix: Sequence[float] = DEFAULT_MIX,
                               max_questions: int = 20, task_source: Optional[TwentyQuestionsTaskSource] = None
                               ) -> dict:
    """Success rate and mean return, one game per task, of the behaviour policy and of the scripted refiner used
    as a policy (always the best question: the "upper reference")."""
    source = task_source if task_source is not None else TwentyQuestionsTaskSource()
    bank = QuestionBank(source.table)
    env = TwentyQuestionsEnv(ScriptedOracle(source.table), max_questions=max_questions)
    res = {"behaviour": [], "scripted_refiner": []}
    for i, task in enumerate(tasks):
        rng = random.Random(f"20q-reference:{seed}:{i}")
        res["behaviour"].append(play_episode(env, task, _chooser(bank, rng, mix), TASK_NAME))
        res["scripted_refiner"].append(play_episode(env, task, lambda h: _best(bank, candidates(bank, h))[0], TASK_NAME))
    k = max(len(tasks), 1)
    out = {"episodes": len(tasks)}
    for name, trajs in res.items():
        out[f"{name}/success_rate"] = sum(bool(tr[-1].success) for tr in trajs) / k
        out[f"{name}/mean_return"] = sum(sum(float(t.reward) for t in tr) for tr in trajs) / k
    return out
