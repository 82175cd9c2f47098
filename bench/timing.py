"""Device-side timing from a ``jax.profiler`` trace, and CPU wall-clock timing.

GPU: the jitted function runs ``n_calls`` times inside ``jax.profiler.trace``; the trace is read
back with ``jax.profiler.ProfileData``. Planes named ``/device:GPU:N`` hold one line per stream,
each event one kernel launch or memcpy. Calls are issued back to back and the events come out in
launch order, so with ``k`` events per call, call ``i`` is events ``[i*k, (i+1)*k)``. Its device
time is the sum of their durations (launch gaps excluded).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import tempfile
import time
from typing import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    line: str
    name: str
    start_ns: float
    duration_ns: float
    plane: str = "/device:GPU:0"


@dataclasses.dataclass(frozen=True)
class Timing:
    median_us: float  # median over calls of the summed device (or wall-clock) time of a call
    min_us: float
    kernels_per_call: int  # device events per call; 0 for wall-clock timings
    calls: int
    kernel_names: tuple[str, ...]
    clock: str  # "device" or "wall"


# Lines of a GPU plane that aggregate the per-stream events (counting them again would double).
_AGGREGATE_LINES = ("XLA Modules", "XLA Ops", "Steps", "Source", "TraceMe", "Launch Stats")


def device_events(planes) -> list[DeviceEvent]:
    """Kernel and memcpy events of every GPU plane, in start order.

    ``planes``: the ``planes`` of a ``jax.profiler.ProfileData``, or any objects with ``name``
    and ``lines`` (each with ``name`` and ``events`` having ``name``, ``start_ns``,
    ``duration_ns``): the unit tests feed recorded and synthetic ones.
    """
    events = []
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        if not streams:
            streams = [ln for ln in lines if not ln.name.startswith(_AGGREGATE_LINES)]
        for line in streams:
            for ev in line.events:
                events.append(DeviceEvent(line.name, ev.name, float(ev.start_ns),
                                          float(ev.duration_ns), plane.name))
    events.sort(key=lambda e: e.start_ns)
    return events


def per_call_times(events: Sequence[DeviceEvent], n_calls: int) -> tuple[list[float], int]:
    """Split ``events`` of ``n_calls`` identical calls into calls; returns (ns per call, k)."""
    if n_calls <= 0 or not events or len(events) % n_calls:
        raise ValueError(f"{len(events)} device events do not split into {n_calls} equal calls; "
                         "was something else running on the GPU?")
    k = len(events) // n_calls
    names = [e.name for e in events[:k]]
    for i in range(1, n_calls):
        if [e.name for e in events[i * k:(i + 1) * k]] != names:
            raise ValueError(f"call {i} launched other kernels than call 0: the trace is mixed")
    return [sum(e.duration_ns for e in events[i * k:(i + 1) * k]) for i in range(n_calls)], k


def _block(out):
    jax.block_until_ready(out)


def traced_events(fn: Callable, input_sets: Sequence[tuple], n_calls: int,
                  warmup: int, sync: Callable = _block) -> list[DeviceEvent]:
    """Warm up, then run ``fn`` ``n_calls`` times inside a profiler trace; its device events.
    ``sync(out)`` waits for a call's result (another framework's kernels, e.g. torch's, are
    traced too when ``sync`` waits for them)."""
    for i in range(max(warmup, len(input_sets))):
        sync(fn(*input_sets[i % len(input_sets)]))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(n_calls):
                out = fn(*input_sets[i % len(input_sets)])
            sync(out)
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError("jax.profiler.trace wrote no .xplane.pb file")
        return device_events(jax.profiler.ProfileData.from_file(paths[0]).planes)


def time_device(fn: Callable, input_sets: Sequence[tuple], n_calls: int = 30,
                warmup: int = 3) -> Timing:
    """Device time of ``fn(*inputs)``, cycling through ``input_sets`` (cache rotation)."""
    events = traced_events(fn, input_sets, n_calls, warmup)
    times, k = per_call_times(events, n_calls)
    return Timing(statistics.median(times) / 1e3, min(times) / 1e3, k, n_calls,
                  tuple(e.name for e in events[:k]), "device")


def two_rounds(runs: dict, n_calls: int = 30) -> dict:
    """Median device time of each ``name: (fn, input_sets)`` of ``runs``, timed in two rounds,
    the second in the opposite order (a drift of clock or cache state over the run then weighs
    on every entry alike): ``{name_a, name_b, name: their mean}`` in us."""
    names = list(runs)
    row = {}
    for rnd, order in (("a", names), ("b", names[::-1])):
        for name in order:
            fn, sets = runs[name]
            row[f"{name}_{rnd}"] = time_device(fn, sets, n_calls=n_calls).median_us
    for name in names:
        row[name] = (row[f"{name}_a"] + row[f"{name}_b"]) / 2
    return row


def time_device_multi(fn: Callable, input_sets: Sequence[tuple], n_calls: int = 20,
                      warmup: int = 3) -> dict:
    """Device time per call on each GPU of a multi-GPU (sharded) call.

    Returns ``{"median_us": median over calls of the slowest GPU's summed kernel time,
    "per_gpu_us": {plane: median}, "kernels_per_call": {plane: k}}``.
    """
    events = traced_events(fn, input_sets, n_calls, warmup)
    by_plane = {}
    for e in events:
        by_plane.setdefault(e.plane, []).append(e)
    per_gpu, kernels, calls = {}, {}, []
    for plane, evs in sorted(by_plane.items()):
        times, k = per_call_times(evs, n_calls)
        per_gpu[plane], kernels[plane] = statistics.median(times) / 1e3, k
        calls.append(times)
    slowest = [max(c[i] for c in calls) for i in range(n_calls)]
    return {"median_us": statistics.median(slowest) / 1e3, "per_gpu_us": per_gpu,
            "kernels_per_call": kernels}


def time_wall(fn: Callable, input_sets: Sequence[tuple], n_calls: int = 10,
              warmup: int = 2) -> Timing:
    """Wall-clock time per call (dispatch included): what a CPU-only machine can report."""
    for i in range(max(warmup, 1)):
        _block(fn(*input_sets[i % len(input_sets)]))
    times = []
    for i in range(n_calls):
        t0 = time.perf_counter()
        _block(fn(*input_sets[i % len(input_sets)]))
        times.append((time.perf_counter() - t0) * 1e6)
    return Timing(statistics.median(times), min(times), 0, n_calls, (), "wall")
