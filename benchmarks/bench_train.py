"""Train-step throughput: our jitted NLAC step vs transformers PyTorch + torch.optim.AdamW, same model and batch.

    .venv/bin/python benchmarks/bench_train.py                 # reference: Qwen2 768h/8L/12H/2KV/2048 MLP/32k vocab
    .venv/bin/python benchmarks/bench_train.py --quick         # small model, seconds (smoke)
    .venv/bin/python benchmarks/bench_train.py --configs jax-bf16,torch-f32 --steps 5

Every configuration runs in its own subprocess (clean peak-RSS, one JAX/torch runtime at a time), one after the
other, on the same random batch (B x S tokens, the first `--prompt` tokens of each row are prompt, the rest target).
Model FLOPs per token = 6 x (parameters - input embedding) + 12 x layers x hidden x seq (PaLM-style count);
MFU denominators are the float32 and bfloat16 (float32 accumulation) matmul peaks measured by this script.
Reported: best and median step time over --steps timed steps after one warm-up (compile) step (tokens/s and MFU use
the BEST step: least disturbed by other processes on a shared machine); peak RSS of the subprocess.
Children run with glibc malloc tunables that keep freed memory (see MALLOC_TUNABLES; --no-malloc-tuning to drop).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dims(a) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_layers=a.layers,
                num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads)


def num_params(a) -> int:
    e, d, h, kv, f, v, L = a.hidden, a.hidden // a.heads, a.heads, a.kv_heads, a.mlp, a.vocab, a.layers
    layer = e * d * (h + 2 * kv) + d * (h + 2 * kv) + h * d * e + 3 * e * f + 2 * e
    return v * e + L * layer + e + e * v  # untied head


def flops_per_token(a) -> float:
    return 6.0 * (num_params(a) - a.vocab * a.hidden) + 12.0 * a.layers * a.hidden * a.seq


def make_batch(a) -> dict:
    r = np.random.RandomState(0)
    B, S = a.batch, a.seq
    ids = r.randint(0, a.vocab, (B, S)).astype(np.int32)
    lm = np.zeros((B, S), np.float32)
    lm[:, a.prompt:] = 1
    return dict(input_ids=ids, attention_mask=np.ones((B, S), np.int32),
                positions=np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(), loss_mask=lm,
                kind=(np.arange(B) % 2).astype(np.int32), weight=np.ones(B, np.float32))


def maxrss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB on Linux


# ----------------------------------------------------------------------------- children
def child_peaks(a) -> dict:
    import jax
    import jax.numpy as jnp
    n = a.peak_n
    out = {}
    for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
        y = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        f(x, y).block_until_ready()
        best = float("inf")
        for _ in range(a.peak_reps):
            t = time.perf_counter()
            f(x, y).block_until_ready()
            best = min(best, time.perf_counter() - t)
        out[name] = 2 * n ** 3 / best / 1e9
    return out


def child_jax(a, dtype: str) -> dict:
    import jax
    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    cfg = models.ModelConfig(**model_dims(a), dtype=dtype, param_dtype="float32", scan_layers=a.scan,
                             remat=a.remat, max_position_embeddings=max(a.seq, 32), tie_word_embeddings=False)
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = training.make_optimizer(training.make_schedule(1e-4), weight_decay=0.01, clip_norm=1.0)
    state = training.create_train_state(cfg, mesh, opt, seed=0)
    step = training.make_train_step(cfg, mesh, opt, loss_chunk=a.loss_chunk, num_microbatches=a.microbatches,
                                    loss_positions=a.loss_positions)
    batch = step.prepare_batch(make_batch(a))
    batch = jax.device_put(batch, step.batch_shardings)
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t
    times, losses = [], [(float(m["l1"]) + float(m["l2"])) / 2]
    for _ in range(a.steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t)
        losses.append((float(m["l1"]) + float(m["l2"])) / 2)
    stats = {}
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        pass
    return dict(step_s=min(times), median_s=statistics.median(times), times=times, first_s=first, losses=losses,
                rss_gb=maxrss_gb(), device_peak_gb=stats.get("peak_bytes_in_use", 0) / 1024 ** 3)


def child_torch(a, dtype: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    config = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         max_position_embeddings=max(a.seq, 32), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    b = make_batch(a)
    ids = torch.from_numpy(b["input_ids"]).long()
    am = torch.from_numpy(b["attention_mask"]).long()
    labels = ids.clone()
    labels[:, :a.prompt] = -100

    target = labels[:, 1:] != -100  # position t-1 predicts token t

    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            if a.loss_positions:  # the same saving as ours: the LM head on target positions only
                hidden = model.model(input_ids=ids, attention_mask=am).last_hidden_state[:, :-1][target]
                loss = torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), labels[:, 1:][target])
            else:
                loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    t = time.perf_counter()
    losses = [one()]
    first = time.perf_counter() - t
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        losses.append(one())
        times.append(time.perf_counter() - t)
    return dict(step_s=min(times), median_s=statistics.median(times), times=times, first_s=first, losses=losses,
                rss_gb=maxrss_gb(), threads=torch.get_num_threads())


# ----------------------------------------------------------------------------- parent
CONFIGS = {
    "jax-f32": ("ours (JAX)", "float32 compute, f32 master"),
    "jax-bf16": ("ours (JAX)", "bfloat16 compute, f32 master"),
    "torch-f32": ("PyTorch + AdamW", "float32"),
    "torch-bf16": ("PyTorch + AdamW", "bf16 autocast, f32 master"),
}


# glibc malloc returns large blocks to the OS on free (mmap/munmap), so every step page-faults its big buffers
# again (measured: a 24576x64x512 bf16 matmul 23 ms -> 5 ms with these settings). Applied to BOTH frameworks.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184"


def run_child(argv: list[str], malloc_tuning: bool = True) -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if malloc_tuning:
        env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES"), MALLOC_TUNABLES) if x)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv, capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child {argv} failed (rc={p.returncode}):\n{p.stderr[-3000:]}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model (256h/2L/4H/2KV/512 MLP/4k vocab, 2x128)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens per row (no loss); default seq//4")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    ap.add_argument("--configs", default="jax-bf16,jax-f32,torch-f32")
    ap.add_argument("--loss-chunk", type=int, default=0, help="make_train_step.loss_chunk")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--loss-positions", type=int, default=0,
                    help="K > 0: the LM head on target positions only (ours: make_train_step.loss_positions=K; "
                         "PyTorch: the head on the target rows of the hidden states)")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    ap.add_argument("--scan", action="store_true",
                    help="scanned layers (cfg.scan_layers=True); default unrolled: on XLA:CPU the scan's stacked "
                         "residuals cost extra copies/converts (~30%% of the step), on TPU scan is the usual choice")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--peak-reps", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--no-malloc-tuning", dest="malloc_tuning", action="store_false",
                    help="do not set GLIBC_TUNABLES (malloc keeps freed memory) in the child processes")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.heads, a.kv_heads, a.mlp, a.vocab = 256, 2, 4, 2, 512, 4096
        a.batch, a.seq, a.peak_n = 2, 128, 1024
    if not a.prompt:
        a.prompt = a.seq // 4
    return a


def main(argv=None):
    a = parse(argv)
    if a.child:
        if a.child == "peaks":
            res = child_peaks(a)
        elif a.child.startswith("jax-"):
            res = child_jax(a, "bfloat16" if a.child == "jax-bf16" else "float32")
        else:
            res = child_torch(a, "bfloat16" if a.child == "torch-bf16" else "float32")
        print("RESULT " + json.dumps(res), flush=True)
        return
    fwd = [x for x in (argv if argv is not None else sys.argv[1:])]
    tokens = a.batch * a.seq
    fpt = flops_per_token(a)
    print(f"model: hidden {a.hidden}, layers {a.layers}, heads {a.heads}/{a.kv_heads} kv, mlp {a.mlp}, vocab {a.vocab}"
          f" (untied) = {num_params(a) / 1e6:.1f}M params; batch {a.batch} x seq {a.seq} ({tokens} tokens/step, "
          f"loss on {a.seq - a.prompt}/{a.seq} positions); {fpt / 1e6:.1f} MFLOP/token", flush=True)
    if a.loss_positions:
        print(f"--loss-positions {a.loss_positions}: both sides run the LM head on target positions only; GFLOP/s "
              f"and MFU still count it at every position (the same work as without the flag)", flush=True)
    peaks = run_child(fwd + ["--child", "peaks"], a.malloc_tuning)
    print(f"matmul peak ({a.peak_n}^3, best of {a.peak_reps}): float32 {peaks['f32']:.0f} GFLOP/s, "
          f"bfloat16 (f32 accumulation) {peaks['bf16']:.0f} GFLOP/s", flush=True)
    results = {}
    for c in a.configs.split(","):
        results[c] = run_child(fwd + ["--child", c], a.malloc_tuning)
        r = results[c]
        print(f"  {c}: best step {r['step_s']:.2f}s, median {r['median_s']:.2f}s (times "
              f"{[round(x, 2) for x in r['times']]}, first incl. compile {r['first_s']:.1f}s), mean target NLL "
              f"{[round(x, 4) for x in r['losses']]}", flush=True)
    base = results.get("torch-f32")
    hdr = (f"| {'config':<10} | {'framework':<16} | {'precision':<29} | {'best s':>6} | {'median s':>8} | {'tokens/s':>8} | "
           f"{'GFLOP/s':>7} | {'MFU f32':>7} | {'MFU bf16':>8} | {'vs torch f32':>12} | {'peak RSS GB':>11} |")
    print()
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for c, r in results.items():
        tps = tokens / r["step_s"]
        gf = tps * fpt / 1e9
        rel = f"{tps / (tokens / base['step_s']):.2f}x" if base else "-"
        fw, prec = CONFIGS[c]
        print(f"| {c:<10} | {fw:<16} | {prec:<29} | {r['step_s']:>6.2f} | {r['median_s']:>8.2f} | {tps:>8.1f} | {gf:>7.1f} | "
              f"{gf / peaks['f32']:>7.1%} | {gf / peaks['bf16']:>8.1%} | {rel:>12} | {r['rss_gb']:>11.2f} |")


if __name__ == "__main__":
    main()
