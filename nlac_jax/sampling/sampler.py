"""The public host-side API: `Sampler` (compiled prefill + decode for one config and mesh), `get_sampler`, `generate`.

Host work only: the sampler's jitted functions and its run-layout weights, buckets and padding, and the two ways a
call runs (one batch, or continuous batching over fixed slots). Where each call's prefill starts (a shared prefix,
trunks, what the store keeps across calls) is decided in `starts`. What a call asks for is checked and prepared in
`requests` (arguments, prompt encoding, the context-overflow policy, stop strings, the
shared prefix); the decode's slot schedule (refills, collection, the drain's compaction) is in `slots`; turning its
buffers into a `GenerateOutput` is in `output`; the compiled code is in `decode`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax import models, text
from nlac_jax.models.config import ModelConfig
from nlac_jax.models.decoder import fuse_projections, has_inference_weights, inference_weights, layout_params
from nlac_jax.parallel import sharding, xla_options
from nlac_jax.parallel.distributed import replicated_to_global
from nlac_jax.sampling.decode import (MIN_STOP_SLOTS, compact_impl, controls, decode_impl, empty_state, fit_impl,
                                      keep_into_impl, pack_impl, prefill_impl, prefix_impl, refill_impl,
                                      trunk_impl)
from nlac_jax.sampling.requests import (_MIN_SHARED_PREFIX, apply_overflow, as_key, check_sampling_args, encode_prompts,
                                        shared_prefix_length, stop_table)
from nlac_jax.sampling.output import GenerateOutput, finish_rows
from nlac_jax.sampling.slots import pad_rows, run_slots
from nlac_jax.sampling.starts import StartCaches
from nlac_jax.text import bucket_length  # the one bucketing rule (prompts, batches, budgets)

log = logging.getLogger(__name__)
Array = jax.Array


_MIN_PROMPT_BUCKET = 16
_MIN_NEW_BUCKET = 16


class Sampler:
    """Compiled prefill + decode for one model config (and mesh). Keep one and call it with any params.

        sampler = Sampler(cfg, mesh=None)
        out = sampler.generate(params, prompts, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=3, tokenizer=tok)

    `params` must have the config's shapes; with a mesh they should already be laid out by
    `models.param_shardings(cfg, mesh)` (device_put to that layout is a no-op when they are).
    """

    def __init__(self, cfg: ModelConfig, mesh=None, rules=None, min_prompt_bucket: int = _MIN_PROMPT_BUCKET,
                 min_new_bucket: int = _MIN_NEW_BUCKET, layer_loop: str = "auto", min_batch_bucket: int = 1,
                 compact_levels: int = 0, weights: str = "compute", min_shared_prefix: int = _MIN_SHARED_PREFIX,
                 trunk_rows: int = 0, min_trunk: int = _MIN_SHARED_PREFIX, prefix_store: int = 4):
        # min_batch_bucket: every call pads its batch to at least this many rows. Each new (batch, prompt, new-token)
        # bucket costs a compilation (seconds on a CPU), while a few padded rows of a small model cost almost
        # nothing: rollouts whose active episodes shrink 16 -> 9 -> 3 -> 1 then reuse one executable.
        if layer_loop not in ("auto", "unrolled", "scan"):
            raise ValueError(f"layer_loop={layer_loop!r} is not one of auto|unrolled|scan")
        # weights: 'compute' runs prefill/decode from a copy of the matmul weights in cfg.dtype, made once per
        # parameter tree (decoder.inference_weights; bit-identical outputs, half the weight bytes each decode step
        # reads under bf16 compute with float32 master weights); 'master' reads the trees as given.
        if weights not in ("compute", "master"):
            raise ValueError(f"weights={weights!r} is not one of compute|master")
        self.weights = weights
        # min_shared_prefix: when a call's prompts (two or more) share a common prefix of at least this many tokens,
        # it is prefilled once (`prefix_impl`) and every prompt only prefills its rest against that cache (0: never).
        # Full-attention configs only: a sliding window is measured in cache slots, which the padded gap between
        # the prefix and each prompt's rest would skew.
        self.min_shared_prefix = max(0, int(min_shared_prefix))
        # prefix_store: the last this-many shared prefixes' caches are kept across calls, each with the parameter tree
        # it was computed from (0: none kept). A call whose shared prefix (`StartCaches.pick_shared`: the same tokens)
        # was computed under the same tree reuses it instead of prefilling it again: in an NLAC targets phase every
        # role's call starts with the environment's system prompt, and a rollout's turns too. Kept at the prefix's own
        # length and fitted to each call's cache length (`fit_impl`: a copy), so which call hits the store never changes
        # what is compiled. `release()` empties it, as it drops the trees it was computed from. Trees are matched by
        # identity: with a mesh, pass them already laid out (`models.param_shardings`, as the loop's θ and θ̄ are); a
        # tree the call has to place is a new tree at every call and finds nothing kept. With trunk_rows, as many trunk
        # sets are kept too: a call whose prompts share more with an earlier call's trunks (same tree, same common
        # prefix; in a targets phase, the same episodes' transcripts read by another role) than its own trunks would
        # save starts from them (`requests.plan_from_trunks`) and prefills none. A call that prefilled no trunks of its
        # own keeps its prompts as a trunk set (`StartCaches.keep_plan`: up to trunk_rows of them, the longest;
        # continuous batching packs each refill's as it goes), so a rollout's next turn, whose prompts extend this
        # turn's, prefills only the action and the new observation.
        self.prefix_store = max(0, int(prefix_store))
        # trunk_rows: > 0 shares more than the common prefix: prompts whose rests share at least `min_trunk` more
        # tokens form groups (at most trunk_rows, those that save the most), each prefilled once up to its longest
        # member (a trunk), and each prompt keeps its common prefix with that trunk (`requests.plan_trunks`: in an RL
        # targets phase, one episode's states). 0: off. A fixed row count (a multiple of the data-parallel degree),
        # so the trunk executable's shape depends on the data only through its width, one of a grid of two per
        # power of two. One more executable call per sampler call, made only when a plan saves at least a fifth of
        # the rests' tokens. Its cost: the first call of two or more prompts at a (prompt bucket, new-token bucket,
        # shared prefix) compiles a trunk and a prefill executable per grid width (2 log2(width / min_trunk) each),
        # so that no later call there compiles, whatever width its data asks for.
        self.trunk_rows, self.min_trunk = max(0, int(trunk_rows)), max(1, int(min_trunk))
        platform = next(iter(mesh.devices.flat if mesh is not None else jax.devices())).platform
        if layer_loop == "auto":
            layer_loop = "unrolled" if (not cfg.scan_layers or platform == "cpu") else "scan"
        self.cfg, self.mesh, self.rules, self.layer_loop = cfg, mesh, rules, layer_loop
        self.min_prompt_bucket, self.min_new_bucket = int(min_prompt_bucket), int(min_new_bucket)
        self.min_batch_bucket = max(1, int(min_batch_bucket))
        # compact_levels: once no prompt waits, the rows still running move into a batch half as large, up to this
        # many times (0: never), so a call's drain does not decode finished rows. Each level is one more decode
        # executable per bucket (all compiled the first time the bucket is seen): few levels keep most of the gain.
        self.compact_levels = max(0, int(compact_levels))
        self.drain_compiled: set = set()
        self._param_shardings = None
        # the layer loop is a model option: the compiled functions run the model with this config
        run_cfg = cfg.replace(scan_layers=layer_loop == "scan")
        # the prompt-processing executables get their own XLA options (nlac_jax/parallel/xla_options.py; on CPU only)
        self.prefill_options = xla_options.for_executable("prefill", cfg.dtype, platform) or None
        # named functions, so the loop's "compiled N new executable(s)" warning says which
        def sampler_prefill(params, ids, mask, live, key, ctl, src=None, prefix=None, *, new_bucket):
            return prefill_impl(run_cfg, params, ids, mask, live, key, ctl, src, prefix, new_bucket=new_bucket)

        def sampler_prefix(params, ids, mask, *, cache_len):
            return prefix_impl(run_cfg, params, ids, mask, cache_len=cache_len)

        def sampler_fit(cache, *, cache_len):
            return fit_impl(cache, cache_len=cache_len)

        def sampler_trunk(params, ids, mask, prefix, *, cache_len):
            return trunk_impl(run_cfg, params, ids, mask, prefix, cache_len=cache_len)

        def sampler_decode(params, st, ctl):
            return decode_impl(run_cfg, params, st, ctl)

        def sampler_empty(key, batch, cache_len, new_bucket):
            return empty_state(run_cfg, key, batch=batch, cache_len=cache_len, new_bucket=new_bucket)

        def sampler_refill(params, st, ids, mask, slots, rows, ctl, src, prefix=None):
            return refill_impl(run_cfg, params, st, ids, mask, slots, rows, ctl, src, prefix)

        self.prefill = jax.jit(sampler_prefill, static_argnames=("new_bucket",),
                               compiler_options=self.prefill_options)
        self.prefix = jax.jit(sampler_prefix, static_argnames=("cache_len",), compiler_options=self.prefill_options)
        self.fit = jax.jit(sampler_fit, static_argnames=("cache_len",))
        self.trunk = jax.jit(sampler_trunk, static_argnames=("cache_len",), compiler_options=self.prefill_options)
        self.decode = jax.jit(sampler_decode, donate_argnums=(1,))
        self.empty = jax.jit(sampler_empty, static_argnames=("batch", "cache_len", "new_bucket"))
        self.refill = jax.jit(sampler_refill, donate_argnums=(1,), compiler_options=self.prefill_options)
        def sampler_compact(st, keep):  # its own function: jit caches are per function, and per Sampler here
            return compact_impl(st, keep)

        self.compact = jax.jit(sampler_compact)

        def sampler_pack(cache, rows, index):
            return pack_impl(cache, rows, index)

        self.pack = jax.jit(sampler_pack)

        def sampler_keep(kept, cache, slots, dest, index):
            return keep_into_impl(kept, cache, slots, dest, index)

        self.keep_into = jax.jit(sampler_keep, donate_argnums=(0,))
        # The unrolled loop also fuses gate/up and q/k/v into one matmul each (decoder.fuse_projections); q/k/v
        # only without tensor parallelism, whose 'heads' and 'kv_heads' shards a concatenation would mix.
        fuse_qkv = mesh is None or dict(mesh.shape).get("tensor", 1) == 1
        def to_layout(params):
            return self.weights_for_inference(layout_params(run_cfg, params) if layer_loop == "scan" else
                                              fuse_projections(layout_params(run_cfg, params), cfg.num_layers,
                                                               fuse_qkv))
        if layer_loop == "scan" and mesh is not None:
            # the copy keeps the trees' own shardings: those the planner compiles the executables for
            self._to_layout = jax.jit(to_layout, out_shardings=models.param_shardings(run_cfg, mesh, rules))
        else:
            self._to_layout = jax.jit(to_layout)
        self._layouts: list = []  # [(leaf ids, source tree, tree in the run layout)], newest first
        self.starts = StartCaches(self)  # where each call starts, and the store across calls

    # ------------------------------------------------------------------ helpers
    def _mesh_ctx(self):
        import contextlib
        return sharding.use_mesh(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    @property
    def data_parallel(self) -> int:
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape]))

    def place_params(self, params):
        """device_put params to the config's shardings on this mesh (no copy when already there)."""
        if self.mesh is None:
            return params
        if self._param_shardings is None:
            self._param_shardings = models.param_shardings(self.cfg, self.mesh, self.rules)
        return jax.device_put(params, self._param_shardings)

    def weights_for_inference(self, params):
        """The weights the compiled functions read, in any layer layout: `decoder.inference_weights` (matmul
        operands in cfg.dtype) unless this sampler was built with weights='master'. Works on ShapeDtypeStructs
        (the planner's abstract arguments)."""
        return params if self.weights == "master" else inference_weights(self.cfg, params)

    def run_params(self, params):
        """`params` in the layout the compiled functions run: for the unrolled loop, scanned weights sliced per
        layer and the projections fused (decoder.fuse_projections); the matmul weights in the compute dtype
        (`weights_for_inference`). Done once per parameter tree, not inside every prefill/decode/refill executable,
        where it copied all the weights on every call; the last four trees are kept (a loop samples from θ and θ̄,
        the frozen-critic arm from its frozen critic too, the split-critic arm from its critic's θ and θ̄: fewer
        would rebuild a tree at every call). `release` drops them."""
        if self.layer_loop == "scan":
            ready = "layers" in params
        else:
            ready = "gate_up" in params.get("layers_0", {}).get("mlp", {})
        if ready and self.weights == "compute":
            ready = has_inference_weights(self.cfg, params)
        if ready:
            return params
        ids = tuple(map(id, jax.tree.leaves(params)))
        for known, _source, out in self._layouts:
            if known == ids:  # the source tree is held, so its leaves' ids cannot be reused by other arrays
                return out
        out = self._to_layout(params)
        self._layouts = [(ids, params, out)] + self._layouts[:3]
        return out

    def release(self) -> None:
        """Drop the cached run-layout trees (and the source trees they pin), e.g. before a train step: the
        next parameter update makes them stale, and they would otherwise stay in device memory beside it. The
        stored prefix caches (`prefix_store`) go with them."""
        self._layouts = []
        self.forget_prefixes()

    def forget_prefixes(self) -> None:
        """Empty the prefix store (`prefix_store`: kept prefixes and trunk sets), keeping the run-layout trees: the
        next call computes every prefix it shares (e.g. a benchmark that times one call, not a call after its
        twin)."""
        self.starts.forget()

    def buckets(self, batch: int, longest_prompt: int, max_new_tokens: int) -> tuple[int, int, int]:
        """(batch bucket, prompt bucket, new-token bucket) for these sizes."""
        b = bucket_length(batch, self.min_batch_bucket)
        dp = self.data_parallel
        b = -(-b // dp) * dp
        return (b, bucket_length(longest_prompt, self.min_prompt_bucket, fine=True),
                bucket_length(max_new_tokens, self.min_new_bucket))

    # ------------------------------------------------------------------ main entry
    def generate(self, params, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop_token_ids=None, stop_strings: Sequence[str] = (), seed=0, tokenizer=None,
                 overflow: str = "truncate_left", max_context: int | None = None, slots: int | None = None,
                 refill_rows: int | None = None, n: int = 1) -> GenerateOutput:
        """Generate for a batch of prompts (token-id lists, or strings with `tokenizer`). See the package docstring.

        n: samples per prompt; the output has len(prompts) * n rows, prompt-major (row i*n + j), exactly as if each
          prompt were repeated n times in `prompts` (same rows, same randomness), but each prompt is prefilled once
          and its cache copied to its n rows.

        slots: with more prompts than `slots`, continuous batching: `slots` rows (bucketed) decode at once and the
          rows that finish are refilled with waiting prompts, `refill_rows` at a time (default slots // 8), so no
          row idles until the longest one ends. Greedy results equal the one-batch path's; sampled ones are
          reproducible for a seed (each prompt's randomness follows its index, not its slot)."""
        cfg = self.cfg
        per_prompt = int(n)  # (`n` is reused below for row lengths)
        if per_prompt < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_sampling_args(temperature, top_k, top_p)
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(s for s in stop_strings)
        if any(not s for s in stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        if stop_token_ids is None:
            if tokenizer is not None:
                stop_token_ids = text.stop_token_ids(tokenizer)
            else:
                eos = cfg.eos_token_id
                stop_token_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        elif isinstance(stop_token_ids, (int, np.integer)):
            stop_token_ids = (int(stop_token_ids),)
        stop_token_ids = tuple(int(t) for t in stop_token_ids)
        context = int(max_context if max_context is not None else cfg.max_position_embeddings)

        prompts = encode_prompts(prompts, tokenizer, self.cfg.vocab_size)
        prompts, dropped = apply_overflow(prompts, max_new_tokens, context, overflow)
        stop_ids = np.full((bucket_length(len(stop_token_ids), MIN_STOP_SLOTS),), -1, np.int32)
        stop_ids[: len(stop_token_ids)] = stop_token_ids
        table, host_check = stop_table(tokenizer, self.cfg.vocab_size, stop_strings)
        ctl = controls(temperature, top_k, top_p, max_new_tokens, context, jnp.asarray(stop_ids), table)
        key = as_key(seed)
        B = len(prompts) * per_prompt
        common = self.shared_prefix_length(prompts)
        with self._mesh_ctx():
            params = self.run_params(self.place_params(params))
            if slots is not None and B > int(slots):
                tokens, logprobs, lengths, reason, steps, token_slots, L, prefilled, prefill_slots = self._continuous(
                    params, prompts, per_prompt, max_new_tokens, key, ctl, int(slots), refill_rows, common)
            else:
                tokens, logprobs, lengths, reason, steps, token_slots, L, prefilled, prefill_slots = self._one_batch(
                    params, prompts, per_prompt, max_new_tokens, key, ctl, common)
        out = finish_rows(tokens[:B, :max_new_tokens], logprobs[:B, :max_new_tokens], lengths[:B], reason[:B],
                          tokenizer, stop_strings, host_check)
        return dataclasses.replace(
            out, prompt_lengths=np.repeat(np.asarray([len(p) for p in prompts], np.int32), per_prompt),
            prompt_tokens_dropped=np.repeat(np.asarray(dropped), per_prompt), num_steps=int(steps),
            token_slots=int(token_slots), shared_prefix=L, prefill_tokens=int(prefilled),
            prefill_slots=int(prefill_slots))

    def device_rows(self, *arrays):
        """Host arrays [rows, ...] placed on the mesh with their leading axis on 'batch' (as they are without one).
        With several processes every one holds the same host arrays (the caller's contract) and places the slices
        its devices own: the results are global arrays."""
        if self.mesh is None:
            return arrays
        shs = [sharding.named_sharding(("batch",) + (None,) * (np.ndim(a) - 1), np.shape(a), self.mesh, self.rules)
               for a in arrays]
        if jax.process_count() > 1:
            return tuple(replicated_to_global(list(arrays), shs))
        return tuple(jax.device_put(a, sh) for a, sh in zip(arrays, shs))

    def replicated(self, tree):
        """Small host values (key, controls, refill indices) as arrays every device sees in full; global arrays when
        several processes share the mesh."""
        if self.mesh is None or jax.process_count() == 1:
            return tree
        rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        is_key = lambda x: isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731

        def one(x):
            if is_key(x):
                data = replicated_to_global(np.asarray(jax.random.key_data(x)), rep)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return replicated_to_global(np.asarray(x), rep)
        return jax.tree.map(one, tree, is_leaf=is_key)

    def shared_prefix_length(self, prompts: Sequence[list]) -> int:
        """The prompts' common prefix (`shared_prefix_length` with this sampler's `min_shared_prefix`; 0 for a
        config with sliding-window layers). A call shares `prefix_to_share` of it."""
        if self.cfg.has_sliding_layers:
            return 0
        return shared_prefix_length(prompts, self.min_shared_prefix)

    def rest_width(self, rests: Sequence[list], width: int, start) -> int:
        """The slot width each prompt's rest is prefilled in, after a start cache (`_starts`): `width` (the prompt
        bucket minus the shared prefix) or, when the rests are short, the power of two that holds the longest
        (at least `min_prompt_bucket`): a call whose prompts share 1,536 of 1,600 tokens prefills 64-token rests in
        64 slots instead of the 512 the 2,048-token bucket leaves, each row's rest then sitting right after the
        prefix. The cache length, so every decode executable, is unchanged; the prefill compiles once per rest
        width, a function of the call's data alone (no history: a resumed process picks what the uninterrupted one
        did). Without a start cache, or with trunks (their grid compiles every rest width it may plan), `width`."""
        if start is None or self.trunk_rows or not rests:
            return width
        return min(width, bucket_length(max(map(len, rests)), self.min_prompt_bucket))

    def prefix_arg(self, cache, src, keep, rows: int):
        """The `prefix` argument of prefill / refill for `rows` prompt rows (src / keep: per real row, padded here
        with row 0 and nothing kept); None without a start cache."""
        if cache is None:
            return None
        D = self.data_parallel
        full_src = (np.arange(rows) * D // rows).astype(np.int32)  # each row's own shard's copy of the prefix
        full_keep = np.zeros((rows,), np.int32)
        full_keep[:len(keep)] = keep
        if src is not None:
            full_src[:] = 0
            full_src[:len(src)] = src
        src, keep = self.device_rows(full_src, full_keep)
        return dict(cache=cache, src=src, keep=keep)

    def _one_batch(self, params, prompts, n, max_new_tokens, key, ctl, common=0):
        """Every prompt (n rows each) in one bucketed batch: prefill, then decode until all rows are done (compacting
        the batch as rows finish). With n > 1 each prompt is prefilled once and copied to its n rows. With a
        `common` prefix, the first `shared` tokens (`StartCaches.pick_shared`) are prefilled once, into the first
        `shared` slots of the prompt bucket (then the trunks, `StartCaches.plan`), and each prompt's rest fills the
        other slots (same cache length, same decode). Returns the per-row arrays, the rounds, the token slots,
        `shared`, the prompt tokens prefilled and the prompt slots prefilled (padding included)."""
        P = len(prompts) * n
        Bb, Tb, Nb = self.buckets(P, max(len(p) for p in prompts), max_new_tokens)
        full = Tb
        whole = prompts
        prompts, Tb, cache, psrc, pkeep, shared, prefilled, slots, fresh, own = self.starts.plan(
            params, prompts, Tb, Nb, common)
        Tb = self.rest_width(prompts, Tb, cache)
        prefilled += sum(map(len, prompts))
        Ub = self.buckets(len(prompts), 1, 1)[0] if n > 1 else Bb
        src = None
        if Ub < Bb:  # fewer prompts to prefill than rows: prefill each once
            src = np.zeros((Bb,), np.int32)
            src[:P] = np.repeat(np.arange(len(prompts), dtype=np.int32), n)
        else:
            prompts, Ub = [p for p in prompts for _ in range(n)], Bb
            psrc, pkeep = (None if psrc is None else np.repeat(psrc, n)), np.repeat(pkeep, n)
        prefix = self.prefix_arg(cache, psrc, pkeep, Ub)
        ids, mask = pad_rows(prompts, Ub, Tb)
        ids, mask = self.device_rows(ids, mask)
        (live,) = self.device_rows(np.arange(Bb) < P)
        key, ctl, src = self.replicated((key, ctl, src))
        if fresh is not None:
            self.starts.compile_rests(fresh, full - shared, Ub, lambda i, m, pre: self.prefill.lower(
                params, i, m, live, key, ctl, src, pre, new_bucket=Nb).compile())
        st = self.prefill(params, ids, mask, live, key, ctl, src, prefix, new_bucket=Nb)
        # the prompts kept for the next call, before the decode donates the state
        self.starts.keep_prompts(params, st.cache, whole, n, shared, (full, Nb), own)
        holds = [b if b < P else -1 for b in range(Bb)]
        out = run_slots(self, params, st, ctl, prompts, 1, holds, Nb, nxt=P, refill_rows=0, slots_used=Bb, rows=P)
        return out[:-1] + (shared, prefilled, slots + Ub * Tb)

    def _continuous(self, params, prompts, n, max_new_tokens, key, ctl, slots, refill_rows, common=0):
        """Continuous batching over a fixed slot count: refill finished rows with waiting prompts between decode
        calls (host syncs only there). With n > 1 a refill places whole prompts: each prefilled once, into n slots.
        With a `common` prefix (as in `_one_batch`), every refill starts from the shared prefix's (or the trunks')
        cache."""
        B, Tb, Nb = self.buckets(slots, max(len(p) for p in prompts), max_new_tokens)
        cache_len, whole, full = Tb + Nb, prompts, Tb
        prompts, Tb, cache, psrc, pkeep, shared, prefilled, start_slots, _, own = self.starts.plan(
            params, prompts, Tb, Nb, common)
        Tb = self.rest_width(prompts, Tb, cache)
        prefilled += sum(map(len, prompts))
        dp, per = self.data_parallel, n  # row r holds sample r % per of prompt r // per, whatever n becomes below
        want = max(1, B // 8) if refill_rows is None else int(refill_rows)
        if n > B // dp * dp or n > B:  # a prompt's n rows cannot all fit at once: no sharing
            prompts = [p for p in prompts for _ in range(n)]
            psrc, pkeep, n = (None if psrc is None else np.repeat(psrc, n)), np.repeat(pkeep, n), 1
        # prompts per refill: its own bucket (not min_batch_bucket, which would make every refill wait for 16 free
        # slots), a multiple of the data-parallel degree, and its n rows each must fit the slots
        Ru = -(-bucket_length(-(-want // n), 1) // dp) * dp
        while Ru * n > B and Ru > dp:
            Ru -= dp
        key, ctl = self.replicated((key, ctl))
        st = self.empty(key, batch=B, cache_len=cache_len, new_bucket=Nb)
        self.starts.compile_refills(params, st, ctl, B, (full, Nb), shared, Ru, n)
        on_refill, finish = self.starts.keeper(params, st, key, whole, per, shared, (full, Nb), own, B, Ru)
        out = run_slots(self, params, st, ctl, prompts, n, [-1] * B, Nb, nxt=0, refill_rows=Ru, slots_used=0,
                        rows=len(prompts) * n, prompt_bucket=Tb,
                        prefix=None if cache is None else (cache, psrc, pkeep), on_refill=on_refill)
        finish()  # the prompts kept for the next call
        return out[:-1] + (shared, prefilled, start_slots + out[-1])

    __call__ = generate

    def cache_sizes(self) -> dict:
        """Compiled variants held by this Sampler's jitted functions."""
        return {"prefill": self.prefill._cache_size(), "prefix": self.prefix._cache_size(),
                "fit": self.fit._cache_size(),
                "trunk": self.trunk._cache_size(),
                "decode": self.decode._cache_size(),
                "empty": self.empty._cache_size(), "refill": self.refill._cache_size(),
                "compact": self.compact._cache_size()}


_SAMPLERS: dict = {}
_SAMPLERS_LOCK = threading.Lock()


def get_sampler(cfg: ModelConfig, mesh=None, rules=None) -> Sampler:
    """The shared Sampler for (cfg, mesh, rules): `generate` reuses its compiled functions across calls."""
    key = (cfg, mesh, rules)
    with _SAMPLERS_LOCK:
        s = _SAMPLERS.get(key)
        if s is None:
            s = _SAMPLERS[key] = Sampler(cfg, mesh=mesh, rules=rules)
        return s


def generate(model_or_cfg_params, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, stop_token_ids=None, stop_strings: Sequence[str] = (), seed=0, tokenizer=None,
             mesh=None, overflow: str = "truncate_left", max_context: int | None = None, n: int = 1) -> GenerateOutput:
    """Sample continuations for `prompts` from a `models.Model` (or a `(ModelConfig, params)` pair).

    prompts: list of token-id lists, or of strings (needs a tokenizer: `tokenizer=` or the Model's own).
    max_new_tokens: budget per row. temperature 0 = greedy; top_k 0 = off; top_p 1 = off. seed: int or PRNG key.
    stop_token_ids: ids that end a row (default: the tokenizer's stop ids, else the config's eos; () = none).
    stop_strings: strings that end a row (needs a tokenizer). mesh: run sharded (params are laid out on it).
    overflow: 'truncate_left' | 'error' | 'stop' (package docstring). n: samples per prompt (rows i*n + j, each
    prompt prefilled once). Returns a GenerateOutput with len(prompts) * n rows.
    """
    if isinstance(model_or_cfg_params, tuple):
        cfg, params = model_or_cfg_params
    else:
        cfg, params = model_or_cfg_params.config, model_or_cfg_params.params
        if tokenizer is None:
            tokenizer = getattr(model_or_cfg_params, "tokenizer", None)
    return get_sampler(cfg, mesh).generate(
        params, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_token_ids=stop_token_ids, stop_strings=stop_strings, seed=seed, tokenizer=tokenizer, overflow=overflow,
        max_context=max_context, n=n)
