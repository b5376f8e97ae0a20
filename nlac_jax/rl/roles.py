"""Role sampling: the interface between text generation and its users (rollouts in ``rl/``, targets in ``nlac/``).

It sits upstream of both so that data flows one way (envs -> rl -> nlac): rollouts act through the same
:class:`RoleSampler` that NLAC's target builder uses, without ``rl`` importing ``nlac``.

Callers never call the sampler directly: they ask a :class:`RoleSampler` for completions, naming the role (which
prompt family this is: one of :data:`CHAT_ROLES`) and which parameters to generate with: ``'policy'`` = θ (the
parameters being trained) or ``'target'`` = θ̄ (their EMA). The trainer implements it by wrapping
``sampling.generate`` with θ or θ̄ (``nlac.model_roles.ModelRoleSampler``); tests use
:class:`ScriptedRoleSampler`.

Parameter routing: a sampler may serve some roles from another parameter set than the one the caller names,
whatever it asks for (:func:`served_params`; ``routes`` maps role -> parameter-set name). The frozen-critic
ablation routes 'successor' and 'evaluator' to a frozen copy of the warm start, so every call site (targets,
evaluation, scoring) stays as it is and cannot forget the routing. A set may also carry its own θ and θ̄
(:func:`param_set_weights`: the split-critic arm's second TrainState), so it serves each call the one it names.
Both samplers take routes through ``routing(routes, param_sets)`` (a context manager) and record which set served
each call.

Scoring: ``score(messages_batch, continuations, params, role)`` returns log π(continuation | role prompt) per
prompt, under the (routed) parameter set: the critic metrics read P(success | s, a) this way.

How each role is sampled (temperature, top-p, token budget) is ONE gin-configurable object,
:class:`RoleSampling` (``nlac.RoleSampling.*``). Every sampler exposes its settings as ``sampler.settings`` and
``sample`` accepts a ``settings`` override (held-out evaluation passes ``settings.evaluation()``), so a scripted
sampler and the model sampler see, and record, the same thing.

Each sample is a :class:`Completion`: the text AND why generation stopped. The stop reason matters because a
text cut off at its token budget must never become a training target (text packing appends the end-of-turn
token, which would teach the model to stop mid-thought there).

Return convention for ``n`` samples per prompt: ONE FLAT list of ``len(messages_batch) * n`` completions,
prompt-major: ``out[i * n + j]`` is sample ``j`` of prompt ``i``. Use :func:`group` to get a list of lists.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

import gin

__all__ = [
    "CHAT_ROLES",
    "Completion",
    "ParamsName",
    "PARAMS_NAMES",
    "RoleSampler",
    "RoleSampling",
    "STOP_REASONS",
    "SamplerCall",
    "ScriptedRoleSampler",
    "TRUNCATED_REASONS",
    "check_routes",
    "check_samples",
    "group",
    "param_set_weights",
    "served_name",
    "served_params",
    "texts",
]

# The roles whose prompt is sent to the model (values of RoleSampler's `role` argument). The prompt registry
# (nlac.prompts) renders one prompt family per role; the settings below are keyed by the same names.
CHAT_ROLES = ("policy", "successor", "backup", "evaluator", "refiner")

ParamsName = Literal["policy", "target"]
PARAMS_NAMES = ("policy", "target")



def served_params(params: str, role: str, routes: Mapping[str, str] | None) -> str:
    """The parameter set that serves a call for ``role`` that asked for ``params``: ``routes[role]`` when the role
    is routed, else ``params`` itself."""
    return (routes or {}).get(role, params)


def param_set_weights(value: Any, params: str) -> Any:
    """The weights a routed parameter set serves to a call that names ``params``. A set with ``.params`` and
    ``.target_params`` (a TrainState, or a holder of one: the split critic's own state) serves θ calls (``'policy'``)
    from ``.params`` and θ̄ calls (``'target'``) from ``.target_params``, so a second trained state keeps its own
    EMA; any other value (a parameter tree: the frozen critic's) serves both."""
    if _has_own_target(value):
        return value.target_params if params == "target" else value.params
    return value


def _has_own_target(value: Any) -> bool:
    """Whether a routed parameter set carries its own θ̄ (a TrainState or a holder of one)."""
    return hasattr(value, "params") and hasattr(value, "target_params")


def served_name(params: str, role: str, routes: Mapping[str, str] | None, param_sets: Mapping[str, Any]) -> str:
    """What a sampler records as the set that served a call: :func:`served_params`, with ``'.target'`` appended
    when a θ̄ call is served by the target params of a set that has its own (:func:`param_set_weights`)."""
    name = served_params(params, role, routes)
    value = param_sets.get(name)
    if params == "target" and _has_own_target(value):
        return f"{name}.target"
    return name


def check_routes(routes: Mapping[str, str] | None, known: Sequence[str]) -> dict[str, str]:
    """``routes`` as a dict, refused with one line naming the role or parameter set at fault: every key must be one
    of :data:`CHAT_ROLES`, every value one of ``known`` (the sampler's parameter-set names)."""
    routes = dict(routes or {})
    for role, name in routes.items():
        if role not in CHAT_ROLES:
            raise ValueError(f"parameter routes: unknown role {role!r} (roles are {list(CHAT_ROLES)})")
        if name not in known:
            raise ValueError(f"parameter routes: role {role!r} -> {name!r}, which is no parameter set of this "
                             f"sampler (known: {sorted(known)})")
    return routes


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


def _default_temperatures() -> dict[str, float]:
    # policy/successor are distributions whose samples stand in for expectations: sample at T=1.
    # backup/evaluator/refiner are "operators" whose output format must be reliable: a cooler T.
    return {"policy": 1.0, "successor": 1.0, "backup": 0.7, "evaluator": 0.7, "refiner": 0.7}


def _default_max_new_tokens() -> dict[str, int]:
    return {"policy": 512, "successor": 384, "backup": 384, "evaluator": 512, "refiner": 512}


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@gin.configurable(module="nlac")
@dataclasses.dataclass(frozen=True)
class RoleSampling:
    """How every role is sampled: the one place for temperatures, top-p and token budgets.

    Attributes:
      temperatures: role -> temperature (0 = greedy). Needs a 'policy' entry; a role without an entry uses it.
      max_new_tokens: role -> generation budget in tokens (same fallback). Prompts are fitted to the context
        minus these budgets, so they are also the longest target a role's prompt is trained with.
      top_p: nucleus sampling for every role (1 = off).
      eval_temperature: the policy's temperature during held-out evaluation (0 = greedy); None (default) = its
        sampling temperature ``temperatures['policy']``, so the policy whose success is reported is the one the
        critic learns the value of (it is trained on that policy's actions and bootstraps from its samples).
        Greedy decoding of a sampled policy reports its mode, a different policy; set 0 to measure that.
        See :meth:`evaluation`.
    """

    temperatures: dict = dataclasses.field(default_factory=_default_temperatures)
    max_new_tokens: dict = dataclasses.field(default_factory=_default_max_new_tokens)
    top_p: float = 1.0
    eval_temperature: float | None = None

    def __post_init__(self):
        # refused at start-up by field, role and value (a NaN temperature samples garbage, hours into a run)
        for field, want in (("temperatures", "a finite number >= 0"), ("max_new_tokens", "an integer >= 1")):
            d = getattr(self, field)
            if not isinstance(d, dict):
                raise TypeError(f"RoleSampling.{field} = {d!r}: expected a dict role -> {want}")
            unknown = [r for r in d if r not in CHAT_ROLES]
            if unknown or "policy" not in d:  # a typo'd role would be ignored; roles without an entry use 'policy'
                raise ValueError(f"RoleSampling.{field} = {d!r}: needs a 'policy' entry and only the roles "
                                 f"{list(CHAT_ROLES)}" + (f" (unknown: {unknown})" if unknown else ""))
            for role, v in d.items():
                if field == "temperatures":
                    ok = _is_real(v) and math.isfinite(v) and v >= 0
                else:
                    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
                if not ok:
                    raise ValueError(f"RoleSampling.{field}[{role!r}] = {v!r}: expected {want}")
        for name, want, ok in (
            ("top_p", "a number in (0, 1] (1 = off)", lambda v: 0.0 < v <= 1.0),
            ("eval_temperature", "a finite number >= 0 (0 = greedy) or None (the policy's temperature)",
             lambda v: v >= 0.0),
        ):
            v = getattr(self, name)
            if name == "eval_temperature" and v is None:
                continue
            if not _is_real(v):
                raise TypeError(f"RoleSampling.{name} = {v!r}: expected {want}")
            if not (math.isfinite(v) and ok(v)):
                raise ValueError(f"RoleSampling.{name} = {v!r}: expected {want}")

    def temperature(self, role: str) -> float:
        """The role's temperature (the 'policy' entry for a role without one)."""
        return float(self.temperatures[role] if role in self.temperatures else self.temperatures["policy"])

    def budget(self, role: str) -> int:
        """The role's ``max_new_tokens`` (the 'policy' entry for a role without one)."""
        return int(self.max_new_tokens[role] if role in self.max_new_tokens else self.max_new_tokens["policy"])

    def evaluation(self) -> "RoleSampling":
        """The settings for held-out evaluation: the policy at ``eval_temperature`` (None: at its sampling
        temperature, i.e. the policy the critic evaluates), every other role unchanged.

        Every role's temperature is written out first, so roles that fell back to the 'policy' entry keep the
        training value instead of following the policy to ``eval_temperature``.
        """
        temps = {r: self.temperature(r) for r in CHAT_ROLES}
        if self.eval_temperature is not None:
            temps["policy"] = float(self.eval_temperature)
        return dataclasses.replace(self, temperatures=temps)


@runtime_checkable
class RoleSampler(Protocol):
    """Generates completions per role (see the module docstring for the flat, prompt-major order).

    ``settings`` are the sampler's own :class:`RoleSampling`; they apply whenever ``sample`` gets none.
    """

    settings: RoleSampling

    def sample(
        self,
        messages_batch: list[list[dict]],
        params: ParamsName,
        role: str,
        n: int = 1,
        settings: RoleSampling | None = None,
    ) -> list[Completion]:
        """``n`` completions per chat prompt, flattened prompt-major (``len(messages_batch) * n`` of them),
        sampled with ``settings`` (default: ``self.settings``) for ``role``."""
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
    settings: RoleSampling  # the settings the call was sampled with (the sampler's own unless overridden)
    served: str | None = None  # the parameter set that served the call (``params`` unless the role was routed)

    @property
    def temperature(self) -> float:
        """The temperature this call's role was sampled at."""
        return self.settings.temperature(self.role)

    @property
    def max_new_tokens(self) -> int:
        """The token budget this call's role was sampled with."""
        return self.settings.budget(self.role)

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
    (raise if ``default`` is None). ``calls`` records every call as a :class:`SamplerCall`, in order, with the
    settings it would have been sampled with (``settings``: default ``RoleSampling()``, so gin bindings apply) and the
    parameter set that served it (``served``: see :meth:`routing`). ``scores(messages, continuation, served_set)
    -> log-prob`` scripts :meth:`score` (None: every score is NaN, so no critic score is reported).
    """

    def __init__(self, responses: Mapping[str, Response] | None = None, default: Scripted | None = None,
                 settings: RoleSampling | None = None,
                 scores: Callable[[list[dict], str, str], float] | None = None):
        self.responses = dict(responses or {})
        self.default = default
        self.settings = settings if settings is not None else RoleSampling()
        self.scores = scores
        self.calls: list[SamplerCall] = []
        self.score_calls: list[SamplerCall] = []
        self.routes: dict[str, str] = {}
        self.param_sets: dict[str, Any] = {}
        self._cursor: dict[str, int] = {}

    @contextlib.contextmanager
    def routing(self, routes: Mapping[str, str] | None = None, param_sets: Mapping[str, Any] | None = None):
        """Serve ``routes``' roles from the named parameter sets inside the block (see the module docstring);
        ``param_sets`` name extra sets (only the names are recorded, plus ``'.target'`` for a θ̄ call served by a
        set with its own target params: :func:`served_name`)."""
        old = self.routes, self.param_sets
        sets = dict(param_sets or {})
        self.routes, self.param_sets = check_routes(routes, PARAMS_NAMES + tuple(sets)), sets
        try:
            yield self
        finally:
            self.routes, self.param_sets = old

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
        settings: RoleSampling | None = None,
    ) -> list[Completion]:
        """Returns scripted completions (flat, prompt-major) and records the call (its settings included)."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        outputs = [self._next(role, msgs, j) for msgs in messages_batch for j in range(n)]
        self.calls.append(
            SamplerCall(role=role, params=params, messages_batch=copy.deepcopy(list(messages_batch)), n=n,
                        outputs=list(outputs), settings=self.settings if settings is None else settings,
                        served=served_name(params, role, self.routes, self.param_sets))
        )
        return outputs

    def score(self, messages_batch: list[list[dict]], continuations: Sequence[str], params: ParamsName,
              role: str) -> list[float]:
        """Scripted log-probabilities ``scores(messages, continuation, served parameter set)``, one per prompt
        (NaN for every prompt without a ``scores`` function); recorded in ``score_calls`` (outputs = the scores)."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if len(continuations) != len(messages_batch):
            raise ValueError(f"{len(continuations)} continuations for {len(messages_batch)} prompts")
        served = served_name(params, role, self.routes, self.param_sets)
        out = [math.nan if self.scores is None else float(self.scores(m, c, served))
               for m, c in zip(messages_batch, continuations)]
        self.score_calls.append(SamplerCall(role=role, params=params, messages_batch=copy.deepcopy(list(messages_batch)),
                                            n=1, outputs=list(out), settings=self.settings, served=served))
        return out

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
        self.score_calls.clear()
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
