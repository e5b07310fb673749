"""The benchmarks' one timer: the wall time of regions of code on one device, perf_counter on
the CPU and CUDA events on a GPU (read after one synchronisation, so that timing a region adds
none inside the run), the time of single calls and of loops of them built on it, and on a GPU
each kernel's device time a call (torch.profiler)."""

from __future__ import annotations

import statistics
import time
import timeit
from collections.abc import Callable

import torch


class Timer:
    """Marks in time on one device: ``start`` makes one, ``seconds`` reads the time between
    two; ``time`` records a call's span, ``median_ms`` reads the recorded spans."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple] = []

    @classmethod
    def on(cls, device: torch.device) -> Timer:
        return cls(device.type == "cuda")

    def start(self):
        """A mark: a recorded CUDA event on a GPU, the perf_counter on the CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin, end) -> float:
        """Seconds from mark ``begin`` to mark ``end`` (on a GPU, after a synchronisation)."""
        if self.cuda:
            torch.cuda.synchronize()
            return begin.elapsed_time(end) / 1e3
        return end - begin

    def time(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` and record its span."""
        begin = self.start()
        fn()
        self.spans.append((begin, self.start()))

    def median_ms(self) -> float:
        """The median of the recorded spans, in milliseconds."""
        return statistics.median(self.seconds(b, e) for b, e in self.spans) * 1e3


def call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``, the device synchronised before and after: its whole
    cost, host and device, alone."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timer = Timer(cuda=False)
    begin = timer.start()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return timer.seconds(begin, timer.start()) * 1e3


def best_per_call(fn: Callable[[], object], device: torch.device, number: int, repeat: int = 7):
    """Seconds per call of ``fn``: the best of ``repeat`` loops of ``number`` calls, each loop
    synchronised at its end, with the garbage collector off as timeit keeps it (for calls so
    small that the host, not the device, bounds them)."""

    def loop():
        for _ in range(number):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return min(timeit.repeat(loop, number=1, repeat=repeat)) / number


def device_kernels(call, device: torch.device, calls: int = 10) -> dict:
    """Each kernel a call launches, by name, on the GPU (torch.profiler's device activity):
    launches and microseconds of device time a call, the longest first; where the profiler
    fails, its error (the rest of the results stand)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize(device)
        rows = {
            row.key: {"launches": row.count / calls, "us": row.device_time_total / calls}
            for row in prof.key_averages()
            if row.device_time_total > 0
        }
    except Exception as error:  # a benchmark records what failed and goes on
        return {"error": f"{type(error).__name__}: {error}"}
    return dict(sorted(rows.items(), key=lambda item: -item[1]["us"]))
