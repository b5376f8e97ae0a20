"""The τ-bench user simulators (the customer side of a ``TauBenchEnv`` episode) and the stop tokens they speak.

``ScriptedUser`` is deterministic (tests); ``ModelUser`` is backed by a ``generate_fn`` over chat histories and can
hand its generation to ``BatchedRunner`` as a ``ModelRequest``. Both follow tau2's conventions: the user answers
tau2's greeting first and ends the conversation with ``###STOP###`` (or ``###TRANSFER###`` /
``###OUT-OF-SCOPE###``).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

from nlac_jax.envs.base import ModelRequest
from nlac_jax.envs.tau_adapter import import_tau2

STOP, TRANSFER, OUT_OF_SCOPE = '###STOP###', '###TRANSFER###', '###OUT-OF-SCOPE###'
USER_STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)
GREETING = 'Hi! How can I help you today?'  # tau2's default first agent message


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
    _, _, data_dir = import_tau2()
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
