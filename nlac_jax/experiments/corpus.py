"""Scripted warm-start corpus for the toy number game: every NLAC role, written by scripted experts.

NLAC assumes a model that can already act, forecast, critique and refine, only imperfectly (design §1). No tiny
model can do that zero-shot, so the unit-scale experiment builds that premise honestly: a warm start trained on
this corpus. Everything in it comes from the real environment (``GuessNumberEnv``) and its exact optimality rule;
nothing is invented:

* a deliberately suboptimal, diverse **behaviour policy** plays full episodes on TRAIN tasks only (per move: the
  midpoint of the consistent interval, a "linear step" near an end of it or near the last guess, or a wild /
  inconsistent / repeated guess, mixed with weights ``mix``);
* **policy** examples clone its moves (so the warm-start policy is as imperfect as it is);
* **successor** examples summarise the REAL rest of the episode after each move; **backup** examples merge the
  real reply with the next step's summary into the same text, with exactly the arguments ``targets.py`` uses;
* **evaluator** examples state the consistent interval, the good-guess range from ``optimal_actions`` and the
  verdict of ``is_action_optimal``; **refiner** examples keep an optimal action and otherwise take the middle of
  the good range. Alternative (not taken) actions get evaluator/refiner examples too, with their futures played
  out counterfactually by the behaviour policy, so both verdicts are well represented.

Summary format (non-terminal step; near future in detail, far future condensed after ``DETAIL_GUESSES``; the
first two lines below are ONE line in the real text)::

    Reply: higher. Next guess 62: lower. Next guess 56: higher. Next guess 59: lower.
    Then 2 more guesses. Final reply: correct.
    Outcome: success; Return: 1

A terminal step's summary is exactly ``PromptSet.terminal_summary`` as ``targets.build_critic_examples`` calls it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Optional, Sequence

from nlac_jax.envs.base import BatchedRunner, Task, TaskCursor
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource, parse_guess
from nlac_jax.envs.transition import Transition
from nlac_jax.nlac.prompts import PromptSet, render_transcript
from nlac_jax.nlac.targets import TargetConfig, terminal_success, truncate_summary
from nlac_jax.nlac.verdict import outcome_line, parse_outcome
from nlac_jax.rl.transitions import transitions_from_episode
from nlac_jax.training.batching import KIND_CRITIC, KIND_POLICY

__all__ = [
    "TASK_NAME",
    "CORPUS_ROLES",
    "DEFAULT_MIX",
    "DETAIL_GUESSES",
    "CorpusExample",
    "consistent_interval",
    "behaviour_action",
    "good_range",
    "critique",
    "terminal_summary",
    "future_summary",
    "critic_and_policy_examples",
    "play_behaviour_episodes",
    "build_toy_examples",
    "toy_corpus",
    "toy_eval_corpus",
    "corpus_stats",
    "rendered_observation",
    "prefixed_chooser",
    "backup_example",
    "greedy_settings",
    "reference_success_rates",
]

TASK_NAME = "toy"  # the env / prompt-set name NLAC uses for this game
CORPUS_ROLES = ("policy", "successor", "backup", "evaluator", "refiner")
_KIND = {"policy": KIND_POLICY, "successor": KIND_CRITIC, "backup": KIND_CRITIC, "evaluator": KIND_POLICY,
         "refiner": KIND_POLICY}
DEFAULT_MIX = (0.35, 0.35, 0.30)  # (bisect, linear, wild): the warm start must leave clear room to improve
DETAIL_GUESSES = 3  # "Next guess" items written in full before the rest is condensed
_NON_NUMBERS = ("higher", "lower", "I am not sure.", "Let me think.", "my guess", "?")


@dataclasses.dataclass(frozen=True)
class CorpusExample:
    """One supervised example for one role: ``prompt_messages`` → ``target_text``.

    ``state`` / ``action`` are the (s, a) the example is about (the state alone for policy examples); ``meta``
    holds bookkeeping for statistics and tests (episode, step, source, verdict, return_to_go, ...).
    """

    role: str
    prompt_messages: list
    target_text: str
    task_id: str
    state: list = dataclasses.field(default_factory=list)
    action: str = ""
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> int:
        """0 (critic loss L1) for successor/backup examples, 1 (policy loss L2) for the others."""
        return _KIND[self.role]

    def to_training_dict(self, weight: float = 1.0) -> dict:
        """The fields ``batching.chat_example`` takes: prompt_messages, target_text, kind, weight."""
        return {"prompt_messages": self.prompt_messages, "target_text": self.target_text, "kind": self.kind,
                "weight": float(weight)}


# ------------------------------------------------------------------------------------------- game logic


def consistent_interval(history: Sequence[dict], n: int) -> tuple[int, int, int, list[int]]:
    """(lo, hi, guesses used, numeric guesses so far) from the feedback in ``history`` only (no hidden data).

    Mirrors the env's bookkeeping: "higher" after g raises lo to g + 1, "lower" lowers hi to g - 1 (never
    loosening the interval, so inconsistent guesses cannot widen it); every assistant turn uses a guess.
    """
    lo, hi, used, last, guesses = 1, n, 0, None, []
    for m in history:
        if m.get("role") == "assistant":
            used += 1
            last = parse_guess(m.get("content", ""))
            if last is not None:
                guesses.append(last)
        elif m.get("role") == "user" and last is not None:
            c = m.get("content", "").strip().lower()
            if c.startswith("higher"):
                lo = max(lo, last + 1)
            elif c.startswith("lower"):
                hi = min(hi, last - 1)
            last = None
    return lo, hi, used, guesses


def check_mix(mix: Sequence[float]) -> tuple[float, float, float]:
    """The three behaviour-mix weights as floats; refused unless non-negative and not all zero (relative weights)."""
    if len(mix) != 3 or any(p < 0 for p in mix) or sum(mix) <= 0:
        raise ValueError(f"mix must be three non-negative weights (bisect, linear, wild), got {mix!r}")
    return tuple(float(p) for p in mix)  # type: ignore[return-value]


def behaviour_action(history: Sequence[dict], n: int, rng: random.Random,
                     mix: Sequence[float] = DEFAULT_MIX) -> str:
    """One move of the suboptimal behaviour policy (a bare number), from the history's feedback only.

    bisect: the midpoint of the consistent interval (ties broken at random); linear: the low or high end of the
    interval, or the last guess moved 1-3 steps towards the interval (clipped into it); wild: a uniform guess in
    [1, n] (often inconsistent), or a repeat of an earlier guess.
    """
    p_bisect, p_linear, p_wild = check_mix(mix)
    lo, hi, _, guesses = consistent_interval(history, n)
    if lo > hi:  # cannot happen with truthful feedback; stay total anyway
        lo, hi = 1, n
    u = rng.random() * (p_bisect + p_linear + p_wild)
    if u < p_bisect:
        g = (lo + hi) // 2 + (rng.randint(0, 1) if (hi - lo) % 2 else 0)
    elif u < p_bisect + p_linear:
        choice = rng.randrange(3) if guesses else rng.randrange(2)
        if choice == 0:
            g = lo
        elif choice == 1:
            g = hi
        else:
            step = rng.randint(1, 3)
            last = guesses[-1]
            g = min(max(last + (step if last < lo else -step), lo), hi)
    else:
        g = rng.choice(guesses) if guesses and rng.random() < 0.25 else rng.randint(1, n)
    return str(g)


def good_range(judge: GuessNumberEnv, state: Sequence[dict]) -> Optional[tuple[int, int]]:
    """(x, y): the optimal guesses per ``judge.optimal_actions`` (the env's exact rule), None when there are none.

    ``judge`` must be reset to the episode's task. The tight rule's optimal set is contiguous (covered(g) is a sum
    of concave functions of g, so its maximisers form an interval); this is asserted.
    """
    opt = judge.optimal_actions(state)
    if not opt:
        return None
    x, y = min(opt), max(opt)
    assert len(opt) == y - x + 1, f"optimal set is not contiguous: {sorted(opt)}"
    return x, y


def _plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 'es' if word.endswith('s') else 's'}"


def critique(judge: GuessNumberEnv, state: Sequence[dict], action: str) -> tuple[str, bool, Optional[tuple[int, int]]]:
    """The scripted evaluator: (critique text, verdict, good range). ``judge`` is reset to the episode's task.

    Text: ``Possible: <lo> to <hi>, <r> guesses left. Good guesses: <x> to <y>. Guess <g> is inside that range.``
    (or ``is outside that range.`` / ``Guess <text> is not a number.``), then ``Best: <m>.`` with m the middle of
    the good range (the guess the refiner takes), then ``Verdict: optimal|suboptimal``. The verdict is
    ``judge.is_action_optimal`` and is asserted to agree with the range sentence.
    """
    lo, hi, used, _ = consistent_interval(state, judge.n)
    r = judge.max_turns - used
    rng_ = good_range(judge, state)
    verdict = bool(judge.is_action_optimal(state, action))
    head = f"Possible: {lo} to {hi}, {_plural(r, 'guess')} left."
    good = f"Good guesses: {rng_[0]} to {rng_[1]}." if rng_ else "Good guesses: none."
    g = parse_guess(action) if judge.validate_action(action) is None else None
    if g is None:
        shown = " ".join(str(action).split())[:40] or "(empty)"
        tail, inside = f"Guess {shown} is not a number.", False
    else:
        inside = rng_ is not None and rng_[0] <= g <= rng_[1]
        tail = f"Guess {g} is {'inside' if inside else 'outside'} that range."
    assert inside == verdict, (state, action, rng_, verdict)
    if rng_ is not None:
        tail += f" Best: {(rng_[0] + rng_[1]) // 2}."
    return f"{head} {good} {tail}\nVerdict: {'optimal' if verdict else 'suboptimal'}", verdict, rng_


# ------------------------------------------------------------------------------------------- summaries


def _reply_word(t: Transition) -> str:
    """The env's reply to one guess in a word or two: higher / lower / correct / not a number (+ out of guesses)."""
    obs = " ".join(m.get("content", "") for m in t.next_observation).strip()
    if t.info.get("success"):
        return "correct"
    if t.info.get("error"):
        word = "not a number"
    elif obs.lower().startswith("higher"):
        word = "higher"
    elif obs.lower().startswith("lower"):
        word = "lower"
    else:
        word = obs.split(".")[0].lower() or "no reply"
    return f"{word}, out of guesses" if t.done else word


def rendered_observation(t: Transition, ps: PromptSet, cfg: TargetConfig) -> Optional[str]:
    """The environment response after ``t.action`` rendered exactly as ``build_critic_examples`` renders it."""
    obs_msgs = t.next_observation if t.next_state is not None else []
    return render_transcript(obs_msgs, ps.transcript_labels, cfg.max_observation_chars, empty="") if obs_msgs else None


def _short_action(a: str) -> str:
    g = parse_guess(a)
    return str(g) if g is not None and a.strip() == str(g) else (" ".join(a.split())[:40] or "(empty)")


def terminal_summary(t: Transition, ps: PromptSet, cfg: Optional[TargetConfig] = None) -> str:
    """The successor target of a terminal transition, exactly as ``targets.build_critic_examples`` builds it."""
    cfg = cfg or TargetConfig()
    obs = rendered_observation(t, ps, cfg)
    success = terminal_success(t, cfg)
    text = ps.terminal_summary(t.reward, t.episode_return, success, obs if cfg.terminal_include_observation else None)
    return truncate_summary(text, cfg.max_summary_chars)


def future_summary(future: Sequence[Transition], ps: PromptSet, cfg: Optional[TargetConfig] = None) -> str:
    """The successor target for (s_t, a_t) given the real transitions from a_t to the end of the episode.

    Terminal step: ``ps.terminal_summary`` with the arguments ``targets.build_critic_examples`` uses. Otherwise
    the compact format of the module docstring, ending in ``outcome_line(success, return from a_t on)``.
    """
    cfg = cfg or TargetConfig()
    if not future:
        raise ValueError("future_summary needs at least one transition")
    first, last = future[0], future[-1]
    if not last.done:
        raise ValueError("future_summary needs a finished episode (its last transition must be terminal)")
    if first.done:
        return terminal_summary(first, ps, cfg)
    parts = [f"Reply: {_reply_word(first)}."]
    nexts = list(future[1:])
    for t in nexts[:DETAIL_GUESSES]:
        parts.append(f"Next guess {_short_action(t.action)}: {_reply_word(t)}.")
    rest = nexts[DETAIL_GUESSES:]
    if rest:
        parts.append(f"Then {len(rest)} more {'guess' if len(rest) == 1 else 'guesses'}. "
                     f"Final reply: {_reply_word(rest[-1])}.")
    success = bool(last.success)
    ret = sum(float(t.reward) for t in future)
    return truncate_summary(" ".join(parts) + "\n" + outcome_line(success, ret), cfg.max_summary_chars)


# ------------------------------------------------------------------------------------------- playing


def prefixed_chooser(act: Callable[[list], str], prefix: Sequence[str] = ()) -> Callable[[list], str]:
    """A chooser for :func:`play_episode`: the actions of ``prefix`` for the first turns (a counterfactual replays a
    real episode's actions up to the step it changes), then ``act(history)``."""
    def choose(history: list) -> str:
        turn = sum(1 for m in history if m.get("role") == "assistant")
        return prefix[turn] if turn < len(prefix) else act(history)
    return choose


def play_episode(env, task: Task, chooser: Callable[[list], str], task_name: str = TASK_NAME) -> list[Transition]:
    """One full episode with the real runner; returns NLAC's Transitions (prompt-set name ``task_name``)."""
    runner = BatchedRunner([env], lambda histories: [chooser(h) for h in histories])
    (episode,) = runner.run([task])
    return transitions_from_episode(episode, task=task_name)


def _behaviour_chooser(n: int, rng: random.Random, mix, prefix: Sequence[str] = ()) -> Callable[[list], str]:
    """Replays ``prefix`` (one action per turn), then acts with the behaviour policy."""
    def choose(history: list) -> str:
        turn = sum(1 for m in history if m.get("role") == "assistant")
        return prefix[turn] if turn < len(prefix) else behaviour_action(history, n, rng, mix)
    return choose


def _alternative_action(state: list, taken: str, n: int, rng: random.Random, mix, p_non_number: float) -> str:
    """A different action for the same state, from the same mixture (rarely a non-number text)."""
    if rng.random() < p_non_number:
        return rng.choice(_NON_NUMBERS)
    a = taken
    for _ in range(8):
        a = behaviour_action(state, n, rng, mix)
        if a != taken:
            break
    return a


def _judge(n: int, max_turns: Optional[int], task: Task) -> GuessNumberEnv:
    env = GuessNumberEnv(n=n, max_turns=max_turns)
    env.reset(task)
    return env


def _step_examples(ps: PromptSet, cfg: TargetConfig, judge: GuessNumberEnv, task: Task, traj: list[Transition],
                   summaries: list[str], t: int, meta: dict) -> list[CorpusExample]:
    """policy / successor / backup / evaluator / refiner examples for step t of a played episode."""
    tr = traj[t]
    d_t = summaries[t]
    out = critic_and_policy_examples(ps, cfg, traj, summaries, t, task.id, meta)
    out += _critic_refiner_examples(ps, judge, task, tr.state, tr.action, d_t, meta)
    return out


def critic_and_policy_examples(ps: PromptSet, cfg: TargetConfig, traj: Sequence[Transition],
                               summaries: Sequence[str], t: int, task_id: str, meta: dict) -> list[CorpusExample]:
    """policy (s_t → a_t), successor (s_t, a_t → d_t) and, for a non-terminal step, backup examples, where
    ``summaries[i]`` is the successor target of step i of the played episode ``traj``."""
    tr, d_t = traj[t], summaries[t]
    out = [CorpusExample("policy", ps.policy(tr.state), tr.action, task_id, tr.state, "", dict(meta)),
           CorpusExample("successor", ps.successor(tr.state, tr.action), d_t, task_id, tr.state, tr.action,
                         dict(meta, terminal=tr.done))]
    if not tr.done:
        # Exactly build_critic_examples' backup call: rendered observation, a_{t+1}, truncated d_{t+1} and the
        # exact Bellman line (r_t + the return parsed from d_{t+1}).
        d_next = truncate_summary(summaries[t + 1], cfg.max_summary_chars)
        succ, ret = parse_outcome(d_next)
        line = (succ, tr.reward + ret)
        assert d_t.rstrip().endswith(outcome_line(*line)), (d_t, line)
        obs = rendered_observation(tr, ps, cfg)
        prompt = ps.backup(tr.state, tr.action, tr.reward, obs or [], traj[t + 1].action, d_next,
                           target=line if cfg.enforce_outcome_line else None)
        out.append(CorpusExample("backup", prompt, d_t, task_id, tr.state, tr.action, dict(meta, terminal=False)))
    return out


def _critic_refiner_examples(ps: PromptSet, judge: GuessNumberEnv, task: Task, state: list, action: str,
                             future: str, meta: dict) -> list[CorpusExample]:
    text, verdict, rng_ = critique(judge, state, action)
    # The refiner takes the critique's best guess (the middle of the good range), also when the guess was already
    # good: a tiny evaluator's verdict errs towards "inside", and a refiner that kept "optimal" guesses would pass
    # those errors on to the policy. The refinement still comes only from the critique's text.
    refined = str((rng_[0] + rng_[1]) // 2) if rng_ is not None else action
    assert judge.is_action_optimal(state, refined), (state, action, refined)
    m = dict(meta, verdict=verdict, good_range=rng_)
    return [CorpusExample("evaluator", ps.evaluator(state, action, [future]), text, task.id, state, action, m),
            CorpusExample("refiner", ps.refiner(state, action, text, []), refined, task.id, state, action, m)]


# ------------------------------------------------------------------------------------------- the corpus


def play_behaviour_episodes(tasks: Sequence[Task], n: int, num_episodes: int, seed: int,
                            mix: Sequence[float] = DEFAULT_MIX,
                            max_turns: Optional[int] = None) -> list[tuple[Task, list[Transition]]]:
    """The corpus's behaviour episodes: (task, NLAC Transitions) for ``num_episodes`` tasks drawn from ``tasks``
    (cycled, reshuffled every epoch from ``seed``); episode i uses its own RNG stream, so it is reproducible."""
    mix = check_mix(mix)
    if num_episodes <= 0:
        return []
    env = GuessNumberEnv(n=n, max_turns=max_turns)
    out = []
    for ep, task in enumerate(TaskCursor(list(tasks), "corpus", seed).take(num_episodes)):
        rng = random.Random(f"toy-corpus:{seed}:{ep}")
        out.append((task, play_episode(env, task, _behaviour_chooser(n, rng, mix))))
    return out


def build_toy_examples(tasks: Sequence[Task], n: int, num_episodes: int, seed: int,
                       mix: Sequence[float] = DEFAULT_MIX, max_turns: Optional[int] = None,
                       alternatives_per_state: int = 1, alternative_successors: bool = False,
                       p_non_number: float = 0.03, prompts: Optional[PromptSet] = None,
                       target_cfg: Optional[TargetConfig] = None) -> list[CorpusExample]:
    """Examples for every role from ``num_episodes`` behaviour episodes over ``tasks`` (cycled, reshuffled per
    epoch from ``seed``). Deterministic given the arguments. Use :func:`toy_corpus` for training data: this
    function does not check the split (the held-out evaluation reuses it on test tasks).

    alternatives_per_state: extra (not taken) actions per state with evaluator + refiner examples; their futures
      are played out counterfactually (same prefix, the alternative, then the behaviour policy).
    alternative_successors: also add successor examples for those counterfactual futures.
    p_non_number: chance that an alternative is a non-number text (teaches the "is not a number" critique).
    """
    mix = check_mix(mix)
    ps = prompts if prompts is not None else PromptSet(task=TASK_NAME)
    cfg = target_cfg or TargetConfig()
    if num_episodes <= 0:
        return []
    env = GuessNumberEnv(n=n, max_turns=max_turns)
    out: list[CorpusExample] = []
    for ep, (task, traj) in enumerate(play_behaviour_episodes(tasks, n, num_episodes, seed, mix, max_turns)):
        summaries = [future_summary(traj[t:], ps, cfg) for t in range(len(traj))]
        judge = _judge(n, max_turns, task)
        success = bool(traj[-1].success)
        actions = [tr.action for tr in traj]
        for t, tr in enumerate(traj):
            rtg = sum(float(x.reward) for x in traj[t:])
            meta = dict(episode=ep, step=t, source="behaviour", episode_success=success, episode_length=len(traj),
                        return_to_go=rtg)
            out += _step_examples(ps, cfg, judge, task, traj, summaries, t, meta)
            for j in range(alternatives_per_state):
                arng = random.Random(f"toy-corpus:{seed}:{ep}:{t}:alt{j}")
                alt = _alternative_action(tr.state, tr.action, n, arng, mix, p_non_number)
                cf = play_episode(env, task, _behaviour_chooser(n, arng, mix, prefix=actions[:t] + [alt]))
                assert cf[t].state == tr.state  # the env is deterministic: same prefix, same state
                d_alt = future_summary(cf[t:], ps, cfg)
                cf_rtg = sum(float(x.reward) for x in cf[t:])
                ameta = dict(meta, source="alternative", return_to_go=cf_rtg, episode_success=bool(cf[-1].success))
                out += _critic_refiner_examples(ps, judge, task, tr.state, alt, d_alt, ameta)
                if alternative_successors:
                    out.append(CorpusExample("successor", ps.successor(tr.state, alt), d_alt, task.id, tr.state,
                                             alt, dict(ameta, terminal=cf[t].done)))
    return out


def _source(n: int, task_source: Optional[GuessNumberTaskSource]) -> GuessNumberTaskSource:
    # Built here (not at import) so gin bindings such as GuessNumberTaskSource.test_every apply.
    source = task_source if task_source is not None else GuessNumberTaskSource(n)
    if source.n != n:
        raise ValueError(f"task_source has n={source.n}, the corpus n={n}")
    return source


def _train_tasks(n: int, task_source: Optional[GuessNumberTaskSource] = None) -> list[Task]:
    source = _source(n, task_source)
    tasks = source.tasks("train")
    held_out = {t.id for t in source.tasks("test")}
    assert all(t.split == "train" and t.id not in held_out for t in tasks), "corpus must use train tasks only"
    return tasks


def toy_corpus(n: int, num_episodes: int, seed: int, mix: Sequence[float] = DEFAULT_MIX,
               max_turns: Optional[int] = None, task_source: Optional[GuessNumberTaskSource] = None,
               **kwargs) -> list[CorpusExample]:
    """The warm-start corpus: :func:`build_toy_examples` over the TRAIN split only of ``task_source`` (default
    ``GuessNumberTaskSource(n)`` with its gin bindings; asserted: no held-out task id can appear). ``kwargs`` go
    to :func:`build_toy_examples`."""
    return build_toy_examples(_train_tasks(n, task_source), n, num_episodes, seed, mix, max_turns, **kwargs)


def toy_eval_corpus(n: int, num_episodes: int, seed: int, mix: Sequence[float] = DEFAULT_MIX,
                    max_turns: Optional[int] = None, task_source: Optional[GuessNumberTaskSource] = None,
                    **kwargs) -> list[CorpusExample]:
    """The same examples on the HELD-OUT (test) tasks: for measuring a warm start per role, never for training."""
    return build_toy_examples(_source(n, task_source).tasks("test"), n, num_episodes, seed, mix, max_turns,
                              **kwargs)


def _mean(xs: Sequence) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def corpus_stats(examples: Sequence[CorpusExample]) -> dict:
    """Counts per role, the evaluator's verdict balance (all / behaviour / alternatives), the behaviour policy's
    success rate and optimal-move rate, and mean target lengths in characters."""
    out: dict = {"examples": len(examples)}
    for role in CORPUS_ROLES:
        ex = [e for e in examples if e.role == role]
        out[f"count/{role}"] = len(ex)
        out[f"target_chars/{role}"] = sum(len(e.target_text) for e in ex) / len(ex) if ex else 0.0
    evals = [e for e in examples if e.role == "evaluator"]
    for src in ("all", "behaviour", "alternative"):
        ev = [e for e in evals if src == "all" or e.meta.get("source") == src]
        opt = sum(1 for e in ev if e.meta.get("verdict"))
        out[f"verdict/{src}/optimal"] = opt
        out[f"verdict/{src}/suboptimal"] = len(ev) - opt
        out[f"verdict/{src}/frac_optimal"] = opt / len(ev) if ev else float("nan")
    refs = [e for e in examples if e.role == "refiner"]
    out["refiner/frac_changed"] = sum(e.target_text != e.action for e in refs) / len(refs) if refs else float("nan")
    episodes = {}
    for e in examples:
        if e.role == "policy" and e.meta.get("source") == "behaviour":
            episodes.setdefault(e.meta["episode"], (e.meta["episode_success"], e.meta["episode_length"]))
    out["behaviour/episodes"] = len(episodes)
    out["behaviour/success_rate"] = (sum(s for s, _ in episodes.values()) / len(episodes)) if episodes else float("nan")
    out["behaviour/mean_length"] = (sum(n for _, n in episodes.values()) / len(episodes)) if episodes else float("nan")
    beh = [e for e in evals if e.meta.get("source") == "behaviour"]
    out["behaviour/frac_optimal_moves"] = _mean([bool(e.meta["verdict"]) for e in beh])
    out["successor/frac_terminal"] = _mean([bool(e.meta.get("terminal")) for e in examples if e.role == "successor"])
    return out


def reference_success_rates(n: int, tasks: Sequence[Task], seed: int = 0, mix: Sequence[float] = DEFAULT_MIX,
                            max_turns: Optional[int] = None) -> dict:
    """Success rates, one episode per task, of the behaviour policy and of the scripted refiner used as a policy
    (always the middle of the good range: an optimal bisection, the "upper reference")."""
    env = GuessNumberEnv(n=n, max_turns=max_turns)
    wins = {"behaviour": 0, "scripted_refiner": 0}
    for i, task in enumerate(tasks):
        rng = random.Random(f"toy-reference:{seed}:{i}")
        wins["behaviour"] += bool(play_episode(env, task, _behaviour_chooser(n, rng, check_mix(mix)))[-1].success)
        judge = _judge(n, max_turns, task)

        def refine(history: list, judge=judge) -> str:
            x, y = good_range(judge, history)
            return str((x + y) // 2)
        wins["scripted_refiner"] += bool(play_episode(env, task, refine)[-1].success)
    k = max(len(tasks), 1)
    return {"episodes": len(tasks), "behaviour": wins["behaviour"] / k,
            "scripted_refiner": wins["scripted_refiner"] / k}


def backup_example(ps: PromptSet, cfg: TargetConfig, traj: Sequence[Transition], summaries: Sequence[str], t: int,
                   task_id: str, meta: dict) -> CorpusExample:
    """Exactly `targets.build_critic_examples`' backup call for step t of ``traj`` (non-terminal; ``summaries[i]``:
    the real summary of the future from step i, in the successor's format) -> the example whose target is the real
    summary d_t. Asserts that d_t starts with the Bellman line of r_t and d_{t+1} (the backup's contract)."""
    tr = traj[t]
    d_next = truncate_summary(summaries[t + 1], cfg.max_summary_chars)
    succ, ret = parse_outcome(d_next)
    line = (succ, tr.reward + ret)
    assert summaries[t].startswith(outcome_line(*line)), (summaries[t], line)
    prompt = ps.backup(tr.state, tr.action, tr.reward, rendered_observation(tr, ps, cfg) or [], traj[t + 1].action,
                       d_next, target=line if cfg.enforce_outcome_line else None)
    return CorpusExample("backup", prompt, summaries[t], task_id, tr.state, tr.action, dict(meta, terminal=False))


def greedy_settings(sampler, roles: Sequence[str]):
    """The sampler's settings with temperature 0 for ``roles`` (the others keep theirs); None if it has none: the
    probes read the critic's most likely outputs, a deterministic function of the parameters."""
    if getattr(sampler, "settings", None) is None:
        return None
    return dataclasses.replace(sampler.settings,
                               temperatures={**sampler.settings.temperatures, **{r: 0.0 for r in roles}})
