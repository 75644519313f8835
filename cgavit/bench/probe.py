"""The precision check: fp32, bf16 and int8 inference paths compared on real images.

No pretrained weights exist offline, so each model has random weights and random BatchNorm affine
parameters; :func:`recalibrate_batchnorm` gives it BatchNorm statistics from real images, and with
CIFAR-10 :func:`fit_linear_probe` gives it a head whose decisions depend on the image. Throughput is
timed round-robin (:func:`cgavit.timing.round_robin`); agreement is the share of images whose top-1
class equals the plain fused fp32 model's.
"""

from __future__ import annotations

from functools import partial
from typing import TypedDict

import torch
from torch import nn

from ..deploy import fuse, optimize
from ..factory import create_model
from ..testing import randomize_, rel_err
from ..timing import round_robin
from .optional import fit_logistic_regression

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class PrecisionRow(TypedDict):
    """One inference path of one model on one image set."""

    model: str
    path: str  # e.g. "bf16 torch.compile", "int8 ONNX Runtime (static)"
    images: str  # "photos" or "cifar"
    n: int  # images
    img_s: float  # median images/s over the timed rounds
    ratio_to_fp32: float  # throughput ratio to the first path
    top1_agreement: float  # share of images with the fp32 model's top-1 class
    rel_err: float  # ||logits - fp32 logits|| / ||fp32 logits||
    fp32_distinct_classes: int  # distinct fp32 top-1 classes among the images
    accuracy: float | None  # against the labels (CIFAR-10 test images), else None


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, images: torch.Tensor, batch: int = 32) -> nn.Module:
    """Set every BatchNorm's running statistics to their average over ``images`` (train-mode passes).

    A random-weight network with arbitrary statistics collapses every input to nearly the same
    features; with statistics from real images its features vary with the image at unit scale.
    """
    norms = [m for m in model.modules() if isinstance(m, _BATCHNORMS)]
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the passes
    model.train()
    for b in images.split(batch):
        model(b)
    for m, mom in zip(norms, saved):
        m.momentum = mom
    return model.eval()


def fit_linear_probe(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 32) -> nn.Module:
    """Give ``model`` a head fitted (logistic regression) on its own pooled features, one class per label.

    Without pretrained weights this turns a random-weight network into a real, if weak, classifier,
    so that top-1 agreement between precisions is measured on image-dependent decisions.
    """
    model.reset_classifier(int(labels.max()) + 1)
    model.eval()
    with torch.no_grad():
        feats = torch.cat([model.forward_head(model.forward_features(b), pre_logits=True) for b in images.split(batch)])
    mu, sd = feats.mean(0), feats.std(0)
    sd = sd.clamp_min(0.1 * float(sd.mean()))  # near-constant features would get huge, ill-conditioned weights
    coef, intercept = fit_logistic_regression(((feats - mu) / sd).numpy(), labels.numpy(), C=0.1, max_iter=2000)
    with torch.no_grad():
        bn, lin = model.head.bn, model.head.linear
        bn.running_mean.copy_(mu)
        bn.running_var.copy_(sd**2 - bn.eps)
        bn.weight.fill_(1.0)
        bn.bias.zero_()
        lin.weight.copy_(torch.as_tensor(coef, dtype=torch.float32))
        lin.bias.copy_(torch.as_tensor(intercept, dtype=torch.float32))
    return model


def precision_paths(
    model: nn.Module, x: torch.Tensor, calibration: torch.Tensor, batch: int, compile: bool = True
) -> dict[str, nn.Module]:
    """fp32 torch, fp32 ONNX Runtime, bf16 torch and int8 ONNX Runtime forms of ``model``, built on ``x``.

    int8 is calibrated on 64 random images of ``calibration`` in batches of ``batch``. Built without
    ``optimize``'s check: a probe head amplifies rounding, and the error is reported instead.
    """
    torch_kind = "torch" + (".compile" if compile else " eager")
    paths = {
        f"fp32 {torch_kind}": optimize(model, x, "fp32", backend="torch", compile=compile, check=False),
        "fp32 ONNX Runtime": optimize(model, x, "fp32", backend="onnxruntime", check=False),
        f"bf16 {torch_kind}": optimize(model, x, "bf16", backend="torch", compile=compile, check=False),
    }
    # drawn after the exports above (they use the global RNG too), as before
    calib = calibration[torch.randperm(len(calibration))[:64]].split(batch)
    paths["int8 ONNX Runtime (static)"] = optimize(model, x, "int8", calibration=calib, check=False)
    return paths


def probe_model(name: str, size: tuple[int, int], images: dict[str, torch.Tensor]) -> nn.Module:
    """Variant ``name`` with random weights, BatchNorm statistics from real images and, with CIFAR-10
    train images in ``images``, a linear-probe head."""
    model = randomize_(create_model(name, img_size=size), seed=0)
    recalibrate_batchnorm(model, images.get("train", images["photos"]))
    if "train" in images:
        fit_linear_probe(model, images["train"], images["train_labels"])
    return model


@torch.no_grad()
def agreement_rows(
    name: str, paths: dict[str, nn.Module], reference: nn.Module, images: dict[str, torch.Tensor],
    rates: dict[str, float], batch: int,
) -> list[PrecisionRow]:
    """Each path's top-1 agreement, error and accuracy against ``reference`` on each image set."""
    rows: list[PrecisionRow] = []
    first = next(iter(paths))
    for set_name in ("photos", "cifar"):
        if set_name not in images:
            continue
        imgs = images[set_name]
        labels = images.get(f"{set_name}_labels")
        ref = torch.cat([reference(b) for b in imgs.split(batch)])
        for path, fn in paths.items():
            out = torch.cat([fn(b) for b in imgs.split(batch)])
            rows.append(PrecisionRow(
                model=name, path=path, images=set_name, n=len(imgs), img_s=rates[path],
                ratio_to_fp32=rates[path] / rates[first],
                top1_agreement=float((out.argmax(1) == ref.argmax(1)).float().mean()),
                rel_err=rel_err(out, ref),
                fp32_distinct_classes=int(ref.argmax(1).unique().numel()),
                accuracy=None if labels is None else float((out.argmax(1) == labels).float().mean()),
            ))
    return rows


def precision_report(
    models: list[str], size: tuple[int, int], batch: int, images: dict[str, torch.Tensor],
    repeats: int, warmup: int, compile: bool = True,
) -> list[PrecisionRow]:
    """fp32 vs bf16 vs int8 paths: throughput (same run, round-robin) and top-1 agreement with fp32.

    ``images`` as :func:`~cgavit.bench.photos.sample_photos` returns them. BatchNorm statistics come
    from the CIFAR-10 train images (the photos without them); with CIFAR-10 each model also gets a
    linear-probe head and its test accuracy is reported per path.
    """
    rows: list[PrecisionRow] = []
    pool = images.get("train", images["photos"])
    x = pool[torch.arange(batch) % len(pool)]  # real images as the example input (compile, check, timing)
    for name in models:
        model = probe_model(name, size, images)
        reference = fuse(model)  # plain fp32 eager: the decisions every path is compared with
        paths = precision_paths(model, x, pool, batch, compile)
        with torch.no_grad():
            timings = round_robin({k: partial(fn, x) for k, fn in paths.items()}, warmup, repeats)
        rates = {k: t.median_rate(batch) for k, t in timings.items()}
        rows += agreement_rows(name, paths, reference, images, rates, batch)
    return rows
