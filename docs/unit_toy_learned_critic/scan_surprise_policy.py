"""Where the surprise-drawn L2 states of `nlac_surprise_policy` lie in the toy game (results_endgame.md, section 4).

Reads the arm's example dumps (workdir/arms/nlac_surprise_policy/seed_S/examples/iter_*.txt: the loop writes the first
`LoopConfig.dump_examples` policy examples of each iteration, and the arm builds its surprise-drawn ones first, marked
"action from buffer"), rebuilds each state's public transcript, and counts by how many numbers were still possible
(`experiments.corpus.consistent_interval`: from the replies only), the verdict, and whether the buffer's action was
distilled unchanged. Public information only; no run is needed.

    python docs/unit_toy_learned_critic/scan_surprise_policy.py WORKDIR 22,23,24
"""

import collections
import glob
import os
import re
import sys

from nlac_jax.experiments.corpus import consistent_interval

_TURN = re.compile(r"\[(AGENT|USER)\]\n\s+(.*)")


def scan(path: str):
    """(possible-set class, verdict, distilled unchanged) of every buffer-action policy example in one dump."""
    for block in re.split(r"(?m)^=== ", open(path).read())[1:]:
        if not block.startswith("policy example") or "action from buffer" not in block:
            continue
        verdict = re.search(r"verdict=(\w+)", block).group(1)
        n = int(re.search(r"between 1 and (\d+)", block).group(1))
        state, rest = block.split("ACTION a:", 1)
        history = [{"role": "assistant" if who == "AGENT" else "user", "content": text.strip()}
                   for who, text in _TURN.findall(state.split("[USER]", 1)[1])]
        lo, hi, _, _ = consistent_interval(history, n)
        action = rest.strip().split("\n")[0].strip()
        target = rest.split("TARGET aʳ:", 1)[1].strip().split("\n")[0].strip() if "TARGET aʳ:" in rest else ""
        size = hi - lo + 1
        kind = "1 (cornered)" if size <= 1 else "2-4" if size <= 4 else "more than 4"
        yield kind, verdict, target.split() == action.split()


def main(argv) -> int:
    workdir, seeds = argv[0], argv[1].split(",")
    counts = collections.Counter()
    for s in seeds:
        for path in sorted(glob.glob(os.path.join(workdir, "arms", "nlac_surprise_policy", f"seed_{s}", "examples",
                                                  "iter_*.txt"))):
            counts.update(scan(path))
    print("| numbers still possible | verdict | buffer action distilled | states |\n|---|---|---|---|")
    for (kind, verdict, kept), k in sorted(counts.items()):
        print(f"| {kind} | {verdict} | {'yes' if kept else 'no'} | {k} |")
    print(f"| all | | | {sum(counts.values())} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
