"""``cgavit bench``: the paper's throughput protocol, our models beside timm's port and peers, same run.

Protocol (the official speed test): BatchNorm fused, grad off, warm-up, then timed repeats.
CPU: 1 thread, batch 16, fp32. GPU: batch 2048, AMP (fp16 autocast), CUDA-event timing.
Every candidate is timed round-robin (one batch each, in turn) so that load from other processes
hits all of them alike; the table reports the median and the interquartile range over repeats, and
each EfficientViT row's ratio to timm's traced port of the same variant with the same weights.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .deploy import fuse, optimize
from .factory import create_model, list_models
from .testing import rel_err
from .variants import VARIANTS

log = logging.getLogger(__name__)

#: Published ImageNet-1k top-1 (%) of the timm peers, from their papers (timm's own evaluation in
#: brackets where it differs): MobileNetV3-Large 75.8 [timm 75.77], LeViT-128S 76.5, EfficientNet-B0
#: 77.7 [timm 77.69], MobileViT-XXS 68.9 [timm 68.91], DeiT-Tiny 72.2.
PEERS_TOP1 = {
    "mobilenetv3_large_100": 75.8,
    "levit_128s": 76.5,
    "efficientnet_b0": 77.7,
    "mobilevit_xxs": 68.9,
    "deit_tiny_patch16_224": 72.2,
}

BATCH_NOTE = (
    "Batch size decides throughput: these are images/s at batch {batch}. Batch-1 latency and "
    "batch-2048 GPU throughput measure different things; compare figures only at the same batch, "
    "threads, precision and image size (the paper: CPU 1 thread batch 16 fp32; GPU batch 2048 AMP)."
)


@dataclass
class Result:
    """One candidate's timings; ``ips`` = images per second of each timed repeat."""

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
        if len(self.ips) < 2:
            return (self.ips[0], self.ips[0])
        q = statistics.quantiles(self.ips, n=4, method="inclusive")
        return (q[0], q[2])


@dataclass
class Candidate:
    name: str
    kind: str
    variant: str
    top1: float | None
    fn: Callable[[torch.Tensor], torch.Tensor]
    result: Result | None = None


def _to_timm_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names to timm's ``efficientvit_msra`` names (the block parts are named differently)."""
    parts = {"pre.0": "dw0", "pre.1": "ffn0", "post.0": "dw1", "post.1": "ffn1"}
    out = {}
    for key, value in sd.items():
        for ours, theirs in parts.items():
            key = key.replace(f".{ours}.", f".{theirs}.")
        out[key] = value
    return out


def timm_port(model: nn.Module, name: str, img_size: tuple[int, int]) -> nn.Module:
    """timm's ``efficientvit_msra`` model with ``model``'s weights, BatchNorm fused by timm itself."""
    import timm
    from timm.utils import reparameterize_model

    port = timm.create_model(name, pretrained=False, img_size=img_size[0]).eval()
    port.load_state_dict(_to_timm_state_dict(model.state_dict()))
    return reparameterize_model(port)


def _trace(module: nn.Module, x: torch.Tensor) -> nn.Module:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, x)


def build_candidates(
    models: list[str],
    peers: list[str],
    x: torch.Tensor,
    precision: str,
    device: torch.device,
    compile: bool = True,
    onnx: bool = False,
) -> list[Candidate]:
    """Our variants (fused; optimized) and timm's traced port of each, then the traced peers."""
    from .testing import randomize_

    cands: list[Candidate] = []
    size = tuple(x.shape[2:])
    amp = device.type == "cuda"
    for name in models:
        top1 = VARIANTS[name].top1
        model = randomize_(create_model(name, img_size=size), seed=0).eval().to(device)
        fused = fuse(model)
        port = timm_port(model.cpu(), name, size).to(device)
        model.to(device)
        with torch.no_grad():
            err = rel_err(fused(x), port(x))
        traced_port = _trace(port, x)
        cands.append(Candidate(f"timm {name} (fused, traced)", "timm-port", name, top1, traced_port))
        cands.append(Candidate(f"cgavit {name} fuse", "ours", name, top1, fused))
        if device.type == "cpu":
            opt = optimize(model, x, precision=precision, backend="torch", compile=compile)
            label = f"cgavit {name} optimize {precision} torch{'.compile' if compile else ' eager'}"
            cands.append(Candidate(label, "ours", name, top1, opt))
            if onnx and precision == "fp32":
                ort = optimize(model, x, precision="fp32", backend="onnxruntime")
                cands.append(Candidate(f"cgavit {name} optimize fp32 onnxruntime", "ours", name, top1, ort))
        else:
            cands.append(Candidate(f"cgavit {name} fuse, traced", "ours", name, top1, _trace(fused, x)))
        for c in cands:
            if c.variant == name and c.kind == "ours":
                with torch.no_grad(), torch.autocast(device.type, enabled=amp):
                    c.result = Result(c.name, c.kind, name, top1, rel_err_vs_timm=rel_err(c.fn(x), port(x)))
        log.info("%s: fused vs timm port relative error %.1e", name, err)
    for peer in peers:
        import timm
        from timm.utils import reparameterize_model

        if peer not in PEERS_TOP1:
            raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS_TOP1)} or 'none'")
        kwargs = {"img_size": size} if peer.startswith(("deit", "levit")) else {}  # the others are size-agnostic
        net = reparameterize_model(timm.create_model(peer, pretrained=False, **kwargs).eval()).to(device)
        cands.append(Candidate(f"timm {peer} (traced)", "peer", peer, PEERS_TOP1[peer], _trace(net, x)))
    return cands


def time_candidates(
    cands: list[Candidate], x: torch.Tensor, warmup: int, repeats: int, device: torch.device
) -> list[Result]:
    """Warm every candidate up, then time one batch of each in turn, ``repeats`` rounds."""
    from tqdm import tqdm

    amp = device.type == "cuda"
    for c in cands:
        if c.result is None:
            c.result = Result(c.name, c.kind, c.variant, c.top1)
    with torch.no_grad(), torch.autocast(device.type, enabled=amp):
        for c in tqdm(cands, desc="warm-up", leave=False):
            for _ in range(warmup):
                c.fn(x)
        for _ in tqdm(range(repeats), desc="timed rounds", leave=False):
            for c in cands:
                c.result.ips.append(x.shape[0] / _time_one(c.fn, x, device))
    results = [c.result for c in cands]
    ports = {r.variant: r.median for r in results if r.kind == "timm-port"}
    for r in results:
        if r.variant in ports:
            r.ratio_to_timm = r.median / ports[r.variant]
    return results


def _time_one(fn, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


def train_throughput(
    models: list[str], batch: int, img_size: tuple[int, int], warmup: int, repeats: int
) -> list[dict]:
    """Forward+backward images/s of our model and timm's port (same weights), interleaved."""
    import timm

    rows = []
    x = torch.randn(batch, 3, *img_size)
    target = torch.randint(0, 1000, (batch,))
    for name in models:
        ours = create_model(name, img_size=img_size).train()
        theirs = timm.create_model(name, pretrained=False, img_size=img_size[0]).train()
        theirs.load_state_dict(_to_timm_state_dict(ours.state_dict()))
        nets = {"cgavit": ours, "timm": theirs}
        ips: dict[str, list[float]] = {k: [] for k in nets}

        def step(net):
            net.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), target).backward()

        for net in nets.values():
            for _ in range(warmup):
                step(net)
        for _ in range(repeats):
            for k, net in nets.items():
                t0 = time.perf_counter()
                step(net)
                ips[k].append(batch / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in ips.items()}
        rows.append(dict(model=name, batch=batch, cgavit_ips=med["cgavit"], timm_ips=med["timm"],
                         ratio=med["cgavit"] / med["timm"], cgavit_all=ips["cgavit"], timm_all=ips["timm"]))
    return rows


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
                  "retina", "colorwheel")


def _prep(arr, size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``(H, W[, C])`` array to a normalised ``(3, *size)`` tensor (bicubic resize)."""
    import numpy as np

    a = np.asarray(arr)
    if a.ndim == 2:
        a = np.stack([a] * 3, -1)
    x = torch.from_numpy(np.array(a[..., :3])).permute(2, 0, 1).float()[None] / 255.0
    x = nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False).clamp_(0, 1)[0]
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    return (x - mean) / std


def sample_photos(size: tuple[int, int], cifar: str | Path | None = None, per_class: int = 20) -> dict[str, torch.Tensor]:
    """Real photographs shipped with the installed libraries, preprocessed for the model.

    ``photos``: scikit-image's sample photos plus matplotlib's grace_hopper.jpg. With ``cifar`` (the
    CIFAR-10 JPEG tarball or its extracted ``cifar10`` folder) also ``cifar`` / ``cifar_labels``
    (``per_class`` test images of each class) and ``train`` / ``train_labels`` (as many train
    images: the linear probe and the int8 calibration use these, never the test images).
    """
    import tarfile
    import tempfile

    import matplotlib.cbook
    import numpy as np
    import skimage.data
    from PIL import Image

    photos = [_prep(getattr(skimage.data, n)(), size) for n in SKIMAGE_PHOTOS]
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as fh:
        photos.append(_prep(np.asarray(Image.open(fh).convert("RGB")), size))
    out = {"photos": torch.stack(photos)}
    if not cifar:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(cifar)
        if root.is_file():
            with tarfile.open(root) as tar:
                keep = [m for m in tar.getmembers() if m.name.endswith(".jpg")
                        and int(Path(m.name).stem) < per_class]  # files are numbered 0000.jpg... per class
                tar.extractall(tmp, members=keep, filter="data")
            root = next(Path(tmp).glob("*"))
        for split, key in (("test", "cifar"), ("train", "train")):
            classes = sorted(d.name for d in (root / split).iterdir() if d.is_dir())
            if len(classes) != 10:
                raise ValueError(f"expected 10 class folders under {root / split}, found {len(classes)}")
            imgs, labels = [], []
            for label, cls in enumerate(classes):
                for f in sorted((root / split / cls).glob("*.jpg"))[:per_class]:
                    imgs.append(_prep(np.array(Image.open(f).convert("RGB")), size))
                    labels.append(label)
            out[key], out[f"{key}_labels"] = torch.stack(imgs), torch.tensor(labels)
    return out


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, images: torch.Tensor, batch: int = 32) -> nn.Module:
    """Set every BatchNorm's running statistics to their average over ``images`` (train-mode passes).

    A random-weight network with arbitrary statistics collapses every input to nearly the same
    features; with statistics from real images its features vary with the image at unit scale.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
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
    """Give ``model`` a 10-class head fitted (logistic regression) on its own pooled features.

    Without pretrained weights this turns a random-weight network into a real, if weak, classifier,
    so that top-1 agreement between precisions is measured on image-dependent decisions.
    """
    from sklearn.linear_model import LogisticRegression

    model.reset_classifier(int(labels.max()) + 1)
    model.eval()
    with torch.no_grad():
        feats = torch.cat([model.forward_head(model.forward_features(b), pre_logits=True) for b in images.split(batch)])
    mu, sd = feats.mean(0), feats.std(0)
    sd = sd.clamp_min(0.1 * float(sd.mean()))  # near-constant features would get huge, ill-conditioned weights
    clf = LogisticRegression(max_iter=2000, C=0.1).fit(((feats - mu) / sd).numpy(), labels.numpy())
    with torch.no_grad():
        bn, lin = model.head.bn, model.head.linear
        bn.running_mean.copy_(mu)
        bn.running_var.copy_(sd**2 - bn.eps)
        bn.weight.fill_(1.0)
        bn.bias.zero_()
        lin.weight.copy_(torch.as_tensor(clf.coef_, dtype=torch.float32))
        lin.bias.copy_(torch.as_tensor(clf.intercept_, dtype=torch.float32))
    return model


def precision_report(
    models: list[str], size: tuple[int, int], batch: int, images: dict[str, torch.Tensor],
    repeats: int, warmup: int, compile: bool = True,
) -> list[dict]:
    """fp32 vs bf16 vs int8 paths: throughput (same run, round-robin) and top-1 agreement with fp32.

    No pretrained weights exist offline, so each model has random weights and random BatchNorm
    affine parameters, with BatchNorm statistics recalibrated on real images (CIFAR-10 train images,
    or the photos without ``cifar``); with CIFAR-10 it also gets a linear-probe head fitted on the
    train images, so its decisions depend on the image and its test accuracy is reported per path.
    """
    from .deploy import optimize
    from .testing import randomize_

    rows = []
    pool = images.get("train", images["photos"])
    x = pool[torch.arange(batch) % len(pool)]  # real images as the example input (compile, check, timing)
    for name in models:
        model = randomize_(create_model(name, img_size=size), seed=0)
        recalibrate_batchnorm(model, images.get("train", images["photos"]))
        if "train" in images:
            fit_linear_probe(model, images["train"], images["train_labels"])
        calib = images.get("train", images["photos"])
        reference = fuse(model)  # plain fp32 eager: the decisions every path is compared with
        opts = dict(check=False)  # the probe head amplifies rounding; the error is reported below instead
        paths = {
            "fp32 torch" + (".compile" if compile else " eager"): optimize(model, x, "fp32", backend="torch", compile=compile, **opts),
            "fp32 ONNX Runtime": optimize(model, x, "fp32", backend="onnxruntime", **opts),
            "bf16 torch" + (".compile" if compile else " eager"): optimize(model, x, "bf16", backend="torch", compile=compile, **opts),
            "int8 ONNX Runtime (static)": optimize(model, x, "int8", calibration=calib[torch.randperm(len(calib))[:64]].split(batch), **opts),
        }
        first = next(iter(paths))
        ips: dict[str, list[float]] = {k: [] for k in paths}
        with torch.no_grad():
            for fn in paths.values():
                for _ in range(warmup):
                    fn(x)
            for _ in range(repeats):
                for k, fn in paths.items():
                    t0 = time.perf_counter()
                    fn(x)
                    ips[k].append(batch / (time.perf_counter() - t0))
            for set_name in ("photos", "cifar"):
                if set_name not in images:
                    continue
                imgs = images[set_name]
                ref = torch.cat([reference(b) for b in imgs.split(batch)])
                labels = images.get(f"{set_name}_labels")
                for k, fn in paths.items():
                    out = torch.cat([fn(b) for b in imgs.split(batch)])
                    rows.append(dict(
                        model=name, path=k, images=set_name, n=len(imgs),
                        img_s=statistics.median(ips[k]),
                        ratio_to_fp32=statistics.median(ips[k]) / statistics.median(ips[first]),
                        top1_agreement=float((out.argmax(1) == ref.argmax(1)).float().mean()),
                        rel_err=rel_err(out, ref),
                        fp32_distinct_classes=int(ref.argmax(1).unique().numel()),
                        accuracy=None if labels is None else float((out.argmax(1) == labels).float().mean()),
                    ))
    return rows


def format_table(results: list[Result]) -> str:
    head = f"{'model':<52}{'img/s':>9}{'IQR':>17}{'x timm port':>12}{'rel err':>9}{'top-1':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        lo, hi = r.iqr
        ratio = f"{r.ratio_to_timm:.2f}" if r.ratio_to_timm is not None else ""
        err = f"{r.rel_err_vs_timm:.0e}" if r.rel_err_vs_timm is not None else ""
        top1 = f"{r.top1:.1f}" if r.top1 is not None else ""
        lines.append(f"{r.name:<52}{r.median:>9.1f}{f'{lo:.1f}-{hi:.1f}':>17}{ratio:>12}{err:>9}{top1:>7}")
    return "\n".join(lines)


def plot(results: list[Result], path: Path, title: str) -> Path:
    """Published top-1 against measured images/s (log scale), one point per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from .io import atomic_write

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = {"ours": "tab:red", "timm-port": "tab:gray", "peer": "tab:blue"}
    for kind, label in (("ours", "cgavit (this package)"), ("timm-port", "timm efficientvit_msra port"), ("peer", "timm peers")):
        pts = [r for r in results if r.kind == kind and r.top1 is not None]
        if pts:
            ax.scatter([r.median for r in pts], [r.top1 for r in pts], c=colors[kind], label=label, s=40)
            for r in pts:
                label = r.name.replace("cgavit ", "").replace("timm ", "").replace("efficientvit_", "")
                stacked = sum(1 for q in results if q.top1 == r.top1 and results.index(q) < results.index(r))
                ax.annotate(label, (r.median, r.top1), fontsize=6, xytext=(4, 4 + 8 * stacked),
                            textcoords="offset points", arrowprops=dict(arrowstyle="-", lw=0.3, color="0.6"))
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("measured throughput (images/s, log scale)")
    ax.set_ylabel("published ImageNet-1k top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    plt.close(fig)
    return path


def environment() -> dict:
    """CPU model, library versions and date, for the record."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import timm

    return dict(cpu=cpu, torch=torch.__version__, timm=timm.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked but no CUDA GPU is visible; use --device cpu")
    gpu = device.type == "cuda"
    batch = args.batch or (2048 if gpu else 16)
    threads = args.threads or (torch.get_num_threads() if gpu else 1)
    torch.set_num_threads(threads)
    precision = args.precision or ("amp" if gpu else "fp32")
    if precision == "amp" and not gpu:
        raise ValueError("--precision amp is the GPU protocol; on CPU use fp32 or bf16")
    size = tuple(args.img_size) if len(args.img_size) == 2 else (args.img_size[0],) * 2
    models = [m if m.startswith("efficientvit_") else f"efficientvit_{m}" for m in args.models]
    for m in models:
        if m not in VARIANTS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(list_models())}")
    peers = [] if args.peers == ["none"] else args.peers
    unknown = [p for p in peers if p not in PEERS_TOP1]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS_TOP1)} or 'none'")
    torch.manual_seed(0)
    x = torch.randn(batch, 3, *size, device=device)
    print(f"protocol: {device.type}, {threads} thread(s), batch {batch}, {precision}, {size[0]}x{size[1]}, "
          f"{args.warmup} warm-up + {args.repeats} timed rounds (round-robin), BatchNorm fused, grad off")
    results = []
    if not args.skip_table:
        cands = build_candidates(models, peers, x, "fp32" if precision == "amp" else precision, device,
                                 compile=not args.no_compile, onnx=args.onnx)
        results = time_candidates(cands, x, args.warmup, args.repeats, device)
    print(format_table(results))
    print("img/s: median over timed rounds; IQR: 25th-75th percentile; 'x timm port': ratio of medians to "
          "timm's efficientvit_msra (BatchNorm fused by timm, torch.jit.trace) with the same weights, same run; "
          "rel err: our output vs that port's.")
    print(BATCH_NOTE.format(batch=batch))
    env = environment()
    record = dict(protocol=dict(device=device.type, threads=threads, batch=batch, precision=precision,
                                img_size=list(size), warmup=args.warmup, repeats=args.repeats),
                  environment=env, results=[asdict(r) | dict(median=r.median, iqr=list(r.iqr)) for r in results])
    if args.precision_check:
        images = sample_photos(size, args.cifar or None, per_class=args.cifar_per_class)
        rows = precision_report(models, size, batch, images, args.repeats, args.warmup, compile=not args.no_compile)
        record["precision"] = rows
        print(f"\n{'model':<17}{'path':<30}{'images':<8}{'n':>5}{'img/s':>8}{'x fp32':>7}{'top-1 agree':>12}"
              f"{'rel err':>9}{'classes':>8}{'accuracy':>9}")
        for r in rows:
            acc = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
            print(f"{r['model']:<17}{r['path']:<30}{r['images']:<8}{r['n']:>5}{r['img_s']:>8.1f}{r['ratio_to_fp32']:>7.2f}"
                  f"{100 * r['top1_agreement']:>11.1f}%{r['rel_err']:>9.1e}{r['fp32_distinct_classes']:>8}{acc:>9}")
        print("top-1 agree / rel err: against the plain fused fp32 model in eager mode; x fp32: throughput ratio to the "
              "first row.")
        print("top-1 agree: share of images whose top-1 class equals the plain fp32 model's. No pretrained weights offline: "
              "random weights and BatchNorm affine, BatchNorm statistics recalibrated on real images; with --cifar "
              "a linear-probe head fitted on CIFAR-10 train images (accuracy: on CIFAR-10 test images). "
              "'classes': distinct fp32 top-1 classes among the images.")
    if args.train:
        rows = train_throughput(models, args.train_batch, size, max(1, args.warmup), args.repeats)
        record["training"] = rows
        for r in rows:
            print(f"training (forward+backward, batch {r['batch']}, train mode): {r['model']} cgavit "
                  f"{r['cgavit_ips']:.1f} img/s, timm {r['timm_ips']:.1f} img/s, ratio {r['ratio']:.2f}")
    if args.out and results:
        from .io import atomic_write

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "bench.json", lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1)))

        def write_csv(tmp: str) -> None:
            with open(tmp, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["model", "kind", "variant", "img_s_median", "iqr_low", "iqr_high", "min", "max",
                            "ratio_to_timm_port", "rel_err_vs_timm", "published_top1"])
                for r in results:
                    w.writerow([r.name, r.kind, r.variant, f"{r.median:.2f}", f"{r.iqr[0]:.2f}", f"{r.iqr[1]:.2f}",
                                f"{min(r.ips):.2f}", f"{max(r.ips):.2f}",
                                "" if r.ratio_to_timm is None else f"{r.ratio_to_timm:.3f}",
                                "" if r.rel_err_vs_timm is None else f"{r.rel_err_vs_timm:.2e}", r.top1 or ""])

        atomic_write(out / "bench.csv", write_csv)
        title = (f"{env['cpu']} | {device.type} {threads} thread(s), batch {batch}, {precision}, "
                 f"{size[0]}px | {env['date']}")
        plot(results, out / "accuracy_vs_throughput.png", title)
        print(f"wrote {out / 'bench.csv'}, {out / 'bench.json'}, {out / 'accuracy_vs_throughput.png'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput of our variants vs timm's port and peers, same run (the paper's protocol)",
        description="Time cgavit's inference paths, timm's efficientvit_msra port (same weights) and timm peers "
        "round-robin in one process. Defaults are the paper's protocol: CPU 1 thread, batch 16, fp32; "
        "GPU batch 2048, AMP. Random weights (throughput does not depend on them); published top-1 "
        "figures are used for the accuracy-throughput plot.",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    p.add_argument("--threads", type=int, help="intra-op threads (default: 1 on CPU, as the paper)")
    p.add_argument("--batch", type=int, help="batch size (default: 16 on CPU, 2048 on GPU)")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N", help="N or H W (default 224)")
    p.add_argument("--precision", choices=["fp32", "bf16", "amp"],
                   help="our optimize() precision (default fp32 on CPU, amp on GPU); baselines run fp32 on CPU")
    p.add_argument("--models", nargs="+", default=["efficientvit_m0", "efficientvit_m4"], metavar="NAME",
                   help="our variants (default efficientvit_m0 efficientvit_m4)")
    p.add_argument("--peers", nargs="+", default=list(PEERS_TOP1), metavar="NAME",
                   help=f"timm peers with random weights, or 'none' (default: {' '.join(PEERS_TOP1)})")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per candidate (default 10)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds, one batch per candidate each (default 30)")
    p.add_argument("--no-compile", action="store_true", help="optimize() without torch.compile (quick runs)")
    p.add_argument("--no-onnx", dest="onnx", action="store_false",
                   help="skip optimize()'s ONNX Runtime backend (its default on CPU for fp32)")
    p.add_argument("--train", action="store_true", help="also time training steps (forward+backward) vs timm's port")
    p.add_argument("--precision-check", action="store_true",
                   help="also compare fp32, bf16 and int8 paths: throughput and top-1 agreement on real photos")
    p.add_argument("--skip-table", action="store_true", help="skip the main throughput table (e.g. with --precision-check)")
    p.add_argument("--cifar", default="", help="CIFAR-10 JPEG tarball or folder for --precision-check (linear probe on "
                   "train images, agreement and accuracy on test images)")
    p.add_argument("--cifar-per-class", type=int, default=20, help="CIFAR-10 images per class and split (default 20)")
    p.add_argument("--train-batch", type=int, default=64, help="batch of the training comparison (default 64)")
    p.add_argument("--out", default="bench-results", help="folder for bench.csv, bench.json and the plot ('' = none)")
    p.set_defaults(func=_run)
