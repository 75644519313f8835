"""The whole study: data, ladder and ``study.json``, every (rung, seed) not done yet, then the
throughput of all rungs and the summary files (:func:`run_ablation`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...factory import create_model
from ...io import DataError, read_json_record, write_json
from ...train import TrainConfig
from ...train.config import normalize_dials
from ...train.data import list_split
from ..data import load_images
from ..reports import write_outputs
from .config import AblationConfig
from .ladder import RUNGS, Variant, build_ladder
from .runs import prepare_data, run_variant
from .summary import plot_study, summarize, table_markdown
from .throughput import measure_throughput

log = logging.getLogger(__name__)

#: ``--train-args`` options that leave a run's result as it is (where and how it runs, what it prints).
RUN_ONLY = frozenset({"device", "workers", "log_interval", "progress", "trust_checkpoint"})


@dataclass
class StudySummary:
    """What :func:`run_ablation` wrote: one row per rung, the markdown table, the depth matching of
    rung 1, and the files."""

    rows: list[dict]
    table: str
    matching: dict
    json_path: Path
    table_path: Path
    plots: list[Path]


@dataclass
class _Study:
    data_dir: Path
    classes: list[str]
    variants: list[Variant]
    matching: dict
    spec: dict


def finished_runs(out: Path) -> list[tuple[str, int]]:
    """The (rung, seed) runs of the study in ``out`` that finished (their ``result.json`` written)."""
    done = []
    for result in sorted((out / "runs").glob("*/seed*/result.json")):
        rung, seed = result.parent.parent.name, result.parent.name.removeprefix("seed")
        if rung in RUNGS and seed.isdigit():
            done.append((rung, int(seed)))
    return done


def _result_args(train_args: dict) -> dict:
    """``train_args`` without the options that do not change a run's result (:data:`RUN_ONLY`): a study stopped on
    one machine continues on another with other workers or without a progress bar."""
    return {k: v for k, v in train_args.items() if k not in RUN_ONLY}


def _prepare_study(cfg: AblationConfig, out: Path) -> _Study:
    """Data, ladder (the rungs asked for and those the study ran before) and ``study.json``; refuses a folder
    that holds a study with other settings."""
    data_dir = prepare_data(cfg.data, out, cfg.train_subset, cfg.val_subset)
    classes, _ = list_split(data_dir, "train")
    overrides = {k: getattr(cfg, k) for k in ("embed_dim", "num_heads", "depth") if getattr(cfg, k) is not None}
    rungs = {rung for rung, _ in finished_runs(out)} | set(cfg.rungs)  # the study's: those run before stay in it
    variants, note = build_ladder(cfg.model, overrides, len(classes), cfg.img_size, rungs=[r for r in RUNGS if r in rungs],
                                  common=normalize_dials(cfg.train_args.get("dials", {})))
    spec = json.loads(json.dumps(dict(
        model=cfg.model, arch=overrides and {k: list(v) for k, v in overrides.items()}, epochs=cfg.epochs,
        batch_size=cfg.batch_size, img_size=cfg.img_size, lr=cfg.lr, train_args=_result_args(cfg.train_args),
        data=str(Path(cfg.data).resolve()), train_subset=cfg.train_subset, val_subset=cfg.val_subset,
        heads_images=cfg.heads_images,
    )))
    spec_file = out / "study.json"
    variants_json = json.loads(json.dumps([
        dict(rung=v.rung, dials={k: list(x) if isinstance(x, tuple) else x for k, x in v.dials.items()}) for v in variants
    ]))
    if spec_file.exists():
        before = read_json_record(spec_file, ("spec",))
        old = before["spec"]
        if not isinstance(old, dict):
            raise DataError(f"{spec_file} is not a record this command wrote (its spec is no object); move it away, "
                            "or use another --output")
        if isinstance(old.get("train_args"), dict):  # a study written before run-only options were left out
            old["train_args"] = _result_args(old["train_args"])
        if old != spec:
            changed = sorted(k for k in spec if old.get(k) != spec[k])
            raise ValueError(f"{out} holds a study with other settings ({', '.join(changed)}); use another --output or the same options")
        built = {v["rung"]: v["dials"] for v in before.get("variants", [])}
        other = [v["rung"] for v in variants_json if v["rung"] in built and built[v["rung"]] != v["dials"]]
        if other or before.get("matching", note) != json.loads(json.dumps(note)):
            raise ValueError(f"{out} holds a study whose rungs ({', '.join(other) or 'standard'}) were built otherwise, by an "
                             "earlier cgavit, from the same options; its runs are not these models: use another --output")
    write_json(spec_file, dict(spec=spec, matching=note, variants=variants_json))
    return _Study(data_dir, classes, variants, note, spec)


def run_ablation(cfg: AblationConfig) -> StudySummary:
    """Train and measure every (rung, seed) asked for and not done yet, then write the summary of the whole
    study: those runs and the ones it finished before (another ``--rungs`` or ``--seeds`` adds to it).

    Seed-major: a study cut short still has every rung for the first seeds.

    Raises:
        StudyStopped: a training run was stopped by a signal (run the same study again to continue).
        ValueError: bad options, data, or a folder holding a study with other settings.
    """
    cfg.validate()
    torch.set_num_threads(max(1, cfg.threads))
    out = Path(cfg.output)
    t0 = time.perf_counter()
    study = _prepare_study(cfg, out)
    fed = TrainConfig(**cfg.train_args)  # the head-similarity images are fed as the runs are evaluated
    heads_batch, _, _ = load_images([study.data_dir / "val"], cfg.img_size, cfg.heads_images, crop_pct=fed.crop_pct,
                                    seed=0, mean=fed.mean, std=fed.std, interpolation=fed.interpolation)
    if heads_batch.shape[0] < cfg.heads_images:  # a small split (or --val-subset), or images that could not be read
        log.warning("--heads-images %d: the validation split %s gives %d readable images; head similarity is measured "
                    "on those %d", cfg.heads_images, study.data_dir / "val", heads_batch.shape[0], heads_batch.shape[0])
    before = set(finished_runs(out))
    seeds = list(dict.fromkeys([*cfg.seeds, *sorted(seed for _, seed in before)]))
    results = [run_variant(v, seed, cfg, study.data_dir, out, heads_batch) for seed in seeds for v in study.variants
               if (v.rung in cfg.rungs and seed in cfg.seeds) or (v.rung, seed) in before]
    throughput = None
    if not cfg.no_throughput:
        log.info("measuring CPU throughput of %d variants (interleaved)", len(study.variants))
        models = {
            v.rung: create_model(cfg.model, num_classes=len(study.classes), img_size=cfg.img_size, **v.dials)
            for v in study.variants
        }
        throughput = measure_throughput(models, cfg.img_size, rounds=cfg.speed_rounds, seconds=cfg.speed_seconds)
    rows = summarize(results, throughput, [v.rung for v in study.variants])
    table = table_markdown(rows)
    protocol = ("torch.set_num_threads(1), batch 16, fp32, BatchNorm fused, traced, random weights; "
                f"{cfg.speed_rounds} interleaved rounds of ~{cfg.speed_seconds:g} s per variant, median")
    record = dict(
        spec=study.spec, matching=study.matching, seeds=sorted({r["seed"] for r in results}), rows=rows, throughput_protocol=protocol,
        head_similarity_images=heads_batch.shape[0],  # the spec's heads_images is the count asked for
        this_invocation_s=round(time.perf_counter() - t0, 1),
        train_epoch_s_total=round(sum(x["train_epoch_s"] for x in results), 1),
    )
    # one set, as analyze writes its own: a previous summary's speed plot that this one lacks (--no-throughput) goes
    # with it, and no other file of the folder
    json_path, plots = write_outputs(out, "ablation", record, lambda folder: plot_study(rows, folder),
                                     texts={"ablation_table.md": table})
    return StudySummary(rows, table, study.matching, json_path, out / "ablation_table.md", plots)
