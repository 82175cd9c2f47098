"""How the kernels are launched: rows per program, ``num_warps``, ``num_stages``, and programs
per row block.

Backend business (these are Triton's launch parameters): the API never sees them. One pure
function of the launch key (the op and its output format), the row count, the padded row size
and the target (``heuristic_config``),
with a tuned table (``tuned_configs.json`` beside this file, written by ``python -m bench.tune``)
that takes precedence where it has an entry. Kernels never hold launch constants of their own.

Two hooks serve the tuning sweep, the benchmark and the ROCm gate: ``forced(config)`` makes
every launch traced inside use ``config``, and ``recording()`` collects what each launch asked
for and got (op, rows, row size, config).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from k3pallas.kernels import hooks
from k3pallas.platform import Target

__all__ = ["LaunchConfig", "launch_config", "heuristic_config", "tuned_table", "Launch",
           "TUNED_PATH", "GemmConfig", "gemm_config", "gemm_heuristic", "gemm_tuned_table",
           "GemmLaunch", "GEMM_DECODE_ROWS"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    rows_per_program: int  # power of two
    num_warps: int  # warps (NVIDIA) or wavefronts (AMD) per program
    num_stages: int = 1  # the row kernels have no loop to pipeline; kept explicit for the sweep
    # Programs per row block: 1, or 2 for the joint norms (q on one program, kv and the rope
    # part on another, in the same launch: a token's two halves on two cores). Tuned table only.
    split: int = 1

    def __post_init__(self):
        for name in ("rows_per_program", "num_warps", "split"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 1, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"LaunchConfig.num_stages must be >= 1, got {self.num_stages}")


# Heuristic constants. Elements a program handles (summed over its tiles), and elements per
# thread of its largest tile: few while the grid is too small to fill the GPU (spread a row's
# latency chain over many threads), many once it is large (cheaper cross-warp reductions;
# occupancy comes from the many programs). AMD holds 16 per thread there, not 32, to keep
# >= 4 waves per SIMD (the ROCm gate). The sweeps behind them: docs/performance.md.
_ELEMS_PER_PROGRAM = 4096
_ELEMS_PER_THREAD_LATENCY = 8
_ELEMS_PER_THREAD_THROUGHPUT = {"cuda": 32, "rocm": 16}
_PROGRAMS_PER_CORE_THROUGHPUT = 4
_MAX_ROWS = 64
_INTERPRET_ROWS = 16


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def heuristic_config(op: str, n_rows: int, row_elems: int, max_tile_row_elems: int,
                     target: Target) -> LaunchConfig:
    """The default launch config: a pure function of the problem and the target.

    ``row_elems``: elements one row loads over all its tiles (padded to powers of two);
    ``max_tile_row_elems``: the largest single tile's row (tiles are processed one after another,
    so the largest decides the registers per thread).
    """
    del op  # one rule serves every row kernel today; the tuned table specializes per op
    if not target.is_gpu:
        # Interpret mode runs the programs one after another, so large programs are fastest; but
        # a fixed size, not one that grows with the token count: XLA's CPU reductions over a
        # [R, ...] tile can round differently for another R, and results would then depend in
        # the last bit on T (and on how tokens are sharded).
        return LaunchConfig(rows_per_program=_INTERPRET_ROWS, num_warps=4, num_stages=1)
    rows = _pow2_floor(max(1, _ELEMS_PER_PROGRAM // max(1, row_elems)))
    rows = min(rows, _MAX_ROWS, _pow2_ceil(max(1, n_rows)))
    # Keep at least two programs per core while there are rows enough for that.
    while rows > 1 and math.ceil(n_rows / rows) < 2 * target.num_cores:
        rows //= 2
    programs = math.ceil(n_rows / rows)
    per_thread = (_ELEMS_PER_THREAD_THROUGHPUT.get(target.backend, 32)
                  if programs >= _PROGRAMS_PER_CORE_THROUGHPUT * target.num_cores
                  else _ELEMS_PER_THREAD_LATENCY)
    warp = max(1, target.warp_size)
    threads = max(1, rows * max_tile_row_elems // per_thread)
    num_warps = _pow2_floor(max(1, min(threads, target.max_threads) // warp))
    return LaunchConfig(rows_per_program=rows, num_warps=num_warps, num_stages=1)


TUNED_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")


@functools.lru_cache(maxsize=None)
def tuned_table() -> dict:
    """The sweep's choices: {arch: {op: [[max_rows, row_elems, rows, warps, stages(, split)], ...]}}.

    Entries are looked up by (arch, op, exact padded row size) and the smallest ``max_rows`` bucket
    that holds the row count. Missing file or entry: the heuristic decides.
    """
    return _load_table("configs", lambda e: (e[1], e[0]))


def _load_table(section: str, order) -> dict:
    """``tuned_configs.json``'s ``section``, each entry list sorted by ``order``; {} without it."""
    try:
        with open(TUNED_PATH) as f:
            table = json.load(f).get(section, {})
    except FileNotFoundError:
        return {}
    for ops in table.values():
        for entries in ops.values():
            entries.sort(key=order)
    return table


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch as ``recording()`` sees it."""

    op: str  # the launch-config key: the op's name, with its output format (common.launch_name)
    n_rows: int
    row_elems: int
    max_tile_row_elems: int
    config: LaunchConfig


def launch_config(op: str, n_rows: int, row_elems: int, max_tile_row_elems: int | None = None, *,
                  target: Target, splits: tuple[int, ...] = ()) -> LaunchConfig:
    """The launch config for launch key ``op`` (``common.launch_name``) on ``target``. ``splits``:
    the ``LaunchConfig.split`` values above 1 that this kernel can run for this row (a tuned
    entry with another is skipped; a forced one reaches ``common.row_call``, which refuses a
    split the kernel does not launch).

    Whatever its source (forced, tuned table, heuristic), a config with more threads per program
    (``num_warps * warp_size``) than the target allows (``Target.max_threads``, 1024) is a
    ValueError: such a launch is invalid on the device (AMD: 32 warps are 2048 threads)."""
    max_tile_row_elems = row_elems if max_tile_row_elems is None else max_tile_row_elems
    config, source = hooks.forced_config(), "forced"
    if config is None:
        config, source = _choose(op, n_rows, row_elems, max_tile_row_elems, target, splits)
    _check_threads(op, source, config, target)
    hooks.record(Launch(op, n_rows, row_elems, max_tile_row_elems, config))
    return config


def _check_threads(key, source, config, target) -> None:
    """ValueError for a config with more threads per program than the target runs."""
    threads = config.num_warps * target.warp_size
    if threads > target.max_threads:
        raise ValueError(f"{key}: the {source} launch config {config} has {threads} threads per "
                         f"program on {target.arch} (warp {target.warp_size}); the limit is "
                         f"{target.max_threads}")


def _choose(op, n_rows, row_elems, max_tile_row_elems, target, splits) -> LaunchConfig:
    for max_rows, elems, rows, warps, stages, *split in tuned_table().get(target.arch, {}).get(op, []):
        split = split[0] if split else 1
        if elems == row_elems and n_rows <= max_rows and (split == 1 or split in splits):
            rows = min(rows, _pow2_ceil(max(1, n_rows)))
            return LaunchConfig(rows, warps, stages, split), "tuned"
    return heuristic_config(op, n_rows, row_elems, max_tile_row_elems, target), "heuristic"


# ------------------------------------------------------------------------------------------------
# The scaled FP8 GEMM (``kernels.gemm``)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch of the GEMM: a program per ``[block_m, block_n]`` output tile, K in steps of
    ``block_k`` pipelined ``num_stages`` deep; ``swap``: the tile computed transposed (the
    weight's rows as the matrix cores' M: few tokens)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False
    # FP8 products the matrix cores may sum before their partial sum is promoted to float32
    # registers (Triton's ``maxNumImpreciseAcc``): 0, every instruction, is Pallas' own request
    # and on Hopper rules out wgmma for FP8 (Triton then converts the codes to float16 for
    # mma.sync); from 32 Hopper may take wgmma, promoting every ``mma_acc`` products
    # (``_compat.fp8_dot_accumulation``). NVIDIA only; AMD's matrix cores accumulate in float32.
    mma_acc: int = 0
    # Load the scales that change along K (group FP8, per-token groups) one K step before their
    # use, carried through the loop; False: in their own step (a global load's latency in each).
    scale_prefetch: bool = False
    # K steps per loop iteration (each its own loads, dot and scales): the loop's fixed
    # instructions (barriers, waits) once per ``k_unroll * block_k``.
    k_unroll: int = 1

    def __post_init__(self):
        for name, low in (("block_m", 16), ("block_n", 16), ("block_k", 32), ("num_warps", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= {low}, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"GemmConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.k_unroll not in (1, 2, 4):
            raise ValueError(f"GemmConfig.k_unroll must be 1, 2 or 4, got {self.k_unroll}")
        if self.mma_acc and (self.mma_acc < 32 or self.mma_acc & (self.mma_acc - 1)):
            raise ValueError(f"GemmConfig.mma_acc must be 0 or a power of two >= 32, got "
                             f"{self.mma_acc}")

    # The optional fields of an entry, in order, and their defaults (left off at the end).
    _OPTIONAL = (("mma_acc", 0), ("scale_prefetch", 0), ("k_unroll", 1))

    def as_entry(self) -> list:
        entry = [self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages,
                 int(self.swap)] + [int(getattr(self, name)) for name, _ in self._OPTIONAL]
        while len(entry) > 6 and entry[-1] == self._OPTIONAL[len(entry) - 7][1]:
            entry.pop()
        return entry

    @classmethod
    def from_entry(cls, entry) -> "GemmConfig":
        """The config of an ``as_entry`` list (a tuned table's entry without its first three)."""
        bm, bn, bk, warps, stages, swap, *rest = entry
        mma_acc, prefetch, unroll = rest + [d for _, d in cls._OPTIONAL][len(rest):]
        return cls(bm, bn, bk, warps, stages, bool(swap), mma_acc, bool(prefetch), unroll)


# Rows up to which the GEMM runs its decode form: tokens padded in registers to 16 (the least
# the matrix cores take), the tile computed transposed, narrow column blocks so that every core
# streams a part of the weight (a decode GEMM reads its weight once: its floor is the weight's
# bytes over the memory bandwidth).
GEMM_DECODE_ROWS = 16
_GEMM_PROGRAMS_PER_CORE = 2  # AMD decode tiles


def gemm_heuristic(m: int, n: int, k: int, target: Target, *, w_block: int | None) -> GemmConfig:
    """The default GEMM config: a pure function of the problem and the target. ``w_block``: the
    weight's scale blocks along N (128), which a program's columns may not cross; None for
    per-channel or per-tensor weight scales.

    NVIDIA: the tiles that won (or came within 10 % of the winner) at every shape of the H100
    sweeps (docs/formats.md, Consumers): decode the swapped 16 x 64 tile, 6 stages (8 with
    per-channel weight scales; with block scales and 32 K steps or more, 4 steps an iteration
    with their scales loaded an iteration early, 3 stages); up to 128 rows 64 x 64 (with block
    scales and 32 K steps or more, again 4 steps an iteration, prefetched, 3 stages); beyond,
    64 x 128, 3 stages; on Hopper with FP8 wgmma (``mma_acc`` 128). AMD (not timed): 16-row
    decode tiles narrow enough for two programs a CU, 2 stages."""
    amd = target.backend == "rocm"
    if not target.is_gpu:  # interpret mode: large tiles, few programs
        return GemmConfig(16 if m <= 16 else 32, 64, 128, 4, 1)
    cap_n = w_block or 256
    if amd:
        if m <= GEMM_DECODE_ROWS:
            bn = min(cap_n, 128)
            while bn > 16 and -(-n // bn) < _GEMM_PROGRAMS_PER_CORE * target.num_cores:
                bn //= 2
            return GemmConfig(16, bn, 128, 4, 2)
        if m <= 128:
            return GemmConfig(16 if m <= 32 else 64, min(cap_n, 64), 128, 4, 2)
        return GemmConfig(128, min(cap_n, 128), 64, 8, 2)
    wgmma = 128 if target.arch.startswith("sm_90") else 0
    # Hopper (measured), block scales over 32 K steps or more: 4 steps an iteration, their
    # scales loaded an iteration early, 3 stages.
    unrolled = bool(wgmma and w_block and k >= 32 * 128)
    if m <= GEMM_DECODE_ROWS:
        # Hopper (measured; 227 KB of shared memory): a long K of block scales 4 steps an
        # iteration (120 KB), per-channel weight scales a deeper pipeline (80 KB). Elsewhere
        # (99 KB on sm_86 / sm_89; untimed) the 60 KB tile.
        if unrolled:
            return GemmConfig(16, 64, 128, 4, 3, swap=True, mma_acc=wgmma, scale_prefetch=True,
                              k_unroll=4)
        return GemmConfig(16, 64, 128, 4, 8 if wgmma and not w_block else 6, swap=True,
                          mma_acc=wgmma)
    if m <= 128:
        # 192 KB (the DeepSeek-V3 MLP at T = 64 on an H100: 18.05 us against 24.91).
        if unrolled:
            return GemmConfig(64, 64, 128, 4, 3, mma_acc=wgmma, scale_prefetch=True, k_unroll=4)
        return GemmConfig(64, 64, 128, 4, 4, mma_acc=wgmma)
    return GemmConfig(64, min(cap_n, 128), 128, 4, 3, mma_acc=wgmma)


@functools.lru_cache(maxsize=None)
def gemm_tuned_table() -> dict:
    """The GEMM sweep's choices: {arch: {key: [[max_rows, n, k, bm, bn, bk, warps, stages,
    swap(, mma_acc(, scale_prefetch(, k_unroll)))], ...]}}, looked up by (arch, key, exact n and k) and the smallest ``max_rows`` bucket
    that holds the row count."""
    return _load_table("gemm_configs", lambda e: (e[1], e[2], e[0]))


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """One GEMM launch as ``recording()`` sees it."""

    op: str
    m: int
    n: int
    k: int
    config: GemmConfig


def gemm_config(key: str, m: int, n: int, k: int, *, target: Target,
                w_block: int | None) -> GemmConfig:
    """The GEMM config for launch key ``key`` (``linear_<format>``) on ``target``: forced (a
    ``GemmConfig`` given to ``hooks.forced``), tuned, or ``gemm_heuristic``."""
    config, source = hooks.forced_config(), "forced"
    if not isinstance(config, GemmConfig):
        config, source = None, "tuned"
        for max_rows, en, ek, *entry in gemm_tuned_table().get(target.arch, {}).get(key, []):
            if en == n and ek == k and m <= max_rows:
                config = GemmConfig.from_entry(entry)
                break
        if config is None:
            config, source = gemm_heuristic(m, n, k, target, w_block=w_block), "heuristic"
    _check_threads(key, source, config, target)
    hooks.record(GemmLaunch(key, m, n, k, config))
    return config
