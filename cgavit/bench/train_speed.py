"""Training speed: forward+backward steps of our model and timm's port with the same weights,
timed round-robin by :func:`cgavit.timing.round_robin`."""

from __future__ import annotations

from functools import partial
from typing import TypedDict

import torch
from torch import nn

from ..factory import create_model
from ..timing import round_robin
from ..model import to_timm_state_dict
from .candidates import port_build_size
from .optional import create_timm_model


class TrainingRow(TypedDict):
    """One variant's training throughput (images/s) here and in timm's port."""

    model: str
    batch: int
    warmup: int  # untimed rounds first
    repeats: int  # timed rounds
    cgavit_ips: float  # median over the timed rounds
    timm_ips: float
    ratio: float  # cgavit_ips / timm_ips
    cgavit_all: list[float]  # every round
    timm_all: list[float]


def train_step(net: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    """One forward+backward pass of cross-entropy (gradients only: no optimiser step)."""
    net.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(net(x), target).backward()


def train_throughput(
    models: list[str], batch: int, img_size: tuple[int, int], warmup: int, repeats: int
) -> list[TrainingRow]:
    """Forward+backward images/s of our model and timm's port (same weights), on the CPU, interleaved."""
    rows: list[TrainingRow] = []
    x = torch.randn(batch, 3, *img_size)
    target = torch.randint(0, 1000, (batch,))
    for name in models:
        ours = create_model(name, img_size=img_size).train()
        theirs = create_timm_model(name, img_size=port_build_size(img_size)).train()  # the same windows as ours
        theirs.load_state_dict(to_timm_state_dict(ours.state_dict()))
        calls = {"cgavit": partial(train_step, ours, x, target), "timm": partial(train_step, theirs, x, target)}
        timings = round_robin(calls, warmup, repeats)
        ips = {k: t.per_second(batch) for k, t in timings.items()}
        med = {k: t.median_rate(batch) for k, t in timings.items()}
        rows.append(TrainingRow(model=name, batch=batch, warmup=warmup, repeats=repeats, cgavit_ips=med["cgavit"], timm_ips=med["timm"],
                                ratio=med["cgavit"] / med["timm"], cgavit_all=ips["cgavit"], timm_all=ips["timm"]))
    return rows
