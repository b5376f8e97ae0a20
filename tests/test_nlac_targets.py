"""NLAC target construction (nlac_jax.nlac.targets) through a ScriptedRoleSampler.

The scripted responses echo which prompt they were given (the action inside <action>...</action>, the round
of refinement), so the tests can follow each text from one role to the next.
"""

import dataclasses
import math
import re

import pytest

from nlac_jax.nlac import prompts as P
from nlac_jax.nlac.roles import ScriptedRoleSampler, group
from nlac_jax.nlac.targets import (
    CriticExample,
    PolicyExample,
    TargetConfig,
    TargetStats,
    build_critic_examples,
    build_nlac_examples,
    build_policy_examples,
    format_examples_for_humans,
    trainable,
    truncate_summary,
)
from nlac_jax.nlac.verdict import parse_outcome
from nlac_jax.rl.transitions import Transition

PS = P.PromptSet()
SYS = {"role": "system", "content": "Play 20 Questions: find the hidden animal."}


def conv(*turns):
    """[SYS, user, assistant, user, ...] from alternating user/assistant contents."""
    msgs = [SYS]
    for i, c in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": c})
    return msgs


def trans(qid: str, reward=0.0, done=False, success=None, episode_return=0.0, final_obs="Correct!"):
    """State ends with the user's message U-<qid>; the agent asks A-<qid>; the user answers N-<qid>."""
    state = conv("Start.", "Is it big?", f"U-{qid}")
    nxt = state + [{"role": "assistant", "content": f"A-{qid}"}, {"role": "user", "content": f"N-{qid}" if not done else final_obs}]
    info = {} if success is None else {"success": success}
    return Transition(state=state, action=f"A-{qid}", reward=reward, next_state=nxt, done=done,
                      episode_return=episode_return, info=info, task=None)


def prompt_action(messages):
    """The action inside <action>...</action> of a role prompt."""
    m = re.search(r"<action>\n(.*?)\n</action>", messages[-1]["content"], re.S)
    return m.group(1) if m else None


def last_content(messages):
    return messages[-1]["content"]


def n_attempts(messages):
    return len(re.findall(r"<attempt id=", messages[-1]["content"]))


def make_sampler(**overrides):
    responses = {
        # π_θ: acts on whatever the last environment message was
        "policy": lambda msgs, j: f"Action: POL({last_content(msgs)})<|im_end|>",
        # M: a future for the action in the prompt, sample j, ending with Return 2
        "successor": lambda msgs, j: f"FUT({prompt_action(msgs)})#{j}\nOutcome: success; Return: 2",
        # B_L: deliberately writes a WRONG final line (the builder must rewrite it to r_t + 2)
        "backup": lambda msgs, j: f"MERGED({prompt_action(msgs)})\nOutcome: failure; Return: 99",
        "evaluator": lambda msgs, j: f"CRIT({prompt_action(msgs)}): ask something sharper.\nVerdict: suboptimal",
        "refiner": lambda msgs, j: f"Refined action: REF{n_attempts(msgs) + 1}({prompt_action(msgs)})",
    }
    responses.update(overrides)
    return ScriptedRoleSampler(responses)


# ------------------------------------------------------------------------------------------ critic


def test_terminal_transitions_make_no_model_calls():
    sampler = make_sampler()
    ts = [trans("w", reward=1.0, done=True, success=True, episode_return=-3.0),
          trans("l", reward=-1.0, done=True, episode_return=-5.0, final_obs="Out of questions.")]
    stats = TargetStats()
    ex = build_critic_examples(ts, sampler, TargetConfig(critic_example_weight=0.5), PS, stats)
    assert sampler.calls == []
    assert all(isinstance(e, CriticExample) and e.terminal and e.kind == 0 and e.weight == 0.5 for e in ex)
    assert ex[0].prompt_messages == PS.successor(ts[0].state, "A-w")
    # success from info; the Return is r_t (the return from this action on), not the episode return
    assert ex[0].target_text == PS.terminal_summary(1.0, -3.0, True, "[USER]\nCorrect!")
    assert parse_outcome(ex[0].target_text) == (True, 1.0) and "Correct!" in ex[0].target_text
    # no info['success']: episode_return -5 <= success_threshold 0 -> failure
    assert parse_outcome(ex[1].target_text) == (False, -1.0) and "Out of questions." in ex[1].target_text
    assert stats.terminal_examples == 2 and stats.critic_examples == 2 and stats.sampler_calls == {}


def test_critic_backup_flow_params_and_batching():
    sampler = make_sampler()
    ts = [trans("a", reward=-1.0), trans("t", reward=1.0, done=True, success=True), trans("c", reward=0.5)]
    stats = TargetStats()
    ex = build_critic_examples(ts, sampler, TargetConfig(), PS, stats)

    # one call per role for the whole batch; θ for the next action, θ̄ for successor-of-next and backup
    assert [(c.role, c.params, len(c.messages_batch), c.n) for c in sampler.calls] == [
        ("policy", "policy", 2, 1), ("successor", "target", 2, 1), ("backup", "target", 2, 1)]
    pol, succ, bk = sampler.calls

    # a_{t+1} ~ π_θ(s_{t+1}): the policy prompt IS the next state
    assert pol.messages_batch == [PS.policy(ts[0].next_state), PS.policy(ts[2].next_state)]
    # d_{t+1} ~ M_θ̄(s_{t+1}, a_{t+1}) with the cleaned next action
    assert succ.messages_batch == [PS.successor(ts[0].next_state, "POL(N-a)"), PS.successor(ts[2].next_state, "POL(N-c)")]
    # backup sees r_t, the environment response, a_{t+1}, d_{t+1} and the exact Bellman line r_t + 2
    b0 = bk.user_texts()[0]
    for piece in ("<action>\nA-a\n</action>", "Reward for the action: -1", "[USER]\nN-a", "POL(N-a)",
                  "FUT(POL(N-a))#0", "Outcome: success; Return: 1"):
        assert piece in b0, piece
    assert "Reward for the action: 0.5" in bk.user_texts()[1] and "Outcome: success; Return: 2.5" in bk.user_texts()[1]
    assert bk.messages_batch[0] == PS.backup(ts[0].state, "A-a", -1.0, "[USER]\nN-a", "POL(N-a)",
                                             "FUT(POL(N-a))#0\nOutcome: success; Return: 2", target=(True, 1.0))

    # examples come back in input order; prompts are successor(s_t, a_t); the final line is rewritten
    assert [e.terminal for e in ex] == [False, True, False]
    assert ex[0].prompt_messages == PS.successor(ts[0].state, "A-a")
    assert ex[0].target_text == "MERGED(A-a)\nOutcome: success; Return: 1"
    assert ex[2].target_text == "MERGED(A-c)\nOutcome: success; Return: 2.5"
    assert ex[0].next_action == "POL(N-a)" and ex[0].next_future.startswith("FUT(POL(N-a))")
    assert ex[0].backup_raw.endswith("Return: 99")
    assert stats.backup_line_rewritten == 2 and stats.sampler_calls == {"policy": 1, "successor": 1, "backup": 1}


def test_one_call_per_role_regardless_of_batch_size():
    for n in (1, 7):
        sampler = make_sampler()
        build_critic_examples([trans(str(i)) for i in range(n)], sampler, TargetConfig(), PS)
        assert sampler.call_counts() == {"policy": 1, "successor": 1, "backup": 1}
        assert all(len(c.messages_batch) == n for c in sampler.calls)


def test_backup_without_line_enforcement_keeps_model_text():
    sampler = make_sampler()
    ex = build_critic_examples([trans("a", reward=-1.0)], sampler, TargetConfig(enforce_outcome_line=False), PS)
    assert ex[0].target_text == "MERGED(A-a)\nOutcome: failure; Return: 99"
    assert "final line is exactly" not in sampler.calls_for("backup")[0].user_texts()[0]


def test_backup_fallback_and_unparsable_successor():
    sampler = make_sampler(backup="", successor="a future without an outcome line")
    stats = TargetStats()
    ex = build_critic_examples([trans("a", reward=-1.0)], sampler, TargetConfig(), PS, stats)
    # empty backup -> d_{t+1}; its line unreadable -> nothing to enforce
    assert ex[0].target_text == "a future without an outcome line"
    assert stats.backup_fallbacks == 1 and stats.successor_unparsable == 1 and stats.backup_line_rewritten == 0


def test_summaries_are_truncated_keeping_the_final_line():
    long = "x" * 500 + "\nOutcome: success; Return: 2"
    sampler = make_sampler(successor=long, backup=lambda m, j: "y" * 500)
    ex = build_critic_examples([trans("a")], sampler, TargetConfig(max_summary_chars=100), PS)
    assert len(ex[0].target_text) <= 100 and ex[0].target_text.endswith("Outcome: success; Return: 2")
    assert truncate_summary("short", 100) == "short"


# ------------------------------------------------------------------------------------------ policy


def test_policy_flow_k_futures_m_rounds_all_under_theta():
    sampler = make_sampler()
    ts = [trans("a"), trans("b")]
    stats = TargetStats()
    ex = build_policy_examples(ts, sampler, TargetConfig(k_futures=3, m_refinements=2, policy_example_weight=2.0), PS, stats)

    assert [(c.role, c.params, c.n) for c in sampler.calls] == [
        ("policy", "policy", 1), ("successor", "policy", 3), ("evaluator", "policy", 1),
        ("refiner", "policy", 1), ("refiner", "policy", 1)]
    pol, succ, ev, r1, r2 = sampler.calls
    assert pol.messages_batch == [PS.policy(ts[0].state), PS.policy(ts[1].state)]
    assert succ.messages_batch == [PS.successor(ts[0].state, "POL(U-a)"), PS.successor(ts[1].state, "POL(U-b)")]
    assert group(succ.outputs, 3)[1] == [f"FUT(POL(U-b))#{j}\nOutcome: success; Return: 2" for j in range(3)]
    # the evaluator gets all k futures of ITS action
    assert ev.messages_batch[0] == PS.evaluator(ts[0].state, "POL(U-a)", [f"FUT(POL(U-a))#{j}\nOutcome: success; Return: 2" for j in range(3)])
    assert "FUT(POL(U-b))#2" in ev.user_texts()[1] and "FUT(POL(U-a))" not in ev.user_texts()[1]
    # round 1: critique, no earlier attempts; round 2: conditioned on round 1's refinement
    crit_a = "CRIT(POL(U-a)): ask something sharper.\nVerdict: suboptimal"
    assert r1.messages_batch[0] == PS.refiner(ts[0].state, "POL(U-a)", crit_a, [])
    assert r2.messages_batch[0] == PS.refiner(ts[0].state, "POL(U-a)", crit_a, ["REF1(POL(U-a))"])

    e = ex[0]
    assert isinstance(e, PolicyExample) and e.kind == 1 and e.weight == 2.0 and e.action_source == "policy"
    assert e.target_text == "REF2(POL(U-a))"  # the last round, cleaned of its label
    assert e.refinements == ["REF1(POL(U-a))", "REF2(POL(U-a))"] and not e.fallback
    assert e.verdict is False and e.critique == crit_a and len(e.futures) == 3
    # L2's prompt is the policy prompt: the critique is NOT in the policy's context
    assert e.prompt_messages == PS.policy(ts[0].state)
    assert "CRIT" not in str(e.prompt_messages) and "FUT" not in str(e.prompt_messages)
    assert stats.sampler_calls == {"policy": 1, "successor": 1, "evaluator": 1, "refiner": 2}
    assert stats.samples["successor"] == 6


def test_default_is_k1_m1_fresh_action():
    sampler = make_sampler()
    ex = build_policy_examples([trans("a")], sampler)
    assert sampler.call_counts() == {"policy": 1, "successor": 1, "evaluator": 1, "refiner": 1}
    assert sampler.calls_for("successor")[0].n == 1 and len(ex[0].futures) == 1
    assert ex[0].action == "POL(U-a)" and ex[0].target_text == "REF1(POL(U-a))"


def test_buffer_action_option():
    sampler = make_sampler()
    ts = [trans("a"), trans("b")]
    ex = build_policy_examples(ts, sampler, TargetConfig(use_buffer_action=True), PS)
    assert "policy" not in sampler.call_counts()
    assert [e.action for e in ex] == ["A-a", "A-b"] and {e.action_source for e in ex} == {"buffer"}
    assert sampler.calls_for("successor")[0].messages_batch[1] == PS.successor(ts[1].state, "A-b")
    assert ex[1].target_text == "REF1(A-b)"
    # bare message lists need explicit actions
    with pytest.raises(ValueError):
        build_policy_examples([ts[0].state], make_sampler(), TargetConfig(use_buffer_action=True), PS)
    ex2 = build_policy_examples([ts[0].state], make_sampler(), TargetConfig(use_buffer_action=True), PS, actions=["MINE"])
    assert ex2[0].action == "MINE" and ex2[0].target_text == "REF1(MINE)"


def test_verdict_stats():
    critiques = ["fine\nVerdict: optimal", "bad\nVerdict: suboptimal", "bad\n**Verdict:** not optimal", "no verdict here"]
    sampler = make_sampler(evaluator=critiques)
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(4)], sampler, TargetConfig(), PS, stats)
    assert [e.verdict for e in ex] == [True, False, False, None]
    assert (stats.verdict_optimal, stats.verdict_suboptimal, stats.verdict_unparsable) == (1, 2, 1)
    assert stats.frac_optimal == pytest.approx(1 / 3)
    d = stats.as_dict()
    assert d["nlac/frac_optimal"] == pytest.approx(1 / 3) and d["nlac/sampler_calls/evaluator"] == 1.0
    assert math.isnan(TargetStats().frac_optimal)


def test_unusable_refinement_falls_back():
    # round outputs per state: "" (empty), a special token only, too long, then a usable one
    sampler = make_sampler(refiner=["", "<|im_end|>", "z" * 50, "Action: GOOD"])
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(4)], sampler, TargetConfig(max_action_chars=20), PS, stats)
    assert [e.target_text for e in ex] == ["POL(U-0)", "POL(U-1)", "POL(U-2)", "GOOD"]
    assert [e.fallback for e in ex] == [True, True, True, False]
    assert stats.refinement_fallbacks == 3 and stats.refinements_unusable == 3 and stats.refinement_unchanged == 3


def test_unusable_later_round_keeps_earlier_refinement():
    sampler = make_sampler(refiner=["first try", ""])
    stats = TargetStats()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(m_refinements=2), PS, stats)
    assert ex[0].target_text == "first try" and not ex[0].fallback and ex[0].refinements == ["first try", ""]
    # round 2 was conditioned on round 1
    assert "first try" in sampler.calls_for("refiner")[1].user_texts()[0]
    assert stats.refinements_unusable == 1 and stats.refinement_fallbacks == 0


def test_zero_refinement_rounds_distils_the_action():
    sampler = make_sampler()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(m_refinements=0), PS)
    assert "refiner" not in sampler.call_counts() and ex[0].target_text == "POL(U-a)" and not ex[0].fallback


# ------------------------------------------------------------------------------------------ plumbing


def test_build_nlac_examples_and_human_dump():
    sampler = make_sampler()
    ts = [trans("a", reward=-1.0), trans("w", reward=1.0, done=True, success=True)]
    critic, policy, stats = build_nlac_examples(ts, sampler, TargetConfig(), PS)
    assert len(critic) == 2 and len(policy) == 2
    assert stats.critic_examples == 2 and stats.policy_examples == 2 and stats.terminal_examples == 1
    assert stats.sampler_calls == {"policy": 2, "successor": 2, "backup": 1, "evaluator": 1, "refiner": 1}
    dump = format_examples_for_humans(critic + policy, n=2)
    for piece in ("critic example 0", "bootstrapped", "terminal", "MERGED(A-a)", "policy example 1",
                  "CRIT(POL(U-w))", "REF1(POL(U-a))", "verdict=suboptimal", "    [USER]\n    U-a"):
        assert piece in dump, piece
    assert format_examples_for_humans([]) == "(no examples)"
    assert set(policy[0].to_training_dict()) == {"prompt_messages", "target_text", "kind", "weight"}


def test_per_task_prompt_sets():
    custom = P.PromptSet(task="mytask", overrides={"successor": "=== user ===\nMY SUCCESSOR {{ action }}"})
    t_my = dataclasses.replace(trans("m"), task="mytask")
    sampler = make_sampler(successor="FUT\nOutcome: success; Return: 0")
    ex = build_critic_examples([t_my, trans("d")], sampler, TargetConfig(), {"mytask": custom})
    assert ex[0].prompt_messages == [{"role": "user", "content": "MY SUCCESSOR A-m"}]
    assert ex[1].prompt_messages == PS.successor(trans("d").state, "A-d")  # default set for task None
    assert sampler.calls_for("successor")[0].messages_batch[0] == [{"role": "user", "content": "MY SUCCESSOR POL(N-m)"}]


def test_three_argument_sampler_contract_and_bad_output_length():
    class Minimal:  # docs/ARCHITECTURE.md's contract: sample(messages_batch, params, role), no `n`
        def sample(self, messages_batch, params, role):
            return ["Outcome: success; Return: 0" if role == "successor" else "x"] * len(messages_batch)

    ex = build_policy_examples([trans("a")], Minimal(), TargetConfig(), PS)
    assert ex[0].target_text == "x"

    class Short:
        def sample(self, messages_batch, params, role, n=1):
            return ["x"]

    with pytest.raises(ValueError, match="expected a flat list of 2"):
        build_critic_examples([trans("a"), trans("b")], Short(), TargetConfig(), PS)


def test_empty_targets_are_counted_and_filtered():
    sampler = make_sampler(policy="<|im_end|>", refiner="", successor="", backup="")
    stats = TargetStats()
    pol = build_policy_examples([trans("a")], sampler, TargetConfig(), PS, stats)
    crit = build_critic_examples([trans("b"), trans("w", reward=1.0, done=True)], sampler, TargetConfig(), PS, stats)
    assert pol[0].target_text == "" and pol[0].fallback and crit[0].target_text == ""
    assert stats.empty_actions == 2 and stats.empty_targets == 2
    assert trainable(pol + crit) == [crit[1]]
