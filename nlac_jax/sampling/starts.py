"""Where each call of a `Sampler` starts its prefill, and what it keeps for the calls after it: the common prefix
prefilled once (`pick_shared`, `prefix_cache`), the trunks of a call's prompts (`requests.plan_trunks`), the store of
common prefixes and trunk sets kept across calls under the parameter tree they were computed with, a rollout turn's
prompts kept for the next turn (`keep_prompts`, `keeper`), and the compile-ahead of every width these may give a
call's prefills and refills (`compile_rests`, `compile_refills`), so which width a call's data picks never compiles
later. The sampler's jitted functions run the device work; this module decides what they run on.
(The package docstring of `nlac_jax.sampling` describes the scheme and its numbers.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nlac_jax.sampling.requests import plan_from_trunks, plan_trunks, prefix_to_share, trunk_grid
from nlac_jax.sampling.slots import on_device, pad_rows

__all__ = ["StartCaches"]


class StartCaches:
    """One Sampler's start caches: its store across calls and the shapes it has compiled them for. The sampler's
    construction arguments (`min_shared_prefix`, `prefix_store`, `trunk_rows`, `min_trunk`) are read from it."""

    def __init__(self, sampler):
        self.s = sampler
        self.stored: list = []  # [(leaf ids, parameter tree, prefix tokens, cache)], newest first
        self.trunk_sets: list = []  # [(leaf ids, tree, prefix tokens, trunk tokens, width, cache)], newest first
        self.prefix_lengths: dict = {}  # (prompt bucket, new-token bucket) -> shared lengths compiled there
        # (prompt bucket, new-token bucket, shared prefix) -> the trunk widths there: the whole grid of
        # `requests.trunk_grid`, whose executables are compiled by the first call there (`plan`,
        # `Sampler._one_batch`), so a later call finds every width it may plan compiled, and a plan does not depend
        # on what this process compiled before (a resumed run plans as the uninterrupted one)
        self.trunk_widths: dict = {}
        # the same keys -> (grid, the trunks' cache, the common prefix's cache or None) as shapes and shardings
        # (`_shapes`): what `compile_rests` lowers the rest widths' prefill and refill executables against, so a
        # continuous call (refills) at buckets a one-batch call saw first still compiles every width at once
        self.rest_shapes: dict = {}
        self.refill_shapes: set = set()  # (slots, buckets, shared, refill prompts, n) whose refills are compiled
        self.pack_shapes: set = set()  # the shapes whose `pack` / `keep_into` executable is compiled (keep_plan)

    def forget(self) -> None:
        """Empty the store (kept prefixes and trunk sets); what is compiled stays known."""
        self.stored, self.trunk_sets = [], []

    def rows(self) -> int:
        """G: the trunk rows of a call (`trunk_rows` rounded up to the data-parallel degree); 0 for a
        sliding-window config (its window is measured in cache slots, which the gap after a trunk would skew)."""
        dp = self.s.data_parallel
        return 0 if self.s.cfg.has_sliding_layers else -(-self.s.trunk_rows // dp) * dp

    def pick_shared(self, common: int, prompt_bucket: int, new_bucket: int) -> int:
        """`prefix_to_share` for a call at these buckets, remembered for the next calls."""
        used = self.prefix_lengths.setdefault((prompt_bucket, new_bucket), set())
        L = prefix_to_share(common, sorted(used), self.s.min_shared_prefix)
        if L:
            used.add(L)
        return L

    def prefix_cache(self, params, prefix: list, cache_len: int):
        """(the cache of `cache_len` slots holding the shared `prefix` (unpadded) in its first len(prefix) slots,
        on D = data-parallel rows; the tokens prefilled for it: 0 when the store held it under these parameters);
        (None, 0) without a prefix. Computed at exactly len(prefix) slots and fitted to `cache_len`, stored or not:
        one path, so the executables a call runs do not depend on what the store holds."""
        if not prefix:
            return None, 0
        ids_, tokens = _tree_ids(params), tuple(prefix)
        for i, (known, _tree, toks, cache) in enumerate(self.stored):
            # the entry holds its tree, so its leaves' ids cannot have been reused by other arrays
            if known == ids_ and toks == tokens:
                self.stored.insert(0, self.stored.pop(i))
                return self.s.fit(cache, cache_len=cache_len), 0
        D = self.s.data_parallel
        ids, mask = self.s.device_rows(*pad_rows([prefix] * D, D, len(prefix)))
        cache = self.s.prefix(params, ids, mask, cache_len=len(prefix))
        if self.s.prefix_store:
            self.stored = [(ids_, params, tokens, cache)] + self.stored[:self.s.prefix_store - 1]
        return self.s.fit(cache, cache_len=cache_len), len(prefix)

    def plan(self, params, prompts, Tb: int, Nb: int, common: int):
        """Where each prompt's prefill starts, for a call at buckets (Tb, Nb): the common prefix's `shared` tokens
        prefilled once (`pick_shared`, D rows), then, with `trunk_rows`, the trunks of `requests.plan_trunks`
        (one row per group, `trunk_rows` rows; never for sliding-window configs, as the common prefix). Returns
        (rests: each prompt's tokens still to prefill, their slot width, the start cache or None, src [U] int32 or
        None (the cache row of each prompt; None: a prompt takes the copy on its own data-parallel shard), keep [U]
        int32 (real tokens it keeps of that row), shared, tokens prefilled by the common prefix (none when
        `prefix_store` held it) and the trunks, the slots those prefills ran (D rows of the prefix, the trunk rows
        at their width), fresh, own). fresh: None, or at the first call with trunks at these buckets and shared
        length, (the grid of trunk widths, whose trunk executables this call compiled, a trunks' cache and the
        common prefix's cache or None, as `_shapes`) for `compile_rests` (`rest_shapes`). own: whether the call
        prefilled trunks of its own (`keep_prompts` keeps the prompts of a call that did not)."""
        cache_len, D = Tb + Nb, self.s.data_parallel
        if len(prompts) == 1 and self.s.prefix_store and not self.s.cfg.has_sliding_layers:
            hit = self.one_prompt_start(params, prompts[0], Tb, Nb)
            if hit is not None:  # (a miss: the prompt shares with nothing kept; it prefills as before)
                shared, grid, plan, cut = hit
                rests, width, keep = [prompts[0][shared:]], Tb - shared, np.full((1,), shared, np.int32)
                if plan is None:  # a kept common prefix only
                    cache, _ = self.prefix_cache(params, list(prompts[0][:shared]), cache_len)
                    return rests, width, cache, None, keep, shared, 0, 0, None, False
                left = plan.rests(rests)
                return (left, width - _widest(grid, plan.width, width, left), self.s.fit(cut, cache_len=cache_len),
                        plan.group, keep + plan.keep, shared, 0, 0, None, False)
        shared = self.pick_shared(common, Tb, Nb)
        cache, computed = self.prefix_cache(params, list(prompts[0][:shared]), cache_len)
        rests, width = [p[shared:] for p in prompts], Tb - shared
        keep = np.full((len(prompts),), shared, np.int32)
        G = self.rows()
        if not G or len(prompts) < 2:  # (one prompt: nothing to share, and no grid compiled for it)
            return rests, width, cache, None, keep, shared, computed, computed * D, None, False
        start = None
        if cache is not None:
            src, kept = self.s.device_rows((np.arange(G) * D // G).astype(np.int32), np.full((G,), shared, np.int32))
            start = dict(cache=cache, src=src, keep=kept)
        fresh = None
        if (Tb, Nb, shared) not in self.trunk_widths:  # which width a later call plans depends on its data
            grid = self.trunk_widths[(Tb, Nb, shared)] = tuple(trunk_grid(self.s.min_trunk, width))
            for w in grid[1:]:
                self.s.trunk.lower(params, *self.s.device_rows(*pad_rows([], G, w)), start,
                                   cache_len=cache_len).compile()
            if grid:  # one run on placeholder rows: a trunks' cache exactly as the prefill will be given one
                trunks = self.s.trunk(params, *self.s.device_rows(*pad_rows([], G, grid[0])), start,
                                      cache_len=cache_len)
                if self.s.prefix_store:  # kept trunks are cut to their filled slots and fitted back, at every width
                    for w in grid:
                        self.s.fit(self.s.fit(trunks, cache_len=shared + w), cache_len=cache_len)
                fresh = self.rest_shapes[(Tb, Nb, shared)] = (grid, _shapes(trunks), _shapes(cache))
        grid = self.trunk_widths[(Tb, Nb, shared)]
        plan = plan_trunks(rests, width, self.s.min_trunk, grid, max_trunks=G) if grid else None
        kept = self.kept_trunks(params, prompts[0][:shared], rests, width, grid, plan)
        if kept is not None:  # an earlier call's trunks leave less to prefill: start from them
            old, trunks = kept
            left = old.rests(rests)
            return (left, width - _widest(grid, old.width, width, left), self.s.fit(trunks, cache_len=cache_len),
                    old.group, keep + old.keep, shared, computed, computed * D, fresh, False)
        if plan is None:
            return rests, width, cache, None, keep, shared, computed, computed * D, fresh, False
        ids, mask = self.s.device_rows(*pad_rows([list(t) for t in plan.trunks], G, plan.width))
        cache = self.s.trunk(params, ids, mask, start, cache_len=cache_len)
        if self.s.prefix_store:  # kept at the slots it fills (common prefix + trunk width) and fitted back
            cut = self.s.fit(cache, cache_len=shared + plan.width)
            self.trunk_sets = [(_tree_ids(params), params, tuple(prompts[0][:shared]), plan.trunks, plan.width,
                                 cut)] + self.trunk_sets[:self.s.prefix_store - 1]
            cache = self.s.fit(cut, cache_len=cache_len)
        left = plan.rests(rests)
        return (left, width - _widest(grid, plan.width, width, left), cache, plan.group, keep + plan.keep, shared,
                computed + sum(map(len, plan.trunks)), computed * D + G * plan.width, fresh, True)

    def one_prompt_start(self, params, prompt, Tb: int, Nb: int):
        """Where a call of one prompt starts (a rollout's tail, where one episode still runs: nothing is shared
        within the call, so neither a common prefix nor trunks form): from what the store keeps under these
        parameters that the prompt extends, whichever leaves the least to prefill: a trunk set (the last turn's
        prompts, `keep_prompts`) whose common prefix the prompt starts with and whose trunk widths this call's
        buckets compiled (`trunk_widths`), or a kept common prefix (the environment's system prompt). Returns
        (shared, the trunk grid, the plan over the set's rows (`plan_from_trunks`) or None for a common prefix,
        the set's cut cache or None), or None when nothing kept is a prefix of the prompt. A trunk set used
        becomes the newest."""
        ids_, best, saved = _tree_ids(params), None, 0  # saved: the prompt's tokens its start cache holds
        for i, (known, _tree, toks, trunks, w, cut) in enumerate(self.trunk_sets):
            L = len(toks)
            grid = self.trunk_widths.get((Tb, Nb, L), ())
            if known != ids_ or L >= len(prompt) or tuple(prompt[:L]) != toks or w not in grid:
                continue
            plan = plan_from_trunks([prompt[L:]], trunks, Tb - L, w)
            if plan is not None and L + int(plan.keep[0]) > saved:
                saved, best = L + int(plan.keep[0]), (L, grid, plan, cut, i)
        for known, _tree, toks, _cache in self.stored:
            L = len(toks)
            if known == ids_ and saved < L < len(prompt) and tuple(prompt[:L]) == toks:
                saved, best = L, (L, (), None, None, None)
        if best is None:
            return None
        if best[4] is not None:
            self.trunk_sets.insert(0, self.trunk_sets.pop(best[4]))
        return best[:4]

    def kept_trunks(self, params, prefix, rests, width: int, grid, plan):
        """(the plan over kept trunks, their cut cache) when one of `trunk_sets` (same parameter tree and common
        `prefix`, a trunk width of this call's `grid`: its prefill is compiled) leaves no more to prefill than
        `plan` (this call's own trunks, or None) would with its trunks; the kept set becomes the newest. Else None."""
        if not self.trunk_sets:
            return None
        ids_, prefix = _tree_ids(params), tuple(prefix)
        cost = plan.tokens(rests) if plan is not None else sum(map(len, rests))
        best = None
        for i, (known, _tree, toks, trunks, w, cut) in enumerate(self.trunk_sets):
            if known != ids_ or toks != prefix or w not in grid:
                continue
            old = plan_from_trunks(rests, trunks, width, w)
            if old is None:
                continue
            c = old.rest_tokens(rests)  # the kept trunks cost nothing
            if c <= cost:
                cost, best = c, (i, old, cut)
        if best is None:
            return None
        i, old, cut = best
        self.trunk_sets.insert(0, self.trunk_sets.pop(i))
        return old, cut

    def keep_plan(self, prompts, shared: int, buckets, own: bool, compile_key=None, compile_fn=None):
        """Which prompts a call keeps as a trunk set for the next call (`trunk_sets`): with trunks and the store
        on, when the call prefilled no trunks of its own (`own`): a rollout turn, whose episodes share nothing
        beyond the common prefix, so no trunks form, while the next turn's prompts extend these. Up to
        `trunk_rows` prompts, the longest rests that a grid width holds, at the smallest grid width w that holds
        them; the next call finds the set as it finds kept trunks (`kept_trunks`: same tree and common prefix, w
        in its grid, and the least to prefill). Returns (the kept prompts' indices, ascending; w) or None.
        compile_fn(): lowers and compiles the executable that keeps them (`pack` or `keep_into`) the first time
        its shapes (`compile_key`) are seen, whether or not this call keeps anything, so which calls keep their
        prompts never compiles later (the later calls' jit finds it)."""
        G = self.rows()
        grid = self.trunk_widths.get(tuple(buckets) + (shared,), ())
        if not (G and self.s.prefix_store and grid):  # (one prompt too: a rollout's tail chains from turn to turn)
            return None
        if compile_fn is not None and compile_key not in self.pack_shapes:
            self.pack_shapes.add(compile_key)
            compile_fn()
        if own:
            return None
        rests = [p[shared:] for p in prompts]
        fits = sorted((i for i, r in enumerate(rests) if len(r) <= grid[-1]), key=lambda i: (-len(rests[i]), i))[:G]
        if not fits:
            return None
        return sorted(fits), next(g for g in grid if g >= len(rests[fits[0]]))

    def store_kept(self, params, prompts, shared: int, chosen, w: int, kept) -> None:
        """Keep `kept` (G rows: the `chosen` prompts' packed rows first, `pack_impl`) as a trunk set of width w."""
        cut = self.s.fit(kept, cache_len=shared + w)
        self.trunk_sets = [(_tree_ids(params), params, tuple(prompts[0][:shared]),
                             tuple(tuple(prompts[i][shared:]) for i in chosen), w, cut)] + \
            self.trunk_sets[:self.s.prefix_store - 1]

    def keep_prompts(self, params, cache, prompts, n: int, shared: int, buckets, own: bool) -> None:
        """The one-batch path's kept prompts (`keep_plan`), from its prefilled `cache` (rows i*n hold prompt i),
        each row's valid slots packed to the left (`pack_impl`) and cut to the common prefix plus w."""
        G = self.rows()
        plan = self.keep_plan(prompts, shared, buckets, own, compile_key=("pack",) + tuple(cache["mask"].shape),
                              compile_fn=lambda: self.s.pack.lower(
                                  cache, self.s.device_rows(np.zeros((G,), np.int32))[0],
                                  self.s.replicated(jnp.int32(0))).compile())
        if plan is None:
            return
        chosen, w = plan
        rows = np.full((G,), chosen[0] * n, np.int32)
        rows[:len(chosen)] = np.asarray(chosen, np.int32) * n
        (rows,) = self.s.device_rows(rows)
        self.store_kept(params, prompts, shared, chosen, w,
                         self.s.pack(cache, rows, self.s.replicated(jnp.int32(shared + w))))

    def compile_rests(self, fresh, width: int, rows: int, compile_one) -> None:
        """Compile the executable that prefills `rows` prompt rows (`prefill`, or a continuous call's `refill`) for
        every rest width a call at these buckets may take: the call's rest `width` minus each trunk width of the
        grid (the start cache: the trunks'), and `width` itself (no plan: the common prefix's cache or none).
        fresh: (grid, trunks, base) of `rest_shapes`. compile_one(ids, mask, prefix) lowers and compiles the
        call's own executable with these. Nothing runs; the later calls' jit finds the executables."""
        grid, trunks, base = fresh
        src, keep = self.s.device_rows(np.zeros((rows,), np.int32), np.zeros((rows,), np.int32))
        for w, prefix in [(width - g, dict(cache=trunks, src=src, keep=keep)) for g in grid] + [
                (width, self.s.prefix_arg(base, None, np.zeros((0,), np.int32), rows))]:
            compile_one(*self.s.device_rows(*pad_rows([], rows, w)), prefix)

    def compile_refills(self, params, st, ctl, B: int, buckets, shared: int, Ru: int, n: int) -> None:
        """A continuous call's refills at every rest width (`compile_rests`) the first time its shapes are seen
        (state `st` of B slots, buckets (prompt, new-token), `Ru` prompts of n rows per refill): with trunks, a
        refill's rest width depends on its data (a grid width, `_widest`), so all are compiled at once, as the
        one-batch path does its prefills (the loop runs continuous calls whenever a call holds more prompts than
        LoopConfig.sampler_max_batch). Nothing when this call's buckets have no trunk grid."""
        full, Nb = buckets
        fresh, sig = self.rest_shapes.get((full, Nb, shared)), (B, full, Nb, shared, Ru, n)
        if fresh is None or sig in self.refill_shapes:
            return
        self.refill_shapes.add(sig)
        R = Ru * n  # the arguments run_slots gives a refill
        idx, rows, src = self.s.replicated((np.full((R,), B, np.int32), np.full((R,), -1, np.int32),
                                            np.repeat(np.arange(Ru, dtype=np.int32), n) if n > 1 else None))
        self.compile_rests(fresh, full - shared, Ru, lambda i, m, pre: self.s.refill.lower(
            params, st, i, m, on_device(idx), on_device(rows), ctl, src, pre).compile())

    def keeper(self, params, st, key, prompts, per: int, shared: int, buckets, own: bool, B: int, Ru: int):
        """A continuous call's kept prompts (`keep_plan`), each packed from its slot right after the refill that
        prefilled it, before the next decode donates the state (`decode.keep_into_impl`). Returns (on_refill for
        `slots.run_slots`, or None; finish(), which stores the set once the call ends). per: rows per prompt."""
        G = self.rows()
        if not G:
            return None, lambda: None
        full, Nb = buckets
        cache_len = full + Nb

        def empty_kept():
            return self.s.empty(key, batch=G, cache_len=cache_len, new_bucket=Nb).cache

        def compile_keep():
            args = (empty_kept(), st.cache) + tuple(self.s.replicated(
                (np.zeros((Ru,), np.int32), np.zeros((Ru,), np.int32), jnp.int32(0))))
            self.s.keep_into.lower(*args).compile()
        plan = self.keep_plan(prompts, shared, buckets, own, compile_key=("keep", B, cache_len, Ru, G),
                              compile_fn=compile_keep)
        if plan is None:
            return None, lambda: None
        kept = {"cache": empty_kept()}
        chosen, w = plan
        dest_of = {int(p): i for i, p in enumerate(chosen)}
        index = self.s.replicated(jnp.int32(shared + w))

        def on_refill(state, idx, row_ids):
            slot, dest = np.zeros((Ru,), np.int32), np.full((Ru,), G, np.int32)  # dest G: dropped
            firsts = [(int(b), dest_of[int(r) // per]) for b, r in zip(idx, row_ids)
                      if r >= 0 and r % per == 0 and int(r) // per in dest_of]
            for j, (b, d) in enumerate(firsts):
                slot[j], dest[j] = b, d
            if firsts:
                kept["cache"] = self.s.keep_into(kept["cache"], state.cache, *self.s.replicated((slot, dest)), index)
                kept["used"] = True

        def finish():
            if kept.get("used"):
                self.store_kept(params, prompts, shared, chosen, w, kept["cache"])
        return on_refill, finish


def _widest(grid, trunk_width: int, width: int, rests) -> int:
    """Where the rests start after trunks `trunk_width` wide: the widest grid value g >= trunk_width that still
    leaves every rest its slots (width - g >= the longest), so they are prefilled in width - g slots, a width whose
    prefill `StartCaches.compile_rests` compiled, instead of width - trunk_width: a rollout turn's rests are its new
    tokens, a few hundred, where width - trunk_width may be thousands. The trunk cache's index stays at the trunk's end,
    so the prefill writes right after it and the g - trunk_width slots after the rests are never written."""
    need = max(map(len, rests), default=0)
    return max([g for g in grid if trunk_width <= g <= width - need], default=trunk_width)


def _shapes(tree):
    """`tree`'s arrays as shapes, dtypes and shardings (jax.ShapeDtypeStruct): enough to lower an executable that
    takes them, without holding their memory (a 7B model's trunk cache is gigabytes per chip)."""
    # an uncommitted array (made on the default device, not placed) lowers without a sharding, as a call with it
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                                       sharding=a.sharding if a.committed else None), tree)


def _tree_ids(tree) -> tuple:
    """The ids of a parameter tree's leaves: what the store matches a tree by (an entry holds its tree, so the ids
    cannot be reused by other arrays while it is kept)."""
    return tuple(map(id, jax.tree.leaves(tree)))
