"""The ROCm compile gate on XLA's own ROCm compiler, end to end. Needs the environment that
``python -m bench.rocm.env`` builds (CI builds it, then runs this file with
``K3PALLAS_ROCM_ENV_JSON`` set); skipped without it."""

from __future__ import annotations

import json
import os

import pytest

from bench.rocm import check as rocm_check

# Only where asked for (CI's gate stage sets it; so can a developer): it takes a minute or two,
# and the gate itself already compiles everything.
ENV = os.environ.get("K3PALLAS_ROCM_ENV_JSON", "")
pytestmark = pytest.mark.skipif(not os.path.exists(ENV),
                                reason="set K3PALLAS_ROCM_ENV_JSON to a bench.rocm.env env.json")


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate")
    code = rocm_check.main(["--env-dir", os.path.dirname(ENV), "--broken", "--check",
                            "--tokens", "64", "--ops", "rmsnorm,rmsnorm_gated_fp8_per_token,quantize_fp8_per_token",
                            "--no-programs", "--out", str(out)])
    with open(out / "rocm_check.json") as f:
        data = json.load(f)
    return code, data["results"], data["sharded"]


def test_a_broken_kernel_fails_the_gate(gate):
    code, results, _ = gate
    assert code == 1
    failing = [r for r in results if rocm_check.problems(r)]
    assert failing and all(r.get("broken") for r in failing)
    assert {r["arch"] for r in failing} == set(rocm_check.ARCHS)
    for r in failing:
        assert r["vgpr_spill"] > 0 or r["scratch"] > 0


def test_every_other_kernel_passes_on_both_archs(gate):
    _, results, _ = gate
    good = [r for r in results if not r.get("broken")]
    assert {r["arch"] for r in good} == set(rocm_check.ARCHS)
    assert len(good) == 2 * (1 + 2 * 3 + 2)  # rmsnorm; gated FP8 x 3 configs x 2 casts; quant x 2
    assert all(not rocm_check.problems(r) and r["instructions"] > 50 for r in good)


def test_native_fp8_conversion_instructions(gate):
    """The native path emits the hardware conversion (gfx942: fnuz, gfx950: OCP fn); the encoder
    path none, and more instructions."""
    _, results, _ = gate
    want = {"gfx942": "v_cvt_pk_fp8_f32", "gfx950": "v_cvt_scalef32_pk_fp8_f32"}
    fp8 = [r for r in results if r.get("fp8_cast")]
    for r in fp8:
        if r["fp8_cast"] == "native":
            assert r["fp8_cvt"] == [want[r["arch"]]] and r["fp8_cvt_count"] > 0, r
            enc = next(e for e in fp8 if e["fp8_cast"] == "encoder" and
                       (e["arch"], e["op"], e["config"]) == (r["arch"], r["op"], r["config"]))
            assert enc["fp8_cvt"] == [] and enc["instructions"] > r["instructions"]
    assert all(r.get("undecoded", 0) == 0 for r in results)


def test_sharded_programs_on_the_8_gpu_topology(gate):
    """shard_map and jit with NamedSharding over 8 topology devices, traced with no k3pallas
    override: each kernel in the arch's FP8 format, with the native conversion, within 1024
    threads, without spills, at occupancy >= 4; the cross-device scale's all-reduce where heads
    or columns are sharded."""
    _, _, rows = gate
    fmt = {"gfx942": "f8e4m3fnuz", "gfx950": "f8e4m3fn"}
    assert {r["arch"] for r in rows} == set(rocm_check.ARCHS)
    assert {(r["sharded"], r["op"]) for r in rows} == {
        (m, op) for m in rocm_check.SHARDINGS
        for op in ("rmsnorm", "rmsnorm_gated_fp8_per_token", "quantize_fp8_per_token")}
    for r in rows:
        assert not rocm_check.problems(r), r
        assert r["target"] == f"rocm {r['arch']}" and r["threads"] <= 1024
        if r["op"] != "rmsnorm":
            assert r["fp8_formats"] == [fmt[r["arch"]]], r
        if r["sharded"] == "named" and r["op"] != "rmsnorm":
            assert "all-reduce" in r["collectives"], r
    codes = [r for r in rows if r["op"] != "rmsnorm" and not r["kernel"].endswith("_scale_only")]
    assert codes and all(rocm_check.NATIVE_CVT[r["arch"]] in r["fp8_cvt"] for r in codes)

