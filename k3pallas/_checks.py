"""Checks of static options shared by the public API and the format values."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

# The floating dtypes activations and weights may have (math is float32 inside).
FLOAT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


# The range of a positive option that the kernels use in float32: from the smallest normal
# (a smaller value becomes 0 or a subnormal that GPUs flush to 0) to the largest finite value.
F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 2**-126, about 1.18e-38
F32_MAX = float(jnp.finfo(jnp.float32).max)


def static_positive_float(name: str, value, low: float = F32_TINY, high: float = F32_MAX) -> float:
    """``value`` as a float if it is a static real in ``[low, high]`` (default: a positive
    normal float32); else TypeError (not a static real) / ValueError (out of range)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or isinstance(value, jax.Array)):
        raise TypeError(f"{name} must be a Python float (a static option), got "
                        f"{type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is outside [{low:.6g}, {high:.6g}], the range it is "
                         "computed in (float32: smaller values become 0, larger ones overflow)")
    return value


def static_int(name: str, value, minimum: int) -> int:
    """A static integer option (any ``numbers.Integral``, not bool): TypeError for an array or a
    traced value, ValueError for anything else (0, False, 2.0, ...)."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{name} must be a Python int (a static option), got {type(value).__name__}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (a static option), got {value!r}")
    return int(value)
