"""The ROCm compile gate's parsing and gate logic (the compile itself runs in CI with the
rocm-check extra: ``python -m bench.rocm_check --check``); and the Triton IR it compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import k3pallas as kp
from bench import rocm_check
from k3pallas import _compat

AMDGCN = """
\t.amdhsa_kernel k
\ts_load_dwordx4 s[0:3], s[0:1], 0x0
\tv_cvt_pk_fp8_f32 v1, v2, v3
\tglobal_store_short v0, v1, s[2:3]
.LBB0_1:
\ts_endpgm
; Occupancy: 5
    .agpr_count:     0
    .private_segment_fixed_size: 0
    .sgpr_count:     30
    .sgpr_spill_count: 0
    .vgpr_count:     59
    .vgpr_spill_count: 2
"""


def test_resources_parser():
    r = rocm_check._resources(AMDGCN)
    assert (r["vgpr"], r["sgpr"], r["agpr"], r["vgpr_spill"], r["sgpr_spill"], r["scratch"],
            r["occupancy"], r["instructions"]) == (59, 30, 0, 2, 0, 0, 5, 4)
    assert r["fp8_cvt"] == ["v_cvt_pk_fp8_f32"]


def test_gate():
    base = {"arch": "gfx942", "op": "fused_q_kv_rmsnorm", "vgpr_spill": 0, "sgpr_spill": 0,
            "scratch": 0, "occupancy": 8}
    assert rocm_check.problems(base) == []
    assert rocm_check.problems({**base, "vgpr_spill": 3})
    assert rocm_check.problems({**base, "scratch": 16})
    assert rocm_check.problems({**base, "occupancy": rocm_check.MIN_OCCUPANCY - 1})
    assert rocm_check.problems({**base, "error": "boom"})
    # A native-cast baseline the arch lacks is a finding, not a failure.
    assert rocm_check.problems({**base, "op": "native cast (Triton)", "error": "x"}) == []


@pytest.mark.parametrize("arch", rocm_check.ARCHS)
def test_triton_ir_extracted_for_rocm(arch):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 1536), (4096, 512), (1536,), (512,))]
    lowered = _compat.lower_for(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"), args, arch, "rocm")
    (mod,) = _compat.triton_ir_modules(lowered)
    assert mod["name"] == "k3pallas_fused_q_kv_rmsnorm" and mod["grid"][0] >= 1
    assert "tt.func public @k3pallas_fused_q_kv_rmsnorm" in mod["ir"]
    assert "tt.load" in mod["ir"] and "tt.store" in mod["ir"]


def test_64bit_offsets_for_huge_arrays():
    """2**21 rows of 2048 bf16 (8 GiB): the IR indexes with i64; 4096 rows: i32 only."""
    def ir_for(t):
        args = [jax.ShapeDtypeStruct((t, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16)]
        lowered = _compat.lower_for(lambda *a: kp.rmsnorm(*a, impl="pallas"), args, "gfx942", "rocm")
        return _compat.triton_ir_modules(lowered)[0]["ir"]

    assert "xi64>" in ir_for(2**21)
    assert "xi64>" not in ir_for(4096)
