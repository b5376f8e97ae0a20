"""The RoleSampler interface (nlac_jax.nlac.roles), the trainer's ModelRoleSampler and rollout's call sites.

What matters here is that every completion carries its stop reason from the sampler to NLAC's target builder,
so a text cut off at its token budget can be refused as a training target.
"""

import math
import types

import numpy as np
import pytest

from nlac_jax import text, tiny
from nlac_jax.envs.base import EnvBase, Episode, Task, Transition
from nlac_jax.nlac import prompts as P
from nlac_jax.nlac.model_roles import ModelRoleSampler
from nlac_jax.nlac.roles import Completion, RoleSampler, ScriptedRoleSampler, check_samples, group, texts
from nlac_jax.rl import rollout

PS = P.PromptSet()
CHAT = [{"role": "user", "content": "Hello?"}]


# ------------------------------------------------------------------------------------------ Completion


def test_completion_truncated_property_and_validation():
    assert [Completion("x", r).truncated for r in ("stop_token", "stop_string", "length", "context_full")] == [
        False, False, True, True]
    assert Completion("x") == Completion("x", "stop_token")
    with pytest.raises(ValueError, match="stop_reason"):
        Completion("x", "eos")
    with pytest.raises(Exception):  # frozen
        Completion("x").text = "y"


def test_scripted_sampler_returns_completions_with_scripted_stop_reasons():
    cut = Completion("half a sent", "length")
    s = ScriptedRoleSampler({"a": "plain", "b": ["one", cut], "c": lambda m, j: cut if j else f"#{j}"})
    assert isinstance(s, RoleSampler)
    assert s.sample([CHAT], "policy", "a") == [Completion("plain", "stop_token")]
    assert s.sample([CHAT, CHAT], "target", "b") == [Completion("one"), cut]
    out = s.sample([CHAT], "policy", "c", n=2, temperature=0.0)
    assert out == [Completion("#0"), cut] and texts(out) == ["#0", "half a sent"]
    call = s.calls[-1]
    assert (call.role, call.n, call.temperature) == ("c", 2, 0.0) and call.output_texts() == ["#0", "half a sent"]
    assert group(out, 2) == [[Completion("#0"), cut]]


def test_check_samples_refuses_plain_strings_and_wrong_lengths():
    ok = [Completion("a"), Completion("b", "length")]
    assert check_samples(ok, 2, "r") == ok
    with pytest.raises(ValueError, match="expected a flat list of 3"):
        check_samples(ok, 3, "r")
    with pytest.raises(TypeError, match="expected Completion"):
        check_samples(["a", "b"], 2, "r")


# ------------------------------------------------------------------------------------------ ModelRoleSampler


class FakeSampler:
    """Stands in for sampling.Sampler: returns canned texts and stop reasons, records its arguments."""

    def __init__(self, rows):
        self.rows = list(rows)  # (text, stop_reason) in call order
        self.calls = []

    def generate(self, weights, prompts, **kw):
        self.calls.append((weights, len(prompts), kw))
        rows, self.rows = self.rows[: len(prompts)], self.rows[len(prompts):]
        return types.SimpleNamespace(texts=[t for t, _ in rows], stop_reason=[r for _, r in rows],
                                     lengths=np.array([len(t) for t, _ in rows]))


def test_model_role_sampler_passes_the_stop_reason_through():
    tok = tiny.make_tiny_tokenizer()
    fake = FakeSampler([("done.", "stop_token"), ("cut off mid", "length"), ("Verdict: x", "stop_string"),
                        ("full context", "context_full")])
    roles = ModelRoleSampler(fake, tok, get_params=lambda which: f"W-{which}", temperatures={"policy": 0.5},
                             max_new_tokens={"policy": 8}, max_batch=3)
    out = roles.sample([CHAT, CHAT], "target", "backup", n=2, temperature=0.0)
    # before the fix the stop reasons were dropped and the caller saw four finished texts
    assert out == [Completion("done.", "stop_token"), Completion("cut off mid", "length"),
                   Completion("Verdict: x", "stop_string"), Completion("full context", "context_full")]
    assert [c.truncated for c in out] == [False, True, False, True]
    # split by max_batch, θ̄ requested, the explicit temperature wins over the role's
    assert [(w, n, kw["temperature"], kw["max_new_tokens"]) for w, n, kw in fake.calls] == [
        ("W-target", 3, 0.0, 8), ("W-target", 1, 0.0, 8)]
    assert fake.calls[0][2]["stop_token_ids"] == text.stop_token_ids(tok)
    assert roles.counters.stop_reasons == {"backup/stop_token": 1, "backup/length": 1, "backup/stop_string": 1,
                                           "backup/context_full": 1}
    assert roles.sample([], "policy", "policy") == []


# ------------------------------------------------------------------------------------------ rollout call sites


def test_policy_fn_acts_on_truncated_actions_and_forwards_temperature():
    s = ScriptedRoleSampler({"policy": [Completion("Action: guess 5", "length"), "Action: guess 7<|im_end|>"]})
    fn = rollout.make_policy_fn(s, PS, temperature=0.25)
    assert fn([CHAT, CHAT]) == ["guess 5", "guess 7"]  # the cut-off action is still played
    assert s.calls[0].temperature == 0.25 and s.calls[0].params == "policy"
    rollout.make_policy_fn(s, PS)([CHAT])
    assert s.calls[1].temperature is None


class AlwaysOptimal(EnvBase):
    def reset(self, task):
        return []

    def is_action_optimal(self, state, action):
        return True


def test_critic_diagnostics_reads_completion_texts():
    state = [{"role": "user", "content": "Guess."}]
    tr = Transition(state_messages=state, action="guess 5", reward=1.0,
                    next_state_messages=state + [{"role": "assistant", "content": "guess 5"}], done=True)
    ep = Episode(task=Task("t0", "eval"), messages=tr.next_state_messages, transitions=[tr], total_return=1.0,
                 success=True, length=1, num_errors=0)
    s = ScriptedRoleSampler({"successor": "It wins.\nOutcome: success; Return: 0.5",
                             "evaluator": Completion("Good.\nVerdict: optimal", "stop_string")})
    m = rollout.critic_diagnostics([ep], s, PS, AlwaysOptimal())
    assert m["calib/n"] == 1 and m["calib/parse_rate"] == 1.0
    assert m["calib/return_mae"] == pytest.approx(0.5) and m["calib/success_accuracy"] == 1.0
    assert m["verdict/n"] == 1 and m["verdict/accuracy"] == 1.0
    assert not math.isnan(m["verdict/predicted_optimal"])


def test_critic_diagnostics_spreads_its_transitions_over_all_episodes():
    """With more transitions than the budget, the sample covers every episode, not just the first ones."""
    eps = []
    for k in range(4):  # only the last episode earns a reward (at its last step)
        state = [{"role": "user", "content": f"task {k}"}]
        trs = [Transition(state_messages=state, action=f"a{k}.{j}", reward=float(k == 3 and j == 2),
                          next_state_messages=state, done=j == 2) for j in range(3)]
        eps.append(Episode(task=Task(f"t{k}", "eval"), messages=state, transitions=trs, total_return=float(k == 3),
                           success=k == 3, length=3, num_errors=0))
    s = ScriptedRoleSampler({"successor": "Outcome: success; Return: 1", "evaluator": "Verdict: optimal"})
    m = rollout.critic_diagnostics(eps, s, PS, AlwaysOptimal(), max_transitions=4)
    # evenly spaced over the 12 transitions: indices 0, 4, 7, 11 (one per episode); return-to-go 0, 0, 0, 1.
    # The first four (the old sample) would all come from episodes 0-1: mean 0.
    assert m["calib/n"] == 4 and m["calib/actual_return_to_go"] == pytest.approx(0.25)
