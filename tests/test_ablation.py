"""The ablation ladder: rung definitions, parameter matching, and `cgavit ablate` end to end with resume."""

import argparse
import itertools
import json
import signal
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from cgavit import create_model
from cgavit.analysis.ablation import runs, study
from cgavit.analysis.ablation import RUNGS, AblationConfig, build_ladder, match_depth, run_ablation, rung_dials
from cgavit.analysis.ablation.ladder import RUNG_TITLES
from cgavit.analysis.ablation.summary import table_markdown
from cgavit.cli import main
from cgavit.cli.ablate import train_args
from cgavit.cli.train import add_train_args, config_from_args
from cgavit.train import TrainConfig

ARCH = dict(embed_dim=(16, 24, 32), num_heads=(2, 2, 2), depth=(1, 1, 1), window_size=(7, 7, 7), kernels=(5, 5, 5, 5))


def test_rung_dials_follow_the_ladder():
    d = {r: rung_dials(r, ARCH) for r in RUNGS}
    assert d["standard"]["ffn_per_side"] == (0, 1) and d["sandwich"]["ffn_per_side"] == (1, 1)
    assert d["standard"]["key_dim"] == (8, 12, 16) and d["standard"]["attn_ratio"] == 1.0  # tied: C/h
    assert [d[r]["group_split"] for r in RUNGS] == [False, False, True, True, True]
    assert [d[r]["cascade"] for r in RUNGS] == [False, False, False, True, True]
    assert [d[r]["ffn_ratio"] for r in RUNGS] == [4.0, 4.0, 4.0, 4.0, 2.0]
    assert d["realloc"]["key_dim"] == (16, 16, 16) and "attn_ratio" not in d["realloc"]
    # each rung builds, and its value width is C/h throughout
    for r in RUNGS:
        m = create_model("m0", num_classes=2, img_size=64, **d[r])
        attn = m.stages[2].blocks[0].mixer.m.attn
        assert attn.value_dim == 16 and attn.cascade == d[r]["cascade"]
    with pytest.raises(ValueError, match="unknown rung"):
        rung_dials("nope", ARCH)


def test_dials_round_trip_through_the_command_line():
    # each run records the `cgavit train` options that repeat it (result.json "train_argv")
    p = argparse.ArgumentParser()
    add_train_args(p)
    for r in RUNGS:
        d = rung_dials(r, ARCH)
        back = config_from_args(p.parse_args(TrainConfig(dials=d).to_argv())).dials
        assert create_model("m0", num_classes=3, **back).cfg == create_model("m0", num_classes=3, **d).cfg


def test_ablation_config_and_train_args():
    assert train_args("--workers 0 --no-model-ema --cascade off --scale 0.5 1") == {
        "workers": 0, "model_ema": False, "scale": [0.5, 1.0], "dials": {"cascade": False},
    }
    assert train_args("") == {}
    with pytest.raises(ValueError, match="--train-args"):
        train_args("--no-such-option 3")
    cfg = AblationConfig(data="d", output="o", epochs=1, seeds=[0, 1], train_args={"workers": 0})
    assert cfg.seeds == (0, 1) and cfg.rungs == RUNGS
    cfg.validate()
    for bad, match in (
        (dict(epochs=0), "--epochs"), (dict(rungs=("nope",)), "--rungs"), (dict(seeds=()), "--seeds"),
        (dict(train_args={"nope": 1}), "--train-args"), (dict(speed_rounds=0), "--speed-rounds"),
        (dict(speed_seconds=float("inf")), "--speed-seconds"), (dict(speed_seconds=float("nan")), "--speed-seconds"),
    ):
        with pytest.raises(ValueError, match=match):
            replace(cfg, **bad).validate()
    variant = build_ladder("m0", dict(embed_dim=(16, 24, 32), num_heads=(2, 2, 2)), 2, 32, rungs=["cascade"],
                           common={"cascade": False})[0][0]
    options = runs.train_options(
        replace(cfg, train_args={"workers": 0, "dials": {"cascade": False}}), variant, 3, "data", "run"
    )
    assert options["seed"] == 3 and options["workers"] == 0 and options["output"] == "run"
    assert options["dials"]["cascade"] is False and options["dials"]["group_split"] is True  # train_args win
    assert options["dials"] == variant.dials  # the model trained is the variant's


def test_train_args_dials_build_every_model_of_the_study(tmp_path):
    """Dials in --train-args changed the model trained, while the throughput models, study.json and the parameter
    matching were built from the ladder's dials alone: a row put one model's params beside another's img/s."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    cfg = AblationConfig(data=str(data), output=str(tmp_path / "o"), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), train_args={"dials": {"ffn_ratio": 3.0, "depth": (1, 1, 1)}})
    prepared = study._prepare_study(cfg, tmp_path / "o")
    written = json.loads((tmp_path / "o" / "study.json").read_text())
    for v, recorded in zip(prepared.variants, written["variants"]):
        assert v.dials["ffn_ratio"] == 3.0 and recorded["dials"]["ffn_ratio"] == 3.0
        assert runs.train_options(cfg, v, 0, "d", "r")["dials"] == v.dials
    assert prepared.matching["base_depth"] == [1, 1, 1]  # architecture fields are the base's (rung 1 stays matched)
    params = {v.rung: sum(p.numel() for p in create_model("m0", num_classes=2, img_size=32, **v.dials).parameters())
              for v in prepared.variants}
    assert (params["standard"], params["sandwich"]) == (prepared.matching["standard_params"], prepared.matching["sandwich_params"])
    with pytest.raises(ValueError, match="--train-args sets embed_dim to other values"):
        build_ladder("m0", dict(embed_dim=(16, 24, 32)), 2, 32, common={"embed_dim": (32, 48, 64)})


def test_a_study_whose_rungs_were_built_otherwise_is_refused(tmp_path):
    """A study begun by an earlier cgavit, whose ladder was built otherwise from the same options, went on: the
    table put its trained runs' params beside models timed from the new ladder, and study.json was rewritten."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    cfg = AblationConfig(data=str(data), output=str(tmp_path / "o"), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2))
    study._prepare_study(cfg, tmp_path / "o")
    written = json.loads((tmp_path / "o" / "study.json").read_text())
    written["variants"][1]["dials"]["ffn_ratio"] = 3.0
    (tmp_path / "o" / "study.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=r"rungs \(sandwich\) were built otherwise"):
        study._prepare_study(cfg, tmp_path / "o")
    with pytest.raises(ValueError, match="--batch-size 7 would leave one image"):  # refused before study.json is written
        replace(cfg, output=str(tmp_path / "odd"), batch_size=7).validate()


def test_head_similarity_images_are_fed_as_the_runs_were(tmp_path, monkeypatch):
    """The study read its head-similarity images with ImageNet's mean/std and bicubic resizing whatever the runs
    were trained and evaluated with."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    seen = {}

    def read(*args, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # nothing more is needed from the study

    monkeypatch.setattr(study, "load_images", read)
    cfg = AblationConfig(data=str(data), output=str(tmp_path / "o"), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), train_args={"mean": (0.1, 0.2, 0.3), "std": (0.3, 0.3, 0.3),
                                                          "interpolation": "bilinear", "crop_pct": 1.0})
    with pytest.raises(KeyboardInterrupt):
        run_ablation(cfg)
    assert seen == dict(crop_pct=1.0, seed=0, mean=(0.1, 0.2, 0.3), std=(0.3, 0.3, 0.3), interpolation="bilinear")


def test_run_only_train_args_do_not_change_the_study(tmp_path):
    """A stopped study resumed with another --workers or without --no-progress was refused as other settings."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    cfg = AblationConfig(data=str(data), output=str(tmp_path / "o"), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), train_args={"workers": 0, "progress": False, "aa": "none"})
    study._prepare_study(cfg, tmp_path / "o")
    study._prepare_study(replace(cfg, train_args={"workers": 3, "aa": "none"}), tmp_path / "o")
    with pytest.raises(ValueError, match=r"other settings \(train_args\)"):
        study._prepare_study(replace(cfg, train_args={"workers": 3}), tmp_path / "o")


def test_the_speed_up_column_names_the_rung_it_is_against():
    rows = [dict(title=RUNG_TITLES[r], rung=r, depth=(1, 1, 1), params=1e6, macs=1e6, top1=[50.0], top1_mean=50.0,
                 top1_sd=float("nan"), head_similarity_mean=0.5, head_similarity_sd=float("nan"),
                 throughput=dict(img_s=100.0 * (i + 1), min=90.0, max=110.0)) for i, r in enumerate(("sandwich", "cascade"))]
    head, _, first, second = table_markdown(rows).splitlines()
    assert "| vs rung 2 |" in head and "| 1.00× |" in first and "| 2.00× |" in second


def test_a_subset_smaller_than_the_classes_is_refused_before_anything_is_written(tmp_path):
    """It wrote the subset's marker and links first, then the class check refused the run, and the corrected
    command was refused for that folder ("made from other data or subset sizes")."""
    data = _dataset(tmp_path / "data")
    classes = len([p for p in (data / "train").iterdir() if p.is_dir()])
    with pytest.raises(ValueError, match=rf"--train-subset 1 is below the number of classes \({classes}\)"):
        runs.prepare_data(data, tmp_path / "study", train_subset=1, val_subset=0)
    assert not (tmp_path / "study").exists()
    assert runs.prepare_data(data, tmp_path / "study", train_subset=classes, val_subset=0) == tmp_path / "study" / "data"


def test_subset_links_keep_every_image_and_a_stopped_subset_is_made_again(tmp_path, monkeypatch):
    """Same-named files in nested folders became one link (12 images -> 6); a subset stopped halfway was taken as
    made on the next run, with more images than its subset.json said."""
    data = _dataset(tmp_path / "data", per_class=3, held=2)
    for c in range(2):
        nested = data / "train" / f"class{c}" / "more"
        nested.mkdir()
        for f in sorted((data / "train" / f"class{c}").glob("*.png")):
            (nested / f.name).write_bytes(f.read_bytes())
    calls = []
    real_symlink = Path.symlink_to

    def stop_on_fifth(self, target, *args):
        calls.append(self)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_symlink(self, target, *args)

    monkeypatch.setattr(Path, "symlink_to", stop_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        runs.prepare_data(data, tmp_path / "study", train_subset=0, val_subset=0)
    assert not (tmp_path / "study" / "data").exists()
    monkeypatch.setattr(Path, "symlink_to", real_symlink)
    dest = runs.prepare_data(data, tmp_path / "study", train_subset=0, val_subset=0)
    assert len(list((dest / "train").rglob("*.png"))) == 12 and len(list((dest / "val").rglob("*.png"))) == 4
    assert not (tmp_path / "study" / "data.partial").exists()
    (tmp_path / "other" / "data").mkdir(parents=True)  # a folder this command did not make is not filled in
    with pytest.raises(ValueError, match="holds no subset.json"):
        runs.prepare_data(data, tmp_path / "other", train_subset=4, val_subset=0)


def test_a_balanced_subset_gives_the_count_asked_for_when_a_class_is_short():
    from cgavit.analysis.data import balanced_subset

    picked = balanced_subset([0] + [1] + [2] * 1000, 1002, 300)
    assert len(picked) == 300 and len(set(picked)) == 300 and {0, 1} <= set(picked)  # was 102


def test_a_signal_after_a_runs_last_epoch_stops_the_study(tmp_path, monkeypatch, capsys):
    """A SIGTERM while a run wrote its last records was logged as received, then the study trained the next rungs
    and exited 0; and a stopped study exited 130 whatever the signal."""
    stopped = SimpleNamespace(interrupted=False, signal=signal.SIGTERM)
    monkeypatch.setattr(runs, "train", lambda cfg: stopped)
    cfg = AblationConfig(data="d", output=str(tmp_path), epochs=1)
    variant = build_ladder("m0", dict(embed_dim=(16, 24, 32), num_heads=(2, 2, 2)), 2, 32, rungs=["cascade"])[0][0]
    options = runs.train_options(cfg, variant, 0, "data", str(tmp_path / "run"))
    with pytest.raises(runs.StudyStopped) as stop:
        runs._train_variant(cfg, variant, 0, options, tmp_path / "run" / "last.pt")
    assert stop.value.signum == signal.SIGTERM

    def stop_study(cfg):
        raise runs.StudyStopped("stopped", signal.SIGTERM)

    monkeypatch.setattr("cgavit.cli.ablate.run_ablation", stop_study)
    assert main(["ablate", "--data", str(tmp_path), "--output", str(tmp_path / "o"), "--epochs", "1"]) == 143


def test_rung_one_is_matched_in_parameters():
    variants, note = build_ladder("m0", dict(embed_dim=(48, 96, 144), num_heads=(3, 3, 3)), 10, 80)
    assert [v.rung for v in variants] == list(RUNGS)
    depth = tuple(note["standard_depth"])
    assert all(a >= b for a, b in zip(depth, note["base_depth"])) and list(depth) == sorted(depth)
    assert abs(note["standard_params"] - note["sandwich_params"]) / note["sandwich_params"] < 0.03
    n = [sum(p.numel() for p in create_model("m0", num_classes=10, img_size=80, **v.dials).parameters()) for v in variants]
    assert n[0] == note["standard_params"] and n[1] == note["sandwich_params"]
    assert n[2] < n[1] and n[3] == n[2] and n[4] < n[3]  # groups shrink Q/K/V; cascade is free; reallocation shrinks


def _depth_by_building_each(model, arch, num_classes, img_size):
    """Rung 1's depth as the search found it before it counted arithmetically: one model built per depth."""
    from cgavit.analysis.ablation.ladder import count_params

    target = count_params(model, rung_dials("sandwich", arch), num_classes, img_size)
    best = None
    for depth in itertools.product(*[range(b, 2 * b + 2) for b in arch["depth"]]):
        if list(depth) == sorted(depth):
            n = count_params(model, rung_dials("standard", {**arch, "depth": depth}), num_classes, img_size)
            best = min(best or ((abs(n - target), sum(depth)), depth, n), ((abs(n - target), sum(depth)), depth, n))
    return best[1], best[2], target


def test_the_arithmetic_depth_search_gives_the_answers_of_building_each_depth():
    """The search built one model per depth (31 s for a base of 8, 8, 8); it now counts them from one model."""
    from cgavit.analysis.ablation.ladder import _base_arch

    for model, overrides, classes, size in (("m0", {}, 10, 32), ("m0", dict(embed_dim=(48, 96, 144), num_heads=(3, 3, 3)), 10, 32)):
        arch = _base_arch(model, overrides)
        assert match_depth(model, arch, classes, size) == _depth_by_building_each(model, arch, classes, size)


def test_rung_one_stays_within_the_depth_a_model_may_have():
    """--depth 16,16,16 was refused with "depth entries must be at most 32 ..., got [16, 16, 33]": the search went
    to 2 x base + 1 whatever the bound; a base with no non-decreasing depth in reach was a TypeError."""
    variants, note = build_ladder("m0", dict(embed_dim=(16, 32, 48), num_heads=(1, 1, 1), depth=(16, 16, 16)), 2, 64,
                                  rungs=["standard"])
    assert all(16 <= d <= 32 for d in note["standard_depth"]) and "d_i <= 32" in note["rule"]
    built = create_model("m0", num_classes=2, img_size=64, **variants[0].dials)
    assert sum(p.numel() for p in built.parameters()) == note["standard_params"]
    assert "d_i <= 32" not in build_ladder("m0", {}, 2, 64, rungs=["standard"])[1]["rule"]  # as a study matched before reads
    with pytest.raises(ValueError, match=r"base depth 32,1,1 \(--depth\).*at most 32.*--depth 1,1,32"):
        build_ladder("m0", dict(depth=(32, 1, 1)), 2, 64)


def test_a_ladder_that_cannot_be_built_is_refused_before_anything_is_written(tmp_path, capsys):
    """--depth 32,1,1, or a --train-args dial no rung can be built with, was refused only when the ladder was built,
    after the data subset was written to the study's folder; validate() now asks the ladder's own checks."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)  # its held-out split is test/: a subset is made
    out = tmp_path / "study"
    for extra, says in ((["--depth", "32,1,1"], "base depth 32,1,1 (--depth)"),
                        (["--train-args", "--depth 32,1,1"], "base depth 32,1,1 (--depth)"),
                        (["--depth", "1,1,1", "--train-args", "--depth 1,1,2"], "--train-args sets depth to other values"),
                        (["--train-args", "--key-dim 0,0,0"], "--key-dim: key_dim entries must be")):
        argv = ["ablate", "--data", str(data), "--output", str(out), "--epochs", "1", "--img-size", "32", *extra]
        assert main(argv) == 2
        assert not out.exists(), extra
        assert says in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"base depth 32,1,1 \(--depth\).*--depth 1,1,32"):
        AblationConfig(data=str(data), output=str(out), epochs=1, depth=(32, 1, 1)).validate()
    AblationConfig(data=str(data), output=str(out), epochs=1, depth=(1, 1, 32)).validate()


def test_data_the_trainer_refuses_is_refused_before_anything_is_written(tmp_path, capsys):
    """Data of one class was refused only by the first run's trainer, after study.json and the subset were written:
    the same command, once a class was added, was refused as "a study whose rungs were built otherwise, by an earlier
    cgavit" (the ladder of one class was recorded), and the subset made from one class stayed one class."""
    import shutil

    data = _dataset(tmp_path / "data", per_class=2, held=1)
    for split in ("train", "test"):
        shutil.move(data / split / "class1", tmp_path / f"{split}_class1")
    out = tmp_path / "study"
    argv = ["ablate", "--data", str(data), "--output", str(out), "--epochs", "1", "--img-size", "32", "--embed-dim",
            "16,24,32", "--num-heads", "2,2,2", "--train-subset", "2", "--val-subset", "2", "--no-throughput"]
    assert main(argv) == 2
    assert "has one class folder (class0)" in capsys.readouterr().err
    assert not out.exists()
    for split in ("train", "test"):
        shutil.move(tmp_path / f"{split}_class1", data / split / "class1")
    cfg = AblationConfig(data=str(data), output=str(out), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), train_subset=2, val_subset=2)
    assert study._prepare_study(cfg, out).classes == ["class0", "class1"]


def test_the_summary_is_written_as_one_set_and_leaves_other_files(tmp_path, monkeypatch):
    """The summary's files were written one by one (a study stopped among them kept new figures beside the old
    ablation.json), and every ablation_*.png it did not draw was deleted: a figure kept in the study's folder, such as
    an analysis saved as ablation_heads_matrices_standard.png (docs/ names them so), went at the next re-run."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    out = tmp_path / "study"

    def measured(variant, seed, *args):  # a finished run's result.json, without the training
        blocks = [dict(stage=0, block=0, num_heads=2, tokens=4, mean_off_diagonal=0.5)]
        return dict(rung=variant.rung, seed=seed, dials={"depth": list(variant.dials["depth"])}, params=1, macs=1,
                    top1=50.0 + len(variant.rung), head_similarity=0.5, head_similarity_blocks=blocks, train_epoch_s=1.0)

    monkeypatch.setattr(study, "run_variant", measured)
    cfg = AblationConfig(data=str(data), output=str(out), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), rungs=("standard",), heads_images=2, no_throughput=True)
    out.mkdir()
    (out / "ablation_heads_matrices_standard.png").write_bytes(b"kept by the user")
    (out / "ablation_speed_accuracy.png").write_bytes(b"an earlier summary's")
    run_ablation(cfg)
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "ablation.json", "ablation_heads.png", "ablation_heads_matrices_standard.png", "ablation_table.md",
        "ablation_top1.png", "study.json"]
    assert (out / "ablation_heads_matrices_standard.png").read_bytes() == b"kept by the user"
    def summary() -> dict:
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "study.json"}

    before = summary()
    draw = study.plot_study

    def stopped(rows, folder):
        draw(rows, folder)
        raise KeyboardInterrupt  # after the figures, before the report and the table

    monkeypatch.setattr(study, "plot_study", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_ablation(replace(cfg, rungs=("sandwich",)))
    assert summary() == before  # the study.json of its ladder is written first, as ever
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_an_output_inside_a_split_of_the_data_is_refused(tmp_path, capsys):
    """--output DATA/train/study wrote study.json there, and the first run refused its own study folder as "a class
    folder that holds no images"; a study beside the splits (DATA/study) is fine."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    for split in ("train", "test"):
        out = data / split / "study"
        assert main(["ablate", "--data", str(data), "--output", str(out), "--epochs", "1", "--img-size", "32", "--batch-size", "2"]) == 2
        assert f"is inside the {split} split of --data" in capsys.readouterr().err
        assert not out.exists()
    AblationConfig(data=str(data), output=str(data / "study"), epochs=1, img_size=32).validate()


def test_an_output_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    """--output FILE/study with a data subset to link was a NotADirectoryError traceback from the subset's mkdir."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)  # held-out split test/: a subset is linked
    (tmp_path / "file").write_text("mine")
    for output in (tmp_path / "file", tmp_path / "file" / "study"):
        assert main(["ablate", "--data", str(data), "--output", str(output), "--epochs", "1", "--img-size", "32",
                     "--batch-size", "2", "--train-subset", "4", "--val-subset", "2"]) == 2
        assert capsys.readouterr().err == (f"cgavit ablate: error: --output {output} cannot be a folder: {tmp_path / 'file'} "
                                           "is a file; give a folder for the study\n")
    assert (tmp_path / "file").read_text() == "mine"


def test_an_empty_output_is_refused(tmp_path, monkeypatch, capsys):
    """--output "" was accepted: the study's folders and files went into the folder the command ran in."""
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for output in ("", " "):
        with pytest.raises(ValueError, match=f"--output must name a folder for the study, got {output!r}"):
            AblationConfig(data=str(data), output=output, epochs=1).validate()
        assert main(["ablate", "--data", str(data), "--output", output, "--epochs", "1", "--no-throughput"]) == 2
        assert "cgavit ablate: error: --output must name a folder" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_a_study_of_one_head_per_block_says_why_its_head_chart_is_empty(tmp_path, monkeypatch):
    """With --num-heads 1,1,1 ablation_heads.png had no bars and no word of why."""
    from cgavit.analysis import plots
    from cgavit.analysis.ablation import summary

    figures, save = {}, plots._save

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    blocks = [dict(stage=s, block=0, num_heads=1, tokens=t, mean_off_diagonal=None) for s, t in enumerate((16, 4, 1))]
    result = dict(rung="standard", seed=0, dials={"depth": [1, 1, 1]}, params=1, macs=1, top1=50.0, head_similarity=None,
                  head_similarity_blocks=blocks, train_epoch_s=1.0)
    for tokens, says in (((16, 4, 1), "no block has two heads over windows of more than one token to compare"),
                         ((16, 4, 4), "no block has two heads to compare")):
        for b, t in zip(blocks, tokens):
            b["tokens"] = t
        summary.plot_study(summary.summarize([result], None, ["standard"]), tmp_path)
        ax = figures.pop("ablation_heads.png").axes[0]
        assert [t.get_text().replace("\n", " ") for t in ax.texts] == [says]  # wrapped to the chart's width
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"stage {i + 1} ({t} tokens)" for i, t in enumerate(tokens)]
    result["head_similarity_blocks"] = [dict(b, num_heads=2, mean_off_diagonal=0.5) for b in blocks]  # bars: no note
    summary.plot_study(summary.summarize([result], None, ["standard"]), tmp_path)
    assert not figures["ablation_heads.png"].axes[0].texts


def test_fewer_head_similarity_images_than_asked_are_said_and_recorded(tmp_path, monkeypatch, caplog):
    """--heads-images above the validation split's images was cut to those without a word, and no result file said
    how many images the head similarity was measured on."""
    data = _dataset(tmp_path / "data", per_class=2, held=3)
    used = []

    def measured(variant, seed, cfg, data_dir, out, heads_batch):  # a finished run's result.json, without the training
        used.append(heads_batch.shape[0])
        blocks = [dict(stage=0, block=0, num_heads=2, tokens=4, mean_off_diagonal=0.5)]
        return dict(rung=variant.rung, seed=seed, dials={"depth": list(variant.dials["depth"])}, params=1, macs=1,
                    top1=50.0, head_similarity=0.5, head_similarity_blocks=blocks, train_epoch_s=1.0)

    monkeypatch.setattr(study, "run_variant", measured)
    cfg = AblationConfig(data=str(data), output=str(tmp_path / "study"), epochs=1, img_size=32, embed_dim=(16, 24, 32),
                         num_heads=(2, 2, 2), rungs=("standard",), heads_images=50, no_throughput=True)
    with caplog.at_level("WARNING", logger=study.log.name):
        run_ablation(cfg)
    assert used == [6]
    assert [r.getMessage() for r in caplog.records] == [
        f"--heads-images 50: the validation split {tmp_path / 'study' / 'data' / 'val'} gives 6 readable images; head similarity is measured on those 6"]
    assert json.loads((tmp_path / "study" / "ablation.json").read_text())["head_similarity_images"] == 6
    caplog.clear()
    run_ablation(replace(cfg, heads_images=6, output=str(tmp_path / "study6")))
    assert not caplog.records  # as many as asked: no word


def test_the_head_similarity_images_are_bounded_as_one_forward_pass():
    """--heads-images had no upper bound: 10**9 passed validate(), and the images were stacked and run as one batch."""
    cfg = AblationConfig(data="d", output="o", epochs=1, img_size=224, heads_images=10**9)
    with pytest.raises(ValueError, match="--heads-images 1000000000 at 224 px are too many.*give --heads-images 1337 or fewer"):
        cfg.validate()
    replace(cfg, heads_images=1337).validate()


def _dataset(root, per_class=20, held=5):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("test", held)):
        for c in range(2):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                a = rng.integers(0, 100, (32, 32, 3), dtype=np.uint8)
                a[..., c] += 150  # red vs green: learnable
                Image.fromarray(a).save(d / f"{i}.png")
    return root


def test_ablate_end_to_end_and_resume(tmp_path, monkeypatch, sigterm_after):
    data = _dataset(tmp_path / "data")
    out = tmp_path / "study"
    calls = []
    real_train = runs.train

    def spy(cfg):
        run = cfg.output
        calls.append((run.split("/runs/")[1], cfg.resume is not None))
        if run.endswith("sandwich/seed0") and cfg.resume is None:
            with sigterm_after(1):  # stopped by SIGTERM after one update
                return real_train(cfg)
        return real_train(cfg)

    monkeypatch.setattr(runs, "train", spy)
    common = [
        "ablate", "--data", str(data), "--output", str(out), "--epochs", "1", "--embed-dim", "16,24,32",
        "--num-heads", "2,2,2", "--depth", "1,1,1", "--img-size", "32", "--batch-size", "8", "--heads-images", "4",
        "--speed-rounds", "1", "--speed-seconds", "0.02",
        "--train-args", "--workers 0 --aa none --mixup 0 --cutmix 0 --reprob 0 --warmup-epochs 0 --no-model-ema --crop-pct 1.0",
    ]
    # a first invocation stopped inside the second variant
    assert main([*common, "--rungs", "standard", "sandwich"]) == 143  # 128 + SIGTERM
    assert calls == [("standard/seed0", False), ("sandwich/seed0", False)]
    assert (out / "runs/standard/seed0/result.json").exists()
    assert (out / "runs/sandwich/seed0/last.pt").exists() and not (out / "runs/sandwich/seed0/result.json").exists()
    done = (out / "runs/standard/seed0/result.json").read_text()
    # the same command for the whole ladder: standard is not retrained, sandwich resumes, the rest train
    calls.clear()
    assert main(common) == 0
    assert calls == [("sandwich/seed0", True), ("groups/seed0", False), ("cascade/seed0", False), ("realloc/seed0", False)]
    assert (out / "runs/standard/seed0/result.json").read_text() == done
    rep = json.loads((out / "ablation.json").read_text())
    assert [r["rung"] for r in rep["rows"]] == list(RUNGS)
    for r in rep["rows"]:
        assert 0 <= r["top1_mean"] <= 100 and r["throughput"]["img_s"] > 0 and r["params"] > 0 and r["macs"] > 0
        assert 0 < r["head_similarity_mean"] <= 1 + 1e-6
    res = json.loads((out / "runs/realloc/seed0/result.json").read_text())
    assert res["val_images"] == 10 and res["dials"]["cascade"] is True and res["head_similarity_images"] == 4
    assert len((out / "ablation_table.md").read_text().strip().splitlines()) == 2 + len(RUNGS)
    for name in ("ablation_top1.png", "ablation_heads.png", "ablation_speed_accuracy.png"):
        assert (out / name).stat().st_size > 0
    assert sorted(p.name for p in (out / "data").iterdir()) == ["subset.json", "train", "val"]  # test/ linked as val
    # a finished study is only re-summarised; other settings in the same folder are refused
    calls.clear()
    assert main([*common, "--no-throughput"]) == 0 and calls == []
    assert not (out / "ablation_speed_accuracy.png").exists()  # the earlier run's plot of figures no longer there
    assert main([*common[:6], "2", *common[7:]]) == 2
    # ... --heads-images too (the finished runs' head similarity was silently kept, measured on other images);
    # and a study run again for fewer rungs keeps the others in its summary (it rewrote it with those alone)
    assert main([*[a if a != "4" else "2" for a in common], "--no-throughput"]) == 2
    assert main([*common, "--no-throughput", "--rungs", "standard"]) == 0 and calls == []
    assert [r["rung"] for r in json.loads((out / "ablation.json").read_text())["rows"]] == list(RUNGS)
    # the analyses read a checkpoint of the study with its architecture and preprocessing
    assert main(["analyze", "heads", "--checkpoint", str(out / "runs/cascade/seed0/last.pt"), "--data", str(data / "test"), "--output", str(tmp_path / "h")]) == 0
    rep = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert rep["img_size"] == 32 and rep["config"]["cascade"] is True and rep["num_images"] == 10


def test_records_are_strict_json_and_bad_ones_are_named(tmp_path):
    """A one-seed study wrote NaN (which strict parsers refuse); a study.json or result.json of {} was a KeyError
    traceback, an empty one a JSON error naming no file; --output naming a file was a NotADirectoryError."""
    from cgavit.analysis.ablation import summary
    from cgavit.analysis.ablation.config import AblationConfig
    from cgavit.analysis.ablation.study import run_ablation
    from cgavit.io import DataError, read_json_record, write_json

    path = write_json(tmp_path / "r.json", {"sd": float("nan"), "rows": [float("inf"), 1.5]})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c)) == {"sd": None, "rows": [None, 1.5]}
    result = dict(rung="standard", seed=0, dials={"depth": [1, 1, 1]}, params=1, macs=1, top1=50.0,
                  head_similarity=None, head_similarity_blocks=[], train_epoch_s=1.0)  # one head: none, read back
    rows = summary.summarize([result], None, ["standard"])
    assert "| 50.00 | 50.00 | n/a |" in summary.table_markdown(rows)
    for text, says in (("", "is not a JSON record"), ("[1]", "a JSON list"), ("{}", "no rung, seed")):
        (tmp_path / "result.json").write_text(text)
        with pytest.raises(DataError, match=f"result.json {says}" if text == "" else says):
            read_json_record(tmp_path / "result.json", runs.RESULT_KEYS)
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(DataError, match="folder.json cannot be read as a record"):
        read_json_record(tmp_path / "folder.json")
    data = _dataset(tmp_path / "data", per_class=2, held=1)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="--output .* is a file"):
        run_ablation(AblationConfig(data=str(data), output=str(tmp_path / "file"), epochs=1))
    assert (tmp_path / "file").read_text() == "mine"
