"""BatchedRunner, TaskCursor, pass^k, factories and gin wiring."""

import json
import math

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
            assert tr.next_state[:len(tr.state)] == tr.state
            assert tr.next_state[len(tr.state)] == {'role': 'assistant', 'content': tr.action}
            assert tr.next_state[-1]['role'] == 'user'
            if t + 1 < e.length:
                assert e.transitions[t + 1].state == tr.next_state
        assert e.transitions[-1].next_state == e.messages
        assert e.transitions[0].state[0]['role'] == 'system'
    assert [e.num_errors for e in eps] == [0, 0, 0, 1, 0]
    assert eps[3].transitions[0].info['error'] and eps[3].transitions[0].next_state[-1][
        'content'].startswith('Error')
    m = envs.episode_metrics(eps)
    assert m['success_rate'] == 1.0 and m['mean_length'] == pytest.approx(17 / 5)
    assert m['mean_length_success'] == pytest.approx(17 / 5)  # every episode won


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
    # turns to a win, by hand: 50 (1 turn), 25 and 75 (2 turns each); no win at all reads NaN, not 0
    from nlac_jax.envs.base import episode_metrics
    assert eps[4].length == 2 and episode_metrics(eps)['mean_length_success'] == pytest.approx(5 / 3)
    assert math.isnan(episode_metrics([eps[1], eps[2]])['mean_length_success'])


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


def test_training_on_the_evaluation_split_is_refused(tmp_path, clean_gin):
    """Same split name, or two JSONL split names over one file: refused in one line naming both, unless the run
    says so on purpose; a real train file next to the test file is accepted and read."""
    rows = [{"problem": f"Compute {i}+1.", "answer": str(i + 1), "level": "Level 5"} for i in range(3)]
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        envs.make_task_source('toy', train_split='test', eval_split='test')
    assert "train_split='test' and eval_split='test'" in str(e.value).splitlines()[0]  # gin appends its call site
    assert envs.make_task_source('toy', train_split='test', eval_split='test', train_on_eval_split=True)
    gin.bind_parameter('nlac_jax.envs.MathJsonlTaskSource.paths', {'train': str(test), 'test': str(test)})
    with pytest.raises(ValueError, match=f"both read {test}"):
        envs.make_task_source('math', source='jsonl')
    train = tmp_path / "train.jsonl"
    train.write_text(test.read_text())
    gin.bind_parameter('nlac_jax.envs.MathJsonlTaskSource.paths', {'train': str(train), 'test': str(test)})
    src = envs.make_task_source('math', source='jsonl')
    assert len(src.tasks('train')) == 3 and src.eval_split == 'test'


@pytest.fixture
def clean_gin():
    """Gin config is global: start and end every gin test from a clean slate, even when it fails."""
    gin.clear_config()
    yield
    gin.clear_config()


def test_gin_task_files(tmp_path, clean_gin):
    import os
    root = os.path.join(os.path.dirname(__file__), '..', '..', 'gin', 'tasks')
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


# --- env exceptions: one failing env ends one episode, the run goes on, a systematic bug still stops it -------

class _FlakyEnv(GuessNumberEnv):
    """Guess-the-number, but 'boom' raises in step and a task with payload 'bad_reset' raises in reset."""

    def reset(self, task):
        if task.payload.get('bad_reset'):
            raise KeyError('bad_reset')
        return super().reset(task)

    def step(self, action_text):
        if action_text == 'boom':
            raise RecursionError('maximum recursion depth exceeded ' + 'x' * 5000)
        return super().step(action_text)


def _toy_tasks(targets, n=16):
    return [Task(f't{x}', 'test', {'target': x, 'n': n}) for x in targets]


def test_runner_turns_env_exceptions_into_error_episodes(caplog):
    from nlac_jax.envs.base import EnvErrorMonitor
    n = 16
    tasks = _toy_tasks([8, 1, 16, 5])
    tasks.insert(2, Task('broken', 'test', {'target': 3, 'n': n, 'bad_reset': True}))
    turn = {'k': 0}

    def policy_fn(histories):
        turn['k'] += 1
        # episode of task t1 (second slot) hits the failing action on its 2nd turn
        return ['boom' if turn['k'] == 2 and i == 1 else binary_search_policy(h, n) for i, h in enumerate(histories)]

    monitor = EnvErrorMonitor(max_consecutive=5)
    with caplog.at_level('WARNING', logger='nlac_jax.envs.base'):
        eps = BatchedRunner([_FlakyEnv(n=n, max_turns=6) for _ in range(3)], policy_fn,
                            error_monitor=monitor).run(tasks)
    assert [e.task.id for e in eps] == [t.id for t in tasks]
    ok = [eps[i] for i in (0, 3, 4)]
    assert all(e.success and not e.env_exceptions for e in ok)
    failed = eps[1]  # t1: step raised
    assert failed.env_exceptions == 1 and not failed.success and failed.length == 2
    last = failed.transitions[-1]
    # terminal, as its text says ("the episode has ended"): no critic bootstraps a next action from a dead state
    assert last.info['env_error'] and last.done is True and last.info['success'] is False and last.reward == 0.0
    assert not failed.truncated and 'truncated' not in last.info  # truncated = cut by the turn limit only
    assert [t.done for t in failed.transitions] == [False, True]
    assert last.info['env_exception'].startswith('RecursionError: maximum recursion')
    assert len(last.info['env_exception']) < 300  # the 5000-character message is cut
    assert last.next_state[-1]['content'].startswith('Error: the environment failed on this action')
    broken = eps[2]  # reset raised: an empty episode, and the env took the next task
    assert broken.env_exceptions == 1 and broken.length == 0 and broken.info['env_error']
    assert broken.info['env_error_where'] == '_FlakyEnv.reset'
    assert monitor.total == 2 and monitor.consecutive == 0  # later episodes ended normally
    assert envs.episode_metrics(eps)['env_exceptions'] == 2.0
    recs = [r for r in caplog.records if r.name == 'nlac_jax.envs.base']
    assert len(recs) == 2  # once per failed episode
    # the first one (the reset of 'broken', at start-up) with its traceback in full, later ones in one line
    assert recs[0].exc_info is not None and 'task broken' in recs[0].getMessage()
    assert recs[1].exc_info is None and 'task t1' in recs[1].getMessage()
    assert '_FlakyEnv.step on task t1' in recs[1].getMessage()
    assert all(len(r.getMessage()) < 400 for r in recs)


def test_runner_raises_after_consecutive_env_exceptions():
    from nlac_jax.envs.base import EnvErrorLimitExceeded, EnvErrorMonitor
    monitor = EnvErrorMonitor(max_consecutive=3)
    runner = BatchedRunner([_FlakyEnv(n=16)], lambda hs: ['boom'] * len(hs), error_monitor=monitor)
    runner.run(_toy_tasks([1, 2]))  # two failures: still below the limit
    assert monitor.consecutive == 2
    with pytest.raises(EnvErrorLimitExceeded, match=r'3 episodes in a row .* bug in the environment'):
        runner.run(_toy_tasks([3, 4]))
    # a normal episode resets the streak
    monitor = EnvErrorMonitor(max_consecutive=2)
    actions = iter(['boom', '8', 'boom', '8', 'boom'])
    BatchedRunner([_FlakyEnv(n=16)], lambda hs: [next(actions)], error_monitor=monitor).run(
        _toy_tasks([7, 8, 7]))
    assert monitor.total == 2 and monitor.consecutive == 1


def test_runner_guards_two_phase_envs_and_keeps_model_errors_visible():
    from nlac_jax.envs.base import EnvBase, EnvErrorMonitor, ModelRequest, StepResult

    class TwoPhase(EnvBase):
        max_turns = 3

        def reset(self, task):
            self.task = task
            return [{'role': 'user', 'content': 'go'}]

        def step_begin(self, action):
            if action == 'begin-fail':
                raise ValueError('step_begin failed')
            return ModelRequest(model_fn, action)

        def step_end(self, reply):
            if reply == 'END-FAIL':
                raise TypeError('step_end failed')
            if reply == 'BAD-RESULT':
                return 'not a StepResult'
            return StepResult('ok', 1.0, True, {})

    calls = []

    def model_fn(inputs):
        calls.append(list(inputs))
        return [x.upper() for x in inputs]

    actions = {'a': 'fine', 'b': 'begin-fail', 'c': 'end-fail', 'd': 'bad-result'}
    monitor = EnvErrorMonitor()
    eps = BatchedRunner([TwoPhase() for _ in range(4)], lambda hs: [actions[t] for t in 'abcd'][:len(hs)],
                        error_monitor=monitor).run([Task(t, 's') for t in 'abcd'])
    assert calls == [['fine', 'end-fail', 'bad-result']]  # the failed step_begin sends no request
    assert eps[0].success is False and eps[0].total_return == 1.0 and not eps[0].env_exceptions
    assert [e.info.get('env_error_where') for e in eps[1:]] == ['TwoPhase.step_begin', 'TwoPhase.step_end',
                                                                'TwoPhase.step_end']
    assert 'not a StepResult' in eps[3].info['env_exception'] or 'StepResult' in eps[3].info['env_exception']
    assert monitor.total == 3

    def broken_model(inputs):
        raise RuntimeError('sampler bug')

    model_fn_ref = broken_model

    class UsesBroken(TwoPhase):
        def step_begin(self, action):
            return ModelRequest(model_fn_ref, action)

    with pytest.raises(RuntimeError, match='sampler bug'):  # our model code, not the env: it propagates
        BatchedRunner([UsesBroken()], lambda hs: ['x'], error_monitor=EnvErrorMonitor()).run([Task('a', 's')])
