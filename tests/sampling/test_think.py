"""Reasoning models' <think>...</think>: never in an action or another role's prompt, kept in training targets
only with nlac.TargetConfig.keep_reasoning; hostile output (unclosed, nested, huge) neither crashes nor hangs."""

import time

import pytest

from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
from nlac_jax.envs.transition import Transition
from nlac_jax.nlac import prompts as P
from nlac_jax.nlac.evaluation import make_policy_fn
from nlac_jax.nlac.targets import TargetConfig, build_critic_examples, build_policy_examples
from nlac_jax.nlac.verdict import clean_action, parse_outcome, parse_verdict, split_think, strip_think
from nlac_jax.rl import rollout
from nlac_jax.rl.roles import Completion, ScriptedRoleSampler

PS = P.PromptSet()


# ------------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("text, answer, closed", [
    ("<think>\nlet me see: 8?\n</think>\n\n8", "\n\n8", True),
    ("plan: bisect\n</think>\n\n8", "\n\n8", True),              # QwQ: the template opened <think> in the prompt
    ("8", "8", True),                                              # no reasoning at all
    ("<think>a<think>b</think>c</think>7", "7", True),              # nested: the answer follows the LAST close
    ("<think>a</think>b<think>c</think>5", "5", True),              # two blocks: the final answer
    ("<think>still thinking about 8", "", False),                    # unclosed: no answer
    ("<think>a</think> 4 <think>more", "", False),                   # a block opened after the answer
    ("", "", True),
])
def test_split_think(text, answer, closed):
    reasoning, got, ok = split_think(text)
    assert (got, ok) == (answer, closed)
    if closed:
        assert reasoning + got == text  # nothing lost: reasoning is the verbatim prefix


def test_clean_action_drops_reasoning():
    assert clean_action("<think>\nThe range is 1-16, Action: 3 would be bad.\nExplanation: no\n</think>\n\n8") == "8"
    assert clean_action("bisect\n</think>\n\nAction: 8<|im_end|>") == "8"
    assert clean_action("<think>I guess 8") == ""                      # unclosed: no action
    assert clean_action("<think><think>x</think>") == ""              # still one open
    assert clean_action("8") == "8"                                   # plain models: unchanged


def _time(fn, *args):
    # CPU seconds of this thread: a loaded machine stretches wall time, not this
    t0 = time.thread_time()
    fn(*args)
    return time.thread_time() - t0


@pytest.mark.parametrize("hostile", [
    "<think>" * 200_000,                                              # 1.4 MB of openings
    "<think>" + "x" * 2_000_000,                                        # huge unclosed reasoning
    "</think>" * 200_000 + "8",
    "Verdict" + " " * 50_000,                                          # was quadratic
    "Outcome" + " " * 50_000 + "x",
    "Return:" + " " * 50_000 + "x",
    "\n" * 50_000,
    "Action" + " " * 50_000 + "x",
    " " * 50_000 + "Action x",
])
def test_hostile_output_is_fast(hostile):
    """Every parser a model output meets is linear: each input takes milliseconds (before, parse_verdict took 30 s
    and parse_outcome 15 s on the 50,000-space cases: adjacent quantifiers over the same spaces). The 5 s guard
    separates the two by orders of magnitude either way, so a loaded machine cannot trip it."""
    for fn in (clean_action, strip_think, parse_verdict, parse_outcome):
        assert _time(fn, hostile) < 5.0, fn.__name__


# ------------------------------------------------------------------------------------------ acting
def test_unclosed_think_reaches_the_env_as_an_empty_action():
    """The env gets "" for an unclosed <think> and answers with its error observation; the episode goes on."""
    env = GuessNumberEnv(n=8)
    task = GuessNumberTaskSource(n=8).tasks("test")[0]
    target = int(task.payload["target"])
    sampler = ScriptedRoleSampler({"policy": ["<think>hmm, maybe " + "very " * 5000,
                                              f"<think>it is {target}</think>\n\n{target}"]})
    episodes, transitions = rollout.collect([env], [task], make_policy_fn(sampler, PS))
    first, second = transitions[0], transitions[1]
    assert first.action == "" and first.info["error"] and "Error" in first.next_state[-1]["content"]
    assert second.action == str(target) and episodes[0].success
    assert all("<think>" not in m["content"] and "</think>" not in m["content"]
               for m in episodes[0].messages if m["role"] == "assistant")


# ------------------------------------------------------------------------------------------ targets
SYS = {"role": "system", "content": "Guess the number."}


def _transition(done=False):
    state = [SYS, {"role": "user", "content": "Guess."}]
    nxt = state + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "higher"}]
    return Transition(state=state, action="4", reward=0.0, next_state=nxt, done=done, episode_return=0.0,
                      info={}, task=None)


def _sampler(**over):
    responses = {
        "policy": "<think>halfway is 8</think>\n\n8",
        "successor": "<think>Outcome: failure; Return: 0 (a thought, not the forecast)</think>\n"
                     "It wins soon.\nOutcome: success; Return: 1",
        "backup": "<think>r + R = 1</think>\n\nAfter 4 it finds the number.\nOutcome: success; Return: 1",
        "evaluator": "<think>Verdict: optimal (just thinking)</think>\nToo low; 8 is the middle.\nVerdict: suboptimal",
        "refiner": "<think>take the critique's 8</think>\n\n8",
    }
    responses.update(over)
    return ScriptedRoleSampler(responses)


def _prompt_texts(sampler):
    return [m["content"] for call in sampler.calls for msgs in call.messages_batch for m in msgs]


@pytest.mark.parametrize("keep", [False, True])
def test_targets_keep_or_drop_reasoning(keep):
    cfg = TargetConfig(keep_reasoning=keep)
    # a ~ π is 4 and the refinement 8: a refinement equal to a rejected a would be dropped (tested elsewhere)
    sampler = _sampler(policy="<think>start low</think>\n\n4")
    critic = build_critic_examples([_transition()], sampler, cfg, PS)[0]
    policy = build_policy_examples([_transition()], sampler, cfg, PS)[0]
    assert not critic.dropped and not policy.dropped
    assert critic.target_text.endswith("After 4 it finds the number.\nOutcome: success; Return: 1")
    assert policy.target_text.endswith("8") and policy.critique.endswith("Verdict: suboptimal")
    assert policy.verdict is False  # the answer's verdict, not the one inside the reasoning
    if keep:
        assert critic.target_text.startswith("<think>r + R = 1</think>\n\n")
        assert policy.target_text == "<think>take the critique's 8</think>\n\n8"
    else:
        assert "think" not in critic.target_text and policy.target_text == "8"
    # no role ever reads another role's reasoning
    assert not any("<think>" in t or "</think>" in t for t in _prompt_texts(sampler))


def test_keep_reasoning_target_is_the_policy_own_when_a_is_distilled():
    """m = 0 and a judged optimal: the target is a, with the policy's own reasoning under keep_reasoning."""
    sampler = _sampler(evaluator="Fine.\nVerdict: optimal")
    ex = build_policy_examples([_transition()], sampler, TargetConfig(m_refinements=0, keep_reasoning=True), PS)[0]
    assert ex.target_text == "<think>halfway is 8</think>\n\n8"


def test_unclosed_think_gives_no_backup_and_no_refinement():
    sampler = _sampler(backup=Completion("<think>" + "r " * 3000, "length"),
                       refiner="<think>I would guess 8 but")
    cfg = TargetConfig(keep_reasoning=True)
    critic = build_critic_examples([_transition()], sampler, cfg, PS)[0]
    policy = build_policy_examples([_transition()], sampler, cfg, PS)[0]
    assert critic.dropped in ("backup_truncated", "backup_empty") and critic.target_text == ""
    # no usable refinement and a verdict of suboptimal: dropped, never the unfinished thought
    assert policy.dropped == "rejected" and policy.target_text == ""
    sampler = _sampler(backup="<think>never closed, no Outcome line")
    assert build_critic_examples([_transition()], sampler, cfg, PS)[0].dropped == "backup_empty"


def test_keep_reasoning_is_checked():
    with pytest.raises(TypeError, match="keep_reasoning = 'False'"):
        TargetConfig(keep_reasoning="False")
