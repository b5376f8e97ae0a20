"""Attention over prefix-tree packed rows: the dense masked softmax (decoder.packed_mask_bias, the [T, T] bias) against
models.tree_attention (visible blocks only), forward + backward, side by side in one process.

The rows are bench_targets.py's timed prefix-tree layout (τ2 retail data: 4 train tasks, max_len 8,192, batch 4, rows
of up to 16,384 tokens), its first --batches batches; random q, k, v in bfloat16 with the bench model's attention
shape (2 kv heads, 2 query heads per kv head, head_dim 32). Each variant is called once to compile, then timed once.

    python benchmarks/bench_tree_attention.py [--blocks 0,128,512] [--batches 3]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="0,128,512", help="block sizes to time; 0 = the dense masked softmax")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--groups", type=int, default=2, help="query heads per kv head")
    p.add_argument("--head_dim", type=int, default=32)
    a = p.parse_args(argv)

    import bench_targets as bt
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nlac_jax.models import decoder, tree_attention
    from nlac_jax.testing import tiny
    transitions, domain = bt.play(4)
    tok = tiny.make_tiny_tokenizer(vocab_size=2048, extra_corpus=tuple(domain))
    _, examples, _ = bt.targets_phase(transitions, tok, 1)
    batches = bt.layouts(examples, tok, 8192, 4, 1, 16384)["prefix_tree"][0][:a.batches]
    K, G, D = a.kv_heads, a.groups, a.head_dim
    scale = D ** -0.5
    print(f"cpu: {os.cpu_count()} cores, flags {' '.join(bt.cpu_flags())}; bf16 q, k, v, {K} kv heads x {G}, "
          f"head_dim {D}; seconds for value_and_grad of sum(attention)")
    print(f"{'row':>4s} {'shape':>12s} " + " ".join(f"{('dense' if b == 0 else f'blocks {b}'):>12s}"
                                                    for b in map(int, a.blocks.split(","))) + "  block pairs computed")
    for i, b in enumerate(batches):
        ids, ends, pos = (np.asarray(x) for x in (b.node_ids, b.node_ends, b.positions))
        B, T = ids.shape
        r = np.random.RandomState(i)
        q = jnp.asarray(r.randn(B, K, G, T, D), jnp.bfloat16)
        k, v = (jnp.asarray(r.randn(B, K, T, D), jnp.bfloat16) for _ in range(2))
        tree = {"node_ids": ids, "node_ends": ends, "positions": pos, "window": np.int32(0)}
        cells, share = [], ""
        for blk in map(int, a.blocks.split(",")):
            if blk == 0:
                def f(q, k, v):
                    s = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
                    probs = jax.nn.softmax(s + decoder.packed_mask_bias(ids, ends, pos), -1).astype(q.dtype)
                    return jnp.einsum("bkgts,bksd->bkgtd", probs, v).astype(jnp.float32).sum()
            else:
                def f(q, k, v, blk=blk):
                    return tree_attention.tree_block_attention(q, k, v, tree, blk, scale, None).astype(
                        jnp.float32).sum()
                n = -(-T // blk)
                pad = [(0, 0), (0, n * blk - T)]
                done = int(tree_attention.visible_blocks(np.pad(ids, pad), np.pad(ends, pad), blk)[1].sum())
                share += f" {blk}: {done}/{n * (n + 1) // 2}"
            g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
            jax.block_until_ready(g(q, k, v))
            t0 = time.perf_counter()
            jax.block_until_ready(g(q, k, v))
            cells.append(time.perf_counter() - t0)
        print(f"{i:4d} {str(ids.shape):>12s} " + " ".join(f"{c:12.2f}" for c in cells) + f" {share}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
