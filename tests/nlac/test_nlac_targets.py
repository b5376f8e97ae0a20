"""NLAC target construction (nlac_jax.nlac.targets) through a ScriptedRoleSampler.

The scripted responses echo which prompt they were given (the action inside <action>...</action>, the round
of refinement), so the tests can follow each text from one role to the next.
"""

import dataclasses
import math
import re

import pytest

from nlac_jax.nlac import prompts as P
from nlac_jax.rl.roles import Completion, ScriptedRoleSampler, group
from nlac_jax.nlac.targets import (
    CriticExample,
    PolicyExample,
    TargetConfig,
    TargetStats,
    build_critic_examples,
    build_nlac_examples,
    build_policy_examples,
    format_examples_for_humans,
    terminal_success,
    trainable,
    truncate_summary,
)
from nlac_jax.envs.transition import Transition
from nlac_jax.nlac.verdict import parse_outcome

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


def test_success_fallback_reads_the_final_reward_like_the_return_line():
    # no info['success'], step costs of -1 (20 Questions' shape): a won game's episode return is negative,
    # but its final step's return-to-go (the Return line) is +1: success. A lost one ends at 0: failure.
    won = [trans(f"w{i}", reward=-1.0, episode_return=-2.0) for i in range(3)]
    won.append(trans("w3", reward=1.0, done=True, episode_return=-2.0))
    lost = trans("l", reward=0.0, done=True, episode_return=-4.0, final_obs="No questions left.")
    ex = build_critic_examples([won[-1], lost], make_sampler(), TargetConfig(), PS)
    assert parse_outcome(ex[0].target_text) == (True, 1.0)
    assert parse_outcome(ex[1].target_text) == (False, 0.0)
    assert terminal_success(won[-1], TargetConfig()) and not terminal_success(lost, TargetConfig())
    # the threshold applies to the same quantity: 0/-1 final rewards (success costs nothing) need it below 0
    zero_win = trans("z", reward=0.0, done=True, episode_return=-7.0)
    assert not terminal_success(zero_win, TargetConfig()) and terminal_success(zero_win, TargetConfig(success_threshold=-0.5))


def test_env_failure_transitions_are_never_critic_targets():
    # envs.BatchedRunner marks a step whose env code raised as terminal with info['env_error']
    fail = Transition(state=conv("Start.", "Is it big?", "U-f"), action="A-f", reward=0.0, done=True,
                      next_state=conv("Start.", "Is it big?", "U-f", "A-f",
                                      "Error: the environment failed on this action (X); the episode has ended."),
                      info={"error": True, "success": False, "env_error": True}, task=None)
    sampler = make_sampler()
    stats = TargetStats()
    ex = build_critic_examples([trans("a"), fail], sampler, TargetConfig(), PS, stats)
    assert [e.dropped for e in ex] == [None, "env_failure"] and trainable(ex) == [ex[0]]
    assert ex[1].target_text == "" and stats.critic_dropped_env_failure == 1 and stats.terminal_examples == 0
    assert all(len(c.messages_batch) == 1 for c in sampler.calls)  # nothing bootstraps from the dead state
    assert stats.as_dict()["nlac/frac_critic_dropped"] == 0.5
    # its state still serves the policy side
    assert build_policy_examples([fail], make_sampler(), TargetConfig(), PS)[0].dropped is None


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


@pytest.mark.parametrize("backup", ["", "   \n", "Outcome: success; Return: 1"])
def test_unusable_backup_drops_the_example_instead_of_using_the_next_future(backup):
    # formerly the target fell back to d_{t+1}: a forecast from (s_{t+1}, a_{t+1}) that lacks r_t
    sampler = make_sampler(backup=backup)
    stats = TargetStats()
    ex = build_critic_examples([trans("a", reward=-1.0), trans("w", reward=1.0, done=True)], sampler, TargetConfig(), PS, stats)
    assert ex[0].target_text == ""  # formerly d_{t+1}
    assert ex[0].dropped == "backup_empty"
    assert ex[0].next_future == "FUT(POL(N-a))#0\nOutcome: success; Return: 2" and ex[0].backup_raw == backup
    assert ex[1].dropped is None and trainable(ex) == [ex[1]]
    assert stats.critic_dropped_backup == 1 and stats.dropped_truncated == 0 and stats.critic_examples == 2
    assert stats.as_dict()["nlac/critic_dropped_backup"] == 1.0 and stats.as_dict()["nlac/frac_critic_dropped"] == 0.5


def test_unparsable_successor_line_is_not_enforced():
    sampler = make_sampler(successor="a future without an outcome line")
    stats = TargetStats()
    ex = build_critic_examples([trans("a", reward=-1.0)], sampler, TargetConfig(), PS, stats)
    assert ex[0].target_text == "MERGED(A-a)\nOutcome: failure; Return: 99" and ex[0].dropped is None
    assert stats.successor_unparsable == 1 and stats.backup_line_rewritten == 0


@pytest.mark.parametrize("reason", ["length", "context_full"])
def test_truncated_backup_is_never_a_target(reason):
    # the cut-off backup has a readable body AND a correct final line: only its stop reason condemns it
    cut = Completion("MERGED(A-a) and then the user\nOutcome: success; Return: 1", reason)
    sampler = make_sampler(backup=[cut, "MERGED(A-b)\nOutcome: success; Return: 2"])
    stats = TargetStats()
    ex = build_critic_examples([trans("a", reward=-1.0), trans("b")], sampler, TargetConfig(), PS, stats)
    assert ex[0].target_text == ""  # formerly the cut-off text itself
    assert (ex[0].dropped, ex[0].backup_stop_reason) == ("backup_truncated", reason)
    assert (ex[1].dropped, ex[1].target_text) == (None, "MERGED(A-b)\nOutcome: success; Return: 2")
    assert ex[1].backup_stop_reason == "stop_token" and trainable(ex) == [ex[1]]
    assert stats.dropped_truncated == 1 and stats.critic_dropped_backup == 1
    assert stats.as_dict()["nlac/dropped_truncated"] == 1.0
    assert "TARGET d*_t: DROPPED (backup_truncated)" in format_examples_for_humans(ex)
    assert f"BACKUP OUTPUT [cut off: {reason}]" in format_examples_for_humans(ex)


def test_stop_string_backup_is_a_target():
    sampler = make_sampler(backup=Completion("MERGED(A-a)\nOutcome: success; Return: 1", "stop_string"))
    ex = build_critic_examples([trans("a", reward=-1.0)], sampler, TargetConfig(), PS)
    assert ex[0].dropped is None and ex[0].target_text == "MERGED(A-a)\nOutcome: success; Return: 1"


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
    assert group(succ.output_texts(), 3)[1] == [f"FUT(POL(U-b))#{j}\nOutcome: success; Return: 2" for j in range(3)]
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
    assert e.refinements == ["REF1(POL(U-a))", "REF2(POL(U-a))"] and e.dropped is None
    assert e.refinement_stop_reasons == ["stop_token", "stop_token"] and e.action_stop_reason == "stop_token"
    assert e.verdict is False and e.critique == crit_a and len(e.futures) == 3
    # the paper's form: ONE critique, of a
    assert e.critiques == [crit_a] and e.critiqued_actions == ["POL(U-a)"] and stats.recritiques == 0
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


def test_unusable_refinement_of_a_rejected_action_drops_the_example():
    # round outputs per state: "" (empty), a special token only, too long, then a usable one; every verdict
    # is "suboptimal", so a rejected action must NOT become the target (formerly: fallback to a)
    sampler = make_sampler(refiner=["", "<|im_end|>", "z" * 50, "Action: GOOD"])
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(4)], sampler, TargetConfig(max_action_chars=20), PS, stats)
    assert [e.target_text for e in ex] == ["", "", "", "GOOD"]
    assert [e.dropped for e in ex] == ["rejected", "rejected", "rejected", None]
    assert trainable(ex) == [ex[3]]
    assert stats.policy_dropped_rejected == 3 and stats.refinements_unusable == 3 and stats.refinement_unchanged == 0
    assert stats.policy_dropped == 3 and stats.as_dict()["nlac/frac_policy_dropped"] == 0.75


def test_no_usable_refinement_keeps_a_only_when_judged_optimal():
    critiques = ["fine\nVerdict: optimal", "bad\nVerdict: suboptimal", "no verdict here"]
    sampler = make_sampler(evaluator=critiques, refiner="")
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(3)], sampler, TargetConfig(), PS, stats)
    assert [e.target_text for e in ex] == ["POL(U-0)", "", ""]
    assert [e.dropped for e in ex] == [None, "rejected", "verdict_unparsable"]
    assert (stats.policy_dropped_rejected, stats.policy_dropped_unparsable, stats.refinement_unchanged) == (1, 1, 1)
    assert trainable(ex) == [ex[0]]
    dump = format_examples_for_humans(ex)
    assert "TARGET aʳ: DROPPED (rejected), not trained on" in dump and "DROPPED (verdict_unparsable)" in dump
    assert "TARGET aʳ:\n    POL(U-0)" in dump


def test_refinement_equal_to_a_is_distilled_only_under_an_optimal_verdict():
    # the refiner hands a back unchanged (modulo whitespace) to every state; only the optimal verdict's a is kept
    critiques = ["fine\nVerdict: optimal", "bad\nVerdict: suboptimal", "no verdict here"]
    sampler = make_sampler(evaluator=critiques, refiner=lambda msgs, j: f"Action:  {prompt_action(msgs)} ")
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(3)], sampler, TargetConfig(), PS, stats)
    assert [e.refinements for e in ex] == [["POL(U-0)"], ["POL(U-1)"], ["POL(U-2)"]]
    assert [(e.target_text, e.dropped) for e in ex] == [
        ("POL(U-0)", None), ("", "refinement_unchanged"), ("", "refinement_unchanged")]
    assert trainable(ex) == [ex[0]]
    assert stats.refinement_unchanged_dropped == 2 and stats.refinement_unchanged == 1 and stats.policy_dropped == 2
    d = stats.as_dict()
    assert d["nlac/refinement_unchanged_dropped"] == 2.0 and d["nlac/frac_policy_dropped"] == pytest.approx(2 / 3)
    # a changed refinement of a rejected action is still the target
    ex = build_policy_examples([trans("x")], make_sampler(), TargetConfig(), PS)
    assert (ex[0].target_text, ex[0].dropped) == ("REF1(POL(U-x))", None)


def test_target_filter_drops_refused_targets_of_either_source():
    # the filter sees (state, target): it refuses the approved a of state 0 and the refinement of state 1
    seen = []

    def refuse(state, target):
        seen.append((state[-1]["content"], target))
        return target in ("POL(U-0)", "REF1(POL(U-1))")
    critiques = ["fine\nVerdict: optimal", "bad\nVerdict: suboptimal", "fine\nVerdict: optimal"]
    refiner = ["", "Action: REF1(POL(U-1))", ""]
    stats = TargetStats()
    ex = build_policy_examples([trans(str(i)) for i in range(3)], make_sampler(evaluator=critiques, refiner=refiner),
                               TargetConfig(target_filter=refuse), PS, stats)
    assert [(e.target_text, e.dropped) for e in ex] == [("", "filtered"), ("", "filtered"), ("POL(U-2)", None)]
    assert seen == [("U-0", "POL(U-0)"), ("U-1", "REF1(POL(U-1))"), ("U-2", "POL(U-2)")]
    assert trainable(ex) == [ex[2]]
    assert stats.policy_dropped_filtered == 2 and stats.policy_dropped == 2 and stats.refinement_unchanged == 1
    assert stats.as_dict()["nlac/policy_dropped_filtered"] == 2.0
    # an example dropped for another reason never reaches the filter
    seen.clear()
    build_policy_examples([trans("r")], make_sampler(refiner=""), TargetConfig(target_filter=refuse), PS)
    assert seen == []


def test_unchanged_refinement_without_a_verdict_is_dropped_when_the_critique_is_ablated():
    sampler = make_sampler(refiner=lambda msgs, j: f"Action: {prompt_action(msgs)}")
    stats = TargetStats()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(ablate_critique=True), PS, stats)
    assert (ex[0].target_text, ex[0].dropped) == ("", "refinement_unchanged") and trainable(ex) == []
    assert stats.refinement_unchanged_dropped == 1


def test_unusable_later_round_keeps_earlier_refinement():
    sampler = make_sampler(refiner=["first try", ""])
    stats = TargetStats()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(m_refinements=2), PS, stats)
    assert ex[0].target_text == "first try" and ex[0].dropped is None and ex[0].refinements == ["first try", ""]
    # round 2 was conditioned on round 1
    assert "first try" in sampler.calls_for("refiner")[1].user_texts()[0]
    assert stats.refinements_unusable == 1 and stats.policy_dropped == 0


def test_zero_refinement_rounds_distils_the_action_only_when_optimal():
    sampler = make_sampler(evaluator=["good\nVerdict: optimal", "bad\nVerdict: suboptimal"])
    ex = build_policy_examples([trans("a"), trans("b")], sampler, TargetConfig(m_refinements=0), PS)
    assert "refiner" not in sampler.call_counts()
    assert (ex[0].target_text, ex[0].dropped) == ("POL(U-a)", None)
    assert (ex[1].target_text, ex[1].dropped) == ("", "rejected")


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
    class Minimal:  # the 3-argument form: sample(messages_batch, params, role), no `n` (k = 1 never passes it)
        def sample(self, messages_batch, params, role):
            text = {"successor": "Outcome: success; Return: 0", "refiner": "y"}.get(role, "x")
            return [Completion(text, "stop_token")] * len(messages_batch)

    ex = build_policy_examples([trans("a")], Minimal(), TargetConfig(), PS)
    assert ex[0].target_text == "y"

    class Short:
        def sample(self, messages_batch, params, role, n=1):
            return [Completion("x")]

    with pytest.raises(ValueError, match="expected a flat list of 2"):
        build_critic_examples([trans("a"), trans("b")], Short(), TargetConfig(), PS)

    class Strings:  # a sampler that drops its stop reasons is refused, not trusted
        def sample(self, messages_batch, params, role, n=1):
            return ["x"] * len(messages_batch) * n

    with pytest.raises(TypeError, match="expected Completion"):
        build_critic_examples([trans("a")], Strings(), TargetConfig(), PS)


def test_degenerate_samples_are_dropped_and_filtered():
    sampler = make_sampler(policy="<|im_end|>", refiner="", successor="", backup="",
                           evaluator="empty but fine\nVerdict: optimal")
    stats = TargetStats()
    pol = build_policy_examples([trans("a")], sampler, TargetConfig(), PS, stats)
    crit = build_critic_examples([trans("b"), trans("w", reward=1.0, done=True)], sampler, TargetConfig(), PS, stats)
    # judged optimal, but a is empty: nothing to distil
    assert (pol[0].target_text, pol[0].dropped) == ("", "action_unusable")
    assert (crit[0].target_text, crit[0].dropped) == ("", "backup_empty")
    assert stats.empty_actions == 2 and stats.policy_dropped_action == 1 and stats.critic_dropped_backup == 1
    assert trainable(pol + crit) == [crit[1]]


# ------------------------------------------------------------------------------------------ cut-off generations


@pytest.mark.parametrize("reason", ["length", "context_full"])
def test_truncated_refinement_is_never_a_target(reason):
    # state 0's refinement was cut off, state 1's finished; both verdicts are "suboptimal"
    sampler = make_sampler(refiner=[Completion("Refined action: Is it a mammal that", reason), "Action: Is it a cat?"])
    stats = TargetStats()
    ex = build_policy_examples([trans("a"), trans("b")], sampler, TargetConfig(), PS, stats)
    assert ex[0].target_text == ""  # formerly the cut-off refinement
    assert ex[0].dropped == "rejected"  # the cut-off text was its only refinement
    assert ex[0].refinements == ["Is it a mammal that"] and ex[0].refinement_stop_reasons == [reason]
    assert (ex[1].target_text, ex[1].dropped) == ("Is it a cat?", None)
    assert stats.dropped_truncated == 1 and stats.refinements_unusable == 1 and stats.policy_dropped_rejected == 1
    assert f"REFINEMENT round 1 [cut off: {reason}]" in format_examples_for_humans(ex)


def test_truncated_later_round_keeps_the_earlier_refinement_and_is_not_shown_again():
    sampler = make_sampler(refiner=["first try", Completion("second try, cut", "length"), "third try"])
    stats = TargetStats()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(m_refinements=2), PS, stats)
    assert ex[0].target_text == "first try" and ex[0].dropped is None
    assert stats.dropped_truncated == 1
    ex = build_policy_examples([trans("a")], make_sampler(refiner=[Completion("cut", "length"), "whole"]),
                               TargetConfig(m_refinements=2), PS)
    assert ex[0].target_text == "whole"


def test_truncated_fresh_action_is_acted_on_and_refined_but_never_a_target():
    cut = Completion("Action: Is it bigger than a", "length")
    # judged optimal, no usable refinement: formerly the cut-off a was the target
    sampler = make_sampler(policy=cut, evaluator="fine\nVerdict: optimal", refiner="")
    stats = TargetStats()
    ex = build_policy_examples([trans("a")], sampler, TargetConfig(), PS, stats)
    assert ex[0].action == "Is it bigger than a" and ex[0].target_text == ""  # formerly the cut-off a
    assert (ex[0].dropped, ex[0].action_stop_reason) == ("action_truncated", "length")
    assert stats.dropped_truncated == 1 and stats.policy_dropped_action == 1 and trainable(ex) == []
    # it was still critiqued
    assert "Is it bigger than a" in sampler.calls_for("evaluator")[0].user_texts()[0]
    assert "ACTION a [cut off: length]" in format_examples_for_humans(ex)
    # a finished refinement of the cut-off action is a fine target
    ex = build_policy_examples([trans("a")], make_sampler(policy=cut, refiner="Action: Is it a dog?"), TargetConfig(), PS)
    assert (ex[0].target_text, ex[0].dropped) == ("Is it a dog?", None)


def test_truncated_next_action_still_feeds_the_backup():
    sampler = make_sampler(policy=Completion("Action: Is it a", "length"))
    ex = build_critic_examples([trans("a", reward=-1.0)], sampler, TargetConfig(), PS)
    assert ex[0].next_action == "Is it a" and ex[0].dropped is None
    assert ex[0].target_text == "MERGED(A-a)\nOutcome: success; Return: 1"


# ------------------------------------------------------------------------------------------ re-critique


def test_recritique_evaluates_each_new_refinement():
    # round 1: state a gets a usable refinement, state b an empty one; round 2: both usable
    sampler = make_sampler(refiner=["Action: R1a", "", "Action: R2a", "Action: R2b"])
    stats = TargetStats()
    cfg = TargetConfig(k_futures=2, m_refinements=2, recritique=True)
    ex = build_policy_examples([trans("a"), trans("b")], sampler, cfg, PS, stats)

    assert [(c.role, len(c.messages_batch), c.n) for c in sampler.calls] == [
        ("policy", 2, 1), ("successor", 2, 2), ("evaluator", 2, 1), ("refiner", 2, 1),
        ("successor", 1, 2), ("evaluator", 1, 1), ("refiner", 2, 1)]  # only a's new refinement is re-critiqued
    s_a, s_b = trans("a").state, trans("b").state
    assert sampler.calls[4].messages_batch == [PS.successor(s_a, "R1a")]
    futs = [f"FUT(R1a)#{j}\nOutcome: success; Return: 2" for j in range(2)]
    assert sampler.calls[5].messages_batch == [PS.evaluator(s_a, "R1a", futs)]
    crit_a = "CRIT(POL(U-a)): ask something sharper.\nVerdict: suboptimal"
    crit_r1 = "CRIT(R1a): ask something sharper.\nVerdict: suboptimal"
    crit_b = "CRIT(POL(U-b)): ask something sharper.\nVerdict: suboptimal"
    # round 2: a's refiner improves R1a under R1a's critique; b (nothing new) refines b under its first critique
    assert sampler.calls[6].messages_batch == [PS.refiner(s_a, "R1a", crit_r1, []), PS.refiner(s_b, "POL(U-b)", crit_b, [])]
    assert sampler.calls[3].messages_batch == [PS.refiner(s_a, "POL(U-a)", crit_a, []), PS.refiner(s_b, "POL(U-b)", crit_b, [])]

    assert ex[0].target_text == "R2a" and ex[1].target_text == "R2b"
    assert ex[0].critique == crit_a and ex[0].verdict is False
    assert ex[0].critiques == [crit_a, crit_r1] and ex[0].critiqued_actions == ["POL(U-a)", "R1a"]
    assert ex[1].critiques == [crit_b] and ex[1].critiqued_actions == ["POL(U-b)"]
    # verdict counters stay about a; re-critiques are counted on their own
    assert (stats.verdict_suboptimal, stats.recritiques) == (2, 1)
    assert stats.sampler_calls == {"policy": 1, "successor": 2, "evaluator": 2, "refiner": 2}
    assert "RE-CRITIQUE 1 of:\n    R1a" in format_examples_for_humans(ex)


def test_recritique_off_by_default_and_the_same_as_chaining_for_m1():
    assert TargetConfig().recritique is False
    a, b = make_sampler(), make_sampler()
    ex_a = build_policy_examples([trans("a")], a, TargetConfig(), PS)
    ex_b = build_policy_examples([trans("a")], b, TargetConfig(recritique=True), PS)
    assert [c.messages_batch for c in a.calls] == [c.messages_batch for c in b.calls]
    assert ex_a[0].target_text == ex_b[0].target_text == "REF1(POL(U-a))"


# ------------------------------------------------------------------------------------------ critique ablation


def test_ablated_critique_skips_the_critic_and_keeps_only_refinements():
    sampler = make_sampler(refiner=["Action: better", ""], evaluator="fine\nVerdict: optimal")
    stats = TargetStats()
    cfg = TargetConfig(ablate_critique=True)
    ex = build_policy_examples([trans("a"), trans("b")], sampler, cfg, PS, stats)
    assert sampler.call_counts() == {"policy": 1, "refiner": 1}
    text = "No critique is available for this action."
    assert cfg.ablated_critique_text == text
    assert sampler.calls_for("refiner")[0].messages_batch == [PS.refiner(trans("a").state, "POL(U-a)", text, []),
                                                               PS.refiner(trans("b").state, "POL(U-b)", text, [])]
    assert (ex[0].target_text, ex[0].dropped, ex[0].verdict) == ("better", None, None)
    assert (ex[1].target_text, ex[1].dropped) == ("", "no_verdict")  # no verdict: a is never the target
    assert ex[0].futures == [] and ex[0].critiques == [] and ex[0].critique_ablated
    assert (stats.verdict_optimal, stats.verdict_suboptimal, stats.verdict_unparsable) == (0, 0, 0)
    assert stats.policy_dropped_no_verdict == 1 and stats.policy_dropped_unparsable == 0
    assert "verdict=ablated" in format_examples_for_humans(ex)


def test_config_rejects_contradictory_switches():
    with pytest.raises(ValueError, match="ablate_critique needs m_refinements"):
        TargetConfig(ablate_critique=True, m_refinements=0)
    with pytest.raises(ValueError, match="exclude each other"):
        TargetConfig(ablate_critique=True, recritique=True)


def test_allow_truncated_targets_is_an_explicit_opt_in_for_plumbing_runs():
    cut = lambda t: Completion(t, "length")  # noqa: E731
    sampler = make_sampler(policy=cut("Action: ask"), backup=cut("MERGED so far"), refiner=cut("Action: better"))
    cfg = TargetConfig(allow_truncated_targets=True)
    stats = TargetStats()
    crit = build_critic_examples([trans("a", reward=-1.0)], sampler, cfg, PS, stats)
    pol = build_policy_examples([trans("a")], sampler, cfg, PS, stats)
    assert crit[0].target_text == "MERGED so far\nOutcome: success; Return: 1" and crit[0].dropped is None
    assert pol[0].target_text == "better" and pol[0].dropped is None
    assert stats.dropped_truncated == 0 and TargetConfig().allow_truncated_targets is False
