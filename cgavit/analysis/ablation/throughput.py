"""CPU throughput of the rungs, measured together: fused, traced, one thread, round-robin."""

from __future__ import annotations

import warnings

import torch

from ...deploy import fuse
from ...timing import round_robin, time_call


@torch.no_grad()
def measure_throughput(models: dict[str, torch.nn.Module], img_size: int, batch: int = 16, rounds: int = 5, seconds: float = 1.0) -> dict[str, dict]:
    """CPU images/s of each model, fused (BatchNorm folded) and traced, one thread, fp32.

    The models are timed round-robin (:func:`cgavit.timing.round_robin`): each round runs every
    model for about ``seconds`` in turn, ``rounds`` rounds, so load from other processes hits all
    of them alike; the median round is reported with the spread.

    Returns:
        ``{name: {"img_s" (median), "min", "max", "rounds", "batch"}}``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch, 3, img_size, img_size)
        calls, images = {}, {}
        for name, m in models.items():
            traced = _traced(m, x)
            one = [time_call(lambda: traced(x)) for _ in range(3)][-1]  # the first calls warm up
            repeats = max(1, round(seconds / max(one, 1e-9)))
            calls[name] = _repeated(traced, x, repeats)
            images[name] = repeats * batch
        timings = round_robin(calls, warmup=0, repeats=rounds)
    finally:
        torch.set_num_threads(threads)
    out = {}
    for name, t in timings.items():
        rates = t.per_second(images[name])
        out[name] = dict(img_s=t.median_rate(images[name]), min=min(rates), max=max(rates), rounds=rounds, batch=batch)
    return out


def _traced(model: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():  # tracer notes on shape checks: shapes are fixed here
        warnings.simplefilter("ignore")
        return torch.jit.trace(fuse(model.eval()), x, check_trace=False)


def _repeated(fn, x: torch.Tensor, repeats: int):
    def call() -> None:
        for _ in range(repeats):
            fn(x)

    return call
