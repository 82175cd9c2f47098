"""Where the kernels run, and how they are launched there.

Two things live here and nowhere else:

* ``Target``: the backend (``cpu``, ``cuda``, ``rocm``), the GPU architecture (``sm_90``,
  ``gfx942``, ``gfx950``, ...), the warp size (32 on NVIDIA and RDNA, a 64-wide wavefront on
  CDNA: MI300X, MI325X, MI355X) and the number of SMs / CUs. ``current_target()`` reads it from
  the abstract mesh in scope (deviceless lowering for a GPU that is not attached) or else from
  jax's default device.
* ``LaunchConfig`` and ``launch_config()``: rows per program, ``num_warps`` and ``num_stages``
  for every kernel, as one pure function of the op, the row count, the padded row size and the
  target, with a tuned table (``tuned_configs.json``, written by ``python -m bench.tune``) that
  takes precedence where it has an entry. Kernels never hold launch constants of their own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import re

import jax

from k3pallas import _compat

__all__ = ["Target", "LaunchConfig", "current_target", "target_for", "device_platform", "launch_config", "KNOWN_TARGETS"]


@dataclasses.dataclass(frozen=True)
class Target:
    backend: str  # "cpu", "cuda" or "rocm"
    arch: str  # "cpu", "sm_90", "gfx942", "gfx950", ...
    device_kind: str
    warp_size: int  # threads per warp (NVIDIA, RDNA) or wavefront (CDNA)
    num_cores: int  # SMs (NVIDIA) or CUs (AMD); a guess of 128 where the device is unknown

    @property
    def is_gpu(self) -> bool:
        return self.backend in ("cuda", "rocm")


# Marketing names -> architecture, for devices that report a name rather than an arch.
_AMD_ARCH_BY_NAME = (
    ("MI355", "gfx950"), ("MI350", "gfx950"),
    ("MI325", "gfx942"), ("MI300", "gfx942"),
    ("MI250", "gfx90a"), ("MI210", "gfx90a"), ("MI100", "gfx908"),
)
_NVIDIA_ARCH_BY_NAME = (
    ("GB300", "sm_103"), ("B300", "sm_103"), ("GB200", "sm_100"), ("B200", "sm_100"),
    ("GH200", "sm_90"), ("H200", "sm_90"), ("H100", "sm_90"), ("H800", "sm_90"),
    ("L40", "sm_89"), ("L4", "sm_89"), ("4090", "sm_89"),
    ("A100", "sm_80"), ("A800", "sm_80"), ("A10", "sm_86"), ("T4", "sm_75"),
)
# SMs / CUs of the parts we know (datasheets); only used to keep every core busy at small T.
_CORES = {
    "H200": 132, "H100": 132, "GH200": 132, "A100": 108, "B200": 148,
    "gfx942": 304, "gfx950": 256, "gfx90a": 104,
}

# The targets the deviceless tests, the ROCm compile gate and the docs talk about.
KNOWN_TARGETS = {
    "h200": ("NVIDIA H200", "cuda"),
    "gfx942": ("gfx942", "rocm"),
    "gfx950": ("gfx950", "rocm"),
}


def _amd_warp_size(arch: str) -> int:
    # CDNA (gfx9xx: MI100 .. MI355X) runs 64-wide wavefronts; RDNA (gfx10+) defaults to 32.
    m = re.match(r"gfx(\d+)", arch)
    if m and len(m.group(1)) >= 4 and m.group(1).startswith(("10", "11", "12")):
        return 32
    return 64


def target_for(device_kind: str, platform: str, compute_capability=None) -> Target:
    """The ``Target`` of a device given its kind string and platform, without touching a device."""
    platform = {"gpu": "cuda"}.get(platform, platform)
    if platform == "rocm":
        arch = None
        for text in (compute_capability, device_kind):
            if isinstance(text, str) and text.startswith("gfx"):
                arch = text.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
                break
        if arch is None:
            arch = next((a for name, a in _AMD_ARCH_BY_NAME if name in device_kind), "gfx_unknown")
        cores = _CORES.get(arch, 128)
        return Target("rocm", arch, device_kind, _amd_warp_size(arch), cores)
    if platform == "cuda":
        arch = None
        if isinstance(compute_capability, str) and re.fullmatch(r"\d+\.\d+", compute_capability):
            arch = "sm_" + compute_capability.replace(".", "")
        if arch is None:
            arch = next((a for name, a in _NVIDIA_ARCH_BY_NAME if name in device_kind), "sm_unknown")
        cores = next((c for name, c in _CORES.items() if name in device_kind), 128)
        return Target("cuda", arch, device_kind, 32, cores)
    return Target(platform, platform, device_kind, 1, os.cpu_count() or 1)


def target_from_name(name: str) -> Target:
    """A ``Target`` from a name alone: ``"gfx942"``, ``"MI355X"``, ``"sm_90"``, ``"H200"``, ``"cpu"``.

    ValueError for a name that is none of those."""
    if not isinstance(name, str):
        raise TypeError(f"expected a device name (str), got {type(name).__name__}")
    if name.lower() == "cpu":
        return target_for("cpu", "cpu")
    if name.startswith("gfx") or any(n in name for n, _ in _AMD_ARCH_BY_NAME):
        return target_for(name, "rocm")
    m = re.fullmatch(r"sm_(\d+)(\d)", name)
    if m:
        return target_for(name, "cuda", f"{m.group(1)}.{m.group(2)}")
    if any(n in name for n, _ in _NVIDIA_ARCH_BY_NAME):
        return target_for(name, "cuda")
    raise ValueError(f"unknown device name {name!r}: expected an AMD arch or part (gfx942, "
                     "MI300X), an NVIDIA arch or part (sm_90, H200) or 'cpu'")


def device_platform(device) -> str:
    """"cpu", "cuda" or "rocm" for a jax device (jax reports both GPU kinds as "gpu")."""
    plat = device.platform
    if plat != "gpu":
        return plat
    cc = getattr(device, "compute_capability", None)
    if isinstance(cc, str) and cc.startswith("gfx"):
        return "rocm"
    client = getattr(device, "client", None)
    version = f"{getattr(client, 'platform', '')} {getattr(client, 'platform_version', '')}".lower()
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"


_TARGET_OVERRIDE = contextvars.ContextVar("k3pallas_target", default=None)


@contextlib.contextmanager
def compiling_for(target: Target):
    """Code traced inside picks implementations, launch configs and FP8 formats for ``target``.

    For ahead-of-time compilation for a device that is not the default one (for example XLA's
    ROCm compiler on a CPU-only machine, ``bench.rocm_check``).
    """
    token = _TARGET_OVERRIDE.set(target)
    try:
        yield target
    finally:
        _TARGET_OVERRIDE.reset(token)


def current_target() -> Target:
    """The target that code traced now will run on.

    Inside ``compiling_for(target)``, that target; inside ``jax.sharding.use_abstract_mesh`` with
    an abstract device (deviceless lowering), that device; otherwise jax's default device.
    """
    override = _TARGET_OVERRIDE.get()
    if override is not None:
        return override
    abstract = _compat.abstract_target_device()
    if abstract is not None:
        return target_for(abstract.device_kind, abstract.platform)
    device = jax.devices()[0]
    return target_for(device.device_kind, device_platform(device),
                      getattr(device, "compute_capability", None))


# ---------------------------------------------------------------------------------------------
# Launch configurations
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    rows_per_program: int  # power of two
    num_warps: int  # warps (NVIDIA) or wavefronts (AMD) per program
    num_stages: int = 1  # the row kernels have no loop to pipeline; kept explicit for the sweep

    def __post_init__(self):
        for name in ("rows_per_program", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 1, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"LaunchConfig.num_stages must be >= 1, got {self.num_stages}")


OPS = ("rmsnorm", "fused_q_kv_rmsnorm", "mla_q_kv_norm", "rmsnorm_gated", "rmsnorm_gated_fp8", "per_token_fp8_quant")

# Heuristic constants. Elements a program handles (summed over the tiles it loads), and elements
# per thread of its largest tile: few per thread while the grid is too small to fill the GPU
# (spread the latency chain of one row over many threads), many once it is large (fewer threads
# per row means cheaper cross-warp reductions; occupancy comes from the many programs). From the
# H200 sweep (bench/results/tune.md): fused q/kv at T = 65536 ran 129 us with 1 warp per row
# against 162 us with 8; the gated FP8 kernel at T = 1 ran 2.0 us with 16 warps against 6.9 with 1.
#
# On AMD the throughput regime holds 16 elements per thread: at 32 the 96-head FP8 kernel needed
# 134 VGPRs on gfx942 / gfx950 (occupancy 3 waves per SIMD, under the ROCm compile gate's 4);
# at 16 every kernel keeps >= 4 (bench/results/rocm_check.md).
_ELEMS_PER_PROGRAM = 4096
_ELEMS_PER_THREAD_LATENCY = 8
_ELEMS_PER_THREAD_THROUGHPUT = {"cuda": 32, "rocm": 16}
_PROGRAMS_PER_CORE_THROUGHPUT = 4
_MAX_THREADS = 1024
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
    num_warps = _pow2_floor(max(1, min(threads, _MAX_THREADS) // warp))
    return LaunchConfig(rows_per_program=rows, num_warps=num_warps, num_stages=1)


_TUNED_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")


@functools.lru_cache(maxsize=None)
def tuned_table() -> dict:
    """The sweep's choices: {arch: {op: [[max_rows, row_elems, rows, warps, stages], ...]}}.

    Entries are looked up by (arch, op, exact padded row size) and the smallest ``max_rows`` bucket
    that holds the row count. Missing file or entry: the heuristic decides.
    """
    try:
        with open(_TUNED_PATH) as f:
            table = json.load(f).get("configs", {})
    except FileNotFoundError:
        return {}
    for ops in table.values():
        for entries in ops.values():
            entries.sort(key=lambda e: (e[1], e[0]))
    return table


def launch_config(op: str, n_rows: int, row_elems: int, max_tile_row_elems: int | None = None,
                  target: Target | None = None) -> LaunchConfig:
    """The launch config for ``op`` on ``target`` (default: ``current_target()``)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    target = current_target() if target is None else target
    max_tile_row_elems = row_elems if max_tile_row_elems is None else max_tile_row_elems
    for max_rows, elems, rows, warps, stages in tuned_table().get(target.arch, {}).get(op, []):
        if elems == row_elems and n_rows <= max_rows:
            rows = min(rows, _pow2_ceil(max(1, n_rows)))
            return LaunchConfig(rows, warps, stages)
    return heuristic_config(op, n_rows, row_elems, max_tile_row_elems, target)
