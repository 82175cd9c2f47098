"""Checks shared by the public API and the FP8 option resolution."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

# The floating dtypes activations and weights may have (math is float32 inside).
FLOAT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def static_positive_float(name: str, value) -> float:
    """``value`` as a float if it is a static, finite, positive real; else TypeError / ValueError."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or isinstance(value, jax.Array)):
        raise TypeError(f"{name} must be a Python float (a static option), got "
                        f"{type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value
