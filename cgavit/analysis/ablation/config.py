"""The options of one ablation study (``cgavit ablate``)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from ...train import TrainConfig
from ...train.config import train_defaults
from .ladder import RUNGS


@dataclass
class AblationConfig:
    """One study; the fields are the ``cgavit ablate`` options.

    Args:
        data: dataset folder: ``DIR/train/<class>/<img>`` and ``DIR/val`` (or ``DIR/test``).
        output: study folder (per-variant folders, results, table, plots).
        epochs: training epochs of every variant.
        model: base variant whose widths / heads / depths the ladder starts from.
        embed_dim, num_heads, depth: base widths, heads, depths (three values each; default: the
            variant's). Rung 1's depth is matched in parameters to rung 2's.
        img_size: training and evaluation size (pixels).
        batch_size: training batch size.
        lr: peak learning rate (AdamW, cosine).
        seeds: one training run per seed and variant.
        rungs: which rungs to run (of :data:`RUNGS`).
        train_subset, val_subset: use this many images, balanced per class (0 = all).
        heads_images: validation images for the head-similarity measurement.
        threads: torch threads for training.
        train_args: further :class:`~cgavit.train.TrainConfig` fields for every run (dials under
            ``"dials"``; they win over the rung's).
        no_throughput: skip the CPU throughput measurement.
        speed_rounds: interleaved timing rounds per variant (throughput: the median).
        speed_seconds: seconds per timing round.
    """

    data: str
    output: str
    epochs: int
    model: str = "efficientvit_m0"
    embed_dim: tuple[int, ...] | None = None
    num_heads: tuple[int, ...] | None = None
    depth: tuple[int, ...] | None = None
    img_size: int = 224
    batch_size: int = 64
    lr: float = 1e-3
    seeds: tuple[int, ...] = (0,)
    rungs: tuple[str, ...] = RUNGS
    train_subset: int = 0
    val_subset: int = 0
    heads_images: int = 64
    threads: int = 1
    train_args: dict = field(default_factory=dict)
    no_throughput: bool = False
    speed_rounds: int = 5
    speed_seconds: float = 1.0

    def __post_init__(self) -> None:
        self.data, self.output = str(self.data), str(self.output)
        for name in ("embed_dim", "num_heads", "depth"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(getattr(self, name)))
        self.seeds, self.rungs = tuple(self.seeds), tuple(self.rungs)

    def validate(self) -> None:
        """Raise ``ValueError`` for options that cannot work, naming the one to change."""
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")
        if not self.seeds:
            raise ValueError("--seeds needs at least one seed")
        unknown = [r for r in self.rungs if r not in RUNGS]
        if unknown or not self.rungs:
            raise ValueError(f"--rungs must name some of {', '.join(RUNGS)}, got {list(self.rungs)}")
        if self.speed_rounds < 1 or self.speed_seconds <= 0:
            raise ValueError("--speed-rounds must be at least 1 and --speed-seconds positive")
        bad = sorted(set(self.train_args) - set(train_defaults()))
        if bad:
            raise ValueError(f"--train-args names no training option {bad}")
        if self.threads < 1 or self.heads_images < 1 or self.train_subset < 0 or self.val_subset < 0:
            raise ValueError("--threads and --heads-images must be at least 1, --train-subset and --val-subset at least 0")
        budget = dict(data=self.data, model=self.model, epochs=self.epochs, batch_size=self.batch_size, img_size=self.img_size, lr=self.lr)
        owned = sorted(set(self.train_args) & {*budget, "seed", "output", "resume"})
        if owned:
            raise ValueError(f"--train-args cannot set {', '.join(owned)}: the study sets them (use its own options)")
        arch = {k: getattr(self, k) for k in ("embed_dim", "num_heads", "depth") if getattr(self, k) is not None}
        for seed in self.seeds:  # the training options every run gets, within the trainer's bounds
            TrainConfig(**budget, seed=seed, **{**self.train_args, "dials": arch}).check_values()


def ablation_defaults() -> dict[str, object]:
    """``{option: default}`` of :class:`AblationConfig` (None for the required ones)."""
    out: dict[str, object] = {}
    for f in fields(AblationConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory() if f.default_factory is not MISSING else None
    return out
