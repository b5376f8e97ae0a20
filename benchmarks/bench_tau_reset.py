"""A τ-bench episode's private DB: the copy-on-read view (`envs.tau_adapter.fresh_db`) against a full copy (the DB
validated again from its JSON, the adapter's previous path), and what the episode's end costs (tau2's DB hash, which
the reward compares with the gold DB's), per domain, on this CPU.

    .venv/bin/python benchmarks/bench_tau_reset.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _per_call(fn, repeats: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    from nlac_jax.envs import tau_adapter as ta
    ta.import_tau2()
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if f" {f}" in flags]
    print(f"{os.cpu_count()} cores, flags {' '.join(keep)}; seconds per call, mean of {a.repeats}")
    print("| domain | full copy (validate JSON) | copy-on-read view | speed-up | DB hash (episode end) |")
    print("|---|---|---|---|---|")
    for domain in ta.DOMAINS:
        _, db_cls, _ = ta.domain_module(domain)
        as_json = ta._shared_db(domain).model_dump_json()
        full = _per_call(lambda: db_cls.model_validate_json(as_json), a.repeats)
        view = _per_call(lambda: ta.fresh_db(domain), a.repeats)
        db = ta.fresh_db(domain)
        h = _per_call(db.get_hash, max(3, a.repeats // 4))
        print(f"| {domain} | {full:.4f} | {view:.5f} | {full / view:,.0f}x | {h:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
