"""Scoring: log π(continuation | prompt) under any parameter set, batched, through the train step's forward.

    scorer = Scorer(cfg, mesh)
    lp = scorer.logprobs(params, prompts, continuations)    # [B] float64: Σ_t log p(c_t | prompt, c_<t)

The critic metrics read P(success | s, a) as a normalised pair of such scores (``Outcome: success`` against
``Outcome: failure`` right after the successor prompt), so they need exact log-probabilities of GIVEN texts, not
samples. The rows are packed like training examples (``batching.pack_examples``: prompt + continuation, right-padded,
the continuation under the loss mask) and go through the same ``CausalLM`` forward and ``loss.token_nll`` LM head as
L1/L2, so a score is exactly minus the (unweighted) NLL the train step would compute for that example. Only each
row's continuation positions reach the LM head (gathered first, as ``loss.target_position_losses`` does), so a large
vocabulary costs [B, K, V] logits with K the continuation bucket, not [B, T, V].

Static shapes, so that evaluation compiles once: every call runs `max_batch` rows (filler rows added; a multiple
of the data-parallel size) and T = prompt bucket + continuation bucket (powers of two >= 16 and >= 8, as the
sampler buckets its prompts and budgets): a new executable only when the longest prompt crosses a power of two.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax import models, text
from nlac_jax.models.config import ModelConfig
from nlac_jax.models.decoder import CausalLM
from nlac_jax.parallel import sharding
from nlac_jax.parallel.distributed import replicated_to_global
from nlac_jax.training import batching, loss as loss_lib

__all__ = ["Scorer", "SCORE_KEYS"]

SCORE_KEYS = ("input_ids", "attention_mask", "positions", "loss_mask")
_MIN_CONT_BUCKET = 8


def _continuation_logprobs(cfg: ModelConfig, params, batch, cont_bucket: int) -> jax.Array:
    """[B] Σ log-probs of each row's loss-masked tokens (traced; `cont_bucket` >= every row's target count)."""
    hidden, _ = CausalLM(cfg).apply({"params": params}, batch["input_ids"], batch["positions"],
                                    batch["attention_mask"], return_hidden=True)
    labels, tmask = loss_lib.shift_targets(batch["input_ids"], batch["loss_mask"])
    per_row = jnp.sum(tmask > 0, axis=1)
    idx = jax.vmap(lambda m: jnp.nonzero(m > 0, size=cont_bucket, fill_value=0)[0])(tmask)  # [B, K]
    valid = jnp.arange(cont_bucket)[None, :] < per_row[:, None]
    h = jnp.take_along_axis(hidden, idx[..., None], axis=1)
    nll = loss_lib.token_nll(cfg, h, params, jnp.take_along_axis(labels, idx, axis=1))
    return -jnp.sum(jnp.where(valid, nll, 0.0), axis=1)


class Scorer:
    """Jitted log-probabilities of continuations for one model config (and mesh); parameters are arguments, so
    θ, θ̄ or a frozen copy go through the same executables.

    params must be in the TRAINING layout (the train state's trees; not the sampler's per-layer run layout).
    max_batch: rows per executable call (larger inputs are scored in chunks of this many).
    """

    def __init__(self, cfg: ModelConfig, mesh=None, rules=None, max_batch: int = 64):
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self._dp = 1 if mesh is None else sharding.data_parallel_size(mesh, rules)
        self.max_batch = -(-max(1, int(max_batch)) // self._dp) * self._dp
        if mesh is None:
            self._param_shardings, self._batch_shardings, rep = None, None, None
        else:
            from jax.sharding import NamedSharding, PartitionSpec as P
            self._param_shardings = models.param_shardings(cfg, mesh, rules)
            every = sharding.batch_shardings(mesh, rules)
            self._batch_shardings = {k: every[k] for k in SCORE_KEYS}
            rep = NamedSharding(mesh, P())
        fn = lambda params, batch, cont_bucket: _continuation_logprobs(cfg, params, batch, cont_bucket)  # noqa: E731
        if mesh is None:
            self._jitted = jax.jit(fn, static_argnums=(2,))
        else:
            self._jitted = jax.jit(fn, static_argnums=(2,), in_shardings=(self._param_shardings,
                                                                          self._batch_shardings), out_shardings=rep)

    def _ctx(self):
        import contextlib
        return sharding.use_mesh(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def logprobs(self, params, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                 pad_id: int = 0) -> np.ndarray:
        """Σ_t log p(continuation_t | prompt, continuation_<t) per row: [B] float64.

        prompts, continuations: B token-id lists each (both non-empty; nothing is cut, so a row longer than the
        model context is refused by name).
        """
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        context = self.cfg.max_position_embeddings or None
        rows = []
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            if not len(p) or not len(c):
                raise ValueError(f"row {i}: empty {'prompt' if not len(p) else 'continuation'}; scoring needs both")
            if context and len(p) + len(c) > context:
                raise ValueError(f"row {i}: {len(p)} prompt + {len(c)} continuation tokens exceed the model context "
                                 f"of {context}")
            rows.append(batching.Example(prompt_ids=list(p), target_ids=list(c)))
        out = np.zeros(len(rows), np.float64)
        if self.mesh is not None and params is not None:
            params = jax.device_put(params, self._param_shardings)  # no copy when already laid out
        for s in range(0, len(rows), self.max_batch):
            chunk = rows[s:s + self.max_batch]
            K = text.bucket_length(max(len(r.target_ids) for r in chunk), _MIN_CONT_BUCKET)
            T = text.bucket_length(max(len(r.prompt_ids) for r in chunk), 16) + K
            packed = batching.pack_examples(chunk, max_len=T, pad_id=pad_id, batch_size=self.max_batch, pad_to=T)
            batch = {k: getattr(packed, k) for k in SCORE_KEYS}
            if jax.process_count() > 1:  # every process holds the whole batch: each places its own rows
                batch = replicated_to_global(batch, self._batch_shardings)
            with self._ctx():
                lp = self._jitted(params, batch, K)
            out[s:s + len(chunk)] = np.asarray(jax.device_get(lp), np.float64)[:len(chunk)]
        return out
