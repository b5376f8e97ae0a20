"""The compact 20 Questions prompts (templates/twenty_questions_forecast): the public state line, every role, the
token budget, and what no prompt may show (the hidden object, the refusal rule)."""

import pytest

from nlac_jax.envs.base import Task
from nlac_jax.envs.twenty_questions import ScriptedOracle, TwentyQuestionsEnv, load_object_table
from nlac_jax.nlac.prompts import PromptSet

FORECAST = "Outcome: failure; Return: -6\nAnswer: can't answer."


@pytest.fixture(scope="module")
def ps():
    return PromptSet(task="twenty_questions", prompt_set="twenty_questions_forecast")


def _state(hidden, questions, refused=("metal",), max_questions=7):
    table = load_object_table("unit")
    env = TwentyQuestionsEnv(ScriptedOracle(table, refused_attributes=refused), max_questions=max_questions)
    state = env.reset(Task(id="t", split="train", payload=table.find(hidden).to_payload()))
    for q in questions:
        state = state + [{"role": "assistant", "content": q}, {"role": "user", "content": env.step(q).observation}]
    return state


def test_state_line_by_hand(ps):
    ps.validate()
    # owl: alive, round, wooden, loud. alive -> dog owl bee pig cup key pen bell; dog guessed "no"; metal refused
    state = _state("owl", ["alive?", "metal?", "dog?"])
    assert ps.policy(state) == [{"role": "user", "content": (
        "ASK.\nHistory: alive? yes, metal? can't answer, dog? no.\n"
        "Possible now: owl, bee, pig, cup, key, pen, bell (7); 4 questions left.")}]
    opening = ps.policy(_state("owl", []))[0]["content"]
    assert opening.endswith("History: none.\nPossible now: cat, dog, fox, owl, bee, cow, pig, ant, cup, pan, key, "
                            "hat, box, pen, car, bell (16); 7 questions left.")


def test_even_splits_line_by_hand(ps):
    """nlac_jax.envs.state_lines.show_even_splits adds the unasked attributes that split the possible objects most
    evenly: every attribute at the opening (the [8,4,4] code splits 16 objects 8/8); after alive, metal and edible
    (all yes: cup, bell) the four where cup and bell differ, not loud (both loud); a refused attribute counts as
    asked; with one object left, none. Off (the default), the line is absent."""
    import gin

    from nlac_jax.envs.twenty_questions_state import even_splits
    table = load_object_table("unit")
    assert even_splits(_state("cup", []), table) == ["alive", "metal", "edible", "heavy", "soft", "round", "wooden",
                                                      "loud"]
    cup_bell = _state("cup", ["alive?", "metal?", "edible?"], refused=())
    assert even_splits(cup_bell, table) == ["heavy", "soft", "round", "wooden"]
    refused = _state("cup", ["alive?", "metal?", "edible?"], refused=("metal",))  # 8 alive objects stay: cup, bell,
    assert even_splits(refused, table) == ["heavy", "soft", "round", "wooden", "loud"]  # key, pen edible (4/8)
    assert even_splits(_state("cup", ["alive?", "metal?", "edible?", "heavy?"], refused=()), table) == []
    assert "Even splits" not in ps.policy(cup_bell)[0]["content"]
    with gin.unlock_config():
        gin.bind_parameter("nlac_jax.envs.state_lines.show_even_splits", True)
    try:
        assert ps.policy(cup_bell)[0]["content"] == (
            "ASK.\nHistory: alive? yes, metal? yes, edible? yes.\nPossible now: cup, bell (2); 4 questions left.\n"
            "Even splits: heavy?, soft?, round?, wooden?.")
        last = ps.policy(_state("cup", ["alive?", "metal?", "edible?", "heavy?"], refused=()))[0]["content"]
        assert last.endswith("Possible now: cup (1); 3 questions left.\nEven splits: none.")
        assert ps.successor(cup_bell, "soft?")[0]["content"].endswith("Even splits: heavy?, soft?, round?, wooden?."
                                                                       "\nQuestion: soft?")
    finally:
        gin.clear_config()


def test_roles_share_the_state_and_end_with_the_action(ps):
    state = _state("owl", ["alive?", "metal?"])
    line = ps.policy(state)[0]["content"].split("\n", 1)[1]
    succ = ps.successor(state, "round?")[0]["content"]
    ev = ps.evaluator(state, "round?", [FORECAST])[0]["content"]
    ref = ps.refiner(state, "round?", "Forecast answer: yes. Question round? gets an answer.\nVerdict: optimal")
    back = ps.backup(state, "round?", -1.0, [{"role": "user", "content": "I can't answer that."}], "pig?", FORECAST,
                     (False, -7.0))[0]["content"]
    for text in (succ, ev, ref[0]["content"], back):
        assert line in text
    assert succ.endswith("Question: round?") and ev.endswith("Question: round?")
    # the backup's real answer comes last, already as the word its target uses
    assert back.endswith("First line: Outcome: failure; Return: -7\nAnswer: can't answer")


def test_terminal_summary_says_only_what_was_observed(ps):
    assert ps.terminal_summary(0.0, -3.0, True, "[USER]\nYes! You guessed it.") == (
        "Outcome: success; Return: 0\nAnswer: correct.")
    assert ps.terminal_summary(-1.0, -7.0, False, "[USER]\nI can't answer that. You have used all 7 questions.") == (
        "Outcome: failure; Return: -1\nAnswer: can't answer. No questions left.")
    assert ps.outcome_first


def test_budget_and_no_hidden_information(ps):
    from nlac_jax.testing import tiny
    tok = tiny.make_tiny_tokenizer(vocab_size=512)
    # the longest states: every question used but one
    state = _state("owl", ["alive?", "metal?", "edible?", "heavy?", "soft?", "Is it round?"], refused=("metal",))
    long_future = "Outcome: failure; Return: -7\nAnswer: can't answer. No questions left."
    prompts = [ps.policy(state), ps.successor(state, "wooden?"), ps.evaluator(state, "wooden?", [long_future]),
               ps.refiner(state, "wooden?", "Forecast answer: can't answer. Question wooden? is wasted: ask loud?\n"
                                           "Verdict: suboptimal", ["loud?"]),
               ps.backup(state, "wooden?", -1.0, [{"role": "user", "content": "Yes."}], "pig?", long_future,
                         (True, -1.0))]
    for msgs in prompts:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert len(tok.encode(text)) < 300
        joined = " ".join(m["content"] for m in msgs)
        # the hidden object appears only as a candidate of the public "Possible now" line (the agent guessed it not)
        assert "owl" not in "\n".join(x for x in joined.split("\n") if not x.startswith("Possible now:"))
        assert "refus" not in joined.lower() and "World" not in joined
