"""The ROCm compile gate on XLA's own ROCm compiler, end to end. Needs the environment that
``python -m bench.rocm_env`` builds (CI builds it, then runs this file with
``K3PALLAS_ROCM_ENV_JSON`` set); skipped without it."""

from __future__ import annotations

import json
import os

import pytest

from bench import rocm_check, rocm_env

ENV = os.environ.get("K3PALLAS_ROCM_ENV_JSON") or os.path.join(rocm_env.default_dir(), "env.json")
pytestmark = pytest.mark.skipif(not os.path.exists(ENV), reason=f"no ROCm compile environment at {ENV}")


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate")
    code = rocm_check.main(["--env-dir", os.path.dirname(ENV), "--broken", "--check",
                            "--tokens", "64", "--ops", "rmsnorm,rmsnorm_gated_fp8_per_token,per_token_fp8_quant",
                            "--no-programs", "--out", str(out)])
    with open(out / "rocm_check.json") as f:
        return code, json.load(f)["results"]


def test_a_broken_kernel_fails_the_gate(gate):
    code, results = gate
    assert code == 1
    failing = [r for r in results if rocm_check.problems(r)]
    assert failing and all(r.get("broken") for r in failing)
    assert {r["arch"] for r in failing} == set(rocm_check.ARCHS)
    for r in failing:
        assert r["vgpr_spill"] > 0 or r["scratch"] > 0


def test_every_other_kernel_passes_on_both_archs(gate):
    _, results = gate
    good = [r for r in results if not r.get("broken")]
    assert {r["arch"] for r in good} == set(rocm_check.ARCHS)
    assert len(good) == 2 * (1 + 2 * 3 + 2)  # rmsnorm; gated FP8 x 3 configs x 2 casts; quant x 2
    assert all(not rocm_check.problems(r) and r["instructions"] > 50 for r in good)


def test_native_fp8_conversion_instructions(gate):
    """The native path emits the hardware conversion (gfx942: fnuz, gfx950: OCP fn); the encoder
    path none, and more instructions."""
    _, results = gate
    want = {"gfx942": "v_cvt_pk_fp8_f32", "gfx950": "v_cvt_scalef32_pk_fp8_f32"}
    fp8 = [r for r in results if r.get("fp8_cast")]
    for r in fp8:
        if r["fp8_cast"] == "native":
            assert r["fp8_cvt"] == [want[r["arch"]]] and r["fp8_cvt_count"] > 0, r
            enc = next(e for e in fp8 if e["fp8_cast"] == "encoder" and
                       (e["arch"], e["op"], e["config"]) == (r["arch"], r["op"], r["config"]))
            assert enc["fp8_cvt"] == [] and enc["instructions"] > r["instructions"]
    assert all(r.get("undecoded", 0) == 0 for r in results)


def test_a_design_variant_compiles_its_own_kernels(tmp_path):
    """``--variant``: the worker compiles a ``bench.ab`` variant's kernels (here a persistent grid
    of 8 programs per CU), not main's (one program per row: grid 4096)."""
    assert rocm_check.main(["--env-dir", os.path.dirname(ENV), "--tokens", "4096", "--ops",
                            "per_token_fp8_quant", "--no-programs", "--variant", "persistent8",
                            "--out", str(tmp_path)]) == 0
    with open(tmp_path / "rocm_check.json") as f:
        data = json.load(f)
    assert data["meta"]["variant"] == "persistent8"
    for r in data["results"]:
        assert r["grid"][0] == 8 * data["meta"]["devices"][r["arch"]]["core_count"], r
