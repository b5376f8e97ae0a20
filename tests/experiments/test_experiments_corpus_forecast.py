"""The learned-critic corpus (experiments/corpus_forecast.py): train tasks only, deterministic, the corpus game's
knowledge in the successor targets, skills whose cues are independent of the guess, exact agreement with NLAC's
own target builder, and the knowledge probe on a scripted critic (hand-computed values)."""

import json

import math

import pytest

from nlac_jax.envs.base import TaskCursor
from nlac_jax.envs.toy import GuessNumberTaskSource, parse_guess
from nlac_jax.experiments import corpus_forecast as F
from nlac_jax.experiments.corpus import consistent_interval
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.verdict import leading_outcome_line, parse_outcome, parse_verdict

N = 32


@pytest.fixture(scope="module")
def source():
    return GuessNumberTaskSource(N, test_every=2)


@pytest.fixture(scope="module")
def examples(source):
    return F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source)


def _key(x):
    return json.dumps([[e.role, e.prompt_messages, e.target_text, e.task_id] for e in x])


def test_train_tasks_only_deterministic_and_every_role(examples, source):
    held_out = {t.id for t in source.tasks("test")}
    assert examples and not {e.task_id for e in examples} & held_out
    assert _key(examples) == _key(F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source))
    assert _key(examples) != _key(F.forecast_corpus(N, 16, 4, skill_episodes=16, task_source=source))
    assert {e.role for e in examples} == {"policy", "successor", "backup", "evaluator", "refiner"}
    # no calculator, no hidden number: nothing in any prompt the policy's own state line does not say
    for e in examples:
        text = "\n".join(m["content"] for m in e.prompt_messages)
        assert "Good guesses" not in text and "the number was" not in text.lower()


def test_successor_targets_carry_the_corpus_rule(examples):
    """Corpus-game forecasts: outcome first; the first reply is "no answer" exactly for the even guesses that are
    not the hidden number (the corpus's knowledge)."""
    succ = [e for e in examples if e.role == "successor"]
    assert {e.meta["game"] for e in succ} == {"corpus"}
    seen = {True: 0, False: 0}
    for e in succ:
        assert leading_outcome_line(e.target_text) is not None, e.target_text
        g = parse_guess(e.action)
        reply = F.forecast_reply(e.target_text)
        if reply != "correct":
            assert (reply == "no answer") == (g % 2 == 0), (e.action, e.target_text)
            seen[g % 2 == 0] += 1
    assert seen[True] > 10 and seen[False] > 10


def test_judge_cues_are_independent_of_the_guess(examples):
    """Skill games: whether a forecast says "no answer" must not be predictable from the guess's parity (else the
    evaluator could learn a rule instead of reading the forecast); the verdict follows the forecast; the critique's
    better guess is the neighbour inside the possible range, and the refiner outputs it."""
    evals = [e for e in examples if e.role == "evaluator"]
    assert {e.meta["game"] for e in evals} == {"skill"}
    rate = {}
    for parity in (0, 1):
        ex = [e for e in evals if parse_guess(e.action) is not None and parse_guess(e.action) % 2 == parity]
        rate[parity] = sum(not e.meta["verdict"] for e in ex) / len(ex)
    assert 0.15 < rate[0] < 0.6 and abs(rate[0] - rate[1]) < 0.2, rate
    pairs = [(e, r) for e, r in zip(examples, examples[1:]) if e.role == "evaluator"]
    assert all(r.role == "refiner" and r.prompt_messages[-1]["content"].endswith(e.target_text) for e, r in pairs)
    for e, r in pairs:
        future = e.prompt_messages[-1]["content"].split("Forecast: ", 1)[1]
        wasted = F.forecast_reply(future) == "no answer"
        assert parse_verdict(e.target_text) is (not wasted if parse_guess(e.action) is not None else False)
        better = r.target_text
        g = parse_guess(e.action)
        if wasted and g is not None:
            lo, hi, _, _ = consistent_interval(e.state, N)
            assert f"try {better}." in e.target_text and abs(int(better) - g) <= 1 and lo <= int(better) <= hi
        elif g is not None:
            assert better == e.action


def test_agrees_with_nlac_target_builder(source):
    """The corpus's backup examples are exactly what build_critic_examples produces when the roles answer like the
    corpus: same prompts (the scripted sampler looks them up) and the same targets, terminal ones included."""
    from nlac_jax.nlac.targets import build_critic_examples
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)
    tasks = source.tasks("train")
    ex = F.build_forecast_examples(tasks, N, 0, 1, seed=5)
    (task,) = TaskCursor(list(tasks), "forecast-skill", 5).take(1)
    _, _, traj = F.skill_episode(task, N, 5, 0)
    d = [F.forecast(traj[t:], ps) for t in range(len(traj))]
    table = {"policy": {json.dumps(ps.policy(t.state)): t.action for t in traj},
             "successor": {json.dumps(ps.successor(t.state, t.action)): d[i] for i, t in enumerate(traj)},
             "backup": {json.dumps(e.prompt_messages): e.target_text for e in ex
                        if e.role == "backup" and e.meta["source"] == "behaviour"}}
    assert len(table["backup"]) == len(traj) - 1
    sampler = ScriptedRoleSampler({r: (lambda m, j, r=r: table[r][json.dumps(m)]) for r in table})
    built = build_critic_examples(traj, sampler, prompts=ps)
    assert [b.target_text for b in built] == d
    assert all(leading_outcome_line(b.target_text) and parse_outcome(b.target_text)[1] is not None for b in built)


def test_critique_by_hand():
    state = [{"role": "system", "content": "You have 6 guesses."}, {"role": "user", "content": "1 and 32."},
             {"role": "assistant", "content": "16"}, {"role": "user", "content": "lower"}]
    assert F.critique(state, "9", "Outcome: failure; Return: 0\nReply: no answer. Then 2 more.", N) == (
        "Forecast reply: no answer. Guess 9 is wasted: try 10.\nVerdict: suboptimal", False, "10")
    assert F.critique(state, "15", "Outcome: failure; Return: 0\nReply: no answer.", N)[2] == "14"  # top of 1..15
    assert F.critique(state, "9", "Outcome: success; Return: 1\nReply: higher.", N) == (
        "Forecast reply: higher. Guess 9 gets an answer.\nVerdict: optimal", True, "9")
    assert F.critique(state, "hmm", "Outcome: failure; Return: 0\nReply: error.", N)[1:] == (False, "8")


def test_range_critique_by_hand():
    """judge_range: a guess outside the public interval (here 1..15 after "16 lower"; the repeat 16 is one) is
    suboptimal whatever the forecast says, and the critique names the middle; inside, the waste critique as before;
    off, the old critique."""
    state = [{"role": "system", "content": "You have 6 guesses."}, {"role": "user", "content": "1 and 32."},
             {"role": "assistant", "content": "16"}, {"role": "user", "content": "lower"}]
    fc = "Outcome: failure; Return: 0\nReply: lower."
    assert F.critique(state, "16", fc, N, judge_range=True) == (
        "Forecast reply: lower. Guess 16 is outside 1 to 15: try 8.\nVerdict: suboptimal", False, "8")
    assert F.critique(state, "30", "Outcome: failure; Return: 0\nReply: no answer.", N, judge_range=True)[1:] == (
        False, "8")
    assert F.critique(state, "9", fc, N, judge_range=True) == F.critique(state, "9", fc, N)
    assert F.critique(state, "16", fc, N) == ("Forecast reply: lower. Guess 16 gets an answer.\nVerdict: optimal",
                                             True, "16")
    assert F.named_guess("Forecast reply: lower. Guess 16 is outside 1 to 15: try 8.") == "16"


def test_range_skill_examples(source):
    """p_out_of_range > 0: skill-game alternatives outside the interval (repeats among them) are judged
    suboptimal with the middle as the better guess, the refiner plays it, the corpus game and the policy and
    successor examples are unchanged, and whether a forecast says "no answer" still does not follow the parity."""
    base = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source)
    ex = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source, p_out_of_range=0.5)
    keep = ("policy", "successor")
    assert _key([e for e in ex if e.role in keep]) == _key([e for e in base if e.role in keep])
    assert not any(e.meta.get("out_of_range") for e in base if e.role == "evaluator")
    pairs = [(e, r) for e, r in zip(ex, ex[1:]) if e.role == "evaluator"]
    out = [(e, r) for e, r in pairs if e.meta["out_of_range"]]
    assert len(out) >= 10 and all(e.meta["source"] == "alternative" for e, _ in out)
    repeats = 0
    for e, r in out:
        lo, hi, _, _ = consistent_interval(e.state, N)
        g = parse_guess(e.action)
        assert not lo <= g <= hi and parse_verdict(e.target_text) is False
        assert r.target_text == str((lo + hi) // 2) and f"outside {lo} to {hi}: try {r.target_text}." in e.target_text
        repeats += e.action in [m["content"] for m in e.state if m["role"] == "assistant"]
    assert 0 < repeats < len(out)
    inside = [e for e, _ in pairs if not e.meta["out_of_range"] and parse_guess(e.action) is not None]
    rate = {p: [not e.meta["verdict"] for e in inside if parse_guess(e.action) % 2 == p] for p in (0, 1)}
    rate = {p: sum(v) / len(v) for p, v in rate.items()}
    assert abs(rate[0] - rate[1]) < 0.2, rate


def test_repeat_critique_by_hand():
    """judge_repeat: a guess the transcript shows was guessed before is suboptimal whatever the forecast says; the
    critique names the nearest number not guessed yet in the interval (from the guess, upwards first; from the
    middle when the guess lies outside); fresh guesses get the old critique; off, the old critique."""
    state = [{"role": "system", "content": "You have 6 guesses."}, {"role": "user", "content": "1 and 32."},
             {"role": "assistant", "content": "16"}, {"role": "user", "content": "lower"},
             {"role": "assistant", "content": "9"}, {"role": "user", "content": "no answer"},
             {"role": "assistant", "content": "10"}, {"role": "user", "content": "no answer"}]
    answered = "Outcome: failure; Return: 0\nReply: higher."
    wasted = "Outcome: failure; Return: 0\nReply: no answer."
    # 9 and 10 were wasted and stay in 1..15: from 9, 10 is taken, so 8
    assert F.critique(state, "9", answered, N, judge_repeat=True) == (
        "Forecast reply: higher. Guess 9 was guessed before: try 8.\nVerdict: suboptimal", False, "8")
    assert F.critique(state, "10", wasted, N, judge_repeat=True)[1:] == (False, "11")
    # 16 was answered ("lower"): outside 1..15, so from the middle (8)
    assert F.critique(state, "16", answered, N, judge_repeat=True)[1:] == (False, "8")
    # with the range critique on as well, an answered repeat outside the interval gets the range critique
    assert F.critique(state, "16", answered, N, judge_repeat=True, judge_range=True)[0].endswith(
        "Guess 16 is outside 1 to 15: try 8.\nVerdict: suboptimal")
    # a fresh guess: the waste critique as before; the option off: the old critique, repeats judged "optimal"
    assert F.critique(state, "12", wasted, N, judge_repeat=True) == F.critique(state, "12", wasted, N)
    assert F.critique(state, "9", answered, N) == (
        "Forecast reply: higher. Guess 9 gets an answer.\nVerdict: optimal", True, "9")
    assert F.named_guess("Forecast reply: higher. Guess 9 was guessed before: try 8.") == "9"
    assert F._fresh_near(5, 4, 6, {4, 5, 6}) == 5 and F._fresh_near(5, 4, 6, {5, 6}) == 4


def test_repeat_skill_examples(source):
    """p_repeat > 0: skill-game alternatives that repeat an earlier guess (answered or wasted) are judged
    suboptimal with a fresh number as the better guess, the refiner plays it, the corpus game's policy and successor
    examples are unchanged, and p_repeat = 0 leaves the corpus bit-identical."""
    base = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source)
    assert _key(F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source, p_repeat=0.0)) == _key(base)
    ex = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source, p_repeat=0.5)
    keep = ("policy", "successor")
    assert _key([e for e in ex if e.role in keep]) == _key([e for e in base if e.role in keep])
    pairs = [(e, r) for e, r in zip(ex, ex[1:]) if e.role == "evaluator"]
    rep = [(e, r) for e, r in pairs if e.meta["repeat"]]
    assert len(rep) >= 10 and any(e.meta["source"] == "alternative" for e, _ in rep)
    kinds = set()
    for e, r in rep:
        lo, hi, _, guessed = consistent_interval(e.state, N)
        g = parse_guess(e.action)
        assert g in guessed and parse_verdict(e.target_text) is False
        assert f"Guess {g} was guessed before: try {r.target_text}." in e.target_text
        assert lo <= int(r.target_text) <= hi and int(r.target_text) not in guessed
        kinds.add(lo <= g <= hi)  # a wasted repeat stays inside the interval, an answered one does not
    assert kinds == {True, False}
    assert not any(e.meta.get("repeat") and parse_verdict(e.target_text) is False
                   and "guessed before" in e.target_text for e in base if e.role == "evaluator")


def test_waste_probe_by_hand():
    """A scripted critic that forecasts the corpus rule (evens wasted), probed for the RL rule (multiples of 3) on
    1..12: RL-wasted 3, 6, 9, 12 -> said for 6 and 12: 0.5; corpus-only 2, 4, 8, 10 -> 1.0; neither 1, 5, 7, 11 ->
    0.0; the majority forecast agrees with the RL rule for 1, 5, 6, 7, 11, 12: 6 / 12."""
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)

    def successor(messages, j):
        g = int(messages[-1]["content"].rsplit("Guess: ", 1)[1])
        return "Outcome: failure; Return: 0\n" + ("Reply: no answer." if g % 2 == 0 else "Reply: higher.")
    def scores(messages, continuation, served):
        # pi("... Reply: no answer.") = a for each outcome, every other reply b: P(wasted) = 2a / (2a + 8b),
        # 0.8 for evens (a = 0.4, b = 0.025) and 0.1 for odds (a = 0.05, b = 0.1125)
        g = int(messages[-1]["content"].rsplit("Guess: ", 1)[1])
        assert served == "policy" and continuation.split("\n")[0] in ("Outcome: success; Return: 1",
                                                                      "Outcome: failure; Return: 0")
        a, b = (0.4, 0.025) if g % 2 == 0 else (0.05, 0.1125)
        return math.log(a if continuation.endswith("\nReply: no answer.") else b)
    sampler = ScriptedRoleSampler({"successor": successor}, scores=scores)
    got = F.waste_probe(sampler, ps, 12, waste_every=3, samples=2)
    gaps = {k: got.pop(k) for k in ("probe/p_gap_rl", "probe/p_gap_corpus")}
    # RL rule (3, 6, 9, 12 wasted): (0.1 + 0.8 + 0.1 + 0.8) / 4 - (4 x 0.8 + 4 x 0.1) / 8 = 0.45 - 0.45 = 0;
    # corpus rule (evens): 0.8 - 0.1
    assert gaps == pytest.approx({"probe/p_gap_rl": 0.0, "probe/p_gap_corpus": 0.7})
    p = {k: got.pop(k) for k in ("probe/p_wasted_rl", "probe/p_wasted_corpus", "probe/p_wasted_other")}
    assert got == {"probe/wasted_said_rl": 0.5, "probe/wasted_said_corpus": 1.0, "probe/wasted_said_other": 0.0,
                   "probe/knowledge_accuracy": 0.5}
    # multiples of 3: 6, 12 at 0.8 and 3, 9 at 0.1; evens only: 0.8; neither: 0.1
    assert p == pytest.approx({"probe/p_wasted_rl": 0.45, "probe/p_wasted_corpus": 0.8, "probe/p_wasted_other": 0.1})
    (score_call,) = sampler.score_calls
    assert score_call.role == "successor" and len(score_call.messages_batch) == 12 * 10
    # greedy by default (a deterministic function of the parameters); the other roles keep their settings
    (call,) = sampler.calls
    assert call.settings.temperature("successor") == 0.0
    assert call.settings.temperature("policy") == sampler.settings.temperature("policy")
    F.waste_probe(sampler, ps, 12, waste_every=3, greedy=False)
    assert sampler.calls[-1].settings is sampler.settings


def test_scripted_references_show_what_the_knowledge_is_worth(source):
    """In the RL game (multiples of 3 wasted): moving the guesses the TRUE rule wastes helps, moving the guesses the
    corpus rule wastes hurts: the knowledge, not the skill, decides."""
    ref = F.reference_success_rates(N, source.tasks("test"), waste_every=3, episodes_per_task=4)
    assert ref["oracle_refiner"] > ref["behaviour"] + 0.2 > ref["corpus_rule_refiner"] + 0.2, ref


ODDS = tuple(range(1, N + 1, 2))


def test_rule_free_corpus_holds_no_knowledge_of_which_numbers_are_wasted(source):
    """corpus_waste_p: each corpus-game episode wastes its own random set, so the successor's targets say "no
    answer" at about that rate for every kind of number (odd, even, multiple of 3): the warm start can learn the
    format and the base rate, not a rule. The same number is wasted in some episodes and answered in others."""
    ex = F.forecast_corpus(N, 150, 7, skill_episodes=0, task_source=source, corpus_waste_p=0.35)
    assert _key(ex) == _key(F.forecast_corpus(N, 150, 7, skill_episodes=0, task_source=source, corpus_waste_p=0.35))
    replies = {}  # guess -> [wasted?]
    for e in ex:
        if e.role != "successor":
            continue
        g, reply = parse_guess(e.action), F.forecast_reply(e.target_text)
        if g is not None and reply not in (None, "correct"):
            replies.setdefault(g, []).append(reply == "no answer")

    def rate(pred):
        xs = [w for g, ws in replies.items() if pred(g) for w in ws]
        return sum(xs) / len(xs)
    for pred in (lambda g: g % 2 == 1, lambda g: g % 2 == 0, lambda g: g % 3 == 0, lambda g: g % 3 != 0):
        assert 0.2 < rate(pred) < 0.5, {g: sum(w) / len(w) for g, w in replies.items()}
    assert abs(rate(lambda g: g % 2 == 1) - rate(lambda g: g % 2 == 0)) < 0.1
    assert abs(rate(lambda g: g % 3 == 0) - rate(lambda g: g % 3 != 0)) < 0.1
    mixed = [g for g, ws in replies.items() if len(ws) >= 5 and 0 < sum(ws) < len(ws)]
    assert len(mixed) >= 10, replies
    # the fixed rule is still the default (the old design's corpus)
    fixed = F.forecast_corpus(N, 8, 7, skill_episodes=0, task_source=source)
    assert all((F.forecast_reply(e.target_text) == "no answer") == (parse_guess(e.action) % 2 == 0)
               for e in fixed if e.role == "successor" and F.forecast_reply(e.target_text) != "correct")


def test_listed_corpus_rule_teaches_the_rl_games_rule(source):
    """corpus_wasted_numbers (the knowing-critic upper reference): with corpus_waste_every = 0 and the odd numbers
    listed, the successor's targets say "no answer" exactly for the odd guesses that are not the hidden number, and
    the policy's examples and the skill games are those of the even-rule corpus with the same seed (one knob moves)."""
    ex = F.forecast_corpus(N, 24, 5, skill_episodes=8, task_source=source, corpus_waste_every=0,
                           corpus_wasted_numbers=ODDS)
    seen = {True: 0, False: 0}
    for e in ex:
        if e.role == "successor" and F.forecast_reply(e.target_text) != "correct":
            g = parse_guess(e.action)
            assert (F.forecast_reply(e.target_text) == "no answer") == (g % 2 == 1), (e.action, e.target_text)
            seen[g % 2 == 1] += 1
    assert seen[True] > 10 and seen[False] > 10
    even = F.forecast_corpus(N, 24, 5, skill_episodes=8, task_source=source)
    skill = lambda xs: _key([e for e in xs if e.meta.get("game") == "skill"])
    assert skill(ex) == skill(even) and skill(ex) != "[]"
    # and the knowledge did move: the successor's targets are not the even-rule corpus's
    assert _key([e for e in ex if e.role == "successor"]) != _key([e for e in even if e.role == "successor"])


def _odd_rule_critic():
    """A scripted successor that knows "the odd numbers are wasted": its greedy forecast says "no answer" for every
    odd guess, and its scored P(wasted) is 0.8 for odd guesses, 0.1 for even ones. Returns (sampler, prompts)."""
    from nlac_jax.rl.roles import ScriptedRoleSampler

    def successor(messages, j):
        g = int(messages[-1]["content"].rsplit("Guess: ", 1)[1])
        return "Outcome: failure; Return: 0\n" + ("Reply: no answer." if g % 2 else "Reply: lower.")

    def scores(messages, continuation, served):
        g = int(messages[-1]["content"].rsplit("Guess: ", 1)[1])
        a, b = (0.4, 0.025) if g % 2 else (0.05, 0.1125)
        return math.log(a if continuation.endswith("\nReply: no answer.") else b)
    return ScriptedRoleSampler({"successor": successor}, scores=scores), PromptSet(task="toy", prompt_set=F.PROMPT_SET)


def test_waste_probe_with_a_listed_rule_and_a_rule_free_corpus():
    """The RL game wastes the odd numbers (GuessNumberEnv.wasted_numbers), the corpus holds no rule
    (corpus_waste_every=0): a scripted critic that knows the RL rule reads 1 on _rl, 0 on _other, NaN on _corpus."""
    sampler, ps = _odd_rule_critic()
    got = F.waste_probe(sampler, ps, 12, waste_every=0,
                        corpus_waste_every=0, wasted_numbers=(1, 3, 5, 7, 9, 11))
    assert math.isnan(got.pop("probe/wasted_said_corpus")) and math.isnan(got.pop("probe/p_wasted_corpus"))
    assert math.isnan(got.pop("probe/p_gap_corpus"))  # a rule that wastes nothing has no gap
    assert got == pytest.approx({"probe/wasted_said_rl": 1.0, "probe/wasted_said_other": 0.0,
                                 "probe/knowledge_accuracy": 1.0, "probe/p_wasted_rl": 0.8,
                                 "probe/p_wasted_other": 0.1, "probe/p_gap_rl": 0.7})


def test_waste_probe_reads_a_listed_corpus_rule():
    """corpus_wasted_numbers: the corpus game's rule listed (here the RL game's own, the knowing-critic reference):
    p_gap_corpus reads it as p_gap_rl does, so the premise "the warm start holds its corpus's rule" can be checked."""
    sampler, ps = _odd_rule_critic()
    odds = (1, 3, 5, 7, 9, 11)
    got = F.waste_probe(sampler, ps, 12, waste_every=0,
                        corpus_waste_every=0, wasted_numbers=odds, corpus_wasted_numbers=odds)
    assert got["probe/p_gap_corpus"] == pytest.approx(0.7) and got["probe/p_gap_rl"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="corpus_wasted_numbers lists a rule and corpus_waste_p asks for none"):
        F.forecast_corpus(N, 2, 0, skill_episodes=0, corpus_waste_p=0.3, corpus_wasted_numbers=odds)


def test_references_for_a_listed_rule(source):
    """Odd numbers wasted: the true rule's refiner wins far more often than the waste-blind behaviour; a rule-free
    corpus has no corpus-rule reference."""
    ref = F.reference_success_rates(N, source.tasks("test"), waste_every=0, episodes_per_task=4,
                                    wasted_numbers=ODDS, corpus_waste_every=0)
    assert set(ref) == {"behaviour", "oracle_refiner", "episodes"}
    assert ref["oracle_refiner"] > ref["behaviour"] + 0.3, ref


def test_skill_probe_scores_copying_and_reading():
    """A scripted critic that answers every skill prompt as the corpus does scores 1 everywhere; one whose backup
    copies the forecast's reply instead of the real one, and whose evaluator names the first guess of the history,
    loses exactly those skills and keeps the others."""
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)
    ex = F.build_forecast_examples(F._train_tasks(N, None), N, 0, 24, 99, prompts=ps)
    table = {(e.role, json.dumps(e.prompt_messages)): e.target_text for e in ex}

    def right(role):
        return lambda m, j: table[(role, json.dumps(m))]
    perfect = F.skill_probe(ScriptedRoleSampler({r: right(r) for r in F.SKILL_ROLES}), ps, N)
    assert perfect == {"skill/backup_reply": 1.0, "skill/backup_outcome": 1.0, "skill/evaluator_guess": 1.0,
                       "skill/evaluator_verdict": 1.0, "skill/evaluator_exact": 1.0, "skill/refiner": 1.0}

    def backup_copies_forecast(m, j):
        t = table[("backup", json.dumps(m))]
        fc = m[-1]["content"].split("Forecast after it: ", 1)[1]
        return t.split("\n")[0] + "\nReply: " + F.forecast_reply(fc) + "."

    def evaluator_names_first(m, j):
        t = table[("evaluator", json.dumps(m))]
        return t.replace(f"Guess {F.named_guess(t)} ", "Guess 0 ", 1)
    broken = F.skill_probe(ScriptedRoleSampler({"backup": backup_copies_forecast, "evaluator": evaluator_names_first,
                                                "refiner": right("refiner")}), ps, N)
    assert broken["skill/backup_outcome"] == 1.0 and broken["skill/refiner"] == 1.0
    assert broken["skill/evaluator_verdict"] == 1.0 and broken["skill/evaluator_guess"] == 0.0
    assert broken["skill/evaluator_exact"] == 0.0
    assert 0.2 < broken["skill/backup_reply"] < 0.9, broken  # right only where the two replies agree
    assert F.named_guess("Forecast reply: no answer. Guess 15 is wasted: try 16.\nVerdict: suboptimal") == "15"
    assert F.named_guess("Forecast reply: higher. Guess 7 gets an answer.\nVerdict: optimal") == "7"
    assert F.named_guess("Verdict: optimal") is None


@pytest.mark.parametrize("name, kw, blind_max", [("evaluator_range", {"p_out_of_range": 0.5}, 0.7),
                                                   ("evaluator_repeat", {"p_repeat": 0.5}, 0.8)])
def test_skill_probe_reads_the_range_and_repeat_critiques(name, kw, blind_max):
    """p_out_of_range > 0 / p_repeat > 0: a scripted evaluator that answers as that corpus does scores 1 on the
    out-of-range / repeated guesses; one blind to them (the waste-only critique) is right there only where the
    forecast happens to say "no answer" (a random waste set: about a third for the range prompts)."""
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)
    tasks = F._train_tasks(N, None)
    ex = F.build_forecast_examples(tasks, N, 0, 24, 99, prompts=ps, **kw)
    ex += F.build_forecast_examples(tasks, N, 0, 24, 99, prompts=ps)
    table = {(e.role, json.dumps(e.prompt_messages)): e for e in ex}
    right = {r: (lambda m, j, r=r: table[(r, json.dumps(m))].target_text) for r in F.SKILL_ROLES}
    got = F.skill_probe(ScriptedRoleSampler(right), ps, N, **kw)
    assert got[f"skill/{name}"] == 1.0 and got["skill/evaluator_verdict"] == 1.0

    def waste_only(m, j):
        e = table[("evaluator", json.dumps(m))]
        future = m[-1]["content"].split("Forecast: ", 1)[1].rsplit("\nGuess: ", 1)[0]
        return F.critique(e.state, e.action, future, N)[0]
    blind = F.skill_probe(ScriptedRoleSampler({**right, "evaluator": waste_only}), ps, N, **kw)
    assert 0.0 < blind[f"skill/{name}"] < blind_max, blind
    assert f"skill/{name}" not in F.skill_probe(ScriptedRoleSampler(right), ps, N)


def test_learnability_examples_follow_the_rule_and_the_batch_share():
    """critic_learnability: the true-target successor examples say "no answer" exactly for the rule's numbers (when
    not the hidden number), and each batch of the mixture holds the asked share of them."""
    from nlac_jax.experiments import critic_learnability as L
    assert L.wasted_numbers("mult3", 10) == (3, 6, 9) and L.wasted_numbers("odd", 5) == (1, 3, 5)
    with pytest.raises(ValueError, match="unknown rule 'prime'"):
        L.wasted_numbers("prime", 10)
    ex = L.true_successor_examples("odd", N, episodes=40)
    seen = set()
    for e in ex:
        g, reply = parse_guess(e.action), F.forecast_reply(e.target_text)
        if g is not None and reply != "correct":
            assert (reply == "no answer") == (g % 2 == 1), (e.action, e.target_text)
            seen.add(g % 2)
    assert seen == {0, 1}
    pol = [e for e in F.forecast_corpus(N, 4, 0, skill_episodes=0, corpus_waste_p=0.35) if e.role == "policy"]
    mix = L.mixture(ex, pol, 3, 0.25)
    assert len(mix) == 3 * L.BATCH
    for b in range(3):
        assert [e.role for e in mix[b * L.BATCH:(b + 1) * L.BATCH]] == ["successor"] * 4 + ["policy"] * 12


def test_endgame_states_by_hand():
    """1..12, odd numbers wasted, 4 turns: bisecting with the even numbers corners every odd target. By hand:
    1: 6 lower, 2 lower -> [1, 1]; 3: 6 lower, 2 higher, 4 lower; 5: 6 lower, 2 higher, 4 higher; 7: 6 higher,
    10 lower (the spared number nearest 9.5), 8 lower; 9: 6 higher, 10 lower, 8 higher; 11: 6 higher, 10 higher,
    12 lower. With 3 turns only target 1 keeps a guess. With the multiples of 3 wasted: 3: 7 lower, 4 lower,
    2 higher; 6: 7 lower, 4 higher, 5 higher; 9: 7 higher, 10 lower, 8 higher; 12: 7 higher, 10 higher, 11 higher."""
    odds = tuple(range(1, 13, 2))
    got = F.endgame_states(12, None, wasted_numbers=odds)
    assert [g for g, _ in got] == [1, 3, 5, 7, 9, 11]
    guesses = {g: [m["content"] for m in s if m["role"] == "assistant"] for g, s in got}
    replies = {g: [m["content"] for m in s if m["role"] == "user"][1:] for g, s in got}
    assert guesses == {1: ["6", "2"], 3: ["6", "2", "4"], 5: ["6", "2", "4"], 7: ["6", "10", "8"],
                       9: ["6", "10", "8"], 11: ["6", "10", "12"]}
    assert replies[1] == ["lower", "lower"] and replies[9] == ["higher", "lower", "higher"]
    assert [g for g, _ in F.endgame_states(12, 3, wasted_numbers=odds)] == [1]
    assert F.endgame_states(12, None) == []  # a game that wastes nothing has no such state
    mult3 = F.endgame_states(12, None, waste_every=3)
    assert {g: [m["content"] for m in s if m["role"] == "assistant"] for g, s in mult3} == {
        3: ["7", "4", "2"], 6: ["7", "4", "5"], 9: ["7", "10", "8"], 12: ["7", "10", "11"]}
    # and the policy reads the cornered range from the public transcript alone
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)
    assert all(f"Possible now: {g} to {g}, 1 guesses left." in ps.policy(s)[-1]["content"] for g, s in mult3)


def test_single_number_critique_by_hand():
    """judge_single: after "16 lower, 8 higher, 12 lower, 10 higher" only 11 is possible (1..15, then 9..15, 9..11,
    11..11). Guessing 11 is optimal whatever the forecast
    says (here "no answer"); any other number is outside and the refiner plays 11; off, the waste critique as
    before (which, at the one possible number, keeps the guess as its own "better" one)."""
    state = [{"role": "system", "content": "You have 6 guesses."}, {"role": "user", "content": "1 and 32."}]
    for g, r in (("16", "lower"), ("8", "higher"), ("12", "lower"), ("10", "higher")):
        state += [{"role": "assistant", "content": g}, {"role": "user", "content": r}]
    assert consistent_interval(state, N)[:2] == (11, 11)
    wasted = "Outcome: failure; Return: 0\nReply: no answer."
    assert F.critique(state, "11", wasted, N, judge_single=True) == (
        "Forecast reply: no answer. Guess 11 is the only number possible.\nVerdict: optimal", True, "11")
    assert F.critique(state, "13", "Outcome: failure; Return: 0\nReply: lower.", N, judge_single=True) == (
        "Forecast reply: lower. Guess 13 is outside 11 to 11: try 11.\nVerdict: suboptimal", False, "11")
    assert F.critique(state, "11", wasted, N) == (
        "Forecast reply: no answer. Guess 11 is wasted: try 11.\nVerdict: suboptimal", False, "11")
    assert F.critique(state, "13", wasted, N, judge_single=True, judge_range=True)[1:] == (False, "11")
    # a wider range: judge_single changes nothing
    wide = state[:-2]
    assert F.critique(wide, "11", wasted, N, judge_single=True) == F.critique(wide, "11", wasted, N)
    assert F.named_guess("Forecast reply: correct. Guess 11 is the only number possible.") == "11"


def test_endgame_episodes_corner_train_targets(source):
    """endgame_episodes: each kept game corners its (train) target, the cornered state's examples are the policy
    playing it, the successor's real forecast (a win), the evaluator approving it under its real forecast and
    under a "no answer" one, and an outside number judged suboptimal with the refiner playing the target. Every
    example of the ordinary corpus and skill games is unchanged except the critique's words at single-number
    states; 0 keeps the corpus bit-identical."""
    base = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source)
    assert _key(base) == _key(F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source,
                                                endgame_episodes=0))
    ex = F.forecast_corpus(N, 16, 3, skill_episodes=16, task_source=source, endgame_episodes=60)
    old, eg = ex[:len(base)], ex[len(base):]
    assert all(e.meta["source"].startswith("endgame") and e.meta["game"] == "skill" for e in eg)
    changed = [(a, b) for a, b in zip(base, old) if _key([a]) != _key([b])]
    for a, b in changed:  # only critiques (and refinements) at a single-number state
        lo, hi, _, _ = consistent_interval(a.state, N)
        assert a.role in ("evaluator", "refiner") and lo == hi, (a.role, a.target_text, b.target_text)
    held_out = {t.id for t in source.tasks("test")}
    pol = [e for e in eg if e.role == "policy"]
    assert len(pol) >= 15 and not {e.task_id for e in eg} & held_out
    assert len({e.target_text for e in pol}) >= 5  # (this source's train targets are the odd numbers)
    for p in pol:
        lo, hi, left, _ = consistent_interval(p.state, N)
        assert lo == hi == int(p.target_text) and left >= 1
        group = [e for e in eg if e.task_id == p.task_id and e.meta["episode"] == p.meta["episode"]]
        by = {(e.role, e.meta["source"]): e for e in group if e.role != "policy"}
        assert parse_outcome(leading_outcome_line(by["successor", "endgame"].target_text)) == (True, 1.0)
        for src in ("endgame", "endgame_no_answer"):
            assert parse_verdict(by["evaluator", src].target_text) is True
            assert by["refiner", src].target_text == p.target_text
        assert "no answer" in by["evaluator", "endgame_no_answer"].prompt_messages[-1]["content"]
        alt = by["evaluator", "endgame_alternative"]
        assert parse_verdict(alt.target_text) is False and alt.action != p.target_text
        assert f"is outside {lo} to {lo}: try {lo}." in alt.target_text
        assert by["refiner", "endgame_alternative"].target_text == p.target_text


def test_endgame_probe_by_hand():
    """The six endgame states of 1..12 (odds wasted) and scripted roles: a successor that knows the exception for
    1, 3, 5 (forecast "correct"; scored P(wasted) 0.1, P(success) 0.75) and not for 7, 9, 11 ("no answer"; 0.8,
    0.2); an evaluator whose verdict follows the forecast; a policy whose greedy guess is the only possible number
    for 1 and 3, and whose 8 samples play it 8 times for 1, once for 3, never otherwise. By hand: p_wasted
    (3 x 0.1 + 3 x 0.8) / 6 = 0.45, p_success (3 x 0.75 + 3 x 0.2) / 6 = 0.475, verdict_optimal 3/6,
    policy_greedy 2/6, policy_sampled (8/8 + 1/8) / 6 = 0.1875."""
    import re
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ps = PromptSet(task="toy", prompt_set=F.PROMPT_SET)

    def only(messages):
        return int(re.search(r"Possible now: (\d+) to \1,", messages[-1]["content"]).group(1))

    def successor(messages, j):
        return ("Outcome: success; Return: 1\nReply: correct." if only(messages) <= 5
                else "Outcome: failure; Return: 0\nReply: no answer.")

    def evaluator(messages, j):
        return "Verdict: suboptimal" if "no answer" in messages[-1]["content"] else "Verdict: optimal"

    def policy(messages, j):
        g = only(messages)
        return str(g) if j < {1: 8, 3: 1}.get(g, 0) else str(g + 1)

    def scores(messages, continuation, served):
        knows = only(messages) <= 5
        if continuation in ("Outcome: success", "Outcome: failure"):
            return math.log((0.75 if knows else 0.2) if continuation.endswith("success") else
                            (0.25 if knows else 0.8))
        a, b = (0.05, 0.1125) if knows else (0.4, 0.025)  # P(wasted) = 2a / (2a + 8b): 0.1 or 0.8
        return math.log(a if continuation.endswith("\nReply: no answer.") else b)
    sampler = ScriptedRoleSampler({"successor": successor, "evaluator": evaluator, "policy": policy}, scores=scores)
    got = F.endgame_probe(sampler, ps, 12, wasted_numbers=tuple(range(1, 13, 2)))
    assert got == pytest.approx({"endgame/states": 6, "endgame/p_wasted": 0.45, "endgame/p_success": 0.475,
                                 "endgame/verdict_optimal": 0.5, "endgame/policy_greedy": 2 / 6,
                                 "endgame/policy_sampled": 0.1875})
    # two score calls for all six states (P(wasted): 6 x 10 continuations; P(success): 6 x 2)
    assert [len(c.messages_batch) for c in sampler.score_calls] == [60, 12]
    # the critic and the greedy policy decode at temperature 0; the acting policy's samples at the sampler's settings
    by_role = {}
    for c in sampler.calls:
        by_role.setdefault(c.role, []).append(c)
    assert [c.settings.temperature("successor") for c in by_role["successor"]] == [0.0]
    assert by_role["evaluator"][0].settings.temperature("evaluator") == 0.0
    greedy, acting = by_role["policy"]
    assert greedy.settings.temperature("policy") == 0.0 and acting.settings is sampler.settings
    # no state: NaN means, nothing sampled
    empty = F.endgame_probe(ScriptedRoleSampler({}), ps, 12)
    assert empty["endgame/states"] == 0 and math.isnan(empty["endgame/policy_sampled"])
