"""Several JAX processes (a TPU pod: one per host) running one NLAC loop.

    distributed.initialize(requested=flags.multihost)   # before anything touches the devices
    procs = distributed.Processes.current()             # index, count; a no-op object for one process
    mine = procs.share(tasks)                           # this process's contiguous share of a global list
    everything = procs.gather(mine)                     # the shares again, concatenated in process order

How the loop divides the work (docs/ARCHITECTURE.md, "Several processes"): every process holds the same host
data (replay buffer, task cursor, examples, token batches); only the environments are divided. Each process plays
its share of the iteration's tasks in its own env pool; every policy turn is one collective round
(`CollectivePolicy`): the processes exchange their histories, all of them run the policy on the concatenation (one
sampler call over the global batch, whose rows the mesh spreads over every device of every host) and each keeps
its own actions. After the rollout the episodes are gathered, so what follows (targets, packing, the train step,
checkpoints) sees the same data on every process, and every collective JAX call is made by every process with the
same shapes, in the same order.

On a Cloud TPU slice, launch/run_pod.sh runs the same `python -m nlac_jax.train ... --multihost` on every worker
with `JAX_NUM_PROCESSES` set; `jax.distributed.initialize` then finds the coordinator and this worker's process id
in the TPU VM metadata. The tests start the processes themselves with `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` and
`JAX_COORDINATOR_ADDRESS` (localhost).

Exchanges go through `jax.experimental.multihost_utils.process_allgather` on byte arrays (the device collectives,
gloo on CPU), as UTF-8 JSON (never pickle: nothing a peer sends is executed). What crosses is plain JSON values:
histories (message dicts), episodes as `Episode.to_dict()` (their transitions through `Transition.to_dict`), the
checkpoint records. Every process decodes every part, its own included, so all of them hold the same values (a
tuple arrives as a list on every process, not only on the others).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

# Environment variables that say how many processes a run has (read before jax.distributed.initialize, which
# needs the count and cannot be undone): ours first, then the ones a Cloud TPU pod (GKE) sets for every worker.
NUM_PROCESSES_VAR = "JAX_NUM_PROCESSES"
PROCESS_ID_VAR = "JAX_PROCESS_ID"
TPU_WORKER_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")


def expected_process_count(environ=None) -> int | None:
    """How many processes this run has according to the environment, or None when it does not say.

    `JAX_NUM_PROCESSES` (set by launch/run_pod.sh to the slice's worker count, and by the tests) wins; otherwise a
    GKE TPU pod's worker list (`TPU_PROCESS_ADDRESSES` / `TPU_WORKER_HOSTNAMES`, times `MEGASCALE_NUM_SLICES`).
    ValueError (one line naming the variable) for a value that is not a positive integer."""
    env = os.environ if environ is None else environ
    raw = env.get(NUM_PROCESSES_VAR)
    if raw is not None and raw.strip():
        return _positive_int(NUM_PROCESSES_VAR, raw)
    for var in TPU_WORKER_VARS:
        hosts = env.get(var)
        if hosts and hosts.strip():
            n_slices = _positive_int("MEGASCALE_NUM_SLICES", env.get("MEGASCALE_NUM_SLICES") or "1")
            return len([h for h in hosts.split(",") if h.strip()]) * n_slices
    return None


def _positive_int(var: str, raw: str) -> int:
    """int(raw) if it is a positive integer, else ValueError naming the environment variable."""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{var}={raw!r}: expected a positive integer")
    return n


def initialize(requested: bool = False, environ=None) -> bool:
    """Call `jax.distributed.initialize()` when this run has more than one process; never for a single process.

    The count comes from `expected_process_count`. More than one: initialise (the coordinator address comes from
    `JAX_COORDINATOR_ADDRESS` or the TPU pod's auto-detection; the process id from `JAX_PROCESS_ID` or
    auto-detection). Exactly one: nothing to do, even when `requested` (`--multihost` on a single host). Unknown
    (no variable set): initialise only when `requested`, which leaves the count to jax's cluster detection
    (Cloud TPU VMs read it from the metadata server). Returns whether jax.distributed was initialised.
    Processes other than 0 then log warnings and errors only (one process's INFO lines describe the run)."""
    import jax
    env = os.environ if environ is None else environ
    n = expected_process_count(env)
    if n == 1 or (n is None and not requested):
        if requested:
            log.info("--multihost: this run has one process (%s=1); jax.distributed is not initialised",
                     NUM_PROCESSES_VAR)
        return False
    pid = env.get(PROCESS_ID_VAR)
    kwargs: dict[str, Any] = {}
    if n is not None:
        kwargs["num_processes"] = n
    if pid is not None and pid.strip():
        try:
            kwargs["process_id"] = int(pid)
        except ValueError:
            raise ValueError(f"{PROCESS_ID_VAR}={pid!r}: expected an integer in [0, {n})") from None
    jax.distributed.initialize(**kwargs)
    if jax.process_index() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def share_bounds(n: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of process `index`'s contiguous share of `n` items over `count` processes (the first
    n % count processes take one more), so the shares concatenated in process order are the whole list."""
    base, extra = divmod(int(n), int(count))
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class Processes:
    """This process's place among the run's processes, and the few exchanges the loop needs.

    Every method that exchanges data (`allgather_bytes`, `allgather_objects`, `gather`, a `CollectivePolicy`) is
    collective: every process must call it, in the same order. With one process they are local and cost nothing."""

    def __init__(self, index: int = 0, count: int = 1):
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"Processes(index={index!r}, count={count!r}): expected 0 <= index < count")
        self.index, self.count = index, count

    @classmethod
    def current(cls) -> "Processes":
        """The running JAX processes (`jax.process_index()`, `jax.process_count()`)."""
        import jax
        return cls(jax.process_index(), jax.process_count())

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs, metrics, dumps, plots and exported files."""
        return self.index == 0

    def share(self, items: Sequence) -> list:
        """This process's contiguous share of `items` (see `share_bounds`)."""
        start, stop = share_bounds(len(items), self.index, self.count)
        return list(items[start:stop])

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's `data`, in process order (collective)."""
        if self.count == 1:
            return [bytes(data)]
        from jax.experimental import multihost_utils
        lengths = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
        # a power-of-two buffer: each new shape compiles the gather again, and every round has another length
        buf = np.zeros((1 << max(8, (int(lengths.max()) - 1).bit_length()),), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(self.count, -1)
        return [rows[i, :int(lengths[i])].tobytes() for i in range(self.count)]

    def allgather_objects(self, obj: Any) -> list:
        """Every process's `obj`, a JSON value (dicts with str keys, lists, str, int, finite float, bool, None), in
        process order (collective); see the module docstring. A value JSON cannot carry is refused here, on the
        sender, with a TypeError/ValueError naming what it is (not turned into something else)."""
        if self.count == 1:
            return [obj]
        try:
            data = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise type(e)(f"Processes.allgather_objects: the value is not plain JSON ({e})") from None
        return [json.loads(b.decode("utf-8")) for b in self.allgather_bytes(data)]

    def gather(self, local: Sequence, encode: Callable[[Any], Any] | None = None,
               decode: Callable[[Any], Any] | None = None) -> list:
        """The processes' lists concatenated in process order (collective): the inverse of `share`.

        encode / decode: item -> JSON value and back (e.g. `Episode.to_dict` / `Episode.from_dict`), for items
        that are not JSON values themselves; with several processes every item (this process's too) comes back
        through decode, so all processes hold equal items."""
        if self.count == 1:
            return list(local)
        parts = self.allgather_objects([x if encode is None else encode(x) for x in local])
        return [x if decode is None else decode(x) for part in parts for x in part]

    def collective_policy(self, policy_fn: Callable[[list], list]) -> "CollectivePolicy":
        """`policy_fn` made collective for a rollout over this process's share of the envs (see CollectivePolicy)."""
        return CollectivePolicy(policy_fn, self)


class CollectivePolicy:
    """A BatchedRunner policy whose every call is one collective round over all processes.

    A round: each process contributes its active histories and whether its rollout has finished; every process
    runs the wrapped `policy_fn` on the concatenation (in process order; it makes collective sampler calls, so all
    processes must make it with the same input) and keeps the actions of its own rows. Episodes end at different
    turns on different processes, so a process whose rollout is over calls `finish()`, which keeps taking part
    (with no rows) until every process has finished.
    """

    def __init__(self, policy_fn: Callable[[list], list], processes: Processes):
        self.policy_fn, self.processes = policy_fn, processes
        self.rounds = 0

    def _round(self, histories: list, done: bool) -> tuple[list, bool]:
        parts = self.processes.allgather_objects((list(histories), bool(done)))
        if all(d for _, d in parts):
            return [], True
        everything = [h for hs, _ in parts for h in hs]
        self.rounds += 1
        actions = list(self.policy_fn(everything))
        if len(actions) != len(everything):
            raise ValueError(f"policy_fn returned {len(actions)} actions for {len(everything)} histories")
        start = sum(len(hs) for hs, _ in parts[:self.processes.index])
        return actions[start:start + len(histories)], False

    def __call__(self, histories: list) -> list:
        """This process's actions for `histories` (collective: a round where this process is not done)."""
        return self._round(histories, done=False)[0]

    def finish(self) -> None:
        """Take part in the other processes' remaining rounds until all have finished (collective)."""
        while not self._round([], done=True)[1]:
            pass


def replicated_to_global(tree, shardings):
    """Global jax.Arrays from host arrays that every process holds in full (each process places only the slices
    its devices own); `shardings`: a matching tree of jax.sharding.Sharding. Used where the loop has the whole
    global batch on every host (the token batches)."""
    import jax

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: np.asarray(x[idx]))
    return jax.tree.map(one, tree, shardings)
