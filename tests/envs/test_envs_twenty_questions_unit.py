"""The unit 20 Questions world (issue 25): its table, the oracle's hidden refusal rule, and the public state."""

import itertools
import os

import pytest

from nlac_jax.envs.base import Task
from nlac_jax.envs.twenty_questions import (CANT, NO, YES, ScriptedOracle, TwentyQuestionsEnv,
                                            TwentyQuestionsTaskSource, load_object_table)
from nlac_jax.envs.twenty_questions_state import answer_word, candidates, public_state, world_of

ATTRS = ("alive", "metal", "edible", "heavy", "soft", "round", "wooden", "loud")


@pytest.fixture
def clean_gin():
    import gin
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def table():
    return load_object_table("unit")


def _task(table, name):
    return Task(id=f"20q-{name}", split="train", payload=table.find(name).to_payload())


def test_unit_table_distance_and_identifiability(table):
    assert len(table.objects) == 16 and table.set_name == "unit"
    assert sorted(set(table.attribute_questions.values())) == sorted(ATTRS)
    vecs = {o.name: tuple(a in o.attributes for a in ATTRS) for o in table.objects}
    assert all(len(o.name.split()) == 1 and not o.synonyms for o in table.objects)
    for x, y in itertools.combinations(vecs.values(), 2):
        assert sum(a != b for a, b in zip(x, y)) >= 4
    # the property the distance buys: with any 3 attributes unanswered, the other 5 still tell every object apart
    for hidden in itertools.combinations(range(8), 3):
        keep = [i for i in range(8) if i not in hidden]
        assert len({tuple(v[i] for i in keep) for v in vecs.values()}) == 16
    # no object is named like an attribute: the bare "alive?" must stay an attribute question, never a guess
    assert not {o.name for o in table.objects} & set(ATTRS)


def test_unit_splits(table):
    src = TwentyQuestionsTaskSource("unit")
    train, test = src.tasks("train"), src.tasks("test")
    assert len(train) == 12 and len(test) == 4
    assert not {t.id for t in train} & {t.id for t in test}
    assert {t.payload["name"] for t in test} == {"fox", "bee", "key", "car"}


def test_scripted_oracle_answers_every_attribute_question(table):
    oracle = ScriptedOracle(table)
    for o in table.objects:
        for a in ATTRS:
            want = YES if a in o.attributes else NO
            # both phrasings of the table: the full question and the compact form
            assert oracle.answer(o, f"Is it {a}?") == want
            assert oracle.answer(o, f"{a}?") == want
        for other in table.objects:
            assert oracle.answer(o, f"{other.name}?") == (YES if other is o else NO)


def test_refused_attributes_rule(table):
    oracle = ScriptedOracle(table, refused_attributes=("metal", "soft"))
    env = TwentyQuestionsEnv(oracle, max_questions=7)
    obs = env.reset(_task(table, "cow"))  # cow: metal, soft, wooden, loud
    assert obs[0]["content"].endswith("World: unit.") and "metal" not in obs[0]["content"]
    r = env.step("metal?")
    assert (r.observation, r.reward, r.done) == (CANT, -1.0, False)
    assert env.step("Is it soft?").observation == CANT
    assert env.step("wooden?").observation == YES and env.step("alive?").observation == NO
    assert env.step("dog?").observation == NO  # guesses are always answered
    r = env.step("cow?")
    assert r.info["success"] and r.reward == 0.0 and r.done
    with pytest.raises(ValueError, match="not attributes"):
        ScriptedOracle(table, refused_attributes=("shiny",))


def test_refused_attributes_from_gin(clean_gin):
    import gin

    from nlac_jax import envs
    task_gin = os.path.join(os.path.dirname(__file__), "..", "..", "gin", "tasks", "twenty_questions.gin")
    gin.parse_config_files_and_bindings([task_gin], ["OBJECTS = 'unit'", "make_env_factory.max_turns = 7",
                                                     "nlac_jax.envs.ScriptedOracle.refused_attributes = ('loud',)"])
    env = envs.make_env_factory()()
    table = load_object_table("unit")
    env.reset(_task(table, "owl"))  # owl: alive, round, wooden, loud
    assert env.step("loud?").observation == CANT and env.step("round?").observation == YES


def test_answer_word():
    assert [answer_word(x) for x in (YES, NO, CANT, "Yes! You guessed it.", "No. You have used all 7 questions.",
                                     "Error: your message was empty.", "[USER]\nI can't answer that.")] == [
        "yes", "no", "can't answer", "correct", "no", "error", "can't answer"]


def test_candidates_against_the_oracle(table):
    """Hand-checked transcript, then every 3-question transcript of every object: the hidden object always stays a
    candidate, and every candidate would have received the same answers (the oracle decides, not our filter)."""
    oracle = ScriptedOracle(table, refused_attributes=("metal",))
    env = TwentyQuestionsEnv(oracle, max_questions=7)
    state = env.reset(_task(table, "owl"))
    for q in ("alive?", "metal?", "dog?", "Is it round?"):
        state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": env.step(q).observation}]
    names, asked = candidates(state, table)
    # alive: dog owl bee pig cup key pen bell; round among them: owl pig key bell; metal refused; dog guessed "no"
    assert names == ["owl", "pig", "key", "bell"] and asked == ["alive?", "metal?", "dog?", "Is it round?"]
    st = public_state(state)
    assert st["history"] == ["alive? yes", "metal? can't answer", "dog? no", "Is it round? yes"]
    assert st["left"] == 3 and st["candidates"] == names and world_of(state) == "unit"
    for obj in table.objects:
        for qs in itertools.combinations(["alive?", "metal?", "soft?", "cat?", "loud?"], 3):
            state = env.reset(_task(table, obj.name))
            for q in qs:
                r = env.step(q)
                state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": r.observation}]
                if r.done:
                    break
            names, asked = candidates(state, table)
            assert obj.name in names
            for c in table.objects:  # a candidate iff the oracle would have answered it the same way
                same = all(oracle.answer(c, q) == oracle.answer(obj, q) for q in asked)
                assert (c.name in names) == same, (obj.name, asked, c.name)


def test_action_categories_by_hand(table):
    """owl (alive, round, wooden, loud) hidden, metal refused. After "alive? yes" and "cat? no" the possible objects
    are the alive ones: dog owl bee pig cup key pen bell."""
    env = TwentyQuestionsEnv(ScriptedOracle(table, refused_attributes=("metal",)), max_questions=7)

    def play(questions):
        state = env.reset(_task(table, "owl"))
        for q in questions:
            state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": env.step(q).observation}]
        return state
    state = play(["alive?", "cat?"])
    cat = env.action_category
    assert cat(state, "Is it alive?") == "repeat" and cat(state, "cat?") == "repeat"
    assert cat(state, "metal?") == "wasted"
    assert cat(state, "hmm?") == "invalid" and cat(state, "") == "invalid"
    assert cat(state, "fox?") == "outside"  # fox is not alive
    assert cat(state, "dog?") == "informative" and cat(state, "owl?") == "informative"
    assert cat(state, "loud?") == "informative"  # dog no, owl yes
    # alive, loud and round all "yes": owl and bell remain, and both are wooden
    state = play(["alive?", "loud?", "round?"])
    assert candidates(state, table)[0] == ["owl", "bell"]
    assert cat(state, "wooden?") == "uninformative" and cat(state, "soft?") == "informative"
    assert env.is_action_optimal(state, "metal?") is False and env.is_action_optimal(state, "bell?") is True
    assert env.is_action_optimal(state, "wooden?") is False


def test_dominated_question_reads_the_public_transcript_as_the_env_categorises(table):
    """envs.dominated_question (the transcript and the world's table only) == the env's own categories 'repeat',
    'outside' or 'uninformative' (which the env reads with the hidden object at hand), on random games with an
    oracle that refuses nothing (so no 'wasted' label hides a public one); a refused question is not dominated."""
    import random

    from nlac_jax.envs.twenty_questions_state import dominated_question
    rng = random.Random(5)
    env = TwentyQuestionsEnv(ScriptedOracle(table, refused_attributes=()), max_questions=7)
    pool = [f"{a}?" for a in ATTRS] + [f"{o.name}?" for o in table.objects] + ["hmm?"]
    checked = {True: 0, False: 0}
    for _ in range(40):
        state = env.reset(_task(table, rng.choice(table.objects).name))
        for _ in range(7):
            for q in rng.sample(pool, 4):
                want = env.action_category(state, q) in ("repeat", "outside", "uninformative")
                assert dominated_question(state, q) == want, (state, q)
                checked[want] += 1
            q = rng.choice(pool)
            r = env.step(q)
            state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": r.observation}]
            if r.done:
                break
    assert min(checked.values()) > 100  # both answers were exercised
    # by hand (owl hidden, metal refused): after "alive? yes" and "metal? can't answer", metal is asked again
    # (dominated: a repeat); edible is refused by nobody here and splits the alive objects, so not dominated
    env = TwentyQuestionsEnv(ScriptedOracle(table, refused_attributes=("metal",)), max_questions=7)
    state = env.reset(_task(table, "owl"))
    for q in ("alive?", "metal?"):
        state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": env.step(q).observation}]
    assert answer_word(state[-1]["content"]) == "can't answer"
    assert dominated_question(state, "Is it metal?") and dominated_question(state, "fox?")
    assert not dominated_question(state, "round?") and not dominated_question(state, "owl?")
    assert not dominated_question(state, "hmm?")
