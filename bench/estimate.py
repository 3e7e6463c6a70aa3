"""Estimated H200 time of an op at the goal shape, from the static sm_90 table.

The model (deliberately simple; every input is visible on a CPU-only machine):

- An op is a list of launches. A launch names its kernel and configuration in the
  static table (``bench/static_sm90.json``: CTAs/SM, warps, tensor-core instruction)
  and carries its work: programs (CTAs), tensor-core FLOPs (tiles as launched, the
  masked half of a diagonal tile included), ALU issue slots (the per-element
  non-matmul work: one slot per fp32 add/mul/FMA/compare/select, 8 per MUFU op such as
  ex2, rcp, since an SM issues 16 of those per clock against 128 FMAs), compulsory
  bytes and serial steps (loop iterations of the longest program).
- Slots = CTAs/SM × 132 SMs. A grid of P programs runs in W = ⌈P / slots⌉ waves and
  keeps a fraction busy = P / (W·slots) of the slots (the tail wave's idle SMs).
- Latency hiding: a tensor-core pipeline needs two resident warpgroups (8 warps) per
  SM to overlap a tile's softmax-like work with the next tile's matmul; with fewer,
  the achieved rate scales by resident warps / 8 (hide ≤ 1).
- Serial latency: each wave's longest program runs its serial steps one after the
  other. A tile loop whose loads the software pipeline prefetches costs its work (the
  terms below); a launch whose steps each wait on a memory round trip and a carried
  value (a scan over the sequence with few programs) sets ``step_s`` (0.5 µs):
  lat = W × steps × step_s.
- time = max(tc + alu, mem, lat) + launch, with tc = FLOPs / (peak(instruction)·busy·hide),
  alu = slots / (ALU rate·busy), mem = bytes / (HBM·busy), launch 4 µs. Tensor-core and
  ALU work are added, not overlapped: a Triton kernel does not ping-pong warpgroups,
  so a tile's elementwise work waits for its matmul and the other way round.
- Peaks (H200, dense): HGMMA (wgmma) 990 TFLOP/s; HMMA (mma.sync) on Hopper about
  half of that, 495; FMA (fp32 ``tl.dot`` on CUDA cores) and "-" 67; ALU
  132 SMs × 128 lanes × 1.98 GHz = 33.5e12 slots/s; HBM 4.8 TB/s.

It ranks algorithms and configurations; it is not a measurement: the benchmarks'
measured column (a GPU run) is the truth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

SMS = 132
PEAK = {"HGMMA": 990e12, "HMMA": 495e12, "FMA": 67e12, "-": 67e12}
ALU_RATE = SMS * 128 * 1.98e9
HBM = 4.8e12
LAUNCH_S = 4e-6
STEP_S = 0.5e-6
HIDE_WARPS = 8
MUFU = 8  # ALU slots per special-function op (ex2, rcp, lg2)
# stands in for an elementwise pass the table does not hold (e.g. torch's)
ROW_KERNEL = {"ctas_per_sm": 8, "num_warps": 4, "tensor_cores": "-"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an op: ``config`` lists ``key=value`` parts its static-table
    configuration must contain (``dtype=bf16`` is implied)."""

    mechanism: str
    kernel: str
    config: tuple[str, ...]
    programs: int
    tc_flops: float = 0.0
    alu_slots: float = 0.0
    bytes: float = 0.0
    serial_steps: int = 0
    step_s: float = 0.0
    note: str = ""


@dataclass
class Estimate:
    launch: Launch
    entry: Mapping
    waves: int
    busy: float
    hide: float
    tc_s: float
    alu_s: float
    mem_s: float
    lat_s: float
    seconds: float = field(init=False)

    def __post_init__(self):
        self.seconds = max(self.tc_s + self.alu_s, self.mem_s, self.lat_s) + LAUNCH_S

    @property
    def bound(self) -> str:
        if self.lat_s >= max(self.mem_s, self.tc_s + self.alu_s):
            return "serial steps"
        if self.mem_s > self.tc_s + self.alu_s:
            return "memory"
        return "tensor cores" if self.tc_s >= self.alu_s else "ALU"


def find(entries: Iterable[Mapping], launch: Launch, dtype: str = "bf16") -> Mapping:
    """The static-table entry of ``launch`` (the first whose config has every part)."""
    want = (*launch.config, f"dtype={dtype}")
    for e in entries:
        parts = set(e["config"].split(","))
        if e["mechanism"] == launch.mechanism and e["kernel"] == launch.kernel and all(w in parts for w in want):
            return e
    if not launch.tc_flops:   # a torch pass or a row kernel not in the table: memory-bound either way
        return ROW_KERNEL
    raise KeyError(f"no static entry for {launch.mechanism}/{launch.kernel}[{','.join(want)}]")


def estimate(launch: Launch, entry: Mapping) -> Estimate:
    """The model above for one launch, given its static-table entry (a pure function)."""
    ctas = max(int(entry["ctas_per_sm"]), 1)
    slots = ctas * SMS
    waves = max(1, math.ceil(launch.programs / slots))
    busy = launch.programs / (waves * slots)
    hide = min(1.0, ctas * int(entry["num_warps"]) / HIDE_WARPS)
    peak = PEAK.get(entry.get("tensor_cores") or "-", PEAK["-"])
    tc = launch.tc_flops / (peak * busy * hide) if launch.tc_flops else 0.0
    alu = launch.alu_slots / (ALU_RATE * busy) if launch.alu_slots else 0.0
    mem = launch.bytes / (HBM * busy) if launch.bytes else 0.0
    lat = waves * launch.serial_steps * launch.step_s
    return Estimate(launch, entry, waves, busy, hide, tc, alu, mem, lat)


def estimate_op(entries: Sequence[Mapping], launches: Sequence[Launch], dtype: str = "bf16") -> list[Estimate]:
    return [estimate(l, find(entries, l, dtype)) for l in launches]


def total_seconds(estimates: Sequence[Estimate]) -> float:
    return sum(e.seconds for e in estimates)


def causal_tiles(S: int, block_m: int, block_n: int) -> int:
    """(query block, key block) tiles a causal walk visits for one (batch, head): query
    block m reads key blocks up to its last row."""
    return sum(math.ceil(min(S, (m + 1) * block_m) / block_n) for m in range(math.ceil(S / block_m)))


def diagonal_tiles(S: int, block_m: int, block_n: int) -> int:
    """Of those, the tiles the causal bound cuts (a query of the block misses a key)."""
    full = sum(((m * block_m + 1) // block_n) for m in range(math.ceil(S / block_m)))
    return causal_tiles(S, block_m, block_n) - full
