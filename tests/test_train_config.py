"""TrainConfig: the official recipe as defaults, resume, validation, the command line that spells it, and
the layering of the training package (no argparse, our own imports at module top)."""

from __future__ import annotations

import dataclasses
import argparse
import ast
import math
import os
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import cgavit
from cgavit.cli.train import TRAIN_FIELDS, add_train_args, config_from_args
from cgavit.factory import create_model
from cgavit.train import TrainConfig, TrainResult
from cgavit.train import checkpoint as ckpt_io
from cgavit.train.config import DIAL_NAMES, NOT_RESUMED, train_defaults
from cgavit.train.demo import demo_config
from cgavit.train.recipe import build_optimizer, build_scheduler, peak_lr
from cgavit.io import CheckpointError

PACKAGE = Path(cgavit.__file__).parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cgavit train")
    add_train_args(p)
    return p


def test_defaults_are_the_official_recipe():
    c = TrainConfig()
    assert (c.lr_base, c.lr_base_size, c.lr) == (1e-3, 512, None)  # lr = 1e-3 x total batch / 512
    assert (c.opt, c.weight_decay, c.epochs, c.warmup_epochs, c.warmup_lr, c.min_lr) == ("adamw", 0.025, 300, 5, 1e-6, 1e-5)
    assert (c.clip_grad, c.clip_mode) == (0.02, "agc")
    assert (c.mixup, c.cutmix, c.smoothing, c.reprob, c.aa) == (0.8, 1.0, 0.1, 0.25, "rand-m9-mstd0.5-inc1")
    assert (c.model_ema, c.model_ema_decay, c.aug_repeats, c.batch_size, c.seed) == (True, 0.99996, 3, 256, 0)
    assert (c.img_size, c.crop_pct, c.interpolation, c.model, c.dials) == (224, 0.875, "bicubic", "efficientvit_m0", {})
    # the rest of the official main.py's defaults (cooldown: its loop stops at --epochs; drop path: its model has none)
    assert (c.opt_eps, c.cooldown_epochs, c.sched_on_updates, c.drop_path, c.drop) == (1e-8, 0, False, 0.0, 0.0)
    assert (c.mixup_prob, c.mixup_switch_prob, c.color_jitter, c.hflip, c.scale) == (1.0, 0.5, 0.4, 0.5, (0.08, 1.0))
    assert (c.distillation_type, c.distillation_alpha, c.distillation_tau, c.model_ema_eval) == ("none", 0.5, 1.0, False)


def test_the_recipe_builds_the_official_optimizer_and_schedule():
    """AdamW (betas 0.9/0.999, eps 1e-8) at 1e-3 x total batch / 512; weight decay 0.025 on every weight of two or
    more dimensions but the attention-bias tables (``no_weight_decay()``, as the official model and timm's port name
    them), none on norms and biases; the cosine stepped per epoch from 1e-6, 5 warm-up epochs, min lr 1e-5 after 300."""
    model = create_model("efficientvit_m0", num_classes=10, distillation=True)
    cfg = TrainConfig()
    lr = peak_lr(cfg, 8)  # the paper's 8 x 256
    assert lr == pytest.approx(4e-3)
    optimizer = build_optimizer(model, cfg, lr)
    assert type(optimizer) is torch.optim.AdamW
    assert all(g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8 for g in optimizer.param_groups)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]}
    tables = model.no_weight_decay()
    assert len(tables) == 6 and all(n.endswith("attention_biases") for n in tables)  # one per attention block
    assert decayed == {n for n, p in model.named_parameters() if p.ndim > 1} - tables
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.025}
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=100)
    lrs = {}
    for epoch in (0, 1, 4, 5, 299, 300):
        scheduler.step(epoch)
        lrs[epoch] = optimizer.param_groups[0]["lr"]
    assert lrs[0] == 1e-6 and lrs[1] == pytest.approx(1e-6 + (lr - 1e-6) / 5) and lrs[4] < lrs[5] < lr
    assert lrs[5] == pytest.approx(1e-5 + (lr - 1e-5) * (1 + math.cos(math.pi * 5 / 300)) / 2)
    assert lrs[299] == pytest.approx(1e-5, rel=0.02) and lrs[300] == 1e-5


def test_values_are_normalised():
    c = TrainConfig(data=Path("d"), output=Path("o"), mean=[0.5, 0.5, 0.5], scale=[0.5, 1], dials={"kernels": 3, "depth": [1, 1, 1]})
    assert (c.data, c.output, c.mean, c.scale) == ("d", "o", (0.5, 0.5, 0.5), (0.5, 1.0))
    assert c.dials == {"kernels": (3,), "depth": (1, 1, 1)}
    with pytest.raises(ValueError, match="unknown design dial"):
        TrainConfig(dials={"heads": 3})


def test_validate_names_the_option_to_change():
    ok = TrainConfig(data="d")
    ok.validate()
    cases = [
        (dict(data=None), "--data"),
        (dict(epochs=0), "--epochs"),
        (dict(batch_size=0), "--batch-size"),
        (dict(img_size=16), "--img-size"),
        (dict(workers=-1), "--workers"),
        (dict(crop_pct=1.5), "--crop-pct"),
        (dict(model_ema_decay=1.0), "--model-ema-decay"),
        (dict(drop=1.0), "--drop"),
        (dict(interpolation="lanczos"), "--interpolation"),
        (dict(clip_mode="max"), "--clip-mode"),
        (dict(distillation_type="soft"), "--teacher"),
        (dict(teacher="resnet18"), "--distillation-type"),
        (dict(finetune="a.pt", resume="b.pt"), "not both"),
        (dict(model="nope"), "nope"),
        (dict(dials={"cascade": "yes"}), "cascade"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            replace(ok, **change).validate()


def test_drop_is_the_classifiers_dropout():
    from cgavit.train.recipe import build_model
    assert build_model(TrainConfig(data="d", drop=0.25), 10).head.drop.p == 0.25
    assert not hasattr(build_model(TrainConfig(data="d"), 10).head, "drop")  # none in the official recipe


def _fake_checkpoint(path: Path, record: dict) -> Path:
    ckpt_io.save(path, {"model": {}, "optimizer": {}, "scheduler": {}, "next_epoch": 1, "args": record})
    return path


def test_resume_takes_the_stored_options_and_the_given_ones_win(tmp_path):
    stored = TrainConfig(
        data="d", epochs=7, seed=3, lr=0.5, workers=2, device="cpu", log_interval=5, progress=True,
        finetune="w.pt", output="elsewhere", dials={"cascade": False, "depth": (1, 1, 1)},
    )
    (tmp_path / "run").mkdir()
    ck = _fake_checkpoint(tmp_path / "run" / "last.pt", stored.to_record())
    c = TrainConfig.resume_from(ck, epochs=9, dials={"num_heads": (4, 4, 4)})  # M0's own heads, spelled out
    assert (c.data, c.epochs, c.seed, c.lr) == (os.path.abspath("d"), 9, 3, 0.5)  # stored, except what was given
    assert c.dials == {"cascade": False, "depth": (1, 1, 1), "num_heads": (4, 4, 4)}  # a dial given adds only itself
    with pytest.raises(ValueError, match=r"--depth 2,2,2 \(the run has 1,1,1\)"):  # another network: refused (issue 19)
        TrainConfig.resume_from(ck, dials={"depth": (2, 2, 2)})
    assert c.resume == str(ck) and c.output == str(tmp_path / "run")  # the folder the checkpoint is in now
    defaults = TrainConfig()
    for name in NOT_RESUMED - {"resume"}:  # steer one invocation only: never from the checkpoint
        assert getattr(c, name) == getattr(defaults, name), name
    said = dataclasses.fields(TrainConfig)[[f.name for f in dataclasses.fields(TrainConfig)].index("resume")].metadata
    for name in NOT_RESUMED - {"resume", "finetune"}:  # --resume's help names each ("taken from it" was said of all)
        assert f"--{name.replace('_', '-')}" in str(said), name
    c = TrainConfig.resume_from(ck, output="new", workers=0)
    assert (c.output, c.workers) == ("new", 0)
    with pytest.raises(CheckpointError):
        TrainConfig.resume_from(tmp_path / "missing.pt")


def test_older_checkpoint_records_still_resume(tmp_path):
    # as `cgavit train` stored them before: argparse's namespace, with the command's own keys beside
    record = {**TrainConfig(data="d", epochs=4).to_record(), "command": "train", "verbose": False, "debug": False}
    del record["cooldown_epochs"]  # an option a run of an older version did not have
    record.update(kernels=3, scale=[0.5, 1.0])
    c = TrainConfig.resume_from(_fake_checkpoint(tmp_path / "last.pt", record))
    assert (c.epochs, c.cooldown_epochs, c.scale, c.dials) == (4, 0, (0.5, 1.0), {"kernels": (3,)})


def test_record_round_trip_and_layout():
    c = TrainConfig(data="d", mean=(0.1, 0.2, 0.3), dials={"cascade": False, "embed_dim": (16, 32, 48)})
    record = c.to_record()
    assert record["mean"] == [0.1, 0.2, 0.3] and record["cascade"] is False and record["key_dim"] is None
    assert "dials" not in record and set(DIAL_NAMES) <= set(record)
    assert TrainConfig.from_record(record) == replace(c, data=os.path.abspath("d"))  # the files read: absolute


def test_cli_defaults_are_the_dataclass_defaults():
    defaults = train_defaults()
    assert set(TRAIN_FIELDS) == set(defaults) - {"dials"}  # every option has a flag; the dials have theirs
    assert config_from_args(_parser().parse_args(["--data", "d"])) == TrainConfig(data="d")
    assert all(f.name == "dials" or f.metadata["help"] for f in fields(TrainConfig))


def test_every_training_flag_help_is_its_field_help_and_the_dataclass_default():
    # one text per option: the --help line is the field's metadata help, then the default the dataclass
    # gives (none for switches and None); nothing in cgavit/cli restates either
    actions = {a.dest: a for a in _parser()._actions}
    for f in fields(TrainConfig):
        if f.name == "dials":
            continue
        action, default, text = actions[f.name], train_defaults()[f.name], f.metadata["help"]
        assert action.default is argparse.SUPPRESS, f.name  # typed options can be told from defaults
        if default is None or isinstance(action, argparse._StoreTrueAction):
            assert action.help == text, f.name
            continue
        if isinstance(default, bool):
            assert isinstance(action, argparse.BooleanOptionalAction), f.name  # --x / --no-x
            shown = "on" if default else "off"
        else:
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else str(default)
        assert action.help == f"{text} (default: {shown})", f.name
    assert actions["batch_size"].option_strings == ["--batch-size", "-b"]
    assert actions["workers"].option_strings == ["--workers", "-j"]
    assert actions["mean"].nargs == 3 and actions["scale"].metavar == ("MIN", "MAX")
    assert actions["interpolation"].choices == ("bicubic", "bilinear", "nearest")
    assert "interrupt_after" not in actions and "interrupt_after" not in train_defaults()  # no test-only option


def test_to_argv_spells_the_config_for_the_command_line():
    c = TrainConfig(
        data="d", epochs=3, lr=2e-3, scale=(0.6, 1.0), model_ema=False, progress=False, sched_on_updates=True,
        mean=(0.3, 0.3, 0.3), dials={"cascade": False, "key_dim": (8, 8, 16), "attn_ratio": 1.0, "kernels": (3,)},
    )
    assert config_from_args(_parser().parse_args(c.to_argv())) == c
    assert TrainConfig().to_argv() == []
    demo = demo_config("digits", "run")
    assert config_from_args(_parser().parse_args(demo.to_argv())) == demo


def test_typed_flags_win_on_resume_from_the_command_line(tmp_path):
    ck = _fake_checkpoint(tmp_path / "last.pt", TrainConfig(data="d", epochs=7, seed=3).to_record())
    c = config_from_args(_parser().parse_args(["--resume", str(ck), "--epochs", "8", "--cascade", "on"]))
    assert (c.epochs, c.seed, c.resume, c.dials) == (8, 3, str(ck), {"cascade": True})
    with pytest.raises(ValueError, match="--cascade off"):  # a typed dial that makes another network is refused
        config_from_args(_parser().parse_args(["--resume", str(ck), "--cascade", "off"]))


def test_result_to_dict_keeps_the_summary_keys():
    r = TrainResult(
        best_top1=1.0, best_top5=2.0, best_epoch=0, final_top1=1.0, final_top5=2.0, final_loss=0.5, epochs=1,
        output="o", checkpoint="o/best.pt", last="o/last.pt", weights="o/best.safetensors", curves="o/curves.png",
        wall_s=1.0, skipped_images=0, interrupted=False, signal=None, world_size=1, classes=["a"],
    )
    assert list(r.to_dict()) == [f.name for f in fields(TrainResult)]
    assert list(r.to_dict())[:3] == ["best_top1", "best_top5", "best_epoch"] and r.to_dict()["classes"] == ["a"]


def _library_files() -> list[Path]:
    return sorted((PACKAGE / "train").rglob("*.py")) + sorted((PACKAGE / "analysis" / "ablation").glob("*.py"))


def test_training_library_has_no_argparse_and_imports_our_modules_at_the_top():
    for path in _library_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name != "argparse" for a in node.names), path
            elif isinstance(node, ast.ImportFrom):
                assert node.module != "argparse", path
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    assert node.level == 0 and not (node.module or "").startswith("cgavit"), f"{path}:{node.lineno}"
                elif isinstance(node, ast.Import):
                    assert not any(a.name.startswith("cgavit") for a in node.names), f"{path}:{node.lineno}"


def test_the_color_jitter_help_says_which_policies_jitter():
    """--help said colour jitter is ignored whenever --aa is set, yet timm jitters under --aa 3a (DeiT III's 3-Augment)."""
    from torchvision.transforms import ColorJitter

    from cgavit.train.data import build_transform

    text = {f.name: f for f in fields(TrainConfig)}["color_jitter"].metadata["help"]
    for aa, jitters in (("rand-m9-mstd0.5-inc1", False), ("3a", True), (None, True)):
        steps = build_transform(32, True, auto_augment=aa, color_jitter=0.4).transforms
        assert any(isinstance(t, ColorJitter) for t in steps) == jitters, aa
    assert "ignored when --aa is set" in text and "but for --aa 3a" in text, text
