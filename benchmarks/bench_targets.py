"""One NLAC targets phase and one iteration's train steps on τ-bench-shaped data: the prompt tokens presented,
those a shared prefix lets us skip, and the train step with and without shared-prefix packing.

    .venv/bin/python benchmarks/bench_targets.py                      # counts + train-step timing (minutes)
    .venv/bin/python benchmarks/bench_targets.py --no-timing          # token counts only (seconds)
    .venv/bin/python benchmarks/bench_targets.py --tasks 1 --no-timing --time_targets   # the targets phase, timed

Data: the first --tasks τ2 retail train tasks (the real domain policy and tool schemas, from the installed tau2
package), each played to the end by its gold tool-call script against the real τ2 environment and the scripted
user: real multi-turn episodes with real tool outputs. The targets phase is NLAC's own code
(`build_critic_examples`, `build_policy_examples`, k = --k futures) over every transition, with a scripted role
sampler that returns fixed, well-formed texts of realistic length; every prompt it is asked to complete is recorded.

Tokenizer: the in-process BPE (nlac_jax.testing.tiny) trained with --vocab entries on its built-in corpus PLUS the
domain's policy and tool schemas, so a token covers about as many characters of that text as a real model's
tokenizer (printed). Counts are exact for that tokenizer.

Reported:
* targets phase: prompt tokens presented to the sampler (one prefill per sampled row), the tokens the sampler
  prefills (`Sampler.shared_prefix_length`: each call's common prefix once, each prompt's rest once; a prompt
  sampled n times once), and the tokens a perfect prefix cache over the whole phase would compute (the size of the
  token trie of all its prompts): the ceiling of a prefix cache kept across calls (not built), and the same
  ceiling within each call (the sum of each call's own trie: a prefix tree per call, no cache kept across calls;
  not built either);
* with --time_targets, the targets phase's sampler calls (exactly the prompts, sample counts and roles the phase
  made) replayed through `sampling.Sampler` on a random model of --hidden x --layers, greedy, every row decoding its
  role's scripted output length (stop tokens off: equal work on every path), the ways --modes names side by side
  in one process: no sharing (`min_shared_prefix=0`), each call's common prefix, trunks (`trunk_rows=8`), each of
  the last two with the prefix store (`prefix_store=4`: a common prefix computed once per parameter tree across
  the calls). Each path replays the phase once to compile (reported apart), then once timed; the tokens generated
  must be identical on every path;
* rollout: the policy's calls while the gold scripts play (one per turn, one prompt per episode still running),
  the tokens the sampler prefills with each call's common prefix kept across calls and with each turn's prompts
  kept for the next turn (`StartCaches.keep_prompts`, trunk_rows=8), and a perfect prefix cache's; with
  --time_rollout those calls replayed through the sampler in each of --modes, as --time_targets does;
* train step: tokens presented (Σ prompt + target), tokens computed and slots (B x T, padding included) for
  `batching.pack_train_batches` unpacked and prefix-tree packed (`training.prefix_packing`, LoopConfig.share_prefixes), with
  --timing the wall time of every step (compiles excluded and reported apart), same process, same examples,
  same losses (printed side by side).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def trie_tokens(seqs) -> int:
    """Tokens a perfect prefix cache computes for these sequences: the number of distinct prefixes (trie nodes)."""
    from nlac_jax.text import common_prefix_length
    out, prev = 0, []
    for s in sorted(map(list, seqs)):
        out += len(s) - common_prefix_length(prev, s)
        prev = s
    return out


def sampler_prefill_tokens(calls, tokenizer, min_shared_prefix: int = 64, trunk_rows: int = 0,
                           prefix_store: int = 0) -> int:
    """Prompt tokens `sampling.Sampler` prefills for these role calls (one `generate` call each, as
    `nlac.model_roles` makes them), as `StartCaches.plan` plans them for a fresh sampler: per call, the prompts'
    shared prefix once (`prefix_to_share` of their common prefix; with prefix_store > 0 not at all when one of the
    last prefix_store prefixes computed was the same tokens under the same parameter set, θ or θ̄, as
    `StartCaches.prefix_cache` keeps them), with trunk_rows > 0 the trunks of `plan_trunks` (at most trunk_rows
    groups, min_trunk = min_shared_prefix, the rests' width from the call's prompt bucket) once, or with
    prefix_store > 0 none when the trunks of one of the last prefix_store calls that computed trunks (same
    parameter set and common prefix) leave less to prefill (`plan_from_trunks`, as `StartCaches.plan` chooses), and
    each distinct prompt's remaining rest once (n samples of a prompt: once); a call that prefilled no trunks of its
    own keeps its prompts as a trunk set (`StartCaches.keep_prompts`: a rollout's next turn starts from them); a call
    of one prompt (a rollout's tail) starts from the kept trunk set or common prefix it extends that holds the most
    of it (`StartCaches.one_prompt_start`; a trunk set only where a call of two or more prompts at the same prompt
    bucket and common prefix compiled its grid)."""
    from nlac_jax import text
    from nlac_jax.sampling import plan_from_trunks, plan_trunks, prefix_to_share, shared_prefix_length, trunk_grid
    out, stored, trunk_sets, grids = 0, [], [], set()
    for call in calls:
        prompts = [text.encode_chat(tokenizer, m, add_generation_prompt=True) for m in call.messages_batch]
        bucket = text.bucket_length(max(map(len, prompts)), 16, fine=True)
        if len(prompts) == 1 and prefix_store:
            hit = _one_prompt_start(prompts[0], call.params, bucket, stored, trunk_sets, grids, trunk_rows,
                                    min_shared_prefix, prefix_store)
            if hit is not None:
                out += len(prompts[0]) - hit[0]
                stored, trunk_sets = hit[1], hit[2]
                continue
        L = prefix_to_share(shared_prefix_length(prompts, min_shared_prefix), (), min_shared_prefix)
        rests = [p[L:] for p in prompts]
        key = (call.params, tuple(prompts[0][:L]))
        if L and prefix_store and key in stored:
            stored.remove(key)
            L_computed = 0
        else:
            L_computed = L
        if L and prefix_store:
            stored = [key] + stored[:prefix_store - 1]
        plan = None
        cost = sum(map(len, rests))
        if trunk_rows:
            width = bucket - L
            if len(prompts) >= 2:
                grids.add((bucket, L))
            plan = plan_trunks(rests, width, max(1, min_shared_prefix), max_trunks=trunk_rows)
            if plan is not None:
                cost = plan.tokens(rests)
            reused = None
            for entry in (trunk_sets if prefix_store else []):
                if entry[:2] != key:
                    continue
                old = plan_from_trunks(rests, entry[2], width, entry[3])
                if old is not None and old.rest_tokens(rests) <= cost:
                    cost, reused = old.rest_tokens(rests), entry
            if reused is not None:
                trunk_sets.remove(reused)
                trunk_sets.insert(0, reused)
            elif plan is not None and prefix_store:
                trunk_sets = [key + (plan.trunks, plan.width)] + trunk_sets[:prefix_store - 1]
            grid = trunk_grid(max(1, min_shared_prefix), width)
            kept = _kept_set(key, rests, grid, trunk_rows) if (bucket, L) in grids else None
            if prefix_store and (plan is None or reused is not None) and kept is not None:
                trunk_sets = [kept] + trunk_sets[:prefix_store - 1]  # a call without trunks of its own
        out += L_computed + cost
    return out


def _one_prompt_start(prompt, params, bucket, stored, trunk_sets, grids, trunk_rows, min_shared_prefix, prefix_store):
    """`sampler_prefill_tokens`' model of `StartCaches.one_prompt_start`: (the prompt's tokens its start holds, the
    store's prefixes, its trunk sets, both updated: a one-prompt call that starts from a trunk set keeps its own
    prompt as one, and a common prefix it starts from becomes the newest) or None (nothing kept that it extends)."""
    from nlac_jax.sampling import plan_from_trunks, trunk_grid
    best, saved = None, 0
    for i, (p, toks, trunks, w) in enumerate(trunk_sets):
        L = len(toks)
        if p != params or L >= len(prompt) or tuple(prompt[:L]) != toks or (bucket, L) not in grids:
            continue
        plan = plan_from_trunks([prompt[L:]], trunks, bucket - L, w)
        if plan is not None and L + int(plan.keep[0]) > saved:
            saved, best = L + int(plan.keep[0]), ("trunks", i, L)
    for i, (p, toks) in enumerate(stored):
        if p == params and saved < len(toks) < len(prompt) and tuple(prompt[:len(toks)]) == toks:
            saved, best = len(toks), ("prefix", i, len(toks))
    if best is None:
        return None
    kind, i, L = best
    if kind == "prefix":
        stored = [stored[i]] + stored[:i] + stored[i + 1:]
    else:
        trunk_sets = [trunk_sets[i]] + trunk_sets[:i] + trunk_sets[i + 1:]
    kept = _kept_set((params, tuple(prompt[:L])), [prompt[L:]], trunk_grid(max(1, min_shared_prefix), bucket - L),
                     trunk_rows) if (bucket, L) in grids else None
    if kept is not None:  # kept for the next turn
        trunk_sets = [kept] + trunk_sets[:prefix_store - 1]
    return saved, stored, trunk_sets


def _kept_set(key, rests, grid, trunk_rows):
    """The trunk set a call that prefilled no trunks of its own keeps (`StartCaches.keep_plan`): key + (the longest
    trunk_rows rests a grid width holds, in prompt order; the smallest grid width that holds them), or None."""
    fits = sorted((i for i, r in enumerate(rests) if grid and len(r) <= grid[-1]), key=lambda i: (-len(rests[i]), i))
    if not (trunk_rows and fits):
        return None
    w = next(g for g in grid if g >= len(rests[fits[0]]))
    return key + (tuple(tuple(rests[i]) for i in sorted(fits[:trunk_rows])), w)


def domain_text(task_source, env) -> list[str]:
    """The retail domain's policy and tool schemas as the agent sees them (its system message)."""
    task = task_source.tasks(task_source.train_split)[0]
    return [m["content"] for m in env.reset(task) if m["role"] == "system"]


def play(n_tasks: int):
    """Gold-script episodes of the first n_tasks retail train tasks -> (transitions, domain texts, the histories
    of each policy call)."""
    from nlac_jax import envs
    from nlac_jax.envs.tau_bench import gold_actions_script
    from nlac_jax.rl import rollout
    source = envs.make_task_source(env_name="tau_retail")
    tasks = source.tasks(source.train_split)[:n_tasks]
    env = envs.EnvFactory("tau_retail")()
    scripts = {env.reset(t)[1]["content"]: gold_actions_script(t) for t in tasks}

    def policy(h):
        script = scripts[h[1]["content"]]
        return script[min(sum(m["role"] == "assistant" for m in h), len(script) - 1)]
    turns = []  # the histories of each policy call: the rollout's sampler calls, one per turn

    def policy_fn(hs):
        turns.append(copy.deepcopy(list(hs)))
        return [policy(h) for h in hs]
    _, transitions = rollout.collect(envs.EnvFactory("tau_retail").make(len(tasks)), tasks, policy_fn,
                                     task_name="tau_retail")
    return transitions, domain_text(source, env), turns


def rollout_calls(turns) -> list:
    """The rollout's policy calls (one per turn, one prompt per episode still running), as `SamplerCall`s."""
    from nlac_jax.nlac.prompts import PromptSet
    from nlac_jax.rl.roles import SamplerCall
    ps = PromptSet(task="tau_retail")
    return [SamplerCall(role="policy", params="policy", messages_batch=[ps.policy(h) for h in hs], n=1, outputs=[],
                        settings=None, served="policy") for hs in turns]


def scripted_texts() -> dict:
    """Fixed, well-formed role outputs of realistic length (a forecast ~400 characters, a critique ~300)."""
    from nlac_jax.envs.tau_bench import format_tool_call
    from nlac_jax.nlac.verdict import outcome_line
    future = ("The agent looks up the order, confirms the items and the payment method with the user, and makes the "
              "exchange the user asked for. The user confirms and the conversation ends. "
              "The database matches the expected state.\n" + outcome_line(True, 1.0))
    action = format_tool_call("get_order_details", {"order_id": "#W2378156"})
    critique = ("The action is reasonable: the order must be read before any change. Checking the user's identity "
                "first would be safer, but the forecast shows the task succeeds either way.\nVerdict: optimal")
    return {"policy": action, "successor": future, "backup": future, "evaluator": critique, "refiner": action}


def scripted_sampler():
    from nlac_jax.rl.roles import ScriptedRoleSampler
    return ScriptedRoleSampler(scripted_texts())


def targets_phase(transitions, tokenizer, k: int):
    from nlac_jax import text
    from nlac_jax.nlac import targets
    from nlac_jax.nlac.prompts import PromptSet
    ps = PromptSet(task="tau_retail")
    sampler = scripted_sampler()
    cfg = targets.TargetConfig(k_futures=k)
    t0 = time.perf_counter()
    critic = targets.build_critic_examples(transitions, sampler, cfg, ps)
    policy = targets.build_policy_examples(transitions, sampler, cfg, ps)
    seconds = time.perf_counter() - t0
    rows, per_role = [], {}
    for call in sampler.calls:
        for msgs in call.messages_batch:
            ids = text.encode_chat(tokenizer, msgs, add_generation_prompt=True)
            rows += [ids] * call.n
            r = per_role.setdefault(call.role, [0, 0])
            r[0] += call.n
            r[1] += call.n * len(ids)
    examples = [x for x in critic + policy if x.dropped is None]
    per_call = sum(trie_tokens([text.encode_chat(tokenizer, m, add_generation_prompt=True) for m in c.messages_batch])
                   for c in sampler.calls)  # a sampled prompt's n rows are one trie path
    return dict(rows=len(rows), presented=sum(map(len, rows)), trie=trie_tokens(rows), trie_per_call=per_call,
                per_role=per_role,
                sampler=sampler_prefill_tokens(sampler.calls, tokenizer), calls=len(sampler.calls),
                sampler_trunks={r: sampler_prefill_tokens(sampler.calls, tokenizer, trunk_rows=r) for r in (4, 8, 16)},
                sampler_store=sampler_prefill_tokens(sampler.calls, tokenizer, prefix_store=4),
                sampler_trunks_store={r: sampler_prefill_tokens(sampler.calls, tokenizer, trunk_rows=r, prefix_store=4)
                                      for r in (4, 8, 16)},
                seconds=seconds), examples, sampler.calls


SHARING = {"unshared": dict(min_shared_prefix=0), "shared prefix": dict(prefix_store=0),
           "trunks": dict(trunk_rows=8, prefix_store=0), "shared prefix + store": dict(prefix_store=4),
           "trunks + store": dict(trunk_rows=8, prefix_store=4)}


def time_targets_phase(calls, tokenizer, a) -> dict:
    """The phase's sampler calls replayed through a `Sampler` per sharing mode (SHARING, those in a.modes), same
    model and process: per mode the compile pass's and the timed pass's seconds, prompt tokens presented and
    prefilled, and the generated tokens (which must agree across modes). Greedy; each row decodes its role's
    scripted output length. θ̄ calls (the critic's successor and backup) read a second parameter tree, as in a run
    (a prefix stored under θ does not serve them)."""
    import jax
    import numpy as np

    from nlac_jax import models, sampling, text
    from nlac_jax.parallel import sharding
    cfg = models.ModelConfig(vocab_size=len(tokenizer), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                             num_layers=a.layers, num_heads=a.heads, num_kv_heads=max(1, a.heads // 2),
                             head_dim=a.hidden // a.heads, dtype="bfloat16", param_dtype="float32",
                             max_position_embeddings=4 * a.max_len)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    # placed on the mesh once, as the loop's θ and θ̄ live there: a tree placed at every call would be a new tree
    # each time (no run-layout copy or kept prefix would be found for it)
    trees = {k: jax.device_put(models.init_params(cfg, seed=s), models.param_shardings(cfg, mesh))
             for k, s in (("policy", 0), ("target", 1))}
    budget = {r: len(tokenizer.encode(t)) for r, t in scripted_texts().items()}
    replay = [([text.encode_chat(tokenizer, m, add_generation_prompt=True) for m in c.messages_batch], c.n,
               budget[c.role], trees[c.params]) for c in calls]
    out = {}
    for name, kw in SHARING.items():
        if name not in a.modes:
            continue
        sampler = sampling.Sampler(cfg, mesh=mesh, min_batch_bucket=a.slots, **kw)
        passes = []
        for _ in range(2):  # the first pass compiles every executable the phase needs; the second is timed
            t0, presented, prefilled, tokens = time.perf_counter(), 0, 0, []
            for prompts, n, new, params in replay:
                r = sampler.generate(params, prompts, max_new_tokens=new, stop_token_ids=(), slots=a.slots, n=n)
                presented += n * sum(map(len, prompts))
                prefilled += int(r.prefill_tokens)
                tokens.append(np.asarray(r.tokens))
            passes.append(time.perf_counter() - t0)
        out[name] = dict(compile_pass_s=passes[0], seconds=passes[1], presented=presented, prefilled=prefilled,
                         generated=int(sum(t.size for t in tokens)), tokens=tokens)
        print(f"  {name:14s} {passes[1]:8.1f} s (first pass, compiling: {passes[0]:.0f} s), prefilled "
              f"{prefilled:,} of {presented:,} prompt tokens ({prefilled / presented:.1%})", flush=True)
    first = next(iter(out))
    ref = out[first].pop("tokens")
    for name in list(out)[1:]:
        got = out[name].pop("tokens")
        out[name]["same_tokens"] = all(np.array_equal(x, y) for x, y in zip(ref, got))
    out["params"] = cfg.num_params
    return out


def workload(transitions, tokenizer, sampler_texts: dict, phase: dict, k: int) -> dict:
    """The `planning.Workload` these episodes measure (tokens of ``tokenizer``): the head every policy prompt
    shares, transitions per episode, the tokens one (action, observation) adds to the policy's prompt (mean), the
    scripted role outputs' lengths, and role_tokens fitted so that the planner's model of this targets phase
    (`planning.iteration.calls` over these transitions) presents as many prompt tokens as the phase measured."""
    import types

    from nlac_jax import text
    from nlac_jax.nlac.prompts import PromptSet
    from nlac_jax.nlac.targets import TargetConfig
    from nlac_jax.planning import iteration
    from nlac_jax.rl.roles import RoleSampling
    ps = PromptSet(task="tau_retail")
    prompts = [text.encode_chat(tokenizer, ps.policy(t.state), add_generation_prompt=True) for t in transitions]
    growth = [len(text.encode_chat(tokenizer, ps.policy(t.next_state), add_generation_prompt=True)) - len(p)
              for t, p in zip(transitions, prompts) if not t.done]
    n = {role: len(tokenizer.encode(sampler_texts[role])) for role in ("policy", "successor", "evaluator")}
    w = dict(shared_tokens=min(text.common_prefix_length(prompts[0], p) for p in prompts),
             turns=round(len(transitions) / max(1, sum(1 for t in transitions if t.done)), 2),
             turn_tokens=round(sum(growth) / max(1, len(growth))), role_tokens=0, action_tokens=n["policy"],
             summary_tokens=n["successor"], critique_tokens=n["evaluator"])
    loop = types.SimpleNamespace(episodes_per_iteration=0, critic_examples=len(transitions),
                                 policy_examples=len(transitions))
    model = [c for c in iteration.calls(loop, RoleSampling(), TargetConfig(k_futures=k), iteration.Workload(**w))
             if c.phase != "rollouts"]
    presented = sum(c.prompts * c.samples * c.length for c in model)
    others = sum(c.prompts * c.samples for c in model if c.role != "policy")
    w["role_tokens"] = max(0, round((phase["presented"] - presented) / others))
    return w


def modelled_shared_tokens(w: dict, transitions: int, k: int, calls: int) -> float:
    """The prompt tokens `planning.iteration` says this targets phase computes with each call's shared head once
    (its calls spread over the phase's ``calls`` generate calls): a check of the planner's model against the
    sampler's count above."""
    import types

    from nlac_jax.nlac.targets import TargetConfig
    from nlac_jax.planning import iteration
    from nlac_jax.rl.roles import RoleSampling
    loop = types.SimpleNamespace(episodes_per_iteration=0, critic_examples=transitions, policy_examples=transitions)
    model = [c for c in iteration.calls(loop, RoleSampling(), TargetConfig(k_futures=k), iteration.Workload(**w))
             if c.phase != "rollouts"]
    head = w["shared_tokens"]
    return calls * head + sum(c.prompts * (c.length - min(head, c.length)) for c in model)


def layouts(examples, tokenizer, max_len: int, batch_size: int, row_multiple: int, row_len: int):
    import numpy as np

    from nlac_jax.training import batching
    from nlac_jax.training.prefix_packing import pack_shared_prefix
    items = [batching.chat_example(tokenizer, **x.to_training_dict()) for x in examples]
    pad = tokenizer.pad_token_id or 0
    out = {}
    for name, packer in (("unpacked", None),
                         ("prefix_tree", lambda c: pack_shared_prefix(c, max_len, pad_id=pad, row_len=row_len,
                                                                      row_multiple=row_multiple))):
        batches, m = batching.pack_train_batches(items, np.random.default_rng(0), max_len=max_len,
                                             batch_size=batch_size, train_steps=None, pad_id=pad, packer=packer)
        out[name] = (batches, m)
    return out


QWEN7B = dict(params=7.6e9, layers=28, hidden=3584)
BLOCK = 128  # ModelConfig.attn_query_block's default: the attention's block size in every layout


def report_layouts(lay, res: dict) -> None:
    """Prints the token accounting of each layout; fills res[name]."""
    print(f"  {'layout':12s} {'batches':>7s} {'presented':>10s} {'computed':>10s} {'slots':>10s} {'computed %':>10s}"
          f" {'7B est.':>8s} shapes")
    flops = {}
    for name, (batches, m) in lay.items():
        slots = sum(b.input_ids.size for b in batches)
        done, causal = block_pairs(batches, BLOCK)  # dense causal scores, scaled to the blocks computed
        pairs = sum(b.input_ids.shape[0] * b.input_ids.shape[1] ** 2 / 2 for b in batches) * done / causal
        flops[name] = 6 * QWEN7B["params"] * slots + 6 * QWEN7B["layers"] * QWEN7B["hidden"] * pairs
        res[name] = dict(m, slots=slots, batches=len(batches), flops_7b=flops[name],
                         shapes=sorted({b.shape for b in batches}))
        print(f"  {name:12s} {len(batches):7d} {m['train/tokens_presented']:10,d} {m['train/tokens_computed']:10,d} "
              f"{slots:10,d} {m['train/tokens_computed'] / max(1, m['train/tokens_presented']):10.1%} "
              f"{flops[name] / flops['unpacked']:8.1%} {sorted({b.shape for b in batches})}")


def block_pairs(batches, blk: int) -> tuple[int, int]:
    """(query block, key block) pairs the step's attention computes, and the causal pairs of the same rows, both
    summed over rows: an unpacked row computes every causal pair (decoder.Attention's query blocks); a prefix-tree
    batch the pairs `tree_attention.visible_blocks` keeps for it (one list per batch, so per row of it)."""
    import numpy as np

    from nlac_jax.models import tree_attention
    done = causal = 0
    for b in batches:
        B, T = b.input_ids.shape
        n = -(-T // blk)
        causal += B * n * (n + 1) // 2
        if getattr(b, "node_ids", None) is None:
            done += B * n * (n + 1) // 2
            continue
        ids, ends = (np.pad(np.asarray(x), [(0, 0), (0, n * blk - T)]) for x in (b.node_ids, b.node_ends))
        done += B * int(tree_attention.visible_blocks(ids, ends, blk)[1].sum())
    return done, causal


def time_steps(batches_by_layout, vocab: int, a) -> dict:
    import jax

    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    cfg = models.ModelConfig(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                             num_layers=a.layers, num_heads=a.heads, num_kv_heads=max(1, a.heads // 2),
                             head_dim=a.hidden // a.heads, dtype="bfloat16", param_dtype="float32", remat="full",
                             max_position_embeddings=max(a.max_len, 2048))
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = training.make_optimizer(training.make_schedule(1e-4))
    step = training.make_train_step(cfg, mesh, opt)
    params = jax.device_get(models.init_params(cfg, seed=0))
    out = {}
    for name, (batches, _) in batches_by_layout.items():
        state = training.create_train_state(cfg, mesh, opt, params=params)
        t0 = time.perf_counter()
        for shape in sorted({b.shape for b in batches}):
            step.lower(state, next(b for b in batches if b.shape == shape)).compile()
        compile_s = time.perf_counter() - t0
        pairs = block_pairs(batches[:a.timing_batches], cfg.attn_query_block)
        print(f"  {name}: {len(batches)} batches, shapes {sorted({b.shape for b in batches})}, compiled in "
              f"{compile_s:.0f} s; attention block pairs computed in the timed batches: {pairs[0]:,d} of "
              f"{pairs[1]:,d} causal ({pairs[0] / pairs[1]:.1%}; query blocks of {cfg.attn_query_block})",
              flush=True)
        times, losses = [], []
        for b in batches[:a.timing_batches]:
            t0 = time.perf_counter()
            state, met = step(state, b)
            losses.append(float(met["loss"]))  # blocks: the step's time includes its compute
            times.append(time.perf_counter() - t0)
            print(f"    step {len(times)}: {times[-1]:.1f} s, loss {losses[-1]:.4f}", flush=True)
        out[name] = dict(step_s=times, total_s=sum(times), compile_s=compile_s, losses=losses, block_pairs=pairs,
                         shapes=sorted({b.shape for b in batches}))
    out["params"] = cfg.num_params
    return out


def cpu_flags() -> list[str]:
    """The CPU flags that matter to XLA:CPU's matmuls, as /proc/cpuinfo lists them."""
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    return [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--k", type=int, default=1, help="futures per evaluator call (TargetConfig.k_futures)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max_len", type=int, default=16384,
                   help="LoopConfig.max_len: longer examples are dropped (counted), as the loop drops them")
    p.add_argument("--row_len", type=int, default=None, help="packed row length (default 2 x max_len)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timing_max_len", type=int, default=8192,
                   help="the timed steps use this max_len (dense attention at 16k+ tokens does not fit this CPU)")
    p.add_argument("--timing_batch_size", type=int, default=4)
    p.add_argument("--timing_batches", type=int, default=3, help="timed steps per layout (the same first batches)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--time_targets", action="store_true",
                   help="also time the targets phase's sampler calls without sharing, with each call's shared "
                        "prefix and with trunks (random model of --hidden x --layers; minutes: try --tasks 1)")
    p.add_argument("--time_rollout", action="store_true",
                   help="also replay the rollout's policy calls through the sampler in each of --modes (counts and "
                        "seconds; random model of --hidden x --layers)")
    p.add_argument("--slots", type=int, default=16, help="sampler rows per call (LoopConfig.sampler_max_batch)")
    p.add_argument("--modes", default=",".join(SHARING),
                   help=f"the sharing modes --time_targets times, the first is the reference ({', '.join(SHARING)})")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in a.modes if m not in SHARING]
    if unknown or not a.modes:
        p.error(f"--modes: {', '.join(unknown) or '(none)'} not among {', '.join(SHARING)}")

    from nlac_jax import text
    from nlac_jax.testing import tiny
    transitions, domain, turns = play(a.tasks)
    tok = tiny.make_tiny_tokenizer(vocab_size=a.vocab, extra_corpus=tuple(domain))
    chars = sum(map(len, domain))
    toks = sum(len(tok.encode(d)) for d in domain)
    print(f"data: {a.tasks} retail tasks, {len(transitions)} transitions (gold scripts, real tool outputs); "
          f"tokenizer: {a.vocab} entries, the domain's system prompt = {chars} chars = {toks} tokens "
          f"({chars / max(toks, 1):.1f} chars/token)")
    phase, examples, calls = targets_phase(transitions, tok, a.k)
    w = workload(transitions, tok, scripted_texts(), phase, a.k)
    print("workload (planning.Workload, the planner's per-iteration estimate; gin/tasks/tau_retail.gin): "
          + ", ".join(f"{k} = {v}" for k, v in w.items()))
    print(f"\ntargets phase (k={a.k}): {phase['rows']} sampled rows, {phase['presented']:,} prompt tokens presented")
    for role, (n, t) in sorted(phase["per_role"].items()):
        print(f"  {role:10s} {n:4d} rows {t:10,d} tokens")
    print(f"  the sampler prefills {phase['sampler']:,} ({phase['sampler'] / phase['presented']:.1%} of presented; "
          f"{phase['calls']} generate calls, each call's common prefix once)")
    for r, n in phase["sampler_trunks"].items():
        print(f"  with trunks (Sampler(trunk_rows={r}), LoopConfig.sampler_trunk_rows) it prefills {n:,} "
              f"({n / phase['presented']:.1%})")
    n = phase["sampler_store"]
    print(f"  with each call's common prefix kept across calls (Sampler(prefix_store=4), "
          f"LoopConfig.sampler_prefix_store) it prefills {n:,} ({n / phase['presented']:.1%})")
    for r, n in phase["sampler_trunks_store"].items():
        print(f"  with trunks (trunk_rows={r}) and the store it prefills {n:,} ({n / phase['presented']:.1%})")
    modelled = modelled_shared_tokens(w, len(transitions), a.k, phase["calls"])
    print(f"  the planner's model of this phase (planning.iteration, the workload above) computes {modelled:,.0f} "
          f"({modelled / phase['presented']:.1%}) with one shared prefix per call")
    print(f"  a prefix tree within each call would compute {phase['trie_per_call']:,} "
          f"({phase['trie_per_call'] / phase['presented']:.1%} of presented; no cache kept across calls)")
    print(f"  a perfect prefix cache over the whole phase would compute {phase['trie']:,} "
          f"({phase['trie'] / phase['presented']:.1%} of presented)")

    rcalls = rollout_calls(turns)
    rolled = [text.encode_chat(tok, m, add_generation_prompt=True) for c in rcalls for m in c.messages_batch]
    presented = sum(map(len, rolled))
    roll = dict(calls=len(rcalls), prompts=len(rolled), presented=presented, trie=trie_tokens(rolled),
                store=sampler_prefill_tokens(rcalls, tok, prefix_store=4),
                trunks_store=sampler_prefill_tokens(rcalls, tok, trunk_rows=8, prefix_store=4))
    print(f"\nrollout (the policy's calls while the episodes were played: {roll['calls']} turns, {roll['prompts']} "
          f"prompts, {presented:,} prompt tokens presented)")
    for name, key in (("each call's common prefix, kept across calls (the default)", "store"),
                      ("and each turn's prompts kept for the next turn (trunk_rows=8, StartCaches.keep_prompts)",
                       "trunks_store")):
        print(f"  {name}: the sampler prefills {roll[key]:,} ({roll[key] / presented:.1%})")
    print(f"  a perfect prefix cache over the rollout would compute {roll['trie']:,} "
          f"({roll['trie'] / presented:.1%})")
    res = {"args": vars(a), "workload": w, "targets_phase": phase, "rollout": roll, "train": {}}
    if a.time_rollout:
        import jax
        print(f"\nrollout, replayed through the sampler ({jax.devices()[0].platform}; random model hidden {a.hidden} x "
              f"{a.layers} layers, bf16 compute, greedy, each row the policy's scripted output length):", flush=True)
        t = time_targets_phase(rcalls, tok, a)
        for name in a.modes[1:]:
            print(f"  {name}: generated tokens identical to {a.modes[0]}: {t[name]['same_tokens']}")
        res["rollout_replayed"] = t
    if a.time_targets:
        import jax
        print(f"\ntargets phase, timed ({jax.devices()[0].platform}, {os.cpu_count()} cores, flags "
              f"{' '.join(cpu_flags())}; random model hidden {a.hidden} x {a.layers} layers, bf16 compute, "
              f"{a.slots} slots, greedy, each role's scripted output length):", flush=True)
        t = time_targets_phase(calls, tok, a)
        u = t[a.modes[0]]["seconds"]
        for name in a.modes[1:]:
            print(f"  {name}: {u / t[name]['seconds']:.2f}x {a.modes[0]}; generated tokens identical: "
                  f"{t[name]['same_tokens']}")
        res["targets_phase_timed"] = t
    row_len = a.row_len or 2 * a.max_len
    lay = layouts(examples, tok, a.max_len, a.batch_size, 1, row_len)
    print(f"\ntrain step: {len(examples)} examples, batch_size {a.batch_size}, max_len {a.max_len}, packed rows "
          f"<= {row_len} tokens")
    report_layouts(lay, res)
    print("  7B est.: the step's FLOPs for Qwen2.5-7B's shape (6 N per slot + 6 L d per attention score computed: "
          "the causal half, prefix-tree rows only their visible blocks of 128), relative to unpacked")
    if a.timing:
        import jax
        keep = cpu_flags()
        a.max_len = a.timing_max_len
        lay = layouts(examples, tok, a.timing_max_len, a.timing_batch_size, 1, 2 * a.timing_max_len)
        print(f"\ntimed layouts (max_len {a.timing_max_len}, batch_size {a.timing_batch_size}; longer examples "
              f"dropped):")
        res["timed_layouts"] = {}
        report_layouts(lay, res["timed_layouts"])
        t = time_steps(lay, len(tok), a)
        print(f"\ntrain-step wall time ({jax.devices()[0].platform}, {os.cpu_count()} cores, flags {' '.join(keep)}; "
              f"model hidden {a.hidden} x {a.layers} layers, bf16 compute / f32 master, remat full)")
        for name in lay:
            r = t[name]
            print(f"  {name:14s} steps {r['total_s']:8.1f} s  ({', '.join(f'{s:.1f}' for s in r['step_s'])})  "
                  f"compile {r['compile_s']:.0f} s  losses {', '.join(f'{x:.4f}' for x in r['losses'])}")
        u, s = t["unpacked"]["total_s"], t["prefix_tree"]["total_s"]
        print(f"  speed-up of the train steps: {u / s:.2f}x")
        res["timing"] = t
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
