"""The RoleSampler interface (nlac_jax.rl.roles), the trainer's ModelRoleSampler and rollout's call sites.

What matters here is that every completion carries its stop reason from the sampler to NLAC's target builder,
so a text cut off at its token budget can be refused as a training target.
"""

import math
import types

import numpy as np
import pytest

from nlac_jax import text
from nlac_jax.envs.base import EnvBase, Episode, StepResult, Task, Transition
from nlac_jax.nlac import evaluation, prompts as P
from nlac_jax.nlac.model_roles import ModelRoleSampler
from nlac_jax.rl.roles import Completion, RoleSampler, RoleSampling, ScriptedRoleSampler, check_samples, group, texts
from nlac_jax.testing import tiny

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
    greedy = RoleSampling(temperatures={"policy": 0.0})
    out = s.sample([CHAT], "policy", "c", n=2, settings=greedy)
    assert out == [Completion("#0"), cut] and texts(out) == ["#0", "half a sent"]
    call = s.calls[-1]
    assert (call.role, call.n, call.temperature) == ("c", 2, 0.0) and call.output_texts() == ["#0", "half a sent"]
    assert call.settings is greedy and s.calls[0].settings is s.settings  # no override: the sampler's own
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

    def generate(self, weights, prompts, n=1, **kw):
        self.calls.append((weights, len(prompts) * n, kw))
        rows, self.rows = self.rows[: len(prompts) * n], self.rows[len(prompts) * n:]
        lengths = np.array([len(t) for t, _ in rows])
        return types.SimpleNamespace(texts=[t for t, _ in rows], stop_reason=[r for _, r in rows],
                                     lengths=lengths, token_slots=int(2 * lengths.sum()))


def test_model_role_sampler_passes_the_stop_reason_through():
    tok = tiny.make_tiny_tokenizer()
    fake = FakeSampler([("done.", "stop_token"), ("cut off mid", "length"), ("Verdict: x", "stop_string"),
                        ("full context", "context_full")])
    roles = ModelRoleSampler(fake, tok, get_params=lambda which: f"W-{which}",
                             settings=RoleSampling(temperatures={"policy": 0.5}, max_new_tokens={"policy": 8}),
                             max_batch=3)
    out = roles.sample([CHAT, CHAT], "target", "backup", n=2,
                       settings=RoleSampling(temperatures={"policy": 0.0}, max_new_tokens={"policy": 8}))
    # before the fix the stop reasons were dropped and the caller saw four finished texts
    assert out == [Completion("done.", "stop_token"), Completion("cut off mid", "length"),
                   Completion("Verdict: x", "stop_string"), Completion("full context", "context_full")]
    assert [c.truncated for c in out] == [False, True, False, True]
    # one call (the sampler runs max_batch slots, continuous batching beyond), θ̄ requested, the call's settings
    # win over the sampler's
    assert [(w, n, kw["temperature"], kw["max_new_tokens"], kw["slots"]) for w, n, kw in fake.calls] == [
        ("W-target", 4, 0.0, 8, 3)]
    assert roles.counters.as_dict()["gen/backup/useful_token_fraction"] == 0.5
    assert fake.calls[0][2]["stop_token_ids"] == text.stop_token_ids(tok)
    assert roles.counters.stop_reasons == {"backup/stop_token": 1, "backup/length": 1, "backup/stop_string": 1,
                                           "backup/context_full": 1}
    assert roles.sample([], "policy", "policy") == []
    roles.sample([CHAT], "policy", "refiner")  # no override: the sampler's own settings ('policy' fallback)
    assert fake.calls[-1][2]["temperature"] == 0.5 and fake.calls[-1][2]["top_p"] == 1.0


def test_model_role_sampler_counts_prompt_tokens_prefilled_and_prefill_slots():
    tok = tiny.make_tiny_tokenizer()
    fake = FakeSampler([("a", "stop_token")] * 7)
    per_call = iter([(7, 64), (3, 32), None])  # (prefill_tokens, prefill_slots) the sampler reports per call

    def generate(weights, prompts, n=1, **kw):
        out = FakeSampler.generate(fake, weights, prompts, n=n, **kw)
        counts = next(per_call)
        if counts is not None:  # else a stand-in sampler that counts nothing
            out.prefill_tokens, out.prefill_slots = counts
        return out

    fake.generate = generate
    roles = ModelRoleSampler(fake, tok, get_params=lambda which: which, settings=RoleSampling(), max_batch=4)
    roles.sample([CHAT, CHAT], "policy", "successor", n=2)
    roles.sample([CHAT, CHAT], "policy", "evaluator")
    roles.sample([CHAT], "policy", "refiner")
    one = len(text.encode_chat(tok, CHAT, add_generation_prompt=True))
    d = roles.counters.as_dict()
    # presented: one presentation per sampled row (2 prompts x 2 samples, then 2 x 1)
    assert d["gen/successor/prompt_tokens"] == 4 * one and d["gen/evaluator/prompt_tokens"] == 2 * one
    assert d["gen/successor/prefill_share"] == 7 / (4 * one) and d["gen/evaluator/prefill_share"] == 3 / (2 * one)
    assert d["gen/successor/padded_prefill_share"] == 64 / (4 * one)
    assert d["gen/evaluator/padded_prefill_share"] == 32 / (2 * one)
    # a sampler that counts nothing presents nothing to the shares (its texts are still counted)
    assert "gen/refiner/prompt_tokens" not in d and d["gen/refiner/texts"] == 1
    assert d["gen/prefill_share"] == 10 / (6 * one) and d["gen/padded_prefill_share"] == 96 / (6 * one)


# ------------------------------------------------------------------------------------------ rollout call sites


def test_policy_fn_acts_on_truncated_actions_and_forwards_settings():
    s = ScriptedRoleSampler({"policy": [Completion("Action: guess 5", "length"), "Action: guess 7<|im_end|>"]})
    fn = evaluation.make_policy_fn(s, PS, settings=RoleSampling(temperatures={"policy": 0.25}))
    assert fn([CHAT, CHAT]) == ["guess 5", "guess 7"]  # the cut-off action is still played
    assert s.calls[0].temperature == 0.25 and s.calls[0].params == "policy"
    evaluation.make_policy_fn(s, PS)([CHAT])
    assert s.calls[1].settings is s.settings and s.calls[1].temperature == 1.0


class AlwaysOptimal(EnvBase):
    def reset(self, task):
        return []

    def is_action_optimal(self, state, action):
        return True


def test_critic_diagnostics_reads_completion_texts():
    state = [{"role": "user", "content": "Guess."}]
    tr = Transition(state=state, action="guess 5", reward=1.0,
                    next_state=state + [{"role": "assistant", "content": "guess 5"}], done=True)
    ep = Episode(task=Task("t0", "eval"), messages=tr.next_state, transitions=[tr], total_return=1.0,
                 success=True, length=1, num_errors=0)
    s = ScriptedRoleSampler({"successor": "It wins.\nOutcome: success; Return: 0.5",
                             "evaluator": Completion("Good.\nVerdict: optimal", "stop_string")})
    m = evaluation.critic_diagnostics([ep], s, PS, AlwaysOptimal())
    assert m["calib/n"] == 1 and m["calib/parse_rate"] == 1.0
    assert m["calib/return_mae"] == pytest.approx(0.5) and m["calib/success_accuracy"] == 1.0
    assert m["verdict/n"] == 1 and m["verdict/accuracy"] == 1.0
    assert not math.isnan(m["verdict/predicted_optimal"])


def test_critic_diagnostics_spreads_its_transitions_over_all_episodes():
    """With more transitions than the budget, the sample covers every episode, not just the first ones."""
    eps = []
    for k in range(4):  # only the last episode earns a reward (at its last step)
        state = [{"role": "user", "content": f"task {k}"}]
        trs = [Transition(state=state, action=f"a{k}.{j}", reward=float(k == 3 and j == 2),
                          next_state=state, done=j == 2) for j in range(3)]
        eps.append(Episode(task=Task(f"t{k}", "eval"), messages=state, transitions=trs, total_return=float(k == 3),
                           success=k == 3, length=3, num_errors=0))
    s = ScriptedRoleSampler({"successor": "Outcome: success; Return: 1", "evaluator": "Verdict: optimal"})
    m = evaluation.critic_diagnostics(eps, s, PS, AlwaysOptimal(), max_transitions=4)
    # evenly spaced over the 12 transitions: indices 0, 4, 7, 11 (one per episode); return-to-go 0, 0, 0, 1.
    # The first four (the old sample) would all come from episodes 0-1: mean 0.
    assert m["calib/n"] == 4 and m["calib/actual_return_to_go"] == pytest.approx(0.25)


class OneStep(EnvBase):
    """One turn, always a success: enough to drive evaluate() end to end."""

    def reset(self, task):
        return [{"role": "user", "content": f"Play {task.id}."}]

    def step(self, action_text):
        return StepResult("Correct!", 1.0, True, {"success": True})


def test_by_default_evaluation_reports_the_policy_the_critic_evaluates():
    # no eval_temperature: held-out episodes are played at the policy's sampling temperature, the policy whose
    # actions the critic is trained on and bootstraps from (collection and targets sample at it too)
    settings = RoleSampling(temperatures={"policy": 0.8, "successor": 0.6})
    assert settings.eval_temperature is None
    s = ScriptedRoleSampler({"policy": "guess 1", "successor": "Outcome: success; Return: 1"}, settings=settings)
    evaluation.evaluate([OneStep()], [Task("a", "eval")], s, PS, judge_env=None, calibration_transitions=1)
    assert [c.temperature for c in s.calls_for("policy")] == [0.8]
    evaluation.make_policy_fn(s, PS)([[{"role": "user", "content": "go"}]])  # acting during collection
    assert [c.temperature for c in s.calls_for("policy")] == [0.8, 0.8]
    assert RoleSampling().evaluation().temperature("policy") == RoleSampling().temperature("policy") == 1.0
    # greedy stays one setting away, and says so
    assert RoleSampling(eval_temperature=0).evaluation().temperature("policy") == 0.0


def test_evaluate_acts_at_the_eval_temperature_and_critiques_at_the_training_settings():
    s = ScriptedRoleSampler({"policy": "guess 1", "successor": "Outcome: success; Return: 1"},
                            settings=RoleSampling(temperatures={"policy": 0.9, "successor": 0.6}, eval_temperature=0.0))
    m, eps = evaluation.evaluate([OneStep()], [Task("a", "eval"), Task("b", "eval")], s, PS, judge_env=None,
                                 calibration_transitions=2)
    assert len(eps) == 2 and m["eval/success_rate"] == 1.0 and m["eval/calib/n"] == 2
    assert [c.temperature for c in s.calls_for("policy")] == [0.0, 0.0]  # greedy acting (one env: a call per task)
    assert [c.temperature for c in s.calls_for("successor")] == [0.6]  # the critic as trained
