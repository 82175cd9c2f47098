"""The integer FP8 encoder against XLA's / ml_dtypes' cast, exhaustively, in XLA and inside a
Pallas kernel (interpret mode here; compiled on the GPU in test_gpu.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from k3pallas import fp8 as fp8_lib

from oracle import FP8

NAMES = list(FP8)


def encoder_inputs(name, rng, n_random=100_000):
    """Every finite code's value, every midpoint between neighbours and the float32 values either
    side of each, both signs, float32 subnormals, values rounding to zero, zeros, NaN, and random
    values over the whole range and over many binades."""
    dt, fmax = FP8[name]
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    fin = np.unique(vals[np.isfinite(vals)])
    mids = ((fin[:-1].astype(np.float64) + fin[1:]) / 2).astype(np.float32)
    tiny = np.float32(np.min(fin[fin > 0]))
    parts = [fin, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
             np.nextafter(fin, np.float32(np.inf)), np.nextafter(fin, np.float32(-np.inf)),
             np.array([0.0, -0.0, tiny / 2, tiny / 4, tiny * 0.49, tiny * 0.51, tiny * 1.5,
                       1e-45, 1e-40, 1e-38, 1e-30, np.nan], np.float32),
             rng.uniform(-fmax, fmax, n_random).astype(np.float32),
             (rng.standard_normal(n_random) * np.exp2(rng.integers(-40, 16, n_random))).astype(np.float32)]
    v = np.concatenate(parts).astype(np.float32)
    v = np.concatenate([v, -v])
    return v[~(np.abs(v) > fmax)]  # the encoder's domain: |v| <= largest finite, or NaN


def expected_codes(v, name):
    return v.astype(FP8[name][0]).view(np.uint8)


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


def _encode_kernel(x_ref, o_ref, *, dtype):
    idx = jnp.arange(x_ref.shape[0])
    o_ref[idx] = fp8_lib.encode_fp8(x_ref[idx], dtype).astype(jnp.uint8)


def encode_in_pallas(v, name, interpret):
    n = len(v)
    block = 4096
    pad = (-n) % block
    x = jnp.asarray(np.concatenate([v, np.zeros(pad, np.float32)]))
    out = pl.pallas_call(
        functools.partial(_encode_kernel, dtype=jnp.dtype(name)),
        grid=(x.shape[0] // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.uint8), interpret=interpret)(x)
    return np.asarray(out)[:n]


@pytest.mark.parametrize("name", NAMES)
def test_encoder_bit_exact_in_pallas_interpret(rng, name):
    v = encoder_inputs(name, rng, n_random=2_000)
    got = encode_in_pallas(v, name, interpret=True)
    assert np.array_equal(got, expected_codes(v, name))
