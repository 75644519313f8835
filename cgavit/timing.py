"""One timing harness for every speed comparison in the package.

Candidates are timed *round-robin*: after a warm-up, each timed round calls every candidate once, in
turn, so that load from other processes, thermal drift and frequency changes hit all of them alike.
Comparisons are then ratios of medians from the same run. Used by ``cgavit bench`` (inference table,
precision check, training comparison) and by the ablation study's throughput column.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass
class Timings:
    """Seconds per call of one candidate over the timed rounds."""

    seconds: list[float]

    def per_second(self, items: int) -> list[float]:
        """Throughput of each round, for ``items`` items (e.g. images) per call."""
        return [items / s for s in self.seconds]

    def median_rate(self, items: int) -> float:
        """Median throughput over the rounds."""
        return statistics.median(self.per_second(items))

    def iqr_rate(self, items: int) -> tuple[float, float]:
        """25th and 75th percentile of the throughput."""
        return iqr(self.per_second(items))


def iqr(values: list[float]) -> tuple[float, float]:
    """25th and 75th percentile (both the value itself for one value)."""
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], q[2])


def time_call(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Seconds one call of ``fn`` takes; on a CUDA device measured with events after a synchronise."""
    if device is not None and torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def other_load(own_threads: int) -> float | None:
    """Cores' worth of work besides this process's ``own_threads`` that the 1-minute load average shows now
    (0 on a quiet machine; None where the platform has no load average). Round-robin timing spreads steady
    load over every candidate, but not load that comes and goes: above about half a core the ranking of close
    candidates may not be this machine's (BENCHMARKS.md: a 64 px ``cgavit quantize`` run beside another chose
    ONNX Runtime over an OpenVINO build that, timed alone, was the faster)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return max(0.0, load - own_threads)


def round_robin(
    calls: Mapping[str, Callable[[], object]],
    warmup: int = 10,
    repeats: int = 30,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, Timings]:
    """Warm every call up ``warmup`` times, then time ``repeats`` rounds of one call each, in turn.

    Args:
        calls: name -> zero-argument callable (bind the input with a lambda or ``functools.partial``).
        warmup: untimed calls per candidate before timing.
        repeats: timed rounds.
        device: CUDA device for event timing; CPU wall-clock otherwise.
        progress: show tqdm bars.

    Returns:
        name -> :class:`Timings`, in the order of ``calls``.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    names = list(calls)
    out = {n: Timings([]) for n in names}
    bar = progress_bar if progress else (lambda items, desc: items)  # on a terminal only: not in logs
    for n in bar(names, "warm-up"):
        for _ in range(warmup):
            calls[n]()
    for _ in bar(range(repeats), "timed rounds"):
        for n in names:
            out[n].seconds.append(time_call(calls[n], device))
    return out


def progress_bar(items, desc: str, only_on_a_terminal: bool = True):
    """``items``, iterated under a tqdm bar (on stderr) labelled ``desc``: with ``only_on_a_terminal`` only where
    stderr is a terminal (not in logs or CI); plain ``items`` without tqdm (an optional dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, disable=None if only_on_a_terminal else False)
