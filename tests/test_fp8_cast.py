"""The FP8 conversion choice (k3pallas.kernels.fp8_cast): the self-check's values, the selection logic on
a simulated GPU (interpret mode standing in for the device, a faulty native cast standing in for
a hardware mismatch), the options and their errors, and the scoped lowering patch for e4m3fnuz."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import _compat, platform
from k3pallas.kernels import fp8_cast
from k3pallas import testing
from k3pallas import fp8 as fp8_lib

FORMATS = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"]
GFX942 = platform.target_for(*testing.KNOWN_TARGETS["gfx942"])
GFX950 = platform.target_for(*testing.KNOWN_TARGETS["gfx950"])
H200 = platform.target_for(*testing.KNOWN_TARGETS["h200"])


@pytest.fixture
def fresh(monkeypatch):
    """No cached decisions; self-checks run in interpret mode, as if on an attached device."""
    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_CHECKS", {})
    monkeypatch.setattr(fp8_cast, "_WARNED", set())
    monkeypatch.setattr(fp8_cast, "_attached", lambda target: None)
    monkeypatch.setattr(fp8_cast, "_devices_of", lambda target: [None])
    real = fp8_cast.self_check
    monkeypatch.setattr(fp8_cast, "self_check",
                        lambda dtype, interpret, device=None: real(dtype, interpret=True))
    monkeypatch.delenv(fp8_lib.CAST_ENV_VAR, raising=False)


@pytest.mark.parametrize("name", FORMATS)
def test_check_values_cover_the_format(name):
    v = fp8_cast.check_values(name)
    assert v.dtype == np.float32 and len(v) & (len(v) - 1) == 0
    codes = np.arange(256, dtype=np.uint8).view(jnp.dtype(name)).astype(np.float32)
    finite = codes[np.isfinite(codes)]
    assert set(finite.tolist()) <= set(v.tolist())  # every code's value, both signs
    mags = np.unique(np.abs(finite))
    mids = ((mags[:-1].astype(np.float64) + mags[1:]) / 2).astype(np.float32)
    for m in (mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))):
        assert set(m.tolist()) <= set(v.tolist()) and set((-m).tolist()) <= set(v.tolist())
    assert np.isnan(v).sum() == 2 and (np.signbit(v) & (v == 0)).any()  # NaN both signs, -0
    assert np.abs(v[np.isfinite(v)]).max() <= np.nextafter(np.float32(mags.max()), np.float32(np.inf))


@pytest.mark.parametrize("name", FORMATS)
def test_native_and_encoder_agree_in_interpret_mode(name):
    assert fp8_cast.self_check(name, interpret=True) == ()


def test_fnuz_fixup_flushes_negative_zero():
    """-tiny rounds to zero; in e4m3fnuz that must be 0x00 (0x80 is NaN), native as encoder."""
    v = jnp.asarray([-2.0**-12, -2.0**-11, 2.0**-11, -0.0, float("nan")], jnp.float32)
    got = np.asarray(jax.lax.bitcast_convert_type(fp8_cast.native_codes(v, jnp.float8_e4m3fnuz), jnp.uint8))
    assert got.tolist() == [0, 0, 0, 0, 0x80]


@pytest.mark.parametrize("target,name", [(GFX942, "float8_e4m3fnuz"), (GFX950, "float8_e4m3fn"),
                                         (H200, "float8_e4m3fn"), (H200, "float8_e5m2")])
def test_auto_picks_native_after_a_passing_self_check(fresh, target, name):
    d = fp8_cast.decide(name, "auto", target=target)
    assert d.native and "agree on all" in d.reason and d.mismatches == ()
    assert any(x.target == d.target and x.dtype == name and x.native for x in kp.fp8_cast_decisions())
    assert fp8_cast.decide(name, "native", target=target).native


def test_simulated_mismatch_warns_once_and_falls_back(fresh, monkeypatch):
    real = fp8_cast.native_codes
    monkeypatch.setattr(fp8_cast, "native_codes", lambda v, dtype: real(v * (1 + 2.0**-6), dtype))
    with pytest.warns(RuntimeWarning, match=r"native float8_e4m3fnuz conversion or the encoder differs"):
        d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942)
    assert not d.native and d.mismatches and "native 0x" in d.reason
    value, host, enc, nat = d.mismatches[0]
    assert enc == host != nat
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning
        assert not fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942).native
    with pytest.raises(RuntimeError, match="fp8_cast='native': self-check on rocm gfx942"):
        fp8_cast.decide("float8_e4m3fnuz", "native", target=GFX942)


def test_simulated_mismatch_through_the_api(fresh, monkeypatch, rng):
    """A kernel built after a failed check uses the encoder: its codes equal the encoder's."""
    real = fp8_cast.native_codes
    monkeypatch.setattr(fp8_cast, "native_codes", lambda v, dtype: real(v * 1.5, dtype))
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    with pytest.raises(RuntimeError, match="quantize: fp8_cast='native'"), \
            pytest.warns(RuntimeWarning, match="or the encoder differs"):
        kp.per_token_fp8_quant(x, fp8_cast="native", impl="interpret")
    enc = kp.per_token_fp8_quant(x, fp8_cast="encoder", impl="interpret")
    ref = kp.per_token_fp8_quant(x, impl="reference")
    assert np.array_equal(np.asarray(enc.data).view(np.uint8), np.asarray(ref.data).view(np.uint8))


def test_no_native_conversion_for_the_format(fresh):
    d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=H200)
    assert not d.native and "no e4m3fnuz conversion" in d.reason
    with pytest.raises(RuntimeError, match="NVIDIA GPUs have no e4m3fnuz conversion"):
        fp8_cast.decide("float8_e4m3fnuz", "native", target=H200)
    assert not fp8_cast.decide("float8_e4m3fn", "auto", target=GFX942).native  # emulated there
    assert not fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX950).native
    old = platform.target_for("NVIDIA A100", "cuda")
    assert "sm_89" in fp8_cast.decide("float8_e4m3fn", "auto", target=old).reason


def test_without_a_device_auto_is_the_encoder_and_native_raises(monkeypatch):
    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_CHECKS", {})
    d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942)
    assert not d.native and "no gfx942 device attached" in d.reason, d
    with pytest.raises(RuntimeError, match="no gfx942 device attached.*native_unchecked"):
        fp8_cast.decide("float8_e4m3fnuz", "native", target=GFX942)
    assert fp8_cast.decide("float8_e4m3fnuz", "native_unchecked", target=GFX942).native
    assert not fp8_cast.decide("float8_e4m3fnuz", "encoder", target=GFX942).native


def test_modes_and_environment_variable(monkeypatch, rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    with pytest.raises(ValueError, match="quantize: fp8_cast must be one of"):
        kp.per_token_fp8_quant(x, fp8_cast="fast")
    with pytest.raises(ValueError, match="fp8_cast must be one of"):
        kp.rmsnorm_gated_fp8_per_token(x.reshape(4, 2, 32), jnp.ones(32), x.reshape(4, 2, 32), fp8_cast=1)
    monkeypatch.setenv(fp8_lib.CAST_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="quantize: environment variable K3PALLAS_FP8_CAST='bogus'"):
        kp.per_token_fp8_quant(x, impl="interpret")
    # Calls that convert nothing in a kernel do not read it.
    kp.per_token_fp8_quant(x, impl="reference")
    kp.quantize_weight(x, "fp8_per_token")
    monkeypatch.setenv(fp8_lib.CAST_ENV_VAR, " Encoder ")
    assert fp8_lib.resolve_cast_mode(None) == "encoder"
    monkeypatch.setenv(fp8_lib.CAST_ENV_VAR, "native_unchecked")  # ahead-of-time tools pass it as an argument
    with pytest.raises(ValueError, match="only as the fp8_cast argument"):
        fp8_lib.resolve_cast_mode(None)
    assert fp8_lib.resolve_cast_mode("native_unchecked") == "native_unchecked"
    monkeypatch.setenv(fp8_lib.CAST_ENV_VAR, "native")
    assert fp8_lib.resolve_cast_mode(None) == "native" and fp8_lib.resolve_cast_mode("encoder") == "encoder"
    monkeypatch.delenv(fp8_lib.CAST_ENV_VAR)
    assert fp8_lib.resolve_cast_mode(None) == "auto"


@pytest.mark.parametrize("name", FORMATS)
def test_native_path_in_interpret_equals_the_encoder_path(rng, monkeypatch, name):
    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_CHECKS", {})
    x = jnp.asarray(rng.standard_normal((9, 3, 64)) * 3, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((9, 3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(64), jnp.float32)
    x = x.at[2].set(jnp.nan).at[4].set(0.0)
    out = {c: kp.rmsnorm_gated_fp8_per_token(x, w, g, fp8_dtype=name, fp8_cast=c, impl="interpret")
           for c in ("encoder", "native")}
    a, b = (np.asarray(out[c].data).view(np.uint8) for c in ("encoder", "native"))
    nan = np.isnan(np.asarray(out["encoder"].data.astype(jnp.float32)))
    assert np.array_equal(a[~nan], b[~nan]) and nan[2].all() and not nan[[0, 1, 3, 4]].any()
    assert np.isnan(np.asarray(out["native"].data[2].astype(jnp.float32))).all()
    np.testing.assert_array_equal(np.asarray(out["encoder"].scale), np.asarray(out["native"].scale))
    assert any(d.native and d.target == "interpret" and d.dtype == name for d in kp.fp8_cast_decisions())


def _lower_ir(fn, args, arch="gfx942"):
    lowered = testing.lower_for(fn, args, *testing.KNOWN_TARGETS[arch])
    return [m["ir"] for m in testing.triton_ir_modules(lowered)]


@pytest.mark.parametrize("op", ["gated", "quant"])
def test_native_fnuz_lowers_for_gfx942_in_our_kernels_only(op):
    from jax.experimental import pallas as pl

    s = jax.ShapeDtypeStruct
    if op == "gated":
        args = [s((64, 12, 128), jnp.bfloat16), s((128,), jnp.float32), s((64, 12, 128), jnp.bfloat16)]
        run = lambda cast: (lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, fp8_cast=cast, impl="pallas"))  # noqa: E731
    else:
        args = [s((64, 4096), jnp.bfloat16)]
        run = lambda cast: (lambda a: kp.per_token_fp8_quant(a, fp8_cast=cast, impl="pallas"))  # noqa: E731
    (native,) = _lower_ir(run("native_unchecked"), args)
    (encoder,) = _lower_ir(run("encoder"), args)
    assert "tt.fp_to_fp" in native and "f8E4M3FNUZ" in native
    assert "tt.fp_to_fp" not in encoder and "f8E4M3FNUZ" not in encoder
    # The lowering still refuses the cast in anybody else's kernel.

    def user_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.float8_e4m3fnuz)

    user = lambda x: pl.pallas_call(user_kernel, out_shape=s((1024,), jnp.float8_e4m3fnuz),  # noqa: E731
                                    compiler_params=_compat.triton_compiler_params(4, 1))(x)
    with pytest.raises(NotImplementedError, match="cannot cast to `float8_e4m3fnuz`"):
        _lower_ir(user, [s((1024,), jnp.float32)])


def test_fnuz_patch_refuses_an_unknown_jax(monkeypatch):
    monkeypatch.setattr(_compat, "JAX_VERSION", (0, 9, 0))
    reason = _compat.native_fnuz_cast_unavailable()
    assert reason and "written for jax 0.10.2, 0.11.2, 0.12.0, 0.12.1, not" in reason
    assert "not" in fp8_cast.native_unavailable(GFX942, jnp.float8_e4m3fnuz)
    monkeypatch.setattr(fp8_cast, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="uses the integer encoder"):
        d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942)
    assert not d.native and "written for jax" in d.reason


# ------------------------------------------------------------------------------------------------
# The self-check fails safe
# ------------------------------------------------------------------------------------------------


def test_a_check_that_cannot_run_falls_back_once_in_auto_and_raises_in_native(fresh, monkeypatch):
    calls = []

    def broken(dtype, interpret, device=None):
        calls.append(dtype)
        raise RuntimeError("HIP error: the check kernel failed to launch")

    monkeypatch.setattr(fp8_cast, "self_check", broken)
    with pytest.warns(RuntimeWarning, match="could not run .*failed to launch.*using the encoder"):
        d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942)
    assert not d.native and "could not run" in d.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached: not retried, no second warning
        assert not fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942).native
        with pytest.raises(RuntimeError, match="fp8_cast='native': self-check on rocm gfx942 could not run"):
            fp8_cast.decide("float8_e4m3fnuz", "native", target=GFX942)
    assert len(calls) == 1


def test_the_check_runs_under_a_transfer_guard(fresh):
    """The check's own host <-> device copies are explicit: a caller's
    ``jax.transfer_guard("disallow")`` does not break the user's first FP8 op."""
    x = jnp.ones((4, 64), jnp.float32)
    with jax.transfer_guard("disallow"):
        d = fp8_cast.decide("float8_e4m3fn", "native", target=H200)
        assert d.native
        kp.per_token_fp8_quant(x, fp8_cast="native", impl="interpret")


def test_the_check_compares_with_host_codes(fresh, monkeypatch):
    """Both device paths wrong in the same way is still a failure: the reference is ml_dtypes on
    the host."""
    real = fp8_cast.self_check_codes

    def same_wrong(values, dtype, *, interpret):
        enc, nat = real(values * 2, dtype, interpret=interpret)
        return enc, nat

    monkeypatch.setattr(fp8_cast, "self_check_codes", same_wrong)
    with pytest.warns(RuntimeWarning, match="differs from the host's codes"):
        d = fp8_cast.decide("float8_e4m3fn", "auto", target=H200)
    assert not d.native and all(e == n != h for _, h, e, n in d.mismatches[:5])


def test_one_check_per_format_when_threads_race(fresh, monkeypatch):
    import threading
    import time

    calls = []
    real = fp8_cast.self_check

    def slow(dtype, interpret, device=None):
        calls.append(dtype)
        time.sleep(0.2)
        return real(dtype, interpret=True)

    monkeypatch.setattr(fp8_cast, "self_check", slow)
    start = threading.Barrier(4)
    got = []

    def first_call():
        start.wait()
        got.append(fp8_cast.decide("float8_e4m3fn", "auto", target=GFX950).native)

    threads = [threading.Thread(target=first_call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [True] * 4 and len(calls) == 1


def test_native_refused_where_local_gpus_differ_in_arch(monkeypatch):
    import types

    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_CHECKS", {})

    def dev(kind, cc):
        client = types.SimpleNamespace(platform="gpu", platform_version="rocm 7.1")
        return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc,
                                     client=client, core_count=None)

    mixed = [dev("AMD Instinct MI300X", "gfx942"), dev("AMD Instinct MI355X", "gfx950")]
    monkeypatch.setattr(_compat, "local_devices", lambda: mixed)
    d = fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942)
    assert not d.native and "differ in arch (gfx942, gfx950)" in d.reason
    with pytest.raises(RuntimeError, match="differ in arch"):
        fp8_cast.decide("float8_e4m3fnuz", "native", target=GFX942)
    monkeypatch.setattr(_compat, "local_devices", lambda: mixed[:1])
    assert fp8_cast._attached(GFX942) is None and fp8_cast._devices_of(GFX942) == mixed[:1]


def test_fnuz_patch_checks_the_patched_functions_signature(monkeypatch):
    from jax._src.pallas.triton import lowering

    monkeypatch.setattr(_compat, "_FNUZ_PATCHED", [])
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lambda module, *a: None)
    reason = _compat.native_fnuz_cast_unavailable()
    assert reason and "not jaxpr, grid_mapping" in reason
    with pytest.raises(RuntimeError, match="not jaxpr, grid_mapping"):
        _compat.enable_native_fnuz_cast()


def test_an_unsupported_jax_warns_once_that_it_uses_the_encoder(monkeypatch):
    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_WARNED", set())
    monkeypatch.setattr(_compat, "JAX_VERSION", (0, 9, 0))
    monkeypatch.setattr(_compat, "_FNUZ_PATCHED", [])
    with pytest.warns(RuntimeWarning, match="written for jax .* uses the integer encoder"):
        assert not fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942).native
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not fp8_cast.decide("float8_e4m3fnuz", "auto", target=GFX942).native


def test_the_check_runs_inside_a_trace_without_touching_it(monkeypatch, rng):
    """The first FP8 kernel of a jitted program decides inside its trace. The check's copy to
    the device must happen then and there, not as a step of the program being traced (on the
    H200 a traced device_put made the check fail and left a constant that custom_partitioning
    refuses)."""
    monkeypatch.setattr(fp8_cast, "_DECISIONS", {})
    monkeypatch.setattr(fp8_cast, "_CHECKS", {})
    monkeypatch.setattr(fp8_cast, "_WARNED", set())
    real = fp8_cast.self_check
    device = jax.devices()[0]
    monkeypatch.setattr(fp8_cast, "self_check", lambda dtype, interpret, device=None:
                        real(dtype, interpret=True, device=jax.devices()[0]))
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jax.jit(lambda a: kp.per_token_fp8_quant(a, fp8_cast="native", impl="interpret"))(x)
    ref = kp.per_token_fp8_quant(x, impl="reference")
    assert np.array_equal(np.asarray(out.data).view(np.uint8), np.asarray(ref.data).view(np.uint8))
    assert real("float8_e4m3fn", interpret=True, device=device) == ()
