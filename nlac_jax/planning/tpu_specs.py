"""Cloud TPU slice names -> chip count, per-chip HBM, peak bf16 FLOP/s, HBM bandwidth, and the topology string
`jax.experimental.topologies.get_topology_desc` takes (the planner, `nlac_jax.plan`, compiles for it on a CPU).

Slice names are written as Cloud TPU writes accelerator types: `v4-32`, `v5p-64`, `v5e-256` (also `v5litepod-256`),
`v6e-64`. The number counts TensorCores for v4 and v5p (2 per chip: v5p-64 is 32 chips) and chips for v5e and v6e
(1 TensorCore per chip). On v4 and v5p the two TensorCores of a chip run as one JAX device ("megacore"), so a slice
has one device per chip on every generation.

Per-chip numbers, from the public Cloud TPU system-architecture pages (read 2026-11-30):
  v4   https://cloud.google.com/tpu/docs/v4   275 TFLOP/s bf16, 32 GiB HBM2, 1200 GB/s
  v5p  https://cloud.google.com/tpu/docs/v5p  459 TFLOP/s bf16, 95 GB HBM2e, 2765 GB/s
  v5e  https://cloud.google.com/tpu/docs/v5e  197 TFLOP/s bf16, 16 GB HBM2, 819 GB/s
  v6e  https://cloud.google.com/tpu/docs/v6e  918 TFLOP/s bf16, 32 GB HBM, 1638 GB/s
("GB" is taken as 10^9 bytes and "GiB" as 2^30, as the pages write them; the runtime keeps a little of it for itself,
so a plan that fills the last few percent is not a safe plan.) Slice shapes: the same pages' topology tables.
"""

from __future__ import annotations

import dataclasses
import re

GIB = 1 << 30
# The runtime keeps part of HBM for itself: libtpu 0.0.42.1's compiler offers programs 30.75 GiB of a v4 chip's
# 32 GiB (its out-of-memory message says so). The planner counts a run as fitting only within this fraction.
USABLE_HBM_FRACTION = 30.75 / 32


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU generation's per-chip numbers (see the module docstring for the sources)."""

    generation: str          # as in slice names: v4, v5p, v5e, v6e
    topology_prefix: str     # the generation as get_topology_desc names it
    peak_bf16_flops: float   # FLOP/s per chip
    hbm_bytes: int           # per chip
    hbm_bandwidth: float     # bytes/s per chip
    cores_per_chip: int      # TensorCores per chip: what the number in a slice name counts on v4/v5p
    dims: int                # torus dimensions (3: v4/v5p, 2: v5e/v6e)
    source: str

    @property
    def usable_hbm_bytes(self) -> int:
        """HBM a program can use (USABLE_HBM_FRACTION of the chip's)."""
        return int(self.hbm_bytes * USABLE_HBM_FRACTION)


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", "v4", 275e12, 32 * GIB, 1200e9, 2, 3, "https://cloud.google.com/tpu/docs/v4"),
    "v5p": ChipSpec("v5p", "v5p", 459e12, 95 * 10**9, 2765e9, 2, 3, "https://cloud.google.com/tpu/docs/v5p"),
    "v5e": ChipSpec("v5e", "v5e", 197e12, 16 * 10**9, 819e9, 1, 2, "https://cloud.google.com/tpu/docs/v5e"),
    "v6e": ChipSpec("v6e", "v6e", 918e12, 32 * 10**9, 1638e9, 1, 2, "https://cloud.google.com/tpu/docs/v6e"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}

# chips -> physical slice shape, from the Cloud TPU topology tables (3D torus for v4/v5p, 2D for v5e/v6e)
SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
             256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)}
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


class TopologyError(ValueError):
    """A slice name the table cannot map; the message names the value and what is accepted."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its name, generation spec, chip count and physical shape."""

    name: str
    chip: ChipSpec
    chips: int
    shape: tuple[int, ...]

    @property
    def topology_name(self) -> str:
        """The string `get_topology_desc(topology_name=..., platform='tpu')` takes, e.g. 'v5p:2x4x4'."""
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"

    @property
    def peak_flops(self) -> float:
        """Peak bf16 FLOP/s of the whole slice."""
        return self.chips * self.chip.peak_bf16_flops


def parse_slice(name: str, what: str = "--topology") -> Slice:
    """'v5p-64' -> Slice(v5p, 32 chips, (2, 4, 4)). Raises TopologyError (one line, naming `what`: the flag or
    gin macro the name came from) for anything else."""
    m = re.fullmatch(r"\s*(v\d+[a-z]*)-(\d+)\s*", str(name))
    known = ", ".join(f"{g}-N" for g in CHIPS)
    if not m:
        raise TopologyError(f"{what}={name!r}: expected a Cloud TPU slice name like v4-32, v5p-64, v5e-256 or "
                            f"v6e-64 ({known})")
    gen, n = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2))
    if gen not in CHIPS:
        raise TopologyError(f"{what}={name!r}: unknown TPU generation {m.group(1)!r} (known: {known})")
    chip = CHIPS[gen]
    if n % chip.cores_per_chip:
        raise TopologyError(f"{what}={name!r}: {gen} slice names count TensorCores ({chip.cores_per_chip} per "
                            f"chip), so the number must be a multiple of {chip.cores_per_chip}")
    chips = n // chip.cores_per_chip
    shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
    if chips not in shapes:
        sizes = ", ".join(f"{gen}-{c * chip.cores_per_chip}" for c in shapes)
        raise TopologyError(f"{what}={name!r}: no {gen} slice of {chips} chips in the table (known: {sizes})")
    return Slice(f"{gen}-{n}", chip, chips, shapes[chips])


def check_devices(name: str, platform: str, count: int) -> None:
    """Raises TopologyError (one line) when a run whose gin files are sized for the slice `name` (the gin macro SLICE
    that gin/hardware/*.gin binds: 'cpu' or a Cloud TPU slice name) starts on `count` devices of `platform` that
    cannot be that slice. A malformed name fails on any platform; counts are compared on TPU only (a TPU run's gin
    files also load on a CPU: plans, tests with stand-in models). JAX counts one device per chip on every
    generation in the table (v4 and v5p chips are one megacore device)."""
    if name == "cpu":
        return
    slc = parse_slice(name, what="SLICE")
    if platform == "tpu" and count != slc.chips:
        raise TopologyError(f"SLICE = {name!r}: the gin files size this run for {slc.chips} chips, but this job "
                            f"sees {count} TPU devices; add the gin/hardware/ file of this slice after the run's "
                            f"gin file (and check it with python -m nlac_jax.plan)")
