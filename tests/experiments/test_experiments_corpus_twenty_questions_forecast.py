"""The 20 Questions learned-critic corpus (experiments/corpus_twenty_questions_forecast.py): train objects only,
prompts exactly as the prompt set renders them, the corpus game's knowledge in the successor targets (checked
against the env's own oracle), skills whose cues are independent of the attribute, the critique rule by hand,
nothing hidden in any prompt, agreement with NLAC's own target builder, and the probes on scripted critics."""

import json
import math
import re

import pytest

from nlac_jax.envs.base import TaskCursor
from nlac_jax.envs.twenty_questions import ScriptedOracle, TwentyQuestionsTaskSource, load_object_table
from nlac_jax.envs.twenty_questions_state import answer_word
from nlac_jax.experiments import corpus_twenty_questions_forecast as F
from nlac_jax.nlac.prompts import PromptSet
from nlac_jax.nlac.verdict import leading_outcome_line, parse_outcome, parse_verdict

C, R = F.CORPUS_REFUSED, F.RL_REFUSED
NEITHER = ("alive", "loud")


@pytest.fixture(scope="module")
def source():
    return TwentyQuestionsTaskSource("unit")


@pytest.fixture(scope="module")
def table(source):
    return source.table


@pytest.fixture(scope="module")
def ps():
    return PromptSet(task="twenty_questions", prompt_set=F.PROMPT_SET)


@pytest.fixture(scope="module")
def examples(source):
    return F.twenty_questions_forecast_corpus(24, 3, skill_episodes=80, task_source=source)


def _key(x):
    return json.dumps([[e.role, e.prompt_messages, e.target_text, e.task_id] for e in x])


def test_bank_and_partners(table):
    assert F.bank(table) == ("alive", "metal", "edible", "heavy", "soft", "round", "wooden", "loud")
    assert set(NEITHER) == set(F.bank(table)) - set(C) - set(R)
    assert F.partners(table, C, R) == {"metal": "edible", "heavy": "soft", "round": "wooden",
                                       "edible": "metal", "soft": "heavy", "wooden": "round"}
    with pytest.raises(ValueError):
        F.partners(table, ("metal",), ("metal",))


def test_train_objects_only_deterministic_and_every_role(examples, source):
    held_out = {t.id for t in source.tasks("test")}
    held_names = {t.payload["name"] for t in source.tasks("test")}
    assert examples and not {e.task_id for e in examples} & held_out
    assert not {e.meta["hidden"] for e in examples} & held_names
    assert _key(examples) == _key(F.twenty_questions_forecast_corpus(24, 3, skill_episodes=80, task_source=source))
    assert _key(examples) != _key(F.twenty_questions_forecast_corpus(24, 4, skill_episodes=80, task_source=source))
    assert {e.role for e in examples} == {"policy", "successor", "backup", "evaluator", "refiner"}
    assert {e.meta["game"] for e in examples if e.role in ("policy", "successor")} == {"corpus"}
    assert {e.meta["game"] for e in examples if e.role in F.SKILL_ROLES} == {"skill"}


def test_prompts_are_what_the_prompt_set_renders(examples, ps):
    for e in examples:
        if e.role == "policy":
            assert e.prompt_messages == ps.policy(e.state)
        elif e.role == "successor":
            assert e.prompt_messages == ps.successor(e.state, e.action)
        elif e.role == "evaluator":
            assert e.prompt_messages == ps.evaluator(e.state, e.action, [e.meta["future"]])
        elif e.role == "refiner":
            text = F.critique(e.state, e.action, e.meta["future"], load_object_table("unit"),
                              F.partners(load_object_table("unit"), C, R))[0]
            assert e.prompt_messages == ps.refiner(e.state, e.action, text, [])
        # every role's prompt carries the policy's own state line, and nothing else about the state
        line = ps.policy(e.state)[0]["content"].split("\n", 1)[1]
        assert line in e.prompt_messages[-1]["content"]


def test_successor_targets_are_the_oracles_real_answers(examples, table):
    """Corpus-game forecasts: outcome first; the answer is what the env's own oracle (refusing C) replies to the
    question about the hidden object: "can't answer" exactly for the C attributes (the corpus's knowledge)."""
    oracle = ScriptedOracle(table, refused_attributes=C)
    succ = [e for e in examples if e.role == "successor"]
    seen = {"C": 0, "other": 0}
    for e in succ:
        assert leading_outcome_line(e.target_text) is not None, e.target_text
        obj = table.find(e.meta["hidden"])
        reply = oracle.answer(obj, e.action)
        want = "correct" if e.action == f"{obj.name}?" else answer_word(reply)
        assert F.forecast_answer(e.target_text) == want, (e.action, e.target_text)
        attr = F.attribute_of(e.action, table)
        if attr is not None:
            assert (want == "can't answer") == (attr in C)
            seen["C" if attr in C else "other"] += 1
    assert seen["C"] > 20 and seen["other"] > 20


def test_skill_refusals_are_independent_of_the_attribute(examples):
    """Skill games: whether a forecast says "can't answer" must not be predictable from the attribute (else the
    evaluator could learn a rule instead of reading the forecast); the verdict follows the forecast."""
    evals = [e for e in examples if e.role == "evaluator" and e.meta["attribute"] is not None]
    rate = {}
    for name, group in (("C", C), ("R", R), ("neither", NEITHER)):
        ex = [e for e in evals if e.meta["attribute"] in group]
        assert len(ex) > 40
        rate[name] = sum(not e.meta["verdict"] for e in ex) / len(ex)
    assert all(0.15 < r < 0.6 for r in rate.values()) and max(rate.values()) - min(rate.values()) < 0.2, rate
    for e in evals:
        wasted = F.forecast_answer(e.meta["future"]) in ("can't answer", "error")
        assert parse_verdict(e.target_text) is (not wasted)
        assert wasted == (e.meta["attribute"] in e.meta["refused"])
    pairs = [(e, r) for e, r in zip(examples, examples[1:]) if e.role == "evaluator"]
    assert all(r.role == "refiner" and r.prompt_messages[-1]["content"].endswith(e.target_text) for e, r in pairs)
    for e, r in pairs:
        assert r.target_text == (e.action if parse_verdict(e.target_text) else e.target_text.split("ask ")[1]
                                 .split("\n")[0])


def _state(*pairs):
    state = [{"role": "system", "content": "Let's play 20 Questions. You have at most 7 questions. World: unit."},
             {"role": "user", "content": "I'm thinking of an object. Ask your first yes/no question."}]
    for q, a in pairs:
        state += [{"role": "assistant", "content": q}, {"role": "user", "content": a}]
    return state


def test_critique_by_hand(table):
    partner = F.partners(table, C, R)
    refused = "Outcome: failure; Return: -7\nAnswer: can't answer."
    # 1. a wasted C question moves to its R partner
    s1 = _state(("alive?", "Yes."))
    assert F.critique(s1, "metal?", refused, table, partner) == (
        "Forecast answer: can't answer. Question metal? is wasted: ask edible?\nVerdict: suboptimal", False, "edible?")
    # 2. partner already asked (edible, refused then): the first unasked attribute in bank order (alive is asked)
    s2 = _state(("alive?", "No."), ("edible?", "I can't answer that."))
    assert F.critique(s2, "metal?", refused, table, partner)[1:] == (False, "heavy?")
    # a neither-refused attribute has no partner: the first unasked in bank order
    assert F.critique(s2, "loud?", refused, table, partner)[2] == "metal?"
    # 3. a question the forecast says gets an answer is optimal, the refiner keeps it
    assert F.critique(s1, "metal?", "Outcome: success; Return: -3\nAnswer: no.", table, partner) == (
        "Forecast answer: no. Question metal? gets an answer.\nVerdict: optimal", True, "metal?")
    assert F.named_question("Forecast answer: no. Question metal? gets an answer.") == "metal?"


def test_no_prompt_shows_the_hidden_object_or_the_rule(examples, table):
    names = {o.name for o in table.objects}
    for e in examples:
        text = "\n".join(m["content"] for m in e.prompt_messages)
        assert "refus" not in text.lower() and "World" not in text and "Let's play" not in text
        # the hidden object's name: only in the public "Possible now" list or as an action form "<name>?"
        rest = "\n".join(x for x in text.split("\n") if not x.startswith("Possible now:"))
        for m in re.finditer(rf"\b{e.meta['hidden']}\b", rest):
            assert rest[m.end():m.end() + 1] == "?", (e.role, text)
        for tgt in (e.target_text,) if e.role in ("successor", "backup") else ():
            assert not any(re.search(rf"\b{n}\b", tgt) for n in names), tgt
        # no line lists attributes other than the agent's own questions and the critique's proposal
        for x in rest.split("\n"):
            listed = [a for a in F.bank(table) if re.search(rf"\b{a}\b", x)]
            assert len(listed) <= 1 or x.startswith(("History:", "Critique:", "Earlier")), x


def test_agrees_with_nlac_target_builder(source, table, ps):
    """The corpus's backup examples are exactly what build_critic_examples produces when the roles answer like the
    corpus: same prompts (the scripted sampler looks them up) and the same targets, terminal ones included."""
    from nlac_jax.nlac.targets import build_critic_examples
    from nlac_jax.rl.roles import ScriptedRoleSampler
    tasks = F.train_tasks(source)
    ex = F.build_forecast_examples(tasks, table, 0, 1, seed=5)
    (task,) = TaskCursor(list(tasks), "20q-forecast-skill", 5).take(1)
    _, _, traj = F.skill_episode(task, table, 5, 0)
    d = [F.forecast(traj[t:], ps) for t in range(len(traj))]
    lookup = {"policy": {json.dumps(ps.policy(t.state)): t.action for t in traj},
              "successor": {json.dumps(ps.successor(t.state, t.action)): d[i] for i, t in enumerate(traj)},
              "backup": {json.dumps(e.prompt_messages): e.target_text for e in ex
                         if e.role == "backup" and e.meta["source"] == "behaviour"}}
    assert len(lookup["backup"]) == len(traj) - 1 > 0
    sampler = ScriptedRoleSampler({r: (lambda m, j, r=r: lookup[r][json.dumps(m)]) for r in lookup})
    built = build_critic_examples(traj, sampler, prompts=ps)
    assert [b.target_text for b in built] == d
    assert all(leading_outcome_line(b.target_text) and parse_outcome(b.target_text)[1] is not None for b in built)


def test_references_order(source):
    ref = F.reference_success_rates(source.tasks("test"), episodes_per_task=4)
    assert ref["episodes"] == 16
    assert ref["oracle_refiner"] > ref["behaviour"] > ref["corpus_rule_refiner"], ref


def test_refusal_probe_by_hand(ps):
    """A scripted critic that holds the corpus rule: pi("... Answer: can't answer.") = a for each outcome line and
    every other answer word b, so P(refused) = a / (a + 4b) = 0.8 on C (a = 0.4, b = 0.025) and 0.1 elsewhere
    (a = 0.1, b = 0.225). p_gap_corpus = 0.8 - 0.1; p_gap_rl = 0.1 - (3 x 0.8 + 2 x 0.1) / 5 = -0.42."""
    from nlac_jax.rl.roles import ScriptedRoleSampler

    def scores(messages, continuation, served):
        q = messages[-1]["content"].rsplit("Question: ", 1)[1]
        assert served == "policy" and leading_outcome_line(continuation) is not None
        a, b = (0.4, 0.025) if q.rstrip("?") in C else (0.1, 0.225)
        return math.log(a if continuation.endswith("\nAnswer: can't answer.") else b)
    sampler = ScriptedRoleSampler({}, scores=scores)
    got = F.refusal_probe(sampler, ps)
    assert got == pytest.approx({"probe/p_refused_rl": 0.1, "probe/p_refused_corpus": 0.8,
                                 "probe/p_refused_other": 0.1, "probe/p_gap_corpus": 0.7, "probe/p_gap_rl": -0.42,
                                 "probe/knowledge_accuracy": 2 / 8})
    (call,) = sampler.score_calls
    # 8 attributes x (7 winning returns + 1 loss) x 5 answer words, at the opening state
    assert call.role == "successor" and len(call.messages_batch) == 8 * 8 * 5
    assert "History: none." in call.messages_batch[0][-1]["content"]


def test_skill_probe_scores_a_perfect_and_a_blind_critic(source, ps):
    from nlac_jax.rl.roles import ScriptedRoleSampler
    ex = F.build_forecast_examples(F.train_tasks(source), source.table, 0, 24, 7, prompts=ps)
    lookup = {json.dumps(e.prompt_messages): e.target_text for e in ex if e.role in F.SKILL_ROLES}
    perfect = ScriptedRoleSampler({r: (lambda m, j: lookup[json.dumps(m)]) for r in F.SKILL_ROLES})
    got = F.skill_probe(perfect, ps, seed=7, per_role=16)
    assert got == {"skill/backup_reply": 1.0, "skill/backup_outcome": 1.0, "skill/evaluator_guess": 1.0,
                   "skill/evaluator_verdict": 1.0, "skill/evaluator_exact": 1.0, "skill/refiner": 1.0}
    blind = ScriptedRoleSampler({}, default="Outcome: failure; Return: -7\nVerdict: optimal")
    got = F.skill_probe(blind, ps, seed=7, per_role=16)
    assert got["skill/evaluator_guess"] == 0.0 and got["skill/backup_reply"] == 0.0 and got["skill/refiner"] == 0.0


def test_targets_fit_the_experiments_generation_budgets(examples):
    """gin/experiments/unit_20q.gin's RoleSampling.max_new_tokens hold every corpus target (at the unit model's
    tokenizer, plus the turn-end token): a longer target would be cut off when the model generates it."""
    from nlac_jax.testing import tiny
    tok = tiny.make_tiny_tokenizer(vocab_size=512)
    budget = {"policy": 6, "successor": 40, "backup": 40, "evaluator": 48, "refiner": 6}
    gin_text = open(__file__.rsplit("/tests/", 1)[0] + "/gin/experiments/unit_20q.gin").read()
    assert "nlac.RoleSampling.max_new_tokens = " + repr(budget) in gin_text
    longest = {}
    for e in examples:
        longest[e.role] = max(longest.get(e.role, 0), len(tok.encode(e.target_text)) + 1)
    assert all(longest[r] <= budget[r] for r in budget), longest
