"""seqio Tasks over the NLAC environments' task sources (optional: needs requirements-seqio.txt).

Importing this module imports TensorFlow and seqio, and registers one seqio Task per environment:

    nlac_toy, nlac_twenty_questions, nlac_math, nlac_tau_retail, nlac_tau_airline

Each Task's source is a ``TaskSourceDataSource`` over ``nlac_jax.envs.make_task_source(env_name)`` (built lazily, on
the first read, so gin bindings made before then apply and τ-bench's package is needed only for the τ-bench
Tasks). An example is one ``nlac_jax.envs.Task``, as scalar string features:

    task_id   the Task's id
    split     the Task's own split ('train' / 'test' ...; an 'all' split keeps each task's own)
    payload   the Task's payload as canonical JSON (sorted keys)
    targets   the reference the metrics compare with: math -> the reference answer, other envs -> the task id

``example_to_task`` turns an example (numpy or tf) back into a ``Task``, and ``SeqioTaskSource`` is a ``TaskSource``
that reads its splits through a seqio Task, so the NLAC loop can take its tasks from seqio by name.

Sharding. The source supports arbitrary sharding: ``task.get_dataset(split=..., shard_info=seqio.ShardInfo(i, n))``
gives tasks ``i, i+n, i+2n, ...`` of the split's fixed order, so the n shards are disjoint, cover the split, and
are the same on every host and every run (shuffling, when asked for, happens after sharding, within the shard).

Metrics. Task-level metric functions take seqio's ``(targets, predictions)`` signature:

* episode envs (toy, 20 Questions, τ-bench): ``predictions`` are episode outcomes (``nlac_jax.envs.Episode``
  objects or mappings with ``success`` and ``total_return`` / ``return``); ``targets`` are the task ids.
  ``success_rate`` -> {'success_rate'}, ``mean_return`` -> {'mean_return'}; τ-bench adds
  ``pass_hat_k_metric((1, 2, 4))`` -> {'pass^k'} for each k no larger than the fewest trials of a task.
* math: ``math_accuracy`` -> {'accuracy'}: predictions are solution texts (or episodes / mappings carrying the
  text), graded with ``extract_answer`` + ``answers_equal`` against the reference answers in ``targets``.

``evaluate_episodes(task_name, episodes)`` runs a Task's metric functions on a list of finished episodes.

TensorFlow is told to see no GPU (``tf.config.set_visible_devices([], 'GPU')``) so that a tf.data pipeline in the
same process as JAX never takes accelerator memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Optional, Sequence

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import seqio  # noqa: E402
import tensorflow as tf  # noqa: E402

try:  # keep TF off the accelerators JAX uses (TF only runs the small input pipeline)
    tf.config.set_visible_devices([], 'GPU')
except (RuntimeError, ValueError):  # devices already initialised, or no GPU support in this build
    pass

from nlac_jax.data.names import SEQIO_TASK_PREFIX  # noqa: E402
from nlac_jax.envs import answers_equal, extract_answer, make_task_source  # noqa: E402
from nlac_jax.envs.base import Task, TaskSource, pass_hat_k  # noqa: E402
from nlac_jax.envs.registry import ENV_NAMES  # noqa: E402

FEATURE_KEYS = ('task_id', 'split', 'payload', 'targets')


def _string_feature() -> seqio.Feature:
    return seqio.Feature(seqio.PassThroughVocabulary(size=0), add_eos=False, required=True, dtype=tf.string, rank=0)


OUTPUT_FEATURES = {k: _string_feature() for k in FEATURE_KEYS}


# ---------------------------------------------------------------------------------------------- examples ---

def _text(x: Any) -> str:
    if isinstance(x, bytes):
        return x.decode('utf-8')
    if hasattr(x, 'numpy'):  # tf.Tensor
        return _text(x.numpy())
    if hasattr(x, 'item') and not isinstance(x, str):  # numpy scalar
        return _text(x.item())
    return str(x)


def default_target(env_name: str) -> Callable[[Task], str]:
    """What ``targets`` holds for ``env_name``: the reference answer for math, the task id otherwise."""
    if env_name == 'math':
        return lambda task: str(task.payload['answer'])
    return lambda task: task.id


def task_to_example(task: Task, target_fn: Callable[[Task], str]) -> dict:
    """A Task as the string features of one example (plain Python strings)."""
    return {'task_id': task.id, 'split': task.split,
            'payload': json.dumps(task.payload, sort_keys=True, ensure_ascii=False), 'targets': target_fn(task)}


def example_to_task(example: Mapping[str, Any]) -> Task:
    """The Task of one example (values may be bytes, numpy scalars or tf tensors)."""
    return Task(id=_text(example['task_id']), split=_text(example['split']),
                payload=json.loads(_text(example['payload'])))


def shard_tasks(tasks: Sequence[Task], shard_info: Optional[seqio.ShardInfo]) -> list:
    """Tasks ``index, index + num_shards, ...`` of ``tasks`` (all of them when ``shard_info`` is None)."""
    if shard_info is None:
        return list(tasks)
    n, i = int(shard_info.num_shards), int(shard_info.index)
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"bad ShardInfo(index={i}, num_shards={n})")
    return list(tasks[i::n])


class TaskSourceDataSource(seqio.DataSource):
    """A seqio DataSource over an ``nlac_jax.envs.TaskSource`` built lazily by ``source_fn()``.

    Splits and sizes are the TaskSource's; ``get_dataset`` yields its tasks in their fixed order (sharded by
    ``shard_info`` as described in the module docstring). Shuffling is left to ``seqio.Task.get_dataset``.
    """

    def __init__(self, source_fn: Callable[[], TaskSource], target_fn: Callable[[Task], str]):
        self._source_fn, self._target_fn = source_fn, target_fn
        self._task_source: Optional[TaskSource] = None
        super().__init__(splits=(), num_input_examples=None, caching_permitted=False)

    @property
    def task_source(self) -> TaskSource:
        if self._task_source is None:
            self._task_source = self._source_fn()
        return self._task_source

    @property
    def splits(self) -> Sequence[str]:
        return tuple(self.task_source.splits)

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return True

    def num_input_examples(self, split: str) -> int:
        return len(self.task_source.tasks(split))

    def list_shards(self, split: str) -> Sequence[str]:
        return [split]

    def get_dataset(self, split: str = 'train', shuffle: bool = True, seed: Optional[int] = None,
                    shard_info: Optional[seqio.ShardInfo] = None, *, sequence_length=None, use_cached: bool = False,
                    num_epochs: Optional[int] = 1) -> tf.data.Dataset:
        del shuffle, seed, sequence_length, use_cached, num_epochs  # order is fixed; seqio.Task shuffles
        examples = [task_to_example(t, self._target_fn) for t in shard_tasks(self.task_source.tasks(split), shard_info)]
        return tf.data.Dataset.from_tensor_slices(
            {k: tf.constant([e[k] for e in examples], dtype=tf.string, shape=[len(examples)]) for k in FEATURE_KEYS})

    def __repr__(self):
        return f"{type(self).__name__}(source_fn={getattr(self._source_fn, '__name__', self._source_fn)!r})"


def _postprocess(output: Any, example: Any = None, is_target: bool = False) -> Any:
    """Decodes byte strings (targets read from the dataset, text predictions); leaves other outputs alone."""
    del example, is_target
    return output.decode('utf-8') if isinstance(output, bytes) else output


# ----------------------------------------------------------------------------------------------- metrics ---

def episode_outcome(prediction: Any) -> tuple:
    """(total_return, success) of an Episode or a mapping with 'success' and 'total_return' (or 'return')."""
    if isinstance(prediction, Mapping):
        if 'success' not in prediction or not ('total_return' in prediction or 'return' in prediction):
            raise TypeError(f"an episode outcome mapping needs 'success' and 'total_return' (or 'return'), got "
                            f"keys {sorted(prediction)}")
        ret = prediction['total_return'] if 'total_return' in prediction else prediction['return']
        return float(ret), bool(prediction['success'])
    if hasattr(prediction, 'total_return') and hasattr(prediction, 'success'):
        return float(prediction.total_return), bool(prediction.success)
    raise TypeError(f"expected an Episode or an outcome mapping, got {type(prediction).__name__}")


def _check_lengths(targets: Sequence, predictions: Sequence) -> None:
    if len(targets) != len(predictions):
        raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
    if not predictions:
        raise ValueError("metrics need at least one prediction")


def success_rate(targets: Sequence, predictions: Sequence) -> dict:
    """{'success_rate': fraction of episodes that succeeded} (τ-bench's pass^1 with one trial per task)."""
    _check_lengths(targets, predictions)
    return {'success_rate': sum(episode_outcome(p)[1] for p in predictions) / len(predictions)}


def mean_return(targets: Sequence, predictions: Sequence) -> dict:
    """{'mean_return': mean undiscounted episode return}."""
    _check_lengths(targets, predictions)
    return {'mean_return': sum(episode_outcome(p)[0] for p in predictions) / len(predictions)}


def pass_hat_k_metric(ks: Sequence[int] = (1, 2, 4)) -> Callable[[Sequence, Sequence], dict]:
    """A metric fn giving τ-bench's pass^k for each k in ``ks`` that every task has enough trials for.

    Episodes are grouped by their target (the task id); k larger than the fewest trials of a task is left out.
    """
    ks = tuple(sorted({int(k) for k in ks}))

    def pass_hat_k_fn(targets: Sequence, predictions: Sequence) -> dict:
        _check_lengths(targets, predictions)
        by_task: dict = {}
        for t, p in zip(targets, predictions):
            by_task.setdefault(_text(t), []).append(episode_outcome(p)[1])
        fewest = min(len(v) for v in by_task.values())
        return {f'pass^{k}': pass_hat_k(list(by_task.values()), k) for k in ks if k <= fewest}

    pass_hat_k_fn.__name__ = 'pass_hat_k'
    return pass_hat_k_fn


def _solution_text(prediction: Any) -> str:
    if isinstance(prediction, (str, bytes)):
        return _text(prediction)
    if isinstance(prediction, Mapping):
        for key in ('text', 'prediction', 'action'):
            if key in prediction:
                return _text(prediction[key])
        raise TypeError(f"a math prediction mapping needs 'text', 'prediction' or 'action', got {sorted(prediction)}")
    transitions = getattr(prediction, 'transitions', None)
    if transitions is not None:  # an Episode: the (single) action is the solution
        return transitions[-1].action if transitions else ''
    raise TypeError(f"expected a solution text, an Episode or a mapping, got {type(prediction).__name__}")


def math_accuracy(targets: Sequence, predictions: Sequence) -> dict:
    """{'accuracy': fraction of solutions whose extracted final answer equals the reference (answers_equal)}."""
    _check_lengths(targets, predictions)
    correct = 0
    for ref, pred in zip(targets, predictions):
        answer = extract_answer(_solution_text(pred))
        correct += answer is not None and answers_equal(answer, _text(ref))
    return {'accuracy': correct / len(predictions)}


def default_metric_fns(env_name: str) -> list:
    """The metric functions registered for ``env_name``."""
    if env_name == 'math':
        return [math_accuracy]
    fns = [success_rate, mean_return]
    if env_name.startswith('tau_'):
        fns.append(pass_hat_k_metric((1, 2, 4)))
    return fns


# ---------------------------------------------------------------------------------------------- registry ---

@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    env_name: str
    target_fn: Callable[[Task], str]


_SPECS: dict = {}


def register_task_source(name: str, source_fn: Callable[[], TaskSource], env_name: str,
                         metric_fns: Optional[Sequence[Callable]] = None,
                         target_fn: Optional[Callable[[Task], str]] = None, overwrite: bool = True,
                         shuffle_buffer_size: Optional[int] = 10_000) -> seqio.Task:
    """Registers a seqio Task ``name`` over the TaskSource ``source_fn()`` (called lazily, once) for ``env_name``.

    ``metric_fns`` / ``target_fn`` default to ``default_metric_fns(env_name)`` / ``default_target(env_name)``.
    ``overwrite=False`` keeps (and returns) an already registered Task of that name.
    """
    if name in seqio.TaskRegistry.names():
        if not overwrite:
            return seqio.TaskRegistry.get(name)
        seqio.TaskRegistry.remove(name)
    target_fn = target_fn or default_target(env_name)
    task = seqio.TaskRegistry.add(
        name, source=TaskSourceDataSource(source_fn, target_fn), output_features=OUTPUT_FEATURES,
        preprocessors=[], postprocess_fn=_postprocess,
        metric_fns=list(default_metric_fns(env_name) if metric_fns is None else metric_fns),
        shuffle_buffer_size=shuffle_buffer_size)
    _SPECS[name] = _Spec(name, env_name, target_fn)
    return task


def _env_source_fn(env_name: str) -> Callable[[], TaskSource]:
    def source_fn() -> TaskSource:
        return make_task_source(env_name=env_name)  # gin bindings on make_task_source / the sources apply

    source_fn.__name__ = f'make_task_source_{env_name}'
    return source_fn


def register_seqio_tasks(overwrite: bool = False) -> list:
    """Registers 'nlac_<env>' for every env (done on import); ``overwrite=True`` re-creates them (e.g. after gin
    bindings changed, since each Task builds its TaskSource once). Returns the names."""
    names = []
    for env_name in ENV_NAMES:
        name = SEQIO_TASK_PREFIX + env_name
        register_task_source(name, _env_source_fn(env_name), env_name, overwrite=overwrite)
        names.append(name)
    return names


def registered_env_name(name: str) -> str:
    """The env name a seqio Task was registered for by this module."""
    if name not in _SPECS:
        raise ValueError(f"seqio Task {name!r} was not registered by nlac_jax.data (known: {sorted(_SPECS)})")
    return _SPECS[name].env_name


def get_seqio_task(name: str) -> seqio.Task:
    """The registered seqio Task ``name`` (a Mixture is refused: episodes need one env)."""
    task = seqio.get_mixture_or_task(name)
    if not isinstance(task, seqio.Task):
        raise ValueError(f"{name!r} is a seqio Mixture, not a Task")
    return task


def evaluate_episodes(name: str, episodes: Sequence[Any]) -> dict:
    """All metric functions of seqio Task ``name`` on finished episodes (targets are derived from their tasks)."""
    task = get_seqio_task(name)
    spec = _SPECS.get(name)
    target_fn = spec.target_fn if spec is not None else (lambda t: t.id)
    targets = [target_fn(e.task) for e in episodes]
    out: dict = {}
    for fn in task.metric_fns:
        out.update(fn(targets=targets, predictions=list(episodes)))
    return out


# ------------------------------------------------------------------------------------------- task source ---

class SeqioTaskSource(TaskSource):
    """A TaskSource whose splits are read through seqio Task ``name`` (only one shard of each when asked).

    ``env_name`` is the env to play the tasks in (for ``make_env_factory``); ``train_split`` / ``eval_split``
    default to the wrapped env source's, else 'train' / 'test', and may not be the same split unless
    ``train_on_eval_split``. Task order is the source's fixed order.
    """

    def __init__(self, name: str, train_split: Optional[str] = None, eval_split: Optional[str] = None,
                 shard_by_process: bool = False, shard_index: Optional[int] = None,
                 num_shards: Optional[int] = None, train_on_eval_split: bool = False):
        super().__init__()
        self.name = name
        self.seqio_task = get_seqio_task(name)
        self.env_name = registered_env_name(name)
        if (shard_index is None) != (num_shards is None):
            raise ValueError("give both shard_index and num_shards, or neither")
        if shard_index is not None:
            self.shard_info = seqio.ShardInfo(index=int(shard_index), num_shards=int(num_shards))
        elif shard_by_process:
            import jax
            self.shard_info = seqio.ShardInfo(index=jax.process_index(), num_shards=jax.process_count())
        else:
            self.shard_info = None
        if self.shard_info is not None:
            shard_tasks([], self.shard_info)  # validates it
        self.splits = tuple(self.seqio_task.splits)
        inner = getattr(self.seqio_task.source, 'task_source', None)
        self.train_split = train_split or getattr(inner, 'train_split', None) or 'train'
        self.eval_split = eval_split or getattr(inner, 'eval_split', None) or 'test'
        for s in (self.train_split, self.eval_split):
            if s not in self.splits:
                raise ValueError(f"task_source_from_seqio({name!r}): split {s!r} not in {list(self.splits)}")
        if self.train_split == self.eval_split and not train_on_eval_split:  # as make_task_source refuses it
            raise ValueError(f"task_source_from_seqio({name!r}): train_split and eval_split are both "
                             f"{self.train_split!r}: the run would train on what it evaluates (give a train split, "
                             f"or set task_source_from_seqio.train_on_eval_split = True on purpose)")

    def _load(self, split: str) -> list:
        ds = self.seqio_task.get_dataset(sequence_length=None, split=split, shuffle=False,
                                         shard_info=self.shard_info, num_epochs=1, try_in_mem_cache=False)
        return [example_to_task(ex) for ex in ds.as_numpy_iterator()]

    def __repr__(self):
        return f"SeqioTaskSource({self.name!r}, shard_info={self.shard_info})"


register_seqio_tasks()
