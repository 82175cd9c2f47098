"""The float32 -> FP8 conversion in the kernels: the hardware's, or the integer encoder, and the
device self-check that decides between them.

* the **encoder** (``k3pallas.fp8.encode_fp8``): integer arithmetic on the float32 bits, bit-exact
  with XLA's cast, runs everywhere;
* the **native** conversion (``native_codes``): the lowering's own cast, one instruction per two
  values where the target has it (NVIDIA sm_89+ e4m3fn / e5m2; AMD gfx94x e4m3fnuz, which the
  lowering refuses and ``k3pallas._compat.enable_native_fnuz_cast`` allows for our kernels only;
  AMD gfx950 e4m3fn).

The native path is used only where it was seen on the device itself to give the codes ml_dtypes
gives on the host, as the encoder does: the first FP8 kernel built for a GPU converts a fixed set
of values (``check_values``) both ways in one small kernel (``self_check``). A check that
disagrees, or cannot run, means the encoder, with one warning; the decision is cached per
(target, format). The choice of mode (``fp8_cast=``, ``$K3PALLAS_FP8_CAST``, "auto") is in
``k3pallas.fp8``; in interpret mode "auto" is the encoder. ``decisions()`` lists what was decided.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from k3pallas import _compat
from k3pallas._compat import pl
from k3pallas import fp8 as fp8_lib
from k3pallas import platform

@dataclasses.dataclass(frozen=True)
class CastDecision:
    native: bool
    mode: str  # what was asked for
    target: str  # "rocm gfx942", "cuda sm_90", "interpret", ...
    dtype: str
    reason: str
    mismatches: tuple = ()  # (value, encoder code, native code) where the self-check disagreed


_CHECKS: dict = {}  # (where, dtype) -> the self-check's decision, once per process
_DECISIONS: dict = {}  # (where, dtype, mode) -> the last decision taken


def decisions() -> list[CastDecision]:
    """The decisions taken in this process, one per (target, format, requested mode)."""
    return list(_DECISIONS.values())


def _element_unavailable(dtype) -> str | None:
    """The reason no target converts natively to ``dtype`` here (interpret mode included)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float4_e2m1fn):
        return ("no native float4 conversion is used (NVIDIA sm_90 has none; gfx950's "
                "v_cvt_scalef32_pk_fp4_f32 would need a gfx950 device for the self-check)")
    return None


def native_unavailable(target: platform.Target, dtype) -> str | None:
    """None if the target's lowering has a native conversion to ``dtype``, else the reason."""
    dtype = jnp.dtype(dtype)
    fn, fnuz = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz)
    reason = _element_unavailable(dtype)
    if reason:
        return reason
    if target.backend == "cuda":
        if dtype == fnuz:
            return "NVIDIA GPUs have no e4m3fnuz conversion"
        m = re.fullmatch(r"sm_(\d+)", target.arch)
        if m and int(m.group(1)) < 89:
            return f"{target.arch} has no FP8 conversion instructions (sm_89 and later do)"
        return None
    if target.backend == "rocm":
        if target.arch.startswith("gfx94"):
            if dtype != fnuz:
                return f"{target.arch} converts natively only to e4m3fnuz (Triton emulates {dtype.name})"
            return _compat.native_fnuz_cast_unavailable()
        if target.arch.startswith("gfx95"):
            if dtype != fn:
                return f"{target.arch} is used with e4m3fn only here ({dtype.name}: encoder)"
            return None
        return f"no native FP8 conversion known for {target.arch}"
    return f"no GPU target ({target.backend})"


def native_codes(v, dtype):
    """The lowering's own float32 -> ``dtype`` cast (round to nearest even), with the fix-up that
    makes it equal the encoder: in e4m3fnuz, which has no -0, a value that rounds to zero is
    flushed to +0 before the cast (|v| <= half the smallest subnormal), so the code 0x80 (NaN
    there) comes only from NaN. No saturation fix-up: the kernels' values never exceed
    ``fp8_max`` by more than rounding (``_codes``)."""
    fmt = fp8_lib.fp8_format(dtype)
    if not fmt.has_negative_zero:
        half_min_subnormal = 2.0 ** (1 - fmt.bias - fmt.man_bits - 1)
        v = jnp.where(jnp.abs(v) <= half_min_subnormal, 0.0, v)
    return v.astype(dtype)


def _self_check_kernel(x_ref, enc_ref, nat_ref, *, n, dtype):
    i = jnp.arange(n, dtype=jnp.int32)
    v = x_ref[i]
    enc_ref[i] = fp8_lib.encode_fp8(v, dtype).astype(jnp.uint8)
    nat_ref[i] = native_codes(v, dtype)


def self_check_codes(values, dtype, *, interpret: bool):
    """``values`` float32 ``[n]`` (n a power of two) -> (encoder codes, native codes), both
    uint8, from ONE kernel that converts the same values both ways (``k3pallas.fp8_cast``)."""
    n = values.shape[0]
    kernel = functools.partial(_self_check_kernel, n=n, dtype=jnp.dtype(dtype))
    spec = pl.BlockSpec((n,), lambda i: (0,))
    enc, nat = pl.pallas_call(
        kernel, grid=(1,), in_specs=[spec], out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.uint8), jax.ShapeDtypeStruct((n,), dtype)],
        interpret=interpret, name="k3pallas_fp8_cast_self_check")(values)
    return enc, lax.bitcast_convert_type(nat, jnp.uint8)


def check_values(dtype) -> np.ndarray:
    """The self-check's float32 inputs for ``dtype``, padded to a power of two with zeros."""
    fmt = fp8_lib.fp8_format(dtype)
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(np.float32)
    finite = np.unique(np.abs(codes[np.isfinite(codes)]))  # every code's magnitude, ascending
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    mids = mids.astype(np.float32)
    around = [np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    tiny = finite[1] / 2  # half the smallest subnormal: rounds to zero (a tie, to even)
    small = np.array([tiny, np.nextafter(tiny, np.float32(0)), tiny / 8, 1e-30, 1.4e-45,
                      np.nextafter(tiny, np.float32(1))], np.float32)
    bounds = np.array([fmt.max_finite, fmt.default_max, fp8_lib.FP8_E4M3FNUZ_MAX_AITER,
                       np.nextafter(np.float32(fmt.max_finite), np.float32(0)),
                       np.nextafter(np.float32(fmt.max_finite), np.float32(np.inf))], np.float32)
    bounds = bounds[bounds <= np.nextafter(np.float32(fmt.max_finite), np.float32(np.inf))]
    mags = np.concatenate([finite, mids, *around, small, bounds]).astype(np.float32)
    vals = np.concatenate([mags, -mags, np.array([0.0, -0.0, np.nan, -np.nan], np.float32)])
    n = 1 << int(np.ceil(np.log2(len(vals))))
    return np.concatenate([vals, np.zeros(n - len(vals), np.float32)])


def self_check(dtype, *, interpret: bool, device=None) -> tuple:
    """Run the check kernel on ``device`` (default: jax's default device; or in interpret mode);
    the mismatches as ``((value, host code, encoder code, native code), ...)``: the values where
    either path differs from the codes computed on the host (ml_dtypes, the reference of both)."""
    values = check_values(dtype)
    if not interpret and jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fnuz):
        _compat.enable_native_fnuz_cast()
    # Compiled ahead and called with a concrete array: it runs now, also while an outer function
    # is being traced (the first FP8 kernel of a jitted program decides inside its trace). The
    # transfers are explicit and allowed, whatever the caller's jax.transfer_guard.
    run = jax.jit(lambda v: self_check_codes(v, dtype, interpret=interpret))
    where = None if device is None else jax.sharding.make_single_device_sharding(device)
    compiled = run.lower(jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=where)).compile()
    with jax.transfer_guard("allow"):
        with jax.ensure_compile_time_eval():  # the copy happens now, not as a traced step
            placed = values if device is None else jax.device_put(values, where)
        enc, nat = jax.device_get(compiled(placed))
    enc, nat = np.asarray(enc, np.uint8), np.asarray(nat, np.uint8)
    host = values.astype(jnp.dtype(dtype)).view(np.uint8)
    # NaN in, NaN out: any NaN code of the format counts as the same (XLA's CPU cast, for one,
    # writes e5m2 NaN as 0x7f for either sign where the encoder keeps the sign, 0x7e / 0xfe).
    as_fp8 = lambda c: c.view(jnp.dtype(dtype)).astype(np.float32)  # noqa: E731
    same = lambda a, b: (a == b) | (np.isnan(as_fp8(a)) & np.isnan(as_fp8(b)))  # noqa: E731
    bad = np.nonzero(~same(enc, host) | ~same(nat, host))[0]
    return tuple((float(values[i]), int(host[i]), int(enc[i]), int(nat[i])) for i in bad)


def _devices_of(target: platform.Target) -> list:
    """The local devices of ``target``'s backend and arch."""
    out = []
    for d in _compat.local_devices():
        try:
            here = platform.target_of_device(d)
        except ValueError:
            continue
        if here.backend == target.backend and here.arch == target.arch:
            out.append(d)
    return out


def _attached(target: platform.Target) -> str | None:
    """None if the self-check can run for ``target`` here, else why not: no local device of that
    arch, or local GPUs of several arches (one check could not speak for all of them)."""
    gpus = [d for d in _compat.local_devices() if d.platform != "cpu"]
    arches = set()
    for d in gpus:
        try:
            arches.add(platform.target_of_device(d).arch)
        except ValueError:
            arches.add(d.device_kind)
    if len(arches) > 1:
        return (f"the local GPUs differ in arch ({', '.join(sorted(arches))}): one self-check "
                "cannot speak for all of them")
    if not _devices_of(target):
        return f"no {target.arch} device attached to run the self-check on (ahead-of-time compilation)"
    return None


def decide(dtype, fp8_cast, *, target: platform.Target, interpret: bool = False) -> CastDecision:
    """The conversion path for ``dtype`` in a kernel built for ``target``; ``fp8_cast``: the
    mode asked for (None: ``$K3PALLAS_FP8_CAST``, else "auto"). RuntimeError where "native" is
    asked for and cannot be had.

    A native e4m3fnuz decision for a GPU also enables that cast in the lowering
    (``k3pallas._compat.enable_native_fnuz_cast``, for k3pallas kernels only)."""
    decision = _decide(dtype, fp8_cast, interpret, target)
    _DECISIONS[(decision.target, decision.dtype, decision.mode)] = decision
    if decision.native and not interpret and jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fnuz):
        _compat.enable_native_fnuz_cast()
    return decision


_LOCK = threading.Lock()  # one self-check per (target, format), however many threads trace
_WARNED: set = set()


def _warn_once(key, message):
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"k3pallas: {message}", RuntimeWarning, stacklevel=4)


def _decide(dtype, fp8_cast, interpret, target) -> CastDecision:
    mode = fp8_lib.resolve_cast_mode(fp8_cast)
    dtype = jnp.dtype(dtype)
    where = "interpret" if interpret else f"{target.backend} {target.arch}"
    if mode == "encoder":
        return CastDecision(False, mode, where, dtype.name, "asked for the encoder")
    if interpret and mode == "auto":
        return CastDecision(False, mode, where, dtype.name,
                            "interpret mode: the encoder unless fp8_cast='native' is asked for")
    reason = _element_unavailable(dtype) if interpret else native_unavailable(target, dtype)
    if reason:
        if mode == "auto":
            if "written for jax" in reason or "not importable" in reason or "expected fp8" in reason:
                _warn_once(("jax", where, dtype.name), f"{reason}; {dtype.name} uses the integer encoder")
            return CastDecision(False, mode, where, dtype.name, reason)
        raise RuntimeError(f"fp8_cast={mode!r}: {reason}")
    if mode == "native_unchecked":
        return CastDecision(True, mode, where, dtype.name, "native without a self-check (ahead of time)")
    if not interpret:
        reason = _attached(target)
        if reason:
            if mode == "auto":
                return CastDecision(False, mode, where, dtype.name, reason)
            raise RuntimeError(f"fp8_cast='native': {reason}; use 'native_unchecked' to compile the "
                               "native path without a check")
    key = (where, dtype.name)
    with _LOCK:
        checked = _CHECKS.get(key)
        if checked is None:
            checked = _run_check(target, dtype, where, interpret)
            _CHECKS[key] = checked
    if mode == "native" and not checked.native:
        raise RuntimeError(f"fp8_cast='native': {checked.reason}")
    return dataclasses.replace(checked, mode=mode)


def _run_check(target, dtype, where, interpret) -> CastDecision:
    """The self-check's decision; a check that cannot compile or run decides the encoder (with
    one warning naming the cause), it never fails the user's op."""
    n = len(check_values(dtype))
    try:
        device = None if interpret else _devices_of(target)[0]
        bad = self_check(dtype, interpret=interpret, device=device)
    except Exception as e:  # noqa: BLE001 - any failure of the check means: do not trust native
        reason = (f"self-check on {where} could not run ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''})")
        _warn_once(("check", where, dtype.name), f"{reason}; using the encoder for {dtype.name}")
        return CastDecision(False, "auto", where, dtype.name, reason)
    if bad:
        shown = ", ".join(f"{v!r}: host 0x{h:02x} encoder 0x{e:02x} native 0x{c:02x}"
                          for v, h, e, c in bad[:6])
        reason = (f"self-check on {where}: the native {dtype.name} conversion or the encoder "
                  f"differs from the host's codes on {len(bad)} of {n} values ({shown})")
        _warn_once(("check", where, dtype.name), f"{reason}; using the encoder")
        return CastDecision(False, "auto", where, dtype.name, reason, bad)
    return CastDecision(True, "auto", where, dtype.name,
                        f"self-check on {where}: native, encoder and host agree on all {n} values")
