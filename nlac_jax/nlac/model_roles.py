"""The trainer's RoleSampler: every NLAC role sampled by the in-process JAX sampler from θ or θ̄.

One compiled `sampling.Sampler` serves every role and every parameter set: parameters are arguments, so θ, θ̄
(the trainer's live, sharded arrays) and any extra set (the frozen-critic arm's warm-start copy) go through the
same executables with no copy and no recompilation. Scoring (`score`: log π of a given continuation) runs through
`training.scoring.Scorer`, the train step's forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from nlac_jax import text
from nlac_jax.rl.roles import (Completion, PARAMS_NAMES, ParamsName, RoleSampling, check_routes, param_set_weights,
                               served_params)
from nlac_jax.training.scoring import Scorer


@dataclasses.dataclass
class RoleCounters:
    """Per-role generation counters (texts, generated tokens, token slots the sampler ran, seconds, stop reasons,
    prompt tokens presented and prefilled, prefill slots run), reset per phase. useful_token_fraction = tokens /
    slots: the share of decode slots that produced a kept token. prefill_share = prompt tokens prefilled / presented
    (one presentation per sampled row): what shared prefixes and trunks saved (`sampling.Sampler`).
    padded_prefill_share = prefill slots run (padding included, `GenerateOutput.prefill_slots`) / presented: the
    prefill work itself, which real-token counts alone hide (a 64-token rest prefilled in 512 slots)."""

    texts: dict = dataclasses.field(default_factory=dict)
    tokens: dict = dataclasses.field(default_factory=dict)
    slots: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)
    stop_reasons: dict = dataclasses.field(default_factory=dict)
    presented: dict = dataclasses.field(default_factory=dict)
    prefilled: dict = dataclasses.field(default_factory=dict)
    prefill_slots: dict = dataclasses.field(default_factory=dict)

    def add(self, role: str, n_texts: int, n_tokens: int, seconds: float, reasons, n_slots: int = 0,
            presented: int = 0, prefilled: int = 0, prefill_slots: int = 0) -> None:
        self.presented[role] = self.presented.get(role, 0) + presented
        self.prefilled[role] = self.prefilled.get(role, 0) + prefilled
        self.prefill_slots[role] = self.prefill_slots.get(role, 0) + prefill_slots
        self.texts[role] = self.texts.get(role, 0) + n_texts
        self.tokens[role] = self.tokens.get(role, 0) + n_tokens
        self.slots[role] = self.slots.get(role, 0) + n_slots
        self.seconds[role] = self.seconds.get(role, 0.0) + seconds
        for r in reasons:
            key = f"{role}/{r}"
            self.stop_reasons[key] = self.stop_reasons.get(key, 0) + 1

    def as_dict(self, prefix: str = "gen/") -> dict:
        out = {}
        for role, n in self.tokens.items():
            out[f"{prefix}{role}/tokens"] = n
            out[f"{prefix}{role}/texts"] = self.texts[role]
            out[f"{prefix}{role}/tokens_per_s"] = n / max(self.seconds[role], 1e-9)
            out[f"{prefix}{role}/useful_token_fraction"] = n / max(self.slots[role], 1)
        for role, n in self.presented.items():
            if n:
                out[f"{prefix}{role}/prompt_tokens"] = n
                out[f"{prefix}{role}/prefill_share"] = self.prefilled[role] / n
                out[f"{prefix}{role}/padded_prefill_share"] = self.prefill_slots[role] / n
        if self.tokens:
            out[f"{prefix}useful_token_fraction"] = sum(self.tokens.values()) / max(sum(self.slots.values()), 1)
        if sum(self.presented.values()):
            out[f"{prefix}prefill_share"] = sum(self.prefilled.values()) / sum(self.presented.values())
            out[f"{prefix}padded_prefill_share"] = sum(self.prefill_slots.values()) / sum(self.presented.values())
        for k, n in self.stop_reasons.items():
            out[f"{prefix}{k}"] = n
        return out


class ModelRoleSampler:
    """RoleSampler over `sampling.Sampler`.

    get_params: 'policy' -> θ, 'target' -> θ̄ (called at every sample, so it always sees the current arrays).
      Inside `routing(routes, param_sets)`, a routed role is served by the named set instead (`roles.served_params`):
      one of PARAMS_NAMES or a key of `param_sets` (arrays in the train state's layout and shardings, or an object
      with `.params` / `.target_params` that serves θ and θ̄ calls each their own: `roles.param_set_weights`).
    scorer: a `training.scoring.Scorer` for `score` (None: built on first use from the sampler's config and mesh).
    settings: the run's RoleSampling (per-role temperature and token budget, top_p); a call's own `settings`
      replace them for that call (held-out evaluation's greedy policy).
    max_batch: sampler slots: up to this many prompts decode at once; a larger batch runs with continuous batching
      (finished rows are refilled with waiting prompts), so rows do not idle until the longest one ends.
    seed: base seed; call i of the current phase uses seed (seed, phase_seed, i): reproducible across resumes.
    """

    def __init__(self, sampler, tokenizer, get_params: Callable[[str], object], settings: RoleSampling,
                 max_batch: int = 64, seed: int = 0, scorer=None):
        self.sampler, self.tokenizer, self.get_params = sampler, tokenizer, get_params
        self.settings = settings
        self.max_batch, self.seed = int(max_batch), int(seed)
        self.stop_ids = text.stop_token_ids(tokenizer)
        self.counters = RoleCounters()
        self.scorer = scorer
        self.routes: dict[str, str] = {}
        self.param_sets: dict[str, Any] = {}
        self._phase_seed, self._calls = 0, 0

    @contextlib.contextmanager
    def routing(self, routes: Mapping[str, str] | None = None, param_sets: Mapping[str, Any] | None = None):
        """Inside the block, each role in `routes` is served by the parameter set it names, whatever the caller
        asks for; `param_sets` adds named sets (name -> parameter tree). Restored on exit."""
        old = self.routes, self.param_sets
        sets = dict(param_sets or {})
        clash = [k for k in sets if k in PARAMS_NAMES]
        if clash:
            raise ValueError(f"parameter sets {clash}: the names {list(PARAMS_NAMES)} are θ and θ̄ themselves")
        self.routes, self.param_sets = check_routes(routes, PARAMS_NAMES + tuple(sets)), sets
        try:
            yield self
        finally:
            self.routes, self.param_sets = old

    def _weights(self, params: str, role: str):
        name = served_params(params, role, self.routes)
        if name in self.param_sets:  # a tree, or a state with its own θ and θ̄ (roles.param_set_weights)
            return param_set_weights(self.param_sets[name], params)
        return self.get_params(name)

    def start_phase(self, phase_seed: int) -> None:
        """Make the next samples a deterministic function of (seed, phase_seed, call index); reset counters."""
        self._phase_seed, self._calls = int(phase_seed), 0
        self.counters = RoleCounters()

    def sample(self, messages_batch: list[list[dict]], params: ParamsName, role: str, n: int = 1,
               settings: RoleSampling | None = None) -> list[Completion]:
        """`n` completions per chat prompt, flat and prompt-major (`out[i*n + j]`), each with the sampler's
        stop reason (so callers can refuse cut-off texts as targets)."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if not messages_batch:
            return []
        prompts = [text.encode_chat(self.tokenizer, m, add_generation_prompt=True) for m in messages_batch]
        settings = self.settings if settings is None else settings
        temp, budget, top_p = settings.temperature(role), settings.budget(role), float(settings.top_p)
        weights = self._weights(params, role)
        seed = int(np.random.SeedSequence([self.seed, self._phase_seed, self._calls]).generate_state(1)[0])
        self._calls += 1
        t0 = time.perf_counter()
        res = self.sampler.generate(weights, prompts, max_new_tokens=budget, temperature=temp, top_p=top_p,
                                    stop_token_ids=self.stop_ids, seed=seed, tokenizer=self.tokenizer,
                                    slots=self.max_batch, n=n)  # each prompt prefilled once for its n samples
        prefilled = getattr(res, "prefill_tokens", None)  # (a stand-in sampler may not count them)
        self.counters.add(role, len(prompts) * n, int(np.sum(res.lengths)), time.perf_counter() - t0, res.stop_reason,
                          n_slots=res.token_slots, presented=n * sum(map(len, prompts)) if prefilled is not None else 0,
                          prefilled=int(prefilled or 0), prefill_slots=int(getattr(res, "prefill_slots", 0) or 0))
        return [Completion(t, str(r)) for t, r in zip(res.texts, res.stop_reason, strict=True)]

    def score(self, messages_batch: list[list[dict]], continuations: Sequence[str], params: ParamsName,
              role: str) -> list[float]:
        """log π(continuation_i | role prompt i) per prompt (Σ over the continuation's tokens, no end-of-turn token
        appended), under the parameter set that serves `role` (routing applies). The prompt is rendered with the
        generation prompt and the continuation tokenized on its own, exactly as a training target is."""
        if params not in PARAMS_NAMES:
            raise ValueError(f"params must be one of {PARAMS_NAMES}, got {params!r}")
        if len(continuations) != len(messages_batch):
            raise ValueError(f"{len(continuations)} continuations for {len(messages_batch)} prompts")
        if not messages_batch:
            return []
        if self.scorer is None:
            self.scorer = Scorer(self.sampler.cfg, self.sampler.mesh, self.sampler.rules, max_batch=self.max_batch)
        prompts = [text.encode_chat(self.tokenizer, m, add_generation_prompt=True) for m in messages_batch]
        conts = [text.encode_text(self.tokenizer, c) for c in continuations]
        t0 = time.perf_counter()
        out = self.scorer.logprobs(self._weights(params, role), prompts, conts,
                                   pad_id=self.tokenizer.pad_token_id or 0)
        self.counters.add(f"{role}_score", len(prompts), 0, time.perf_counter() - t0, ())
        return [float(x) for x in out]
