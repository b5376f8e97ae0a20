"""Per-chip memory of the prefix-tree packed train step compiled for a TPU (libtpu, ahead of time, on this CPU):
attention over the visible blocks (models/tree_attention.py, attn_query_block = 128) against the dense masked softmax
(attn_query_block = 0: the [T, T] bias and scores).

A scaled-down Qwen2 block (tests/planning/test_plan.py's small config: 2 layers, 256 wide, 4 heads, bf16 compute,
remat 'dots'), 2 packed rows of --length tokens, a v5p-8 slice (data 1, fsdp 2, tensor 2). Compile-time figures
(XLA's memory analysis), so they are exact and need no TPU; the dense scores grow with the heads, so a 7B model's
gap is larger still.

    python benchmarks/plan_packed_memory.py [--length 8192,16384]
"""

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", default="8192,16384", help="packed row lengths to compile")
    p.add_argument("--topology", default="v5p-8")
    a = p.parse_args(argv)

    from nlac_jax import models, training
    from nlac_jax.parallel import sharding
    from nlac_jax.planning import planner, tpu_specs
    devices = planner.topology_devices(tpu_specs.parse_slice(a.topology))
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=len(devices) // 2, devices=devices)
    base = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=64, tie_word_embeddings=False, dtype="bfloat16", param_dtype="float32", remat="dots")
    opt = training.make_optimizer()
    print(f"{a.topology}, mesh {dict(mesh.shape)}; packed train step, 2 rows; per-chip MiB from XLA's memory analysis")
    print("| row length | attention | temporaries | peak | compile s |\n|---|---|---|---|---|")
    for T in map(int, a.length.split(",")):
        for name, blk in (("visible blocks of 128", 128), ("dense masked softmax", 0)):
            cfg = models.ModelConfig(**base, attn_query_block=blk, max_position_embeddings=T)
            step = training.make_train_step(cfg, mesh, opt, num_microbatches=1)
            state = training.abstract_train_state(cfg, mesh, opt)
            batch = planner.abstract_batch(mesh, 2, T, packed=True)
            t0 = time.perf_counter()
            with sharding.use_mesh(mesh):
                ex, _ = planner.compile_one("train step", f"2 x {T}", lambda: step.packed_jitted.lower(state, batch))
            print(f"| {T:,} | {name} | {ex.temporaries / 2**20:,.1f} | {ex.own_peak / 2**20:,.1f} | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
