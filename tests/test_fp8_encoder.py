"""The integer FP8 encoder against XLA's / ml_dtypes' cast, exhaustively, in XLA and inside a
Pallas kernel (interpret mode here; compiled on the GPU in test_gpu_kernels.py)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3pallas import fp8 as fp8_lib

from support import FP8, encode_in_pallas, encoder_inputs, expected_codes

NAMES = list(FP8)





@pytest.mark.parametrize("name", NAMES)
def test_encoder_bit_exact_in_xla(rng, name):
    v = encoder_inputs(name, rng)
    got = np.asarray(jax.jit(lambda a: fp8_lib.encode_fp8(a, jnp.dtype(name)))(v)).astype(np.uint8)
    want = expected_codes(v, name)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:8]]


def test_every_code_round_trips():
    """Decoding all 256 codes and encoding again gives the code back (NaN codes: the format's
    NaN; fnuz has one code for zero)."""
    for name in NAMES:
        dt = FP8[name][0]
        vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
        finite = np.isfinite(vals)
        got = np.asarray(fp8_lib.encode_fp8(jnp.asarray(vals[finite]), jnp.dtype(name))).astype(np.uint8)
        assert np.array_equal(got, np.arange(256, dtype=np.uint8)[finite]), name


@pytest.mark.parametrize("name", NAMES)
def test_encoder_bit_exact_in_pallas_interpret(rng, name):
    v = encoder_inputs(name, rng, n_random=2_000)
    got = encode_in_pallas(v, name, interpret=True)
    assert np.array_equal(got, expected_codes(v, name))
