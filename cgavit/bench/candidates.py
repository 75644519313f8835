"""The main throughput table: our inference paths, timm's port of the same variant, timm's peers.

Every EfficientViT variant appears as timm's ``efficientvit_msra`` port with our weights (BatchNorm
fused by timm, traced), our fused model, and our :func:`~cgavit.deploy.optimize` paths; each of ours
is checked against the port on the benchmark input. The peers are timm models with random weights.
All candidates are timed round-robin by :func:`cgavit.timing.round_robin`.
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..deploy import fuse, optimize
from ..deploy.formats import runtime_path
from ..factory import create_model, resolve_name
from ..testing import randomize_, rel_err
from ..timing import iqr, round_robin
from ..variants import VARIANTS
from ..model import stage_resolution, to_timm_state_dict
from .optional import create_timm_model, reparameterize

log = logging.getLogger(__name__)

#: Published ImageNet-1k top-1 (%) of the timm peers (timm's own evaluation of its weights in brackets where it
#: differs): MobileNetV3-Large 75.2 [timm 75.77] and MobileViT-XXS 69.0 [timm 68.91], the figures of their papers
#: that the EfficientViT paper compares with (M5 +1.9 over the one, M2 +1.8 over the other); LeViT-128S 76.5,
#: EfficientNet-B0 77.7 [timm 77.69], DeiT-Tiny 72.2.
PEERS_TOP1 = {
    "mobilenetv3_large_100": 75.2,
    "levit_128s": 76.5,
    "efficientnet_b0": 77.7,
    "mobilevit_xxs": 69.0,
    "deit_tiny_patch16_224": 72.2,
}

#: The side (px) each peer's :data:`PEERS_TOP1` figure was published at, where it is not 224: MobileViT evaluates at 256
#: (timm's ``mobilevit_xxs`` input size too).
PEERS_TOP1_SIDE = {"mobilevit_xxs": 256}

#: Peers that run only at sides that are a multiple of this: timm's LeViT sizes its attention for ``side // 16``
#: tokens, while its stem's four stride-2 convolutions leave ``ceil(side / 16)`` (72 px: 4 against 5).
PEER_SIDE_MULTIPLE = {"levit_128s": 16}

#: The autocast dtype of each ``--precision`` on a GPU, where every row of the main table (ours, the port, the peers)
#: runs under it; fp32 runs without autocast.
GPU_AUTOCAST = {"amp": torch.float16, "bf16": torch.bfloat16, "fp32": None}


@dataclass
class Result:
    """One candidate's timings; ``ips`` = images per second of each timed round."""

    name: str
    kind: str  # "ours", "timm-port" or "peer"
    variant: str  # the architecture (e.g. efficientvit_m0, levit_128s)
    top1: float | None
    ips: list[float] = field(default_factory=list)
    rel_err_vs_timm: float | None = None
    ratio_to_timm: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.ips)

    @property
    def iqr(self) -> tuple[float, float]:
        return iqr(self.ips)


@dataclass
class Candidate:
    """One timed inference path: ``fn`` maps an image batch to logits."""

    name: str
    kind: str
    variant: str
    top1: float | None
    fn: Callable[[torch.Tensor], torch.Tensor]
    rel_err_vs_timm: float | None = None


def port_build_size(img_size: tuple[int, int]) -> int:
    """The size to build timm's port at so that its windows are ours at ``img_size``: both follow the shorter side's
    patch grid, ours rounded up (the stem's padded convolutions), timm's rounded down (``img_size // 16``), so the
    port is built at that grid's multiple of 16 (at 100 px, 112: a 7x7 grid, 7x7 windows)."""
    return 16 * stage_resolution(min(img_size), 0)


def timm_port(model: nn.Module, name: str, img_size: tuple[int, int]) -> nn.Module:
    """timm's ``efficientvit_msra`` model with ``model``'s weights, BatchNorm fused by timm itself; ``name`` as
    :func:`cgavit.create_model` takes it (``m4`` too)."""
    port = create_timm_model(resolve_name(name), img_size=port_build_size(img_size))
    port.load_state_dict(to_timm_state_dict(model.state_dict()))
    return reparameterize(port)


def table_autocast(device: torch.device, precision: str) -> torch.autocast:
    """The ``torch.autocast`` the main table's rows run under: on a GPU, ``precision``'s (:data:`GPU_AUTOCAST`); on
    the CPU none (our ``optimize()`` rows hold their own precision, the baselines run fp32)."""
    dtype = GPU_AUTOCAST[precision] if device.type == "cuda" else None
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def trace(module: nn.Module, x: torch.Tensor) -> nn.Module:
    """``torch.jit.trace(module, x)`` without autograd and without the tracer's warnings, called twice more: the
    TorchScript executor profiles the first call and optimises on the second, a one-off cost (several times a
    call) that is the trace's to pay, not the first timed round's (with ``--warmup 0`` it was)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(module, x)
        for _ in range(2):
            traced(x)
        return traced


def peer_model(name: str, img_size: tuple[int, int]) -> nn.Module:
    """A timm peer with random weights in its inference form; ValueError for a name not in :data:`PEERS_TOP1`."""
    if name not in PEERS_TOP1:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS_TOP1)} or 'none'")
    kwargs = {"img_size": img_size} if name.startswith(("deit", "levit")) else {}  # the others are size-agnostic
    return reparameterize(create_timm_model(name, **kwargs))


def variant_candidates(
    name: str, x: torch.Tensor, precision: str, device: torch.device, compile: bool = True,
    runtimes: tuple[str, ...] = (),
) -> list[Candidate]:
    """timm's traced port of variant ``name``, then our paths of it, each checked against the port.

    On the CPU ours are the fused model, ``optimize`` (torch) and, for fp32, one row per runtime in
    ``runtimes`` (``"onnxruntime"``, ``"openvino"``: ``optimize``'s backends; ``"executorch"``,
    ``"tflite"``: the exported program); on a GPU the fused model eager and traced, checked under ``precision``'s
    autocast (:func:`table_autocast`).
    """
    top1 = VARIANTS[name].top1
    size = tuple(x.shape[2:])
    model = randomize_(create_model(name, img_size=size), seed=0).eval()
    port = timm_port(model, name, size).to(device)
    model.to(device)
    fused = fuse(model)
    ours = {f"cgavit {name} fuse": fused}
    if device.type == "cpu":
        label = f"cgavit {name} optimize {precision} torch{'.compile' if compile else ' eager'}"
        ours[label] = optimize(model, x, precision=precision, backend="torch", compile=compile)
        for runtime in runtimes if precision == "fp32" else ():
            ours.update(runtime_row(name, model, x, runtime))
    else:
        ours[f"cgavit {name} fuse, traced"] = trace(fused, x)
    with torch.no_grad():
        log.info("%s: fused vs timm port relative error %.1e", name, rel_err(fused(x), port(x)))
        with table_autocast(device, precision):
            errors = {label: rel_err(fn(x), port(x)) for label, fn in ours.items()}
    cands = [Candidate(f"timm {name} (fused, traced)", "timm-port", name, top1, trace(port, x))]
    cands += [Candidate(label, "ours", name, top1, fn, errors[label]) for label, fn in ours.items()]
    return cands


def runtime_row(name: str, model: nn.Module, x: torch.Tensor, runtime: str) -> dict[str, nn.Module]:
    """The main table's fp32 row of ``runtime`` for variant ``name``: ``{label: module}``."""
    if runtime in ("onnxruntime", "openvino"):
        return {f"cgavit {name} optimize fp32 {runtime}": optimize(model, x, precision="fp32", backend=runtime)}
    fmt = {"executorch": "executorch", "tflite": "tflite"}[runtime]
    return {f"cgavit {name} fp32 {fmt}": runtime_path(fuse(model), x, fmt)}


def build_candidates(
    models: list[str],
    peers: list[str],
    x: torch.Tensor,
    precision: str,
    device: torch.device,
    compile: bool = True,
    onnx: bool = False,
    runtimes: tuple[str, ...] = (),
) -> list[Candidate]:
    """Every variant's candidates (:func:`variant_candidates`), then the traced peers.

    ``onnx`` adds ONNX Runtime to ``runtimes`` (the ``--no-onnx`` flag's field).
    """
    runtimes = tuple(dict.fromkeys((("onnxruntime",) if onnx else ()) + tuple(runtimes)))
    cands = [c for name in models for c in variant_candidates(name, x, precision, device, compile, runtimes)]
    for peer in peers:
        net = peer_model(peer, tuple(x.shape[2:])).to(device)
        cands.append(Candidate(f"timm {peer} (traced)", "peer", peer, PEERS_TOP1[peer], trace(net, x)))
    return cands


def time_candidates(
    cands: list[Candidate], x: torch.Tensor, warmup: int, repeats: int, device: torch.device, precision: str
) -> list[Result]:
    """Time the candidates round-robin on ``x`` (on a GPU under ``precision``'s autocast, :func:`table_autocast`);
    each row's ratio to its variant's port."""
    calls = {c.name: partial(c.fn, x) for c in cands}
    if len(calls) != len(cands):
        raise ValueError("candidate names must be distinct (a model or peer given twice?)")
    with torch.no_grad(), table_autocast(device, precision):
        timings = round_robin(calls, warmup, repeats, device=device, progress=True)
    results = [Result(c.name, c.kind, c.variant, c.top1, timings[c.name].per_second(x.shape[0]), c.rel_err_vs_timm)
               for c in cands]
    ports = {r.variant: r.median for r in results if r.kind == "timm-port"}
    for r in results:
        if r.variant in ports:
            r.ratio_to_timm = r.median / ports[r.variant]
    return results
