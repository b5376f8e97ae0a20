"""The interface between NLAC's target construction and text generation.

NLAC code never calls the sampler directly: it asks a :class:`RoleSampler` for completions, naming the role (which
prompt family this is, so the implementation can pick temperatures, length limits and stop strings per role)
and which parameters to generate with: ``'policy'`` = θ (the parameters being trained) or ``'target'`` = θ̄
(their EMA). The trainer implements it by wrapping ``sampling.generate`` with θ or θ̄; tests use
:class:`ScriptedRoleSampler`.

Each sample is a :class:`Completion`: the text AND why generation stopped. The stop reason matters because a
text cut off at its token budget must never become a training target (text packing appends the end-of-turn
token, which would teach the model to stop mid-thought there).

Return convention for ``n`` samples per prompt: ONE FLAT list of ``len(messages_batch) * n`` completions,
prompt-major: ``out[i * n + j]`` is sample ``j`` of prompt ``i``. Use :func:`group` to get a list of lists.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

__all__ = [
    "Completion",
    "ParamsName",
    "PARAMS_NAMES",
    "RoleSampler",
    "STOP_REASONS",
    "SamplerCall",
    "ScriptedRoleSampler",
    "TRUNCATED_REASONS",
    "check_samples",
    "group",
    "texts",
]

ParamsName = Literal["policy", "target"]
PARAMS_NAMES = ("policy", "target")

# The sampler's stop reasons (sampling.GenerateOutput.stop_reason); the last two mean "cut off".
STOP_REASONS = ("stop_token", "stop_string", "length", "context_full")
TRUNCATED_REASONS = ("length", "context_full")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated text and why generation stopped (one of :data:`STOP_REASONS`)."""

    text: str
    stop_reason: str = "stop_token"

    def __post_init__(self):
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {self.stop_reason!r}")

    @property
    def truncated(self) -> bool:
        """True when the text was cut off (token budget or model context reached), not finished."""
        return self.stop_reason in TRUNCATED_REASONS


@runtime_checkable
class RoleSampler(Protocol):
    """Generates completions for NLAC roles (see the module docstring for the flat, prompt-major order)."""

    def sample(
        self,
        messages_batch: list[list[dict]],
        params: ParamsName,
        role: str,
        n: int = 1,
        temperature: float | None = None,
    ) -> list[Completion]:
        """``n`` completions per chat prompt, flattened prompt-major (``len(messages_batch) * n`` of them).
        ``temperature`` overrides the role's own setting when given."""
        ...


_T = TypeVar("_T")


def group(flat: Sequence[_T], n: int) -> list[list[_T]]:
    """Regroups a flat prompt-major sample list into ``[[n samples of prompt 0], [prompt 1], ...]``."""
    if n <= 0 or len(flat) % n:
        raise ValueError(f"{len(flat)} samples cannot be split into groups of {n}")
    return [list(flat[i : i + n]) for i in range(0, len(flat), n)]


def texts(completions: Sequence[Completion]) -> list[str]:
    """The texts of ``completions``, in order (for callers that do not care why generation stopped)."""
    return [c.text for c in completions]


@dataclasses.dataclass(frozen=True)
class SamplerCall:
    """One recorded :meth:`ScriptedRoleSampler.sample` call (messages deep-copied at call time)."""

    role: str
    params: str
    messages_batch: list
    n: int
    outputs: list  # the Completions returned
    temperature: float | None = None

    def user_texts(self) -> list[str]:
        """All message contents of each prompt joined, one string per prompt (handy for ``in`` asserts)."""
        return ["\n".join(str(m.get("content", "")) for m in msgs) for msgs in self.messages_batch]

    def output_texts(self) -> list[str]:
        """The texts of the returned completions, flat and prompt-major."""
        return texts(self.outputs)


Scripted = str | Completion
Response = Scripted | Sequence[Scripted] | Callable[[list[dict], int], Scripted]


def _as_completion(r: Any) -> Completion:
    # plain strings are finished texts; a Completion scripts its own stop reason
    return r if isinstance(r, Completion) else Completion(str(r), "stop_token")


class ScriptedRoleSampler:
    """A :class:`RoleSampler` for tests: canned responses per role, and a log of every call.

    ``responses[role]`` is one of:
      * a string or a :class:`Completion`: returned for every sample;
      * a list of them: consumed in order across calls (cycled when exhausted);
      * a callable ``fn(messages, sample_index) -> str | Completion``: computed from the prompt, e.g. to echo it.
    A plain string is returned as ``Completion(text, 'stop_token')``; script a ``Completion`` to choose the stop
    reason (e.g. ``Completion(text, 'length')`` for a cut-off text). Roles without an entry return ``default``
    (raise if ``default`` is None). ``calls`` records every call as a :class:`SamplerCall`, in order.
    """

    def __init__(self, responses: Mapping[str, Response] | None = None, default: Scripted | None = None):
        self.responses = dict(responses or {})
        self.default = default
        self.calls: list[SamplerCall] = []
        self._cursor: dict[str, int] = {}

    def _next(self, role: str, messages: list[dict], j: int) -> Completion:
        r = self.responses.get(role, self.default)
        if r is None:
            raise KeyError(f"ScriptedRoleSampler has no response for role {role!r}")
        if callable(r):
            return _as_completion(r(messages, j))
        if isinstance(r, (str, Completion)):
            return _as_completion(r)
        r = list(r)
        i = self._cursor.get(role, 0)
        self._cursor[role] = i + 1
        return _as_completion(r[i % len(r)])

    def sample(
        self,
        messages_batch: list[list[dict]],
        params: ParamsName,
        role: str,
        n: int = 1,
        temperature: float | None = None,
    ) -> list[Completion]:
        """Returns scripted completions (flat, prompt-major) and records the call (temperature included)."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        outputs = [self._next(role, msgs, j) for msgs in messages_batch for j in range(n)]
        self.calls.append(
            SamplerCall(role=role, params=params, messages_batch=copy.deepcopy(list(messages_batch)), n=n,
                        outputs=list(outputs), temperature=temperature)
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


def check_samples(outputs: Any, expected: int, role: str) -> list[Completion]:
    """Validates a sampler's return value (a flat list of ``expected`` :class:`Completion`) with a clear error.

    Plain strings are refused rather than assumed finished: a sampler that drops its stop reasons would let
    cut-off texts become training targets.
    """
    if not isinstance(outputs, (list, tuple)) or len(outputs) != expected:
        got = len(outputs) if isinstance(outputs, (list, tuple)) else type(outputs).__name__
        raise ValueError(f"RoleSampler returned {got} completions for role {role!r}; expected a flat list of {expected}")
    bad = next((o for o in outputs if not isinstance(o, Completion)), None)
    if bad is not None:
        raise TypeError(f"RoleSampler returned a {type(bad).__name__} for role {role!r}; expected Completion "
                        "(text + stop_reason)")
    return list(outputs)
