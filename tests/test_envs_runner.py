"""BatchedRunner, TaskCursor, pass^k, factories and gin wiring."""

import json

import gin
import pytest

import nlac_jax.envs as envs
from nlac_jax.envs.base import BatchedRunner, ListTaskSource, Task, pass_hat_k
from nlac_jax.envs.toy import GuessNumberEnv, binary_search_policy


def test_batched_runner_mixed_lengths_and_transitions():
    n = 16
    targets = [8, 1, 16, 5, 12]  # binary search on [1,16] (8 first) takes 1, 4, 5, 4, 2 guesses
    tasks = [Task(f't{x}', 'test', {'target': x, 'n': n}) for x in targets]
    calls = []

    def policy_fn(histories):
        calls.append(len(histories))
        out = []
        for h in histories:
            # the 4th episode (target 5) opens with a malformed action (no number), costing it one extra turn
            if len(calls) == 1 and len(out) == 3:
                out.append('hmm, not sure')
            else:
                out.append(binary_search_policy(h, n))
        return out

    envs_ = [GuessNumberEnv(n=n, max_turns=6) for _ in tasks]
    eps = BatchedRunner(envs_, policy_fn).run(tasks)
    lengths = [e.length for e in eps]
    assert lengths == [1, 4, 5, 5, 2], lengths
    assert calls == [5, 4, 3, 3, 2]  # one batched call per turn, over the still-active episodes only
    for e in eps:
        assert e.success and e.total_return == 1.0 and not e.truncated
        assert len(e.transitions) == e.length
        for t, tr in enumerate(e.transitions):
            assert tr.done == (t == e.length - 1)
            assert tr.reward == (1.0 if t == e.length - 1 else 0.0)
            # s_{t+1} = s_t + [a_t, o_t]; s_{t+1} of step t is s_t of step t+1
            assert tr.next_state_messages[:len(tr.state_messages)] == tr.state_messages
            assert tr.next_state_messages[len(tr.state_messages)] == {'role': 'assistant', 'content': tr.action}
            assert tr.next_state_messages[-1]['role'] == 'user'
            if t + 1 < e.length:
                assert e.transitions[t + 1].state_messages == tr.next_state_messages
        assert e.transitions[-1].next_state_messages == e.messages
        assert e.transitions[0].state_messages[0]['role'] == 'system'
    assert [e.num_errors for e in eps] == [0, 0, 0, 1, 0]
    assert eps[3].transitions[0].info['error'] and eps[3].transitions[0].next_state_messages[-1][
        'content'].startswith('Error')
    m = envs.episode_metrics(eps)
    assert m['success_rate'] == 1.0 and m['mean_length'] == pytest.approx(17 / 5)


def test_runner_pool_smaller_than_tasks_and_truncation():
    n = 100
    tasks = [Task(f't{x}', 'test', {'target': x, 'n': n}) for x in (50, 1, 99, 25, 75, 3, 60)]
    sizes = []

    def policy_fn(hs):
        sizes.append(len(hs))
        return [binary_search_policy(h, n) for h in hs]

    eps = BatchedRunner([GuessNumberEnv(n=n) for _ in range(3)], policy_fn, max_turns=3).run(tasks)
    assert [e.task.id for e in eps] == [t.id for t in tasks]  # results in task order
    assert max(sizes) == 3
    assert eps[0].success and eps[0].length == 1
    assert eps[3].success and eps[3].length == 2 and eps[4].success
    for e in (eps[1], eps[2], eps[5], eps[6]):
        assert e.truncated and e.length == 3 and not e.success
        assert e.transitions[-1].done is False and e.transitions[-1].info['truncated']


def test_runner_rejects_wrong_batch():
    with pytest.raises(ValueError, match='returned 0 actions for 1'):
        BatchedRunner([GuessNumberEnv(n=4)], lambda hs: []).run([Task('a', 's', {'target': 1, 'n': 4})])


def test_cursor_deterministic_and_resumable():
    src = ListTaskSource({'train': [Task(str(i), 'train', {}) for i in range(7)]})
    a = src.iterate('train', seed=3)
    first = [t.id for t in a.take(10)]
    assert sorted(first[:7]) == [str(i) for i in range(7)]  # one full epoch = a permutation
    assert first == [t.id for t in src.iterate('train', seed=3).take(10)]
    assert first != [t.id for t in src.iterate('train', seed=4).take(10)]
    state = json.loads(json.dumps(a.state_dict()))
    rest = [t.id for t in a.take(9)]
    b = src.iterate('train', seed=0, state=state)
    assert [t.id for t in b.take(9)] == rest
    two = ListTaskSource({'train': [Task('a', 'train', {})], 'test': [Task('b', 'test', {})]})
    with pytest.raises(ValueError, match="not 'test'"):
        two.iterate('test', state=state)


def test_pass_hat_k():
    # task A: 2/4 successes, task B: 4/4
    assert pass_hat_k([[1, 1, 0, 0], [1, 1, 1, 1]], 1) == pytest.approx((0.5 + 1) / 2)
    assert pass_hat_k([[1, 1, 0, 0], [1, 1, 1, 1]], 2) == pytest.approx((1 / 6 + 1) / 2)
    assert pass_hat_k([[1, 1, 0, 0], [1, 1, 1, 1]], 4) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_hat_k([[1]], 2)


def test_factories_and_errors():
    with pytest.raises(ValueError, match="unknown env_name 'chess'"):
        envs.make_env_factory('chess')
    with pytest.raises(ValueError, match="needs a generate_fn"):
        envs.make_env_factory('twenty_questions', oracle='model')()
    with pytest.raises(FileNotFoundError, match='/nope/objects.json'):
        envs.make_env_factory('twenty_questions', object_list_path='/nope/objects.json')()
    e = envs.make_env_factory('toy', max_turns=3)()
    assert isinstance(e, envs.GuessNumberEnv) and e.max_turns == 3
    assert isinstance(envs.make_env_factory('math')(), envs.MathEnv)
    src = envs.make_task_source('math')
    assert src.train_split == 'train' and src.tasks('test')


@pytest.fixture
def clean_gin():
    """Gin config is global: start and end every gin test from a clean slate, even when it fails."""
    gin.clear_config()
    yield
    gin.clear_config()


def test_gin_task_files(tmp_path, clean_gin):
    import os
    root = os.path.join(os.path.dirname(__file__), '..', 'gin', 'tasks')
    for name, cls in [('toy', envs.GuessNumberEnv), ('twenty_questions', envs.TwentyQuestionsEnv),
                      ('math', envs.MathEnv)]:
        gin.clear_config()
        gin.parse_config_file(os.path.join(root, f'{name}.gin'))
        factory = gin.query_parameter('nlac_jax.envs.make_env_factory.env_name')
        assert factory == name
        env = envs.make_env_factory()()
        assert isinstance(env, cls)
        src = envs.make_task_source()
        task = src.tasks(src.train_split)[0]
        assert env.reset(task)[0]['role'] == 'system'
    gin.clear_config()
