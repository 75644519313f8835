"""``run_bench``: the whole benchmark from one typed :class:`BenchConfig`, results as a :class:`BenchReport`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..factory import resolve_name
from .candidates import PEERS_TOP1, Result, build_candidates, time_candidates
from .photos import sample_photos
from .probe import PrecisionRow, precision_report
from .report import environment, write_report
from .train_speed import TrainingRow, train_throughput

PRECISION_CHOICES = ("fp32", "bf16", "amp")


@dataclass
class BenchConfig:
    """What to measure; each field is the ``cgavit bench`` flag of the same name.

    Defaults are the paper's protocol: CPU 1 thread, batch 16, fp32; GPU batch 2048, AMP.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        threads: intra-op threads (default: 1 on CPU, as the paper; all on GPU).
        batch: batch size (default: 16 on CPU, 2048 on GPU).
        img_size: ``(H, W)`` in pixels.
        precision: our ``optimize()`` precision, ``"fp32"``, ``"bf16"`` or ``"amp"`` (default fp32 on
            CPU, amp on GPU); the baselines run fp32 on the CPU.
        models: our variants (``m4`` or ``efficientvit_m4``).
        peers: timm peers (keys of :data:`PEERS_TOP1`); empty for none.
        warmup: untimed calls per candidate.
        repeats: timed rounds, one batch per candidate each.
        compile: ``optimize()`` with ``torch.compile`` (the flag ``--no-compile`` turns it off).
        onnx: also time ``optimize()``'s ONNX Runtime backend on the CPU (``--no-onnx`` turns it off).
        train: also time training steps (forward+backward) against timm's port.
        precision_check: also compare fp32, bf16 and int8 paths on real photos.
        skip_table: skip the main throughput table.
        cifar: CIFAR-10 JPEG tarball or folder for the precision check (None: photos only).
        cifar_per_class: CIFAR-10 images per class and split.
        train_batch: batch of the training comparison.
        out: folder for bench.csv, bench.json and the plot (None: write nothing).
    """

    device: str = "cpu"
    threads: int | None = None
    batch: int | None = None
    img_size: tuple[int, int] = (224, 224)
    precision: str | None = None
    models: tuple[str, ...] = ("efficientvit_m0", "efficientvit_m4")
    peers: tuple[str, ...] = tuple(PEERS_TOP1)
    warmup: int = 10
    repeats: int = 30
    compile: bool = True
    onnx: bool = True
    train: bool = False
    precision_check: bool = False
    skip_table: bool = False
    cifar: str | Path | None = None
    cifar_per_class: int = 20
    train_batch: int = 64
    out: str | Path | None = "bench-results"


@dataclass(frozen=True)
class BenchProtocol:
    """A :class:`BenchConfig` with its defaults filled in for the device and its names resolved."""

    device: torch.device
    threads: int
    batch: int
    precision: str  # "fp32", "bf16" or "amp"
    img_size: tuple[int, int]
    warmup: int
    repeats: int
    models: tuple[str, ...]  # registered variant names
    peers: tuple[str, ...]

    def record(self) -> dict:
        """The protocol as bench.json stores it."""
        return dict(device=self.device.type, threads=self.threads, batch=self.batch, precision=self.precision,
                    img_size=list(self.img_size), warmup=self.warmup, repeats=self.repeats)

    def describe(self) -> str:
        """One line: device, threads, batch, precision, size, rounds."""
        h, w = self.img_size
        return (f"protocol: {self.device.type}, {self.threads} thread(s), batch {self.batch}, {self.precision}, "
                f"{h}x{w}, {self.warmup} warm-up + {self.repeats} timed rounds (round-robin), BatchNorm fused, grad off")


@dataclass
class BenchReport:
    """What :func:`run_bench` measured. ``results``: the main table (empty with ``skip_table``);
    ``precision`` / ``training``: the optional checks (None when not asked for); ``files``: written."""

    protocol: BenchProtocol
    results: list[Result] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    precision: list[PrecisionRow] | None = None
    training: list[TrainingRow] | None = None
    files: list[Path] = field(default_factory=list)

    def record(self) -> dict:
        """The bench.json content."""
        rec = dict(protocol=self.protocol.record(), environment=self.environment,
                   results=[asdict(r) | dict(median=r.median, iqr=list(r.iqr)) for r in self.results])
        if self.precision is not None:
            rec["precision"] = self.precision
        if self.training is not None:
            rec["training"] = self.training
        return rec

    def plot_title(self) -> str:
        p, env = self.protocol, self.environment
        return (f"{env['cpu']} | {p.device.type} {p.threads} thread(s), batch {p.batch}, {p.precision}, "
                f"{p.img_size[0]}px | {env['date']}")


def resolve_protocol(cfg: BenchConfig) -> BenchProtocol:
    """Fill in the device's defaults and check every value.

    Raises:
        ValueError: no CUDA GPU for ``device="cuda"``, amp on the CPU, an unknown model or peer, or
            a size or count out of range.
    """
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {cfg.device!r}")
    device = torch.device(cfg.device)
    gpu = device.type == "cuda"
    if gpu and not torch.cuda.is_available():
        raise ValueError("--device cuda asked but no CUDA GPU is visible; use --device cpu")
    precision = cfg.precision or ("amp" if gpu else "fp32")
    if precision not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {precision!r}")
    if precision == "amp" and not gpu:
        raise ValueError("--precision amp is the GPU protocol; on CPU use fp32 or bf16")
    models = tuple(dict.fromkeys(resolve_name(m) for m in cfg.models))  # "unknown model ..." for a bad name
    unknown = [p for p in cfg.peers if p not in PEERS_TOP1]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS_TOP1)} or 'none'")
    if len(cfg.img_size) != 2 or min(cfg.img_size) < 32:
        raise ValueError(f"img_size must be (H, W) with both at least 32 pixels, got {cfg.img_size}")
    least = (("--threads", cfg.threads, 1), ("--batch", cfg.batch, 1), ("--warmup", cfg.warmup, 0),
             ("--repeats", cfg.repeats, 1), ("--train-batch", cfg.train_batch, 1),
             ("--cifar-per-class", cfg.cifar_per_class, 1))
    for flag, value, low in least:
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    return BenchProtocol(
        device=device,
        threads=cfg.threads or (torch.get_num_threads() if gpu else 1),
        batch=cfg.batch or (2048 if gpu else 16),
        precision=precision,
        img_size=tuple(cfg.img_size),
        warmup=cfg.warmup,
        repeats=cfg.repeats,
        models=models,
        peers=tuple(dict.fromkeys(cfg.peers)),
    )


#: Section names :func:`run_bench` reports to its ``on_section`` callback, in order.
SECTIONS = ("table", "precision", "training")


def run_bench(cfg: BenchConfig, on_section: Callable[[str, BenchReport], None] | None = None) -> BenchReport:
    """Run the benchmark ``cfg`` describes; with ``cfg.out`` (and a main table) write its files.

    Sets torch's intra-op threads to the protocol's (process-wide) and seeds torch with 0.

    Args:
        cfg: what to measure.
        on_section: called with the section's name (``"table"``, then ``"precision"`` and
            ``"training"`` when asked for) and the report so far, as soon as each section is done.

    Returns:
        The measurements; ``report.record()`` is what bench.json holds.
    """
    protocol = resolve_protocol(cfg)
    torch.set_num_threads(protocol.threads)
    torch.manual_seed(0)
    # drawn first even with skip_table, so the later random draws (the precision check's models) stay as before
    x = torch.randn(protocol.batch, 3, *protocol.img_size, device=protocol.device)
    report = BenchReport(protocol)
    done = on_section or (lambda section, report: None)
    if not cfg.skip_table:
        report.results = measure_table(protocol, x, cfg.compile, cfg.onnx)
    done("table", report)
    report.environment = environment()
    if cfg.precision_check:
        images = sample_photos(protocol.img_size, cfg.cifar or None, per_class=cfg.cifar_per_class)
        report.precision = precision_report(list(protocol.models), protocol.img_size, protocol.batch, images,
                                            protocol.repeats, protocol.warmup, compile=cfg.compile)
        done("precision", report)
    if cfg.train:
        report.training = train_throughput(list(protocol.models), cfg.train_batch, protocol.img_size,
                                           max(1, protocol.warmup), protocol.repeats)
        done("training", report)
    if cfg.out and report.results:
        report.files = write_report(cfg.out, report.record(), report.results, report.plot_title())
    return report


def measure_table(protocol: BenchProtocol, x: torch.Tensor, compile: bool = True, onnx: bool = True) -> list[Result]:
    """The main table: every candidate built for the protocol and timed round-robin on the batch ``x``."""
    precision = "fp32" if protocol.precision == "amp" else protocol.precision
    cands = build_candidates(list(protocol.models), list(protocol.peers), x, precision, protocol.device,
                             compile=compile, onnx=onnx)
    return time_candidates(cands, x, protocol.warmup, protocol.repeats, protocol.device)
