"""The options of one ablation study (``cgavit ablate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...bounds import check_threads
from ...fields import option
from ...io import file_in_the_way, is_inside
from ...train import TrainConfig
from ...train.config import normalize_dials, train_defaults
from ..reports import MAX_BATCH_PIXELS
from .ladder import RUNGS, base_architecture, rung_dials


@dataclass
class AblationConfig:
    """One study; the fields are the ``cgavit ablate`` options, each documented by its ``help`` text
    (the line ``cgavit ablate --help`` shows for it).

    Args:
        train_args: further :class:`~cgavit.train.TrainConfig` fields for every run. Dials go under ``"dials"``
            and every rung's model is built with them (trained, counted, timed and matched alike): widths, depths,
            heads, windows and kernels set the base architecture, as ``embed_dim`` etc. do; the others win over
            the rung's. The command takes them as ``cgavit train`` options in one string, ``--train-args``.
    """

    data: str = option(help="dataset folder: DIR/train/<class>/<img> and DIR/val (or DIR/test)")
    output: str = option(help="study folder (per-variant folders, results, table, plots)")
    epochs: int = option(help="training epochs of every variant")
    model: str = option("efficientvit_m0", "base variant whose widths/heads/depths the ladder starts from")
    embed_dim: tuple[int, ...] | None = option(None, "base widths, three values (default: the variant's)", sep=",")
    num_heads: tuple[int, ...] | None = option(None, "base heads per stage (default: the variant's)", sep=",")
    depth: tuple[int, ...] | None = option(
        None, "base depths (rungs 2-5; rung 1 is matched in parameters to rung 2; default: the variant's)", sep=","
    )
    img_size: int = option(224, "training and evaluation size in pixels")
    batch_size: int = option(64, "training batch size")
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine)")
    seeds: tuple[int, ...] = option((0,), "one training run per seed and variant")
    rungs: tuple[str, ...] = option(RUNGS, "which rungs to run", choices=RUNGS)
    train_subset: int = option(0, "use this many training images, balanced per class (0 = all)")
    val_subset: int = option(0, "use this many validation images, balanced per class (0 = all)")
    heads_images: int = option(64, "validation images for the head-similarity measurement, run as one batch "
                               f"(at most {MAX_BATCH_PIXELS // 224**2} at 224 px)")
    threads: int = option(1, "torch threads for training")
    train_args: dict = field(default_factory=dict)
    no_throughput: bool = option(False, "skip the CPU throughput measurement")
    speed_rounds: int = option(5, "interleaved timing rounds per variant (throughput: the median)")
    speed_seconds: float = option(1.0, "seconds per timing round")

    def __post_init__(self) -> None:
        self.data, self.output = str(self.data), str(self.output)
        for name in ("embed_dim", "num_heads", "depth"):
            if getattr(self, name) is not None:
                setattr(self, name, tuple(getattr(self, name)))
        self.seeds, self.rungs = tuple(self.seeds), tuple(self.rungs)

    def validate(self) -> None:
        """Raise ``ValueError`` for options that cannot work, naming the one to change."""
        if not self.output.strip():  # Path("") is the current folder: the study would fill the folder it ran in
            raise ValueError(f"--output must name a folder for the study, got {self.output!r}; give e.g. --output studies/ladder")
        blocker = file_in_the_way(self.output)
        if blocker:  # known now, not once the data subset is being linked or a run has trained
            raise ValueError(f"--output {self.output} cannot be a folder: {blocker} is a file; give a folder for the study")
        split = next((s for s in ("train", "val", "test") if is_inside(self.output, Path(self.data) / s)), None)
        if split:  # the runs would read the study's folder as a class (of its figures, or of none), and refuse it
            raise ValueError(f"--output {self.output} is inside the {split} split of --data {self.data}: the study's folders "
                             f"and figures would be read there as a class of images; give an --output outside {Path(self.data) / split}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")
        if not self.seeds:
            raise ValueError("--seeds needs at least one seed")
        unknown = [r for r in self.rungs if r not in RUNGS]
        if unknown or not self.rungs:
            raise ValueError(f"--rungs must name some of {', '.join(RUNGS)}, got {list(self.rungs)}")
        if self.speed_rounds < 1:
            raise ValueError(f"--speed-rounds must be at least 1, got {self.speed_rounds}")
        if not 0 < self.speed_seconds <= 600:  # NaN fails this too
            raise ValueError(f"--speed-seconds must be in (0, 600] seconds per timing round, got {self.speed_seconds}")
        bad = sorted(set(self.train_args) - set(train_defaults()))
        if bad:
            raise ValueError(f"--train-args names no training option {bad}")
        check_threads(self.threads)
        if self.heads_images < 1 or self.train_subset < 0 or self.val_subset < 0:
            raise ValueError("--heads-images must be at least 1, --train-subset and --val-subset at least 0")
        budget = dict(data=self.data, model=self.model, epochs=self.epochs, batch_size=self.batch_size, img_size=self.img_size, lr=self.lr)
        owned = sorted(set(self.train_args) & {*budget, "seed", "output", "resume"})
        if owned:
            raise ValueError(f"--train-args cannot set {', '.join(owned)}: the study sets them (use its own options)")
        arch = {k: getattr(self, k) for k in ("embed_dim", "num_heads", "depth") if getattr(self, k) is not None}
        for seed in self.seeds:  # the training options every run gets, within the trainer's bounds
            run = TrainConfig(**budget, seed=seed, **{**self.train_args, "dials": arch})
            try:
                run.check_values()
            except ValueError as err:  # the study's --seeds, which the trainer calls --seed
                raise ValueError(str(err).replace("--seed ", "--seeds ", 1)) from None
            run.check_batch()
        base, rest = base_architecture(self.model, arch, normalize_dials(self.train_args.get("dials", {})))  # its checks
        for rung in dict.fromkeys(("standard", "sandwich", *self.rungs)):  # the networks built (1, 2: by the matching)
            TrainConfig(**budget, **{**self.train_args, "dials": rung_dials(rung, base, rest)}).check_values()
        most = MAX_BATCH_PIXELS // self.img_size**2  # the head-similarity images run as one batch, as analyze bounds one
        if self.heads_images > most:
            raise ValueError(f"--heads-images {self.heads_images} at {self.img_size} px are too many for the head-similarity "
                             f"measurement's one forward pass; give --heads-images {most} or fewer")

