"""The precision check without a checkpoint: random-weight probe models on real photographs.

Each model has random weights and random BatchNorm affine parameters; :func:`recalibrate_batchnorm`
gives it BatchNorm statistics from real images, and with CIFAR-10 :func:`fit_linear_probe` gives it
a head whose decisions depend on the image. The paths, timing and rows are those of
:mod:`cgavit.bench.precision`. Such models have near-uniform, ill-conditioned logits: their agreement
figures are a harsh test, not evidence about trained weights (``--checkpoint``/``--data`` is).
"""

from __future__ import annotations

import torch
from torch import nn

from ..deploy import fuse
from ..deploy.fusion import BATCHNORMS
from ..factory import create_model
from ..testing import randomize_
from .optional import fit_logistic_regression
from .precision import PrecisionRow, inference_paths, precision_rows, time_paths


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, images: torch.Tensor, batch: int = 32) -> nn.Module:
    """Set every BatchNorm's running statistics to their average over ``images`` (train-mode passes).

    A random-weight network with arbitrary statistics collapses every input to nearly the same
    features; with statistics from real images its features vary with the image at unit scale.
    """
    norms = [m for m in model.modules() if isinstance(m, BATCHNORMS)]
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


def probe_model(name: str, size: tuple[int, int], images: dict[str, torch.Tensor]) -> nn.Module:
    """Variant ``name`` with random weights, BatchNorm statistics from real images and, with CIFAR-10
    train images in ``images``, a linear-probe head."""
    model = randomize_(create_model(name, img_size=size), seed=0)
    recalibrate_batchnorm(model, images.get("train", images["photos"]))
    if "train" in images:
        fit_linear_probe(model, images["train"], images["train_labels"])
    return model


def precision_report(
    models: list[str], size: tuple[int, int], batch: int, images: dict[str, torch.Tensor],
    repeats: int, warmup: int, compile: bool = True, runtimes: tuple[str, ...] = ("onnxruntime",),
) -> list[PrecisionRow]:
    """Random-weight probe models (no checkpoint): every path's throughput (same run, round-robin) and
    top-1 agreement with fp32 on the sample photos and, with CIFAR-10, its test images.

    ``images`` as :func:`~cgavit.bench.photos.sample_photos` returns them. BatchNorm statistics come
    from the CIFAR-10 train images (the photos without them); with CIFAR-10 each model also gets a
    linear-probe head, its test accuracy is reported per path, and int8 is calibrated on 64 of the
    train images. Agreement on such models is a harsh test, not what a trained model shows: use
    :func:`~cgavit.bench.precision.checkpoint_precision` for that.
    """
    rows: list[PrecisionRow] = []
    pool = images.get("train", images["photos"])
    x = pool[torch.arange(batch) % len(pool)]  # real images as the example input (compile, timing)
    calib = pool[torch.randperm(len(pool))[:64]]
    for name in models:
        model = probe_model(name, size, images)
        paths = inference_paths(model, x, list(calib.split(batch)), runtimes, compile)
        rates = time_paths(paths, x, warmup, repeats)
        for set_name in ("photos", "cifar"):
            if set_name in images:
                rows += precision_rows(name, paths, fuse(model), images[set_name], images.get(f"{set_name}_labels"),
                                       set_name, rates, len(calib), batch)
    return rows
