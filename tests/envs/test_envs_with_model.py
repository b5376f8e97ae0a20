"""Every environment played by the batched runner with a tiny random model through the real sampler.

The random policy's text is mostly unparsable, which is exactly what must never crash an episode: it becomes
error observations. The 20Q model oracle and the τ-bench model user are served by the same tiny model.
"""

import importlib.util

import pytest

from nlac_jax import envs, models, sampling
from nlac_jax.runner.building import build_model
from nlac_jax.nlac import evaluation, model_roles, prompts as prompts_lib
from nlac_jax.rl import rollout
from nlac_jax.rl.roles import RoleSampling

HAVE_TAU = importlib.util.find_spec("tau2") is not None


@pytest.fixture(scope="module")
def roles():
    cfg, tok, _ = build_model()
    m = models.random_model(cfg, seed=0)
    sampler = sampling.Sampler(cfg)
    r = model_roles.ModelRoleSampler(sampler, tok, get_params=lambda which: m.params,
                                     settings=RoleSampling(temperatures={"policy": 1.0}, max_new_tokens={"policy": 12}),
                                     seed=0)
    r.start_phase(0)
    return r


def _oracle_fn(roles):
    # model-backed oracle/user: plain prompts or chat histories -> replies, from the same tiny model
    def fn(requests):
        chats = [[{"role": "user", "content": q}] if isinstance(q, str) else q for q in requests]
        return [c.text for c in roles.sample(chats, "target", "oracle")]
    return fn


CASES = [("toy", {}), ("twenty_questions", {"oracle": "scripted"}), ("twenty_questions", {"oracle": "model"}),
         ("math", {})]
if HAVE_TAU:
    CASES += [("tau_retail", {"user": "scripted"}), ("tau_airline", {"user": "model"})]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{'-'.join(kw.values()) or 'default'}" for n, kw in CASES])
def test_env_runs_with_tiny_model(roles, name, kw):
    factory = envs.make_env_factory(name, max_turns=None if name == "math" else 3, **kw)
    source = envs.make_task_source(name)
    tasks = source.tasks(source.train_split)[:3]
    pool = factory.make(2, _oracle_fn(roles))
    policy = evaluation.make_policy_fn(roles, prompts_lib.PromptSet(task=name))
    episodes, transitions = rollout.collect(pool, tasks, policy, task_name=name, max_turns=3)
    assert len(episodes) == 3 and all(1 <= ep.length <= 3 for ep in episodes)
    assert len(transitions) == sum(ep.length for ep in episodes)
    for ep in episodes:
        assert ep.transitions[-1].done or ep.truncated
        assert ep.messages[-1]["role"] in ("user", "assistant")
        # each action went through the sampler: the history alternates agent turns and observations
        assert [m["role"] for m in ep.messages].count("assistant") == ep.length
    assert all(t.task == name for t in transitions)
