"""Sampler throughput: nlac_jax.sampling vs transformers PyTorch `generate` (KV cache), side by side, same CPU.

    python benchmarks/bench_sampling.py                       # the issue's reference setting (several minutes)
    python benchmarks/bench_sampling.py --quick               # batch 1 and 8, 32 new tokens, float32 only
    python benchmarks/bench_sampling.py --batches 1,32 --new_tokens 64 --dtypes float32,bfloat16 --repeats 3
    python benchmarks/bench_sampling.py --shared_prefix 1536 --suffix_len 64 --batches 16 --new_tokens 32 \
        --dtypes float32 --repeats 2 --only_shared      # prompts sharing a prefix (the prefix cache)

Reference model: a random Qwen2 (hidden 768, 8 layers, 12 heads, 2 kv heads, MLP 2048, vocab 32000, untied head:
97.9M parameters); prompts of --prompt_len random tokens; exactly --new_tokens new tokens (no early stop); greedy.
Reported per (dtype, batch): compile time (first call minus a steady call), steady-state generated tokens/s of both
(best of --repeats runs, ours and transformers interleaved; prefill included, as in transformers' generate), the
speed-up (also against transformers float32 for the bfloat16 rows), our decode-only steps/s, and for batch 1 the
streaming efficiency = parameter bytes x decode steps/s / memory read bandwidth (measured here on a 1 GiB array:
best of numpy, torch and XLA sums); for transformers the decode rate is approximated by new tokens / total time. Greedy agreement with transformers is printed as a sanity check
(exact equality is tested in tests/sampling/test_sampling.py on well-separated tiny models; random init logits here are
near-ties, so an occasional float divergence is expected, especially in bfloat16).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time

import numpy as np


def memory_read_bandwidth(threads: int, mib: int = 1024) -> dict:
    """Read bandwidth (bytes/s) of a `mib` MiB array (larger than the L3 here), best of 5, by three readers:
    numpy sum split over 1 and `threads` threads, torch sum (`threads` threads) and a jitted jnp.sum (XLA)."""
    import jax
    import jax.numpy as jnp
    import torch
    a = np.ones(mib * 2 ** 20 // 4, np.float32)
    out = {}

    def best(fn):
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return a.nbytes / min(ts)

    for n in sorted({1, threads}):
        chunks = np.array_split(a, n)
        with concurrent.futures.ThreadPoolExecutor(n) as ex:
            out[f"numpy x{n}"] = best(lambda: list(ex.map(np.sum, chunks)))
    ta = torch.from_numpy(a)
    out["torch"] = best(lambda: float(ta.sum()))
    ja = jnp.asarray(a)
    f = jax.jit(jnp.sum)
    out["jax"] = best(lambda: f(ja).block_until_ready())
    del ja
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=None, help="default 128")
    p.add_argument("--dtypes", default=None, help="default float32,bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads (and the bandwidth measurement)")
    p.add_argument("--repeats", type=int, default=None, help="default 3")
    p.add_argument("--quick", action="store_true",
                   help="defaults become --batches 1,8 --new_tokens 32 --dtypes float32 --repeats 1")
    p.add_argument("--no_hf", action="store_true", help="skip transformers")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model_dir", help="benchmark this HF directory instead of the random reference model")
    p.add_argument("--samples_per_prompt", type=int, default=1,
                   help="K > 1: also time K samples of each of B/K prompts: ours with generate(n=K) (each prompt "
                        "prefilled once) against ours with the prompts repeated K times and transformers' "
                        "num_return_sequences=K (sampled, temperature 1, top_k 0)")
    p.add_argument("--shared_prefix", type=int, default=0, metavar="P",
                   help="P > 0: also time B prompts that share a P-token prefix, each with its own --suffix_len "
                        "tokens: ours (the prefix is prefilled once), ours with min_shared_prefix=0 (every prompt "
                        "prefilled whole) and transformers generate (no prefix cache); greedy")
    p.add_argument("--suffix_len", type=int, default=64)
    p.add_argument("--only_shared", action="store_true", help="with --shared_prefix: skip the per-batch table")
    args = p.parse_args(argv)
    defaults = dict(batches="1,8", new_tokens=32, dtypes="float32", repeats=1) if args.quick else \
        dict(batches="1,8,32", new_tokens=128, dtypes="float32,bfloat16", repeats=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    N, T = args.new_tokens, args.prompt_len

    import torch
    import transformers
    torch.set_num_threads(args.threads)
    import jax
    from nlac_jax import models, sampling

    bws = memory_read_bandwidth(args.threads)
    bw = max(bws.values())
    tmp = tempfile.TemporaryDirectory()
    if args.model_dir:
        model_dir = args.model_dir
    else:
        model_dir = tmp.name
        torch.manual_seed(0)
        hcfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=2,
                                        max_position_embeddings=4096, tie_word_embeddings=False)
        transformers.Qwen2ForCausalLM(hcfg).save_pretrained(model_dir)
    hm32 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hm32.generation_config.eos_token_id = None
    hm32.generation_config.pad_token_id = 0

    print(f"jax {jax.__version__} ({jax.devices()[0].platform}, {os.cpu_count()} cpus), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}")
    print(f"memory read bandwidth: {bw / 1e9:.1f} GB/s (best of " +
          ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bws.items()) +
          f"); prompt {T} tokens, {N} new tokens, greedy, no early stop")
    rows, shared, prefixed = [], [], []
    for dtype in dtypes:
        m = models.load_pretrained(model_dir, dtype=dtype, load_tokenizer=False)
        cfg = m.config
        pbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(m.params))
        hm = hm32 if dtype == "float32" else hm32.to(getattr(torch, dtype))
        sampler = sampling.Sampler(cfg)
        if args.shared_prefix:
            prefixed.extend(shared_prefix_rows(args, m, hm, batches, dtype))
        for B in ([] if args.only_shared else batches):
            rng = np.random.RandomState(B)
            prompts = rng.randint(0, cfg.vocab_size, (B, T)).tolist()
            kw = dict(max_new_tokens=N, stop_token_ids=(), temperature=0.0)
            # decode loop alone (prefill excluded): steps/s for the streaming efficiency
            _, Tb, Nb = sampler.buckets(B, T, N)
            Bb = sampler.buckets(B, T, N)[0]
            pid = np.zeros((Bb, Tb), np.int32)
            pmask = np.zeros((Bb, Tb), np.int32)
            pid[:B, Tb - T:], pmask[:B, Tb - T:], pmask[B:, -1] = np.asarray(prompts, np.int32), 1, 1
            ctl = sampling.controls(0.0, 0, 1.0, N, cfg.max_position_embeddings)
            ti = torch.tensor(prompts)

            def ours_run():
                return sampler.generate(m.params, prompts, **kw)

            def decode_only():
                st = sampler.prefill(m.params, pid, pmask, np.arange(Bb) < B, jax.random.key(0), ctl, new_bucket=Nb)
                jax.block_until_ready(st)
                t = time.perf_counter()
                jax.block_until_ready(sampler.decode(m.params, st, ctl))
                return time.perf_counter() - t

            def hf_run():
                with torch.no_grad():
                    return hm.generate(input_ids=ti, attention_mask=torch.ones_like(ti), do_sample=False,
                                       max_new_tokens=N, min_new_tokens=N, eos_token_id=None, pad_token_id=0)

            t = time.perf_counter()
            out = ours_run()
            first = time.perf_counter() - t
            if not args.no_hf:
                ref = hf_run()  # warm-up
            ours, dec, hf = [], [], []
            for _ in range(args.repeats):  # interleaved, so load from other processes hits both sides alike
                t = time.perf_counter()
                out = ours_run()
                ours.append(time.perf_counter() - t)
                dec.append(decode_only())
                if not args.no_hf:
                    t = time.perf_counter()
                    ref = hf_run()
                    hf.append(time.perf_counter() - t)
            assert (out.lengths == N).all()
            steps_s = (N - 1) / min(dec)
            hf_t = min(hf) if hf else None
            agree = float((ref[:, T:].numpy() == out.tokens).mean()) if hf else None
            row = dict(dtype=dtype, B=B, compile=first - min(ours), ours=B * N / min(ours),
                       hf=None if hf_t is None else B * N / hf_t, steps=steps_s, agree=agree,
                       eff=pbytes * steps_s / bw if B == 1 else None,
                       hf_eff=(pbytes * N / hf_t / bw) if (B == 1 and hf_t) else None)
            if dtype != "float32":
                base = [r for r in rows if r["dtype"] == "float32" and r["B"] == B and r["hf"]]
                row["hf32"] = base[0]["hf"] if base else None
            rows.append(row)
            print(_fmt(row), flush=True)
        if args.samples_per_prompt > 1:
            shared.extend(shared_prefill_rows(args, m, hm, sampler, batches, dtype))
    if shared:
        print(f"\nK = {args.samples_per_prompt} samples per prompt (B rows = B/K prompts x K; sampled; tok/s, best of "
              f"{args.repeats})\n\n| dtype | rows | ours n=K (shared prefill) | ours, prompts repeated | transformers "
              f"num_return_sequences | shared / repeated | shared / transformers |\n|---|---|---|---|---|---|---|")
        for r in shared:
            print(f"| {r['dtype']} | {r['B']} | {r['shared']:.1f} | {r['repeated']:.1f} | "
                  + ("-" if r["hf"] is None else f"{r['hf']:.1f}") + f" | {r['shared'] / r['repeated']:.2f}x | "
                  + ("-" if r["hf"] is None else f"{r['shared'] / r['hf']:.2f}x") + " |")
    if prefixed:
        print(f"\nPrompts sharing a {args.shared_prefix}-token prefix, each with its own {args.suffix_len} tokens, "
              f"{N} greedy new tokens (seconds per call, best of {args.repeats}; transformers has no prefix cache)"
              "\n\n| dtype | prompts | ours (prefix once) s | ours, no sharing s | transformers s | sharing / no "
              "sharing | ours / transformers | prefill tokens ours / presented | prefill slots ours (padding included) | "
              "greedy agree (ours vs no sharing, vs transformers) |\n|---|---|---|---|---|---|---|---|---|---|")
        for r in prefixed:
            hf = "-" if r["hf"] is None else f"{r['hf']:.2f}"
            vs = "-" if r["hf"] is None else f"{r['hf'] / r['ours']:.2f}x"
            ag = "-" if r["agree_hf"] is None else f"{r['agree_hf']:.0%}"
            print(f"| {r['dtype']} | {r['B']} | {r['ours']:.2f} | {r['plain']:.2f} | {hf} | "
                  f"{r['plain'] / r['ours']:.2f}x | {vs} | {r['computed']} / {r['presented']} | {r['slots']} | "
                  f"{r['agree_plain']:.0%}, {ag} |")
    if args.only_shared:
        return prefixed
    print("\n| dtype | batch | compile s | ours tok/s | transformers tok/s (same dtype) | speed-up | "
          "speed-up vs transformers f32 | our decode steps/s | stream eff. ours / hf | greedy agree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_fmt(r, md=True))
    return rows


def shared_prefill_rows(args, m, hm, sampler, batches, dtype) -> list[dict]:
    """Tok/s of B rows made of B/K prompts x K samples: generate(n=K) vs the prompts repeated K times (both ours) vs
    transformers' num_return_sequences=K (which repeats the prompts before its prefill)."""
    import torch
    K, N, T = args.samples_per_prompt, args.new_tokens, args.prompt_len
    out = []
    for B in batches:
        if B % K:
            continue
        prompts = np.random.RandomState(B).randint(0, m.config.vocab_size, (B // K, T)).tolist()
        kw = dict(max_new_tokens=N, stop_token_ids=(), temperature=1.0, seed=0)
        ti = torch.tensor(prompts)
        runs = {"shared": lambda: sampler.generate(m.params, prompts, n=K, **kw),
                "repeated": lambda: sampler.generate(m.params, [p for p in prompts for _ in range(K)], **kw)}
        if not args.no_hf:
            def hf():
                with torch.no_grad():
                    return hm.generate(input_ids=ti, attention_mask=torch.ones_like(ti), do_sample=True, top_k=0,
                                       temperature=1.0, num_return_sequences=K, max_new_tokens=N, min_new_tokens=N,
                                       eos_token_id=None, pad_token_id=0)
            runs["hf"] = hf
        best = {k: float("inf") for k in runs}
        for k, fn in runs.items():
            fn()  # warm-up / compile
        for _ in range(args.repeats):  # interleaved
            for k, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - t)
        out.append(dict(dtype=dtype, B=B, **{k: B * N / v for k, v in best.items()}, **({} if "hf" in runs
                                                                                       else {"hf": None})))
        print(f"  K={K} rows {B}: " + ", ".join(f"{k} {B * N / v:.1f} tok/s" for k, v in best.items()), flush=True)
    return out


def shared_prefix_rows(args, m, hm, batches, dtype) -> list[dict]:
    """Seconds per `generate` call for B prompts sharing an args.shared_prefix-token prefix (each with its own
    args.suffix_len tokens): ours through the public API (the prefix cache finds the prefix within the call; the
    prefix store is emptied before each call, so no call reuses the last one's prefix), ours with sharing off,
    transformers generate on the same (equal-length, unpadded) prompts; greedy, interleaved, best of repeats."""
    import torch
    from nlac_jax import sampling
    N, P, S = args.new_tokens, args.shared_prefix, args.suffix_len
    out = []
    for B in batches:
        rng = np.random.RandomState(1000 + B)
        prefix = rng.randint(0, m.config.vocab_size, P).tolist()
        prompts = [prefix + rng.randint(0, m.config.vocab_size, S).tolist() for _ in range(B)]
        kw = dict(max_new_tokens=N, stop_token_ids=(), temperature=0.0)
        plain = sampling.Sampler(m.config, min_shared_prefix=0)
        ti = torch.tensor(prompts)
        res = {}
        def ours():
            sampling.get_sampler(m.config).forget_prefixes()  # one call's sharing, as transformers gets none across
            return sampling.generate(m, prompts, **kw)
        runs = {"ours": ours, "plain": lambda: plain.generate(m.params, prompts, **kw)}
        if not args.no_hf:
            def hf():
                with torch.no_grad():
                    return hm.generate(input_ids=ti, attention_mask=torch.ones_like(ti), do_sample=False,
                                       max_new_tokens=N, min_new_tokens=N, eos_token_id=None, pad_token_id=0)
            runs["hf"] = hf
        best = {k: float("inf") for k in runs}
        for k, fn in runs.items():
            res[k] = fn()  # warm-up / compile
        for _ in range(args.repeats):  # interleaved
            for k, fn in runs.items():
                t = time.perf_counter()
                res[k] = fn()
                best[k] = min(best[k], time.perf_counter() - t)
        ours = res["ours"]
        row = dict(dtype=dtype, B=B, ours=best["ours"], plain=best["plain"], hf=best.get("hf"),
                   computed=int(ours.prefill_tokens), presented=B * (P + S), slots=int(ours.prefill_slots),
                   agree_plain=float((ours.tokens == res["plain"].tokens).mean()),
                   agree_hf=float((res["hf"][:, P + S:].numpy() == ours.tokens).mean()) if "hf" in res else None)
        assert ours.shared_prefix == P, (ours.shared_prefix, P)
        out.append(row)
        print(f"  shared prefix {P} + {S}, {B} prompts: " + ", ".join(f"{k} {v:.2f} s" for k, v in best.items()),
              flush=True)
    return out


def _fmt(r, md=False):
    f = lambda x, s: "-" if x is None else s.format(x)
    cells = [r["dtype"], str(r["B"]), f(r["compile"], "{:.1f}"), f(r["ours"], "{:.1f}"), f(r["hf"], "{:.1f}"),
             f(None if r["hf"] is None else r["ours"] / r["hf"], "{:.2f}x"),
             f(r["ours"] / r["hf32"] if r.get("hf32") else (r["ours"] / r["hf"] if r["hf"] and r["dtype"] == "float32"
                                                             else None), "{:.2f}x"),
             f(r["steps"], "{:.1f}"),
             (f(r["eff"], "{:.0%}") + " / " + f(r["hf_eff"], "{:.0%}")) if r["eff"] is not None else "-",
             f(r["agree"], "{:.0%}")]
    return ("| " + " | ".join(cells) + " |") if md else "  ".join(cells)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
