"""The interface between NLAC's target construction and text generation.

NLAC code never calls the sampler directly: it asks a :class:`RoleSampler` for texts, naming the role (which
prompt family this is, so the implementation can pick temperatures, length limits and stop strings per role)
and which parameters to generate with: ``'policy'`` = θ (the parameters being trained) or ``'target'`` = θ̄
(their EMA). The trainer implements it by wrapping ``sampling.generate`` with θ or θ̄; tests use
:class:`ScriptedRoleSampler`.

Return convention for ``n`` samples per prompt: ONE FLAT list of ``len(messages_batch) * n`` strings,
prompt-major: ``out[i * n + j]`` is sample ``j`` of prompt ``i``. Use :func:`group` to get a list of lists.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

__all__ = ["ParamsName", "PARAMS_NAMES", "RoleSampler", "SamplerCall", "ScriptedRoleSampler", "check_samples", "group"]

ParamsName = Literal["policy", "target"]
PARAMS_NAMES = ("policy", "target")


@runtime_checkable
class RoleSampler(Protocol):
    """Generates texts for NLAC roles (see the module docstring for the flat, prompt-major return order)."""

    def sample(
        self, messages_batch: list[list[dict]], params: ParamsName, role: str, n: int = 1
    ) -> list[str]:
        """``n`` completions per chat prompt, flattened prompt-major (``len(messages_batch) * n`` strings)."""
        ...


def group(flat: Sequence[str], n: int) -> list[list[str]]:
    """Regroups a flat prompt-major sample list into ``[[n samples of prompt 0], [prompt 1], ...]``."""
    if n <= 0 or len(flat) % n:
        raise ValueError(f"{len(flat)} samples cannot be split into groups of {n}")
    return [list(flat[i : i + n]) for i in range(0, len(flat), n)]


@dataclasses.dataclass(frozen=True)
class SamplerCall:
    """One recorded :meth:`ScriptedRoleSampler.sample` call (messages deep-copied at call time)."""

    role: str
    params: str
    messages_batch: list
    n: int
    outputs: list

    def user_texts(self) -> list[str]:
        """All message contents of each prompt joined, one string per prompt (handy for ``in`` asserts)."""
        return ["\n".join(str(m.get("content", "")) for m in msgs) for msgs in self.messages_batch]


Response = str | Sequence[str] | Callable[[list[dict], int], str]


class ScriptedRoleSampler:
    """A :class:`RoleSampler` for tests: canned responses per role, and a log of every call.

    ``responses[role]`` is one of:
      * a string: returned for every sample;
      * a list of strings: consumed in order across calls (cycled when exhausted);
      * a callable ``fn(messages, sample_index) -> str``: computed from the prompt, e.g. to echo its content.
    Roles without an entry return ``default`` (raise if ``default`` is None). ``calls`` records
    ``SamplerCall(role, params, messages_batch, n, outputs)`` in order.
    """

    def __init__(self, responses: Mapping[str, Response] | None = None, default: str | None = None):
        self.responses = dict(responses or {})
        self.default = default
        self.calls: list[SamplerCall] = []
        self._cursor: dict[str, int] = {}

    def _next(self, role: str, messages: list[dict], j: int) -> str:
        r = self.responses.get(role, self.default)
        if r is None:
            raise KeyError(f"ScriptedRoleSampler has no response for role {role!r}")
        if callable(r):
            return str(r(messages, j))
        if isinstance(r, str):
            return r
        r = list(r)
        i = self._cursor.get(role, 0)
        self._cursor[role] = i + 1
        return r[i % len(r)]

    def sample(self, messages_batch: list[list[dict]], params: ParamsName, role: str, n: int = 1) -> list[str]:
        """Returns scripted texts (flat, prompt-major) and records the call."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        outputs = [self._next(role, msgs, j) for msgs in messages_batch for j in range(n)]
        self.calls.append(
            SamplerCall(role=role, params=params, messages_batch=copy.deepcopy(list(messages_batch)), n=n, outputs=list(outputs))
        )
        return outputs

    def calls_for(self, role: str) -> list[SamplerCall]:
        """The recorded calls for ``role``, in order."""
        return [c for c in self.calls if c.role == role]

    def call_counts(self) -> dict[str, int]:
        """Number of calls per role."""
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.role] = out.get(c.role, 0) + 1
        return out

    def reset(self) -> None:
        """Forgets recorded calls and list cursors."""
        self.calls.clear()
        self._cursor.clear()


def check_samples(outputs: Any, expected: int, role: str) -> list[str]:
    """Validates a sampler's return value (a flat list of ``expected`` strings) with a clear error."""
    if not isinstance(outputs, (list, tuple)) or len(outputs) != expected:
        got = len(outputs) if isinstance(outputs, (list, tuple)) else type(outputs).__name__
        raise ValueError(f"RoleSampler returned {got} texts for role {role!r}; expected a flat list of {expected}")
    return [str(o) for o in outputs]
