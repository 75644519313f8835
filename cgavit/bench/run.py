"""``run_bench``: the whole benchmark from one typed :class:`BenchConfig`, results as a :class:`BenchReport`."""

from __future__ import annotations

import contextlib

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..deploy import NoiseFloor, PathChoice, cpu_features
from ..deploy.auto import auto_candidates
from ..deploy.fastpath import backend_available
from ..deploy.formats import require_format, runtime_format
from ..factory import resolve_name
from ..bounds import check_threads
from ..io import folders_kept_if_used, make_folder
from ..train.data import check_folder
from ..weights import checked_path
from .candidates import PEER_SIDE_MULTIPLE, PEERS_TOP1, Result, build_candidates, time_candidates
from .ceiling import CeilingRow, fp32_ceilings
from .optional import check_plotting
from .precision import RUNTIMES, PrecisionRow, checkpoint_precision
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
        precision: ``"fp32"``, ``"bf16"`` or ``"amp"`` (default fp32 on CPU, amp on GPU): on the CPU our
            ``optimize()`` precision, the baselines running fp32; on a GPU the autocast every row runs under
            (amp: fp16, bf16: bf16, fp32: none).
        models: our variants (``m4`` or ``efficientvit_m4``).
        peers: timm peers (keys of :data:`PEERS_TOP1`); empty for none.
        warmup: untimed calls per candidate.
        repeats: timed rounds, one batch per candidate each.
        compile: ``optimize()`` with ``torch.compile`` (the flag ``--no-compile`` turns it off).
        onnx: also time ``optimize()``'s ONNX Runtime backend on the CPU (``--no-onnx`` turns it off).
        runtimes: more runtimes to time beside torch (:data:`~cgavit.bench.precision.RUNTIMES`:
            ``"onnxruntime"``, ``"openvino"``, ``"executorch"``, ``"tflite"``), in the main table
            (fp32) and the precision check (fp32, int8, OpenVINO bf16).
        train: also time training steps (forward+backward) against timm's port.
        precision_check: also compare every fp32, bf16 and int8 path on a trained ``checkpoint``
            with ``data`` (both needed).
        skip_table: skip the main throughput table.
        checkpoint: trained weights for the precision check (any file ``cgavit.load_model`` reads).
        trust_checkpoint: allow pickled objects in ``checkpoint`` (runs code from it).
        data: image folder for the precision check with ``checkpoint``: ``data/val_split`` evaluated,
            ``data/train_split`` for the int8 calibration.
        calibration_images: training images int8 is calibrated on.
        eval_images: evaluated images (0: the whole split).
        train_split, val_split: the split folder names under ``data``.
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
    runtimes: tuple[str, ...] = ()
    train: bool = False
    precision_check: bool = False
    skip_table: bool = False
    checkpoint: str | Path | None = None
    trust_checkpoint: bool = False
    data: str | Path | None = None
    calibration_images: int = 256
    eval_images: int = 0
    train_split: str = "train"
    val_split: str = "val"
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
    runtimes: tuple[str, ...] = ()  # beside torch, installed

    def record(self) -> dict:
        """The protocol as bench.json stores it."""
        return dict(device=self.device.type, threads=self.threads, batch=self.batch, precision=self.precision,
                    img_size=list(self.img_size), warmup=self.warmup, repeats=self.repeats)

    def precision_text(self) -> str:
        """The table's precision: on the CPU a reduced one is our ``optimize()`` rows' alone, timm's running fp32."""
        if self.device.type == "cuda" or self.precision == "fp32":  # on a GPU every row runs under its autocast
            return self.precision
        return f"{self.precision} (ours; timm's fp32)"

    def describe(self, sized: bool = True) -> str:
        """One line: device, threads, batch, precision, size (``sized=False``: the checkpoint's, for a precision
        check alone), rounds."""
        h, w = self.img_size
        size = f"{h}x{w}" if sized else "the checkpoint's image size"
        return (f"protocol: {self.device.type}, {self.threads} thread(s), batch {self.batch}, {self.precision_text()}, "
                f"{size}, {self.warmup} warm-up + {self.repeats} timed rounds (round-robin), BatchNorm fused, grad off")


@dataclass
class BenchReport:
    """What :func:`run_bench` measured. ``results``: the main table (empty with ``skip_table``);
    ``precision`` / ``training``: the optional checks (None when not asked for); ``files``: written."""

    protocol: BenchProtocol
    results: list[Result] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    precision: list[PrecisionRow] | None = None
    precision_images: dict[str, str | int] | None = None  # with a checkpoint: evaluated, calibration, counts, size
    auto_order: list[PathChoice] = field(default_factory=list)  # what precision="auto" tries here, without calibration
    auto: PathChoice | None = None  # with a checkpoint: what optimize(precision="auto") chose, measured
    noise_floor: NoiseFloor | None = None  # with a checkpoint: fp32's own decisions under half a grey level of noise
    training: list[TrainingRow] | None = None
    ceilings: list[CeilingRow] = field(default_factory=list)  # CPU fp32: each variant's FLOPs at the measured peak
    files: list[Path] = field(default_factory=list)

    def record(self) -> dict:
        """The bench.json content."""
        protocol = self.protocol.record()
        if not self.results and self.precision is None:  # training alone: its rows carry their batch and rounds
            protocol = {k: protocol[k] for k in ("device", "threads", "img_size")}
        rec = dict(protocol=protocol, environment=self.environment,
                   results=[asdict(r) | dict(median=r.median, iqr=list(r.iqr)) for r in self.results])
        if self.precision is not None:
            rec["precision"] = self.precision
        if self.precision_images is not None:
            rec["precision_images"] = self.precision_images
        if self.auto_order:
            rec["auto_order"] = [asdict(c) for c in self.auto_order]
        if self.auto is not None:
            rec["auto"] = asdict(self.auto)
        if self.noise_floor is not None:
            rec["noise_floor"] = self.noise_floor.record()
        if self.training is not None:
            rec["training"] = self.training
        if self.ceilings:
            rec["fp32_ceiling"] = self.ceilings
        return rec

    def plot_title(self) -> str:
        """The machine (the GPU on a GPU run, else the CPU), the protocol and the date."""
        p, env = self.protocol, self.environment
        h, w = p.img_size
        size = f"{h}px" if h == w else f"{h}x{w}px"
        cpu = f"{env['cpu']} (class {env['cpu_class']})" if env.get("cpu_class") else env["cpu"]
        machine = env.get("gpu", cpu)
        return (f"{machine} | {p.device.type} {p.threads} thread(s), batch {p.batch}, {p.precision_text()}, {size} | "
                f"{env['date']}")


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
    if (cfg.train or cfg.precision_check) and gpu:  # built and run on the CPU: the line would be a CPU figure
        raise ValueError(f"{'--train' if cfg.train else '--precision-check'} runs on the CPU only; run it with --device cpu")
    models = tuple(dict.fromkeys(resolve_name(m) for m in cfg.models))  # "unknown model ..." for a bad name
    unknown = [p for p in cfg.peers if p not in PEERS_TOP1]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS_TOP1)} or 'none'")
    if len(cfg.img_size) != 2 or min(cfg.img_size) < 32:
        raise ValueError(f"img_size must be (H, W) with both at least 32 pixels, got {cfg.img_size}")
    for peer in dict.fromkeys(cfg.peers) if not cfg.skip_table else ():  # peers are built for the table alone
        step = PEER_SIDE_MULTIPLE.get(peer, 1)
        if any(side % step for side in cfg.img_size):
            near = max(step * round(min(cfg.img_size) / step), 32)
            raise ValueError(f"timm's {peer} runs only at sides that are multiples of {step}, and --img-size is "
                             f"{cfg.img_size[0]}x{cfg.img_size[1]}; give e.g. --img-size {near}, or leave it out of --peers")
    least = (("--batch", cfg.batch, 1), ("--warmup", cfg.warmup, 0),
             ("--repeats", cfg.repeats, 1), ("--train-batch", cfg.train_batch, 1))
    for flag, value, low in least:
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if cfg.train_batch != BenchConfig.train_batch and not cfg.train:
        raise ValueError("--train-batch is read by --train alone; add it, or leave --train-batch out")
    if cfg.batch is not None and cfg.skip_table and not cfg.precision_check:  # it took 64 and said nothing
        raise ValueError("--batch is the table's and the precision check's, and neither runs; --train's batch is "
                         "--train-batch")
    if cfg.threads is not None:
        check_threads(cfg.threads)
    check_precision_inputs(cfg)
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
        runtimes=resolve_runtimes(cfg),
    )


def resolve_runtimes(cfg: BenchConfig) -> tuple[str, ...]:
    """``cfg.runtimes`` (with ONNX Runtime first unless ``cfg.onnx`` is off), each checked to be installed.

    Raises:
        ValueError: an unknown runtime, runtimes asked for on a GPU, or one whose extra is not installed (says what
            to install).
    """
    unknown = [r for r in cfg.runtimes if r not in RUNTIMES]
    if unknown:
        raise ValueError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    if cfg.runtimes and cfg.device != "cpu":  # the GPU table is torch's alone: they would be left out without a word
        raise ValueError(f"--runtimes {' '.join(cfg.runtimes)} are CPU runtimes, timed on --device cpu alone; on "
                         f"--device {cfg.device} leave --runtimes out")
    fp32_table = not cfg.skip_table and cfg.precision in (None, "fp32")
    if cfg.runtimes and not (fp32_table or cfg.precision_check):  # no row would time them
        why = "the table is skipped" if cfg.skip_table else f"the table runs {cfg.precision}"
        fix = "--precision-check" if cfg.skip_table else "--precision fp32"
        raise ValueError(f"--runtimes {' '.join(cfg.runtimes)} are timed in the main table's fp32 rows and by "
                         f"--precision-check, and this run has neither ({why}); give {fix}, or leave --runtimes out")
    if not cfg.onnx and "onnxruntime" in cfg.runtimes:
        raise ValueError("--no-onnx leaves ONNX Runtime out, and --runtimes asks for it; give one of them")
    names = (("onnxruntime",) if cfg.onnx else ()) + tuple(r for r in cfg.runtimes if cfg.onnx or r != "onnxruntime")
    names = tuple(dict.fromkeys(names))
    for name in names if cfg.device == "cpu" else ():
        try:
            require_format(runtime_format(name).name)
        except ValueError as err:  # the default ONNX Runtime row, not asked for: it can be left out
            asked = name in cfg.runtimes
            raise ValueError(f"{err}{'' if asked else '; or give --no-onnx to time without ONNX Runtime'}") from None
    return names


def check_precision_inputs(cfg: BenchConfig) -> None:
    """The precision check's inputs fit together: it runs on a trained ``checkpoint`` with ``data`` (both),
    and they are read by it alone. (Agreement on random weights measures noise: there is no check without
    a trained model.)

    Raises:
        ValueError: what is missing or conflicting, and what to give.
    """
    defaults = BenchConfig()
    read_by_check = [flag for flag, value, default in (
        ("--checkpoint", cfg.checkpoint, None), ("--data", cfg.data, None),
        ("--trust-checkpoint", cfg.trust_checkpoint, False),
        ("--calibration-images", cfg.calibration_images, defaults.calibration_images),
        ("--eval-images", cfg.eval_images, defaults.eval_images), ("--train-split", cfg.train_split, defaults.train_split),
        ("--val-split", cfg.val_split, defaults.val_split)) if value != default]
    if read_by_check and not cfg.precision_check:
        raise ValueError(f"{', '.join(read_by_check)} {'is' if len(read_by_check) == 1 else 'are'} read by "
                         "--precision-check alone; add it, or leave them out")
    if cfg.skip_table and not (cfg.precision_check or cfg.train):
        raise ValueError("--skip-table leaves nothing to measure; add --precision-check or --train, or leave it out")
    if cfg.precision_check and not (cfg.checkpoint and cfg.data):
        raise ValueError("--precision-check needs a trained model: give --checkpoint FILE and --data DIR (DIR/val "
                         "evaluated, DIR/train for the int8 calibration); agreement on random weights measures noise")
    if cfg.skip_table and not cfg.train and cfg.img_size != defaults.img_size:  # it ran at the checkpoint's, exit 0
        raise ValueError(f"--img-size {'x'.join(map(str, cfg.img_size))} is the table's and --train's size, and neither "
                         "runs: the precision check reads images at the size the checkpoint records; leave --img-size out")
    if cfg.skip_table and not cfg.train and cfg.models != defaults.models:  # it checked the checkpoint's, exit 0
        raise ValueError(f"--models {' '.join(cfg.models)} are the table's and --train's variants, and neither runs: "
                         "the precision check measures the --checkpoint's model; leave --models out")
    if cfg.skip_table and cfg.peers and cfg.peers != defaults.peers:  # peers are timed in the table alone
        raise ValueError(f"--peers {' '.join(cfg.peers)} are timed in the main table alone, which --skip-table skips; "
                         "leave --peers out")
    if cfg.precision_check:  # before the output folder is made
        checked_path(cfg.checkpoint)
        check_folder(cfg.data)
    for flag, value in (("--calibration-images", cfg.calibration_images), ("--eval-images", cfg.eval_images)):
        if value < (1 if flag == "--calibration-images" else 0):
            raise ValueError(f"{flag} must be at least {1 if flag == '--calibration-images' else 0}, got {value}")


#: Section names :func:`run_bench` reports to its ``on_section`` callback, in order.
SECTIONS = ("table", "precision", "training")


def run_bench(cfg: BenchConfig, on_section: Callable[[str, BenchReport], None] | None = None) -> BenchReport:
    """Run the benchmark ``cfg`` describes; with ``cfg.out`` write its files (without a main table, ``bench.json``
    alone).

    Sets torch's intra-op threads to the protocol's (process-wide) and seeds torch with 0.

    Args:
        cfg: what to measure.
        on_section: called with the section's name (``"table"``, then ``"precision"`` and
            ``"training"`` when asked for) and the report so far, as soon as each section is done.

    Returns:
        The measurements; ``report.record()`` is what bench.json holds.
    """
    protocol = resolve_protocol(cfg)
    writes = cfg.out is not None and (not cfg.skip_table or cfg.precision_check or cfg.train)
    with folders_kept_if_used(cfg.out) if writes else contextlib.nullcontext():  # a failed run leaves no empty folder
        if writes:
            if not cfg.skip_table:  # the table's plot
                check_plotting()
            make_folder(cfg.out, "bench output folder")  # checked before minutes of measuring
        return _measured(cfg, protocol, on_section)


def _measured(cfg: BenchConfig, protocol: BenchProtocol, on_section: Callable[[str, BenchReport], None] | None) -> BenchReport:
    """:func:`run_bench`'s measurements, and its files written where ``cfg.out`` asks."""
    torch.set_num_threads(protocol.threads)
    torch.manual_seed(0)
    # drawn first even with skip_table, so the later random draws (the precision check's models) stay as before
    x = torch.randn(protocol.batch, 3, *protocol.img_size, device=protocol.device)
    report = BenchReport(protocol)
    done = on_section or (lambda section, report: None)
    if not cfg.skip_table:
        report.results = measure_table(protocol, x, cfg.compile)
        if protocol.device.type == "cpu" and protocol.precision == "fp32":
            report.ceilings = fp32_ceilings(report.results, protocol.img_size)
    if protocol.device.type == "cpu":  # what auto tries without calibration images (nothing built)
        report.auto_order = auto_candidates(cpu_features(), False, backend_available)
    done("table", report)
    report.environment = environment(protocol.device)
    if cfg.precision_check:
        run_precision_check(cfg, protocol, report)
        done("precision", report)
    if cfg.train:
        report.training = train_throughput(list(protocol.models), cfg.train_batch, protocol.img_size,
                                           max(1, protocol.warmup), protocol.repeats)
        done("training", report)
    if cfg.out and (report.results or report.precision or report.training):
        report.files = write_report(cfg.out, report.record(), report.results, report.plot_title())
    return report


def run_precision_check(cfg: BenchConfig, protocol: BenchProtocol, report: BenchReport) -> None:
    """Fill ``report.precision``, ``precision_images`` and the measured ``auto`` from the checkpoint."""
    check = checkpoint_precision(
        cfg.checkpoint, cfg.data, protocol.batch, protocol.warmup, protocol.repeats, runtimes=protocol.runtimes,
        compile=cfg.compile, calibration_images=cfg.calibration_images, eval_images=cfg.eval_images,
        train_split=cfg.train_split, val_split=cfg.val_split, trust=cfg.trust_checkpoint)
    report.precision, report.auto, report.noise_floor = check.rows, check.auto, check.noise_floor
    report.precision_images = dict(evaluated=check.evaluated, calibration=check.calibration,
                                   calibration_images=check.calibration_images, evaluated_images=check.evaluated_images,
                                   every=check.evaluated_images >= check.split_images,
                                   img_size=check.img_size)


def measure_table(protocol: BenchProtocol, x: torch.Tensor, compile: bool = True) -> list[Result]:
    """The main table: every candidate built for the protocol and timed round-robin on the batch ``x``."""
    cands = build_candidates(list(protocol.models), list(protocol.peers), x, protocol.precision, protocol.device,
                             compile=compile, runtimes=protocol.runtimes)
    return time_candidates(cands, x, protocol.warmup, protocol.repeats, protocol.device, protocol.precision)
