"""The kernels' tooling hooks, and the key that keeps traces made under them apart.

Tooling (tests, the tuning sweep, the benchmark, the ROCm gate) steers what the kernels trace with
three context managers; nothing at run time sets them:

* ``forced(config)``: every launch traced inside uses that ``LaunchConfig``;
* ``recording()``: yields a list collecting a ``launch.Launch`` per launch config chosen inside;
* ``wrapping(fn)``: every launch goes through ``fn(RowCall) -> RowCall`` first
  (``k3pallas.testing.poisoned_outputs``).

jax caches the trace of a function per argument shapes, so whatever caches a traced kernel entry
keys it on ``trace_key()`` too (``k3pallas.ops.call``).
"""

from __future__ import annotations

import contextlib
import contextvars

_FORCED = contextvars.ContextVar("k3pallas_forced_launch", default=None)
_RECORDING = contextvars.ContextVar("k3pallas_launch_recording", default=None)
_WRAP = contextvars.ContextVar("k3pallas_row_call_wrapper", default=None)


@contextlib.contextmanager
def _setting(var, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def forced(config):
    """Every launch traced inside uses ``config`` (the tuning sweep, the gate's broken kernel)."""
    return _setting(_FORCED, config)


class _Log(list):
    """A list hashed by identity (it is part of ``trace_key``)."""

    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other


def recording():
    """Yields a list that collects a ``launch.Launch`` for every launch config chosen inside."""
    return _setting(_RECORDING, _Log())


def wrapping(fn):
    """Every launch traced inside goes through ``fn(RowCall) -> RowCall`` first."""
    return _setting(_WRAP, fn)


def forced_config():
    return _FORCED.get()


def record(launch) -> None:
    log = _RECORDING.get()
    if log is not None:
        log.append(launch)


def wrapper():
    return _WRAP.get()


def trace_key() -> tuple:
    """What decides the kernels an entry traces besides its arrays' shapes and its options (the
    target among them): the hooks. The hook objects themselves (hashed by identity), not their
    ids: a key keeps them alive, so an id cannot be reused by a later hook while a trace is
    cached under it."""
    return (_FORCED.get(), _RECORDING.get(), _WRAP.get())
