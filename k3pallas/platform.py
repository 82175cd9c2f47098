"""Where the kernels run: the target device, identified from what jax reports.

``Target``: the backend (``cpu``, ``cuda``, ``rocm``), the GPU architecture (``sm_90``, ``gfx942``,
``gfx950``, ...), the warp size (32 on NVIDIA and RDNA, a 64-wide wavefront on CDNA) and the SMs /
CUs. jax reports every GPU, NVIDIA or AMD, as platform ``"gpu"`` (concrete devices, XLA's ROCm
topology devices, and the ``AbstractDevice`` that ``shard_map`` / ``jax.set_mesh`` carry), so the
vendor comes from the evidence beside it, in this order: the compute capability (``"9.0"`` or
``"gfx942"``), the client's platform version (``"cuda 13000"`` / ``"rocm ..."``), then the device
kind (``"NVIDIA H200"``, ``"MI300X"``, ``"AMD Instinct MI355X"``, ``"gfx950"``). "gpu" alone never
means CUDA: a GPU kind that names neither vendor is a ValueError. An AMD kind whose arch is not
known gives arch ``"gfx_unknown"``: launches stay within 1024 threads, FP8 has no default format
(pass ``fp8_dtype``) and no native conversion.

``current_target(*arrays)``: ``compiling_for``'s target, else the abstract mesh in scope
(``shard_map``, ``jax.set_mesh``, deviceless lowering), else the mesh of the arrays' shardings
(``jax.jit`` with ``NamedSharding``), else jax's default device; an abstract device that matches a
local device is read from that device (its compute capability and client).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re

import jax

from k3pallas import _compat

__all__ = ["Target", "current_target", "target_for", "target_of_device", "target_from_name",
           "device_platform", "compiling_for", "target_override", "MAX_THREADS_PER_PROGRAM"]

# Threads in one program (CUDA block / AMD workgroup): 1024 on every NVIDIA and AMD GPU
# (AMD: ``.max_flat_workgroup_size`` 1024, i.e. 16 wavefronts of 64).
MAX_THREADS_PER_PROGRAM = 1024


@dataclasses.dataclass(frozen=True)
class Target:
    backend: str  # "cpu", "cuda" or "rocm"
    arch: str  # "cpu", "sm_90", "gfx942", "gfx950", "gfx_unknown", ...
    device_kind: str
    warp_size: int  # threads per warp (NVIDIA, RDNA) or wavefront (CDNA)
    num_cores: int  # SMs (NVIDIA) or CUs (AMD); a guess of 128 where the device is unknown

    @property
    def is_gpu(self) -> bool:
        return self.backend in ("cuda", "rocm")

    @property
    def max_threads(self) -> int:
        """Threads one program may have (num_warps x warp_size)."""
        return MAX_THREADS_PER_PROGRAM if self.is_gpu else 1 << 30


# AMD Instinct parts -> architecture (model numbers as the ROCm plugin and amd-smi name them:
# "MI300X", "AMD Instinct MI300X", "AMD Instinct MI300X VF", ...).
_AMD_ARCH_BY_MODEL = {
    "MI300X": "gfx942", "MI300A": "gfx942", "MI308X": "gfx942", "MI325X": "gfx942",
    "MI350X": "gfx950", "MI355X": "gfx950",
    "MI250X": "gfx90a", "MI250": "gfx90a", "MI210": "gfx90a", "MI100": "gfx908",
}
_AMD_MODEL = re.compile(r"\bMI\d{3}[A-Z]?\b")
_AMD_WORDS = re.compile(r"\b(AMD|Instinct|Radeon)\b|^gfx\d", re.I)
_NVIDIA_ARCH_BY_NAME = (
    ("GB300", "sm_103"), ("B300", "sm_103"), ("GB200", "sm_100"), ("B200", "sm_100"),
    ("GH200", "sm_90"), ("H200", "sm_90"), ("H100", "sm_90"), ("H800", "sm_90"), ("H20", "sm_90"),
    ("L40", "sm_89"), ("L4", "sm_89"), ("4090", "sm_89"),
    ("A100", "sm_80"), ("A800", "sm_80"), ("A10", "sm_86"), ("T4", "sm_75"),
)
_NVIDIA_WORDS = re.compile(r"\b(NVIDIA|Tesla|Quadro|GeForce|TITAN)\b|^sm_\d", re.I)
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


def _amd_arch(device_kind: str, compute_capability) -> str:
    for text in (compute_capability, device_kind):
        if isinstance(text, str) and text.startswith("gfx"):
            return text.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    m = _AMD_MODEL.search(device_kind.upper())
    return _AMD_ARCH_BY_MODEL.get(m.group(0), "gfx_unknown") if m else "gfx_unknown"


def _gpu_vendor(device_kind: str, compute_capability, platform_version) -> str:
    """"cuda" or "rocm" for a device jax calls "gpu"; ValueError where nothing tells."""
    cc = compute_capability if isinstance(compute_capability, str) else ""
    if cc.startswith("gfx"):
        return "rocm"
    if re.fullmatch(r"\d+\.\d+", cc):
        return "cuda"
    version = (platform_version or "").lower()
    if "rocm" in version or "hip" in version:
        return "rocm"
    if "cuda" in version:
        return "cuda"
    if _AMD_WORDS.search(device_kind) or _AMD_MODEL.search(device_kind.upper()):
        return "rocm"
    if _NVIDIA_WORDS.search(device_kind) or any(n in device_kind for n, _ in _NVIDIA_ARCH_BY_NAME):
        return "cuda"
    raise ValueError(
        f"k3pallas cannot tell whether the GPU device kind {device_kind!r} is NVIDIA or AMD "
        "(jax calls both 'gpu'); trace inside k3pallas.platform.compiling_for("
        "k3pallas.platform.target_from_name('gfx942' / 'sm_90' / ...))")


def target_for(device_kind: str, platform: str, compute_capability=None, *,
               platform_version: str | None = None, num_cores: int | None = None) -> Target:
    """The ``Target`` of a device from what jax reports of it, without touching a device.

    ``platform``: "cpu", "cuda", "rocm" or "gpu" (either vendor: see the module docstring).
    ``compute_capability``: "9.0" on NVIDIA, "gfx942[:...]" on AMD, or None. ``num_cores``: the
    device's SMs / CUs where jax reports them (abstract devices do), else a table or 128.
    """
    if platform == "gpu":
        platform = _gpu_vendor(device_kind, compute_capability, platform_version)
    if platform == "rocm":
        arch = _amd_arch(device_kind, compute_capability)
        return Target("rocm", arch, device_kind, _amd_warp_size(arch),
                      num_cores or _CORES.get(arch, 128))
    if platform == "cuda":
        arch = None
        if isinstance(compute_capability, str) and re.fullmatch(r"\d+\.\d+", compute_capability):
            arch = "sm_" + compute_capability.replace(".", "")
        if arch is None:
            arch = next((a for name, a in _NVIDIA_ARCH_BY_NAME if name in device_kind), "sm_unknown")
        cores = num_cores or next((c for name, c in _CORES.items() if name in device_kind), 128)
        return Target("cuda", arch, device_kind, 32, cores)
    return Target(platform, platform, device_kind, 1, os.cpu_count() or 1)


def target_of_device(device) -> Target:
    """The ``Target`` of a jax device (concrete, or a deviceless topology device)."""
    client = getattr(device, "client", None)
    version = f"{getattr(client, 'platform', '')} {getattr(client, 'platform_version', '')}"
    cc = getattr(device, "compute_capability", None)
    return target_for(device.device_kind, device.platform, cc, platform_version=version,
                      num_cores=getattr(device, "core_count", None))


def device_platform(device) -> str:
    """"cpu", "cuda" or "rocm" for a jax device (jax reports both GPU kinds as "gpu")."""
    return target_of_device(device).backend


def target_from_name(name: str) -> Target:
    """A ``Target`` from a name alone, case-insensitive: ``"gfx942"``, ``"MI355X"``,
    ``"AMD Instinct MI300X"``, ``"sm_90"`` / ``"sm_90a"``, ``"H200"``, ``"cpu"``.

    TypeError for a non-string, ValueError for a name that is none of those (an unknown gfx arch
    or AMD part included)."""
    if not isinstance(name, str):
        raise TypeError(f"expected a device name (str), got {type(name).__name__}")
    text = name.strip()
    if text.lower().startswith("gfx"):
        text = text.split(":")[0]  # "gfx942:sramecc+:xnack-"
    m = re.fullmatch(r"cpu|gfx(\d+[0-9a-f]*)|sm_(\d+)(\d)a?", text, re.I)
    if m and text.lower() == "cpu":
        return target_for("cpu", "cpu")
    if m and m.group(1):
        arch = "gfx" + m.group(1).lower()
        known = set(_AMD_ARCH_BY_MODEL.values()) | {"gfx1100", "gfx1101", "gfx1200", "gfx1201"}
        if arch in known:
            return target_for(arch, "rocm")
    elif m:
        return target_for(text, "cuda", f"{m.group(2)}.{m.group(3)}")
    upper = text.upper()
    model = _AMD_MODEL.search(upper)
    if model and model.group(0) in _AMD_ARCH_BY_MODEL:
        return target_for(text, "rocm")
    nv = next((n for n, _ in _NVIDIA_ARCH_BY_NAME if re.search(rf"\b{n}\b", upper)), None)
    if nv is not None:
        return target_for(nv, "cuda")
    raise ValueError(f"unknown device name {name!r}: expected an AMD arch or part (gfx942, gfx950, "
                     "MI300X, MI355X), an NVIDIA arch or part (sm_90, H200) or 'cpu'")


_TARGET_OVERRIDE = contextvars.ContextVar("k3pallas_target", default=None)


def target_override() -> Target | None:
    """The target of the ``compiling_for`` in force, or None."""
    return _TARGET_OVERRIDE.get()


@contextlib.contextmanager
def compiling_for(target: Target):
    """Code traced inside picks implementations, launch configs and FP8 formats for ``target``.

    For ahead-of-time compilation where jax cannot tell the device (the public functions also
    use it to carry the target they found into their kernels' trace).
    """
    if not isinstance(target, Target):
        raise TypeError(f"compiling_for takes a k3pallas.platform.Target, got {type(target).__name__}")
    token = _TARGET_OVERRIDE.set(target)
    try:
        yield target
    finally:
        _TARGET_OVERRIDE.reset(token)


def _of_abstract(abstract) -> Target:
    """An ``AbstractDevice``: read from a local device of the same kind where there is one (it
    knows its compute capability and client), else from the kind alone (deviceless)."""
    for d in _compat.local_devices():
        if d.device_kind == abstract.device_kind and d.platform == abstract.platform:
            return target_of_device(d)
    return target_for(abstract.device_kind, abstract.platform,
                      num_cores=getattr(abstract, "num_cores", None))


def current_target(*arrays) -> Target:
    """The target that code traced now will run on (see the module docstring for the order).

    ``arrays``: the operands of the op being traced; inside ``jax.jit`` with ``NamedSharding``
    and no mesh in scope, their sharding's mesh names the device.
    """
    override = _TARGET_OVERRIDE.get()
    if override is not None:
        return override
    abstract = _compat.abstract_target_device()
    if abstract is None:
        abstract = next(filter(None, map(_compat.operand_device, arrays)), None)
    if abstract is not None:
        if isinstance(abstract, jax.Device):
            return target_of_device(abstract)
        return _of_abstract(abstract)
    return target_of_device(jax.devices()[0])
