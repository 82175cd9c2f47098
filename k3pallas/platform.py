"""Where the kernels run: the target device.

* ``Target``: the backend (``cpu``, ``cuda``, ``rocm``), the GPU architecture (``sm_90``,
  ``gfx942``, ``gfx950``, ...), the warp size (32 on NVIDIA and RDNA, a 64-wide wavefront on
  CDNA: MI300X, MI325X, MI355X) and the number of SMs / CUs. ``current_target()`` reads it from
  the abstract mesh in scope (deviceless lowering for a GPU that is not attached) or else from
  jax's default device.
How a kernel is launched there (rows per program, warps) is the kernel backend's business:
``k3pallas.kernels.launch``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re

import jax

from k3pallas import _compat

__all__ = ["Target", "current_target", "target_for", "target_from_name", "device_platform", "compiling_for"]


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
