"""Prediction on images of any mode and size, class names, export, and the demo's data loader."""

from __future__ import annotations

import errno
import io
import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from cgavit import create_model
from cgavit.cli import main
from cgavit import load_model
from cgavit.images import load_image, to_rgb
from cgavit.imagenet import imagenet_classes
from cgavit.train import predict, train
from cgavit.schema import WeightsMeta
from cgavit.weights import read_weights_meta, save_weights

from test_train import make_folder, tiny

DIALS = dict(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(3, 3))


def _odd_images(folder):
    rng = np.random.default_rng(1)
    rgb = (rng.random((37, 53, 3)) * 255).astype(np.uint8)
    images = {
        "gray.png": Image.fromarray(rgb[..., 0], "L"),
        "la.png": Image.fromarray(rgb[..., 0], "L").convert("LA"),
        "rgba.png": Image.fromarray(rgb).convert("RGBA"),
        "palette.png": Image.fromarray(rgb).convert("P"),
        "palette_alpha.gif": Image.fromarray(rgb).convert("P"),
        "cmyk.jpg": Image.fromarray(rgb).convert("CMYK"),
        "deep16.png": Image.fromarray((rng.random((300, 17)) * 65535).astype(np.uint16)),
        "int32.tif": Image.fromarray((rng.random((20, 900)) * 4000).astype(np.int32), "I"),
        "float.tif": Image.fromarray(rng.random((9, 9)).astype(np.float32), "F"),
        "bilevel.png": Image.fromarray(rgb[..., 0] > 128),
        "tiny.png": Image.fromarray(rgb[:3, :2]),
    }
    paths = []
    for name, img in images.items():
        kw = {"transparency": 0} if name == "palette_alpha.gif" else {}
        img.save(folder / name, **kw)
        paths.append(folder / name)
    return paths


def test_to_rgb_scales_deep_images():
    deep = Image.fromarray(np.array([[0, 65535]], dtype=np.uint16))
    assert np.asarray(to_rgb(deep)).tolist() == [[[0, 0, 0], [255, 255, 255]]]
    clear = Image.new("RGBA", (2, 2), (10, 20, 30, 0))  # fully transparent -> white background
    assert np.asarray(to_rgb(clear))[0, 0].tolist() == [255, 255, 255]
    assert to_rgb(Image.new("CMYK", (3, 3))).mode == "RGB"


def test_a_damaged_exif_block_is_read_quietly_as_stored(tmp_path):
    """Pillow's "Corrupt EXIF data" warning reached predict's output, naming no file (and under -W error refused
    the image)."""
    import warnings

    path = tmp_path / "exif.jpg"
    Image.new("RGB", (8, 6), (200, 10, 10)).save(path, exif=b"Exif\x00\x00II*\x00\x00\xff\xff\xff")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(path).size == (8, 6)


def test_a_16_bit_pgm_is_scaled_by_its_depth_not_its_values(tmp_path):
    # Pillow opens a PGM with maxval above 255 as mode I, scaled to 0-65535; 255 was read as 8-bit white, 256 as black
    grey = {}
    for value, maxval in ((255, 65535), (256, 65535), (65535, 65535), (1023, 1023), (200, 1023)):
        path = tmp_path / f"{value}-{maxval}.pgm"
        path.write_bytes(b"P5 2 2 %d\n" % maxval + np.full(4, value, ">u2").tobytes())
        grey[value, maxval] = int(np.asarray(load_image(path))[0, 0, 0])
    assert grey == {(255, 65535): 1, (256, 65535): 1, (65535, 65535): 255, (1023, 1023): 255, (200, 1023): 50}


def test_predict_any_mode_and_size_with_dataset_names(tmp_path, capsys):
    data = make_folder(tmp_path / "ds", classes=3, train=4, val=1)
    res = train(tiny(data=str(data), epochs=1, output=str(tmp_path / "run")))
    paths = _odd_images(tmp_path)
    for ckpt in ("best.pt", "best.safetensors"):
        rows = predict(paths, tmp_path / "run" / ckpt, topk=5)
        assert [r["image"] for r in rows] == [str(p) for p in paths]
        for r in rows:
            probs = [t["prob"] for t in r["top"]]
            assert len(r["top"]) == 3  # only 3 classes
            assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-5
            assert {t["name"] for t in r["top"]} == set(res.classes)
    meta = read_weights_meta(tmp_path / "run" / "best.safetensors")  # written with the run's WeightsMeta
    assert meta.model == "efficientvit_m0" and meta.class_names == tuple(res.classes) and meta.img_size == 32
    assert meta.config.embed_dim == (16, 32, 48) and meta.extra["epoch"] == "0" and "val_top1" in meta.extra
    assert main(["predict", str(paths[0]), "--checkpoint", str(tmp_path / "run" / "best.safetensors")]) == 0
    assert "class_" in capsys.readouterr().out
    (tmp_path / "bad.png").write_bytes(b"nope")
    assert main(["predict", str(tmp_path / "bad.png"), "--checkpoint", str(tmp_path / "run" / "best.pt")]) == 2
    assert "bad.png" in capsys.readouterr().err


def test_predict_imagenet_names_for_third_party_files(tmp_path, capsys):
    assert len(imagenet_classes()) == 1000 and imagenet_classes()[0][0] == "n01440764"
    model = create_model("m0", num_classes=1000, **DIALS).eval()
    save_weights(model, tmp_path / "w.safetensors")  # no model name, but the architecture is recorded
    assert load_model(tmp_path / "w.safetensors")[0].cfg == model.cfg
    torch.save({"model": model.state_dict()}, tmp_path / "bare.pth")  # a foreign file records nothing
    with pytest.raises(ValueError, match="--model"):
        load_model(tmp_path / "bare.pth")
    torch.save({"model": model.state_dict()}, tmp_path / "w.pth")
    img = tmp_path / "x.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(img)
    args = ["predict", str(img), "--checkpoint", str(tmp_path / "w.pth"), "--model", "m0", "--json"]
    args += ["--embed-dim", "16,32,48", "--depth", "1,1,1", "--num-heads", "2,2,2", "--kernels", "3,3"]
    assert main(args) == 0
    top = json.loads(capsys.readouterr().out)[0]["top"]
    names = [d.split(",")[0] for _, d in imagenet_classes()]
    assert len(top) == 5 and all(t["name"] == names[t["index"]] and "synset" in t for t in top)
    with torch.no_grad():  # the file's weights were used: same top-1 as the model itself
        loaded, _ = load_model(tmp_path / "w.pth", "m0", DIALS)
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
            assert torch.equal(a, b)


def test_predict_text_aligns_ranks_of_ten_and_more(tmp_path, capsys):
    """With --topk 12 the ranks 10-12 pushed their lines one column right of ranks 1-9."""
    save_weights(create_model("m0", num_classes=20, img_size=32, **DIALS).eval(), tmp_path / "w.safetensors")
    img = tmp_path / "x.png"
    Image.new("RGB", (40, 40), (20, 200, 30)).save(img)
    assert main(["predict", str(img), "--checkpoint", str(tmp_path / "w.safetensors"), "--topk", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 12 and lines[0].startswith("   1. ") and lines[11].startswith("  12. ")
    assert len({line.index("%") for line in lines}) == 1


def test_predict_takes_one_path_as_one_image(tmp_path):
    """`predict("cat.png", ...)` read the name as a list of its characters: 7 rows of 'image c does not exist', ...;
    a Path was a TypeError (not iterable)."""
    save_weights(create_model("m0", num_classes=3, img_size=32, **DIALS).eval(), tmp_path / "w.safetensors")
    img = tmp_path / "cat.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(img)
    for one in (str(img), img):
        rows = predict(one, tmp_path / "w.safetensors", topk=1)
        assert [r["image"] for r in rows] == [str(img)] and len(rows[0]["top"]) == 1, rows
    assert [r["image"] for r in predict((img, img), tmp_path / "w.safetensors")] == [str(img)] * 2  # any sequence


class _FullDisk(io.StringIO):
    """Standard output redirected to a file on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_output_to_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    """`cgavit predict ... > results.txt` on a full disk ended in OSError's traceback (exit 1)."""
    save_weights(create_model("m0", num_classes=3, img_size=32, **DIALS).eval(), tmp_path / "w.safetensors")
    img = tmp_path / "cat.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(img)
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert main(["predict", str(img), "--checkpoint", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["cgavit predict: error: cannot write the command's output (standard output): the disk "
                                "is full; free some space and run again"], err


def test_eval_holds_workers_to_training_s_bound(tmp_path, capsys):
    """`cgavit train -j 5000` was refused (0..1024) while `cgavit eval -j 5000` started 5000 loader processes."""
    from cgavit.train.inference import check_eval_options

    with pytest.raises(ValueError, match=r"--workers within 0\.\.1024, got 1 and 5000"):
        check_eval_options(None, None, 1, 5000)  # before any process starts
    check_eval_options(None, None, 1, 1024)
    data = make_folder(tmp_path / "ds", classes=2, train=1, val=1)
    save_weights(create_model("m0", num_classes=2, img_size=32, **DIALS).eval(), tmp_path / "w.safetensors")
    assert main(["eval", "--data", str(data), "--checkpoint", str(tmp_path / "w.safetensors"), "-j", "5000"]) == 2
    assert "--workers within 0..1024" in capsys.readouterr().err


def test_eval_refuses_an_unknown_interpolation_in_one_line(tmp_path):
    """evaluate_checkpoint(interpolation="cubic") loaded the model, then raised a bare KeyError('cubic') from timm's
    table; it is a ValueError naming the choices, before the model is read."""
    from cgavit.train import evaluate_checkpoint

    data = make_folder(tmp_path / "ds", classes=2, train=1, val=1)
    with pytest.raises(ValueError, match=r"--interpolation must be one of bicubic, bilinear, nearest, got 'cubic'"):
        evaluate_checkpoint(data, tmp_path / "never-read.safetensors", interpolation="cubic", workers=0)


def test_eval_of_a_folder_of_splits_without_val_says_to_name_one(tmp_path, capsys, caplog):
    """A dataset of train/ and test/ (no val/) was read as two classes named 'train' and 'test': a checkpoint with
    class names was refused with 'give the folder the model was trained on', and a 2-class file without names was
    evaluated on the training and test images with the split names as labels, without a word. Both now name
    --split test; with the split named, nothing is said."""
    data = make_folder(tmp_path / "ds", classes=2, train=1, val=1)
    (data / "val").rename(data / "test")
    model = create_model("m0", num_classes=2, img_size=32, **DIALS).eval()
    save_weights(model, tmp_path / "bare.safetensors")  # no class names: matched to folders by count
    named = WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=2, img_size=32, crop_pct=0.875,
                        class_names=("class_0", "class_1"))
    save_weights(model, tmp_path / "named.safetensors", named)
    run = ["eval", "--data", str(data), "--workers", "0", "--checkpoint"]
    assert main([*run, str(tmp_path / "named.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "'test', 'train' hold folders of their own" in err and "--split test" in err, err
    assert len(err.strip().splitlines()) == 1, err
    with caplog.at_level("WARNING"):
        assert main([*run, str(tmp_path / "bare.safetensors")]) == 0
    assert "evaluating 'test', 'train' as class folders" in caplog.text and "--split test" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main([*run, str(tmp_path / "named.safetensors"), "--split", "test"]) == 0
    assert "--split" not in caplog.text
    assert "on " + str(data / "test") in capsys.readouterr().out


def test_weights_in_the_older_training_layout_still_load(tmp_path):
    from safetensors.torch import save_file

    model = create_model("m0", num_classes=3, img_size=64, **DIALS).eval()
    old = {  # what `cgavit train` wrote before WeightsMeta: the variant name and the dials it changed
        "format": "cgavit", "model": "efficientvit_m0", "dials": json.dumps({k: list(v) for k, v in DIALS.items()}),
        "class_names": json.dumps(["a", "b", "c"]), "img_size": "64", "crop_pct": "1.0", "interpolation": "bicubic",
        "mean": json.dumps([0.3] * 3), "std": json.dumps([0.4] * 3), "distillation": "False", "epoch": "3",
    }
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "old.safetensors"), metadata=old)
    loaded, info = load_model(tmp_path / "old.safetensors")
    assert loaded.cfg == model.cfg and info.class_names == ["a", "b", "c"]
    assert (info.img_size, info.crop_pct, info.mean, info.std) == (64, 1.0, (0.3,) * 3, (0.4,) * 3)
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_one_epoch_demo_has_no_warm_up_to_warn_about():
    """`cgavit demo --epochs 1` warned "give --warmup-epochs below --epochs", an option the demo does not take."""
    from cgavit.train.demo import demo_config

    assert demo_config("d", "r", epochs=1).warmup_epochs == 0 and demo_config("d", "r").warmup_epochs == 1


def test_a_one_epoch_demo_says_one_epoch():
    """`cgavit demo --epochs 1` printed '1 epochs in 4 s'."""
    from cgavit.train.demo import summary_lines

    report = dict(held_out_top1=90.0, held_out_images=360, held_out_top5=99.0, train_wall_s=4.0, total_cpu_s=8.0,
                  curves="c.png", checkpoint="last.pt", weights="model.safetensors")
    assert ", 1 epoch in 4 s" in summary_lines({**report, "epochs": 1}, "out")[0]
    assert ", 3 epochs in 4 s" in summary_lines({**report, "epochs": 3}, "out")[0]


def test_demo_data_loader(tmp_path):
    from sklearn.datasets import load_digits

    from cgavit.train.demo import IMG_SIZE, demo_config, write_digits
    from cgavit.train.distributed import DistEnv
    from cgavit.train.data import check_layout
    from cgavit.train.recipe import build_loaders

    split = write_digits(tmp_path / "digits")
    assert (split["train"], split["val"]) == (1437, 360)
    layout = check_layout(tmp_path / "digits")
    assert layout["classes"] == [str(i) for i in range(10)]
    # the held-out split is disjoint from the training split and keeps the class balance
    train_ids = {p.rsplit("/", 1)[1] for p, _ in layout["train"]}
    val_ids = {p.rsplit("/", 1)[1] for p, _ in layout["val"]}
    assert not train_ids & val_ids and len(train_ids | val_ids) == 1797
    counts = np.bincount([c for _, c in layout["val"]], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    # pixels are the digits' 0..16 intensities scaled to 0..255
    digits = load_digits()
    path, label = layout["val"][0]
    idx = int(path.rsplit("/", 1)[1][:4])
    assert label == digits.target[idx]
    np.testing.assert_array_equal(np.asarray(Image.open(path)), np.round(digits.images[idx] * 255 / 16).astype(np.uint8))

    cfg = replace(demo_config(tmp_path / "digits", tmp_path / "run"), workers=0)
    loaders = build_loaders(cfg, DistEnv(), layout)
    loader_train, loader_val = loaders.train, loaders.val
    batch = next(iter(loader_val))
    assert batch.images.shape == (64, 3, IMG_SIZE, IMG_SIZE) and batch.images.dtype == torch.float32
    assert batch.labels.tolist() == [c for _, c in layout["val"][:64]]
    loader_train.sampler.set_epoch(0)
    batch = next(iter(loader_train))
    assert batch.images.shape == (64, 3, IMG_SIZE, IMG_SIZE) and not batch.bad
    assert len(loader_train) == 1437 // 64


def test_a_folder_of_every_class_in_another_order_is_not_called_a_subset(tmp_path, caplog):
    """A checkpoint whose class names are not in sorted order, evaluated on a folder of all of them, was warned
    about as "evaluating 10 of the checkpoint's 10 classes"; a real subset is still said."""
    from cgavit import ModelInfo
    from cgavit.train.inference import split_for_model

    make_folder(tmp_path / "data", classes=3, train=1, val=1, size=8)
    names = ["class_2", "class_0", "class_1"]
    info = ModelInfo(names, img_size=8, names_recorded=True)
    with caplog.at_level("WARNING", logger="cgavit.train.inference"):
        classes, samples = split_for_model(tmp_path / "data" / "val", info, 3)
    assert classes == names and sorted(label for _, label in samples) == [0, 1, 2]
    assert "of the checkpoint's" not in caplog.text
    with caplog.at_level("WARNING", logger="cgavit.train.inference"):
        split_for_model(tmp_path / "data" / "val", replace(info, class_names=[*names, "class_3"]), 4)
    assert "evaluating 3 of the checkpoint's 4 classes" in caplog.text


def test_a_one_channel_model_is_evaluated_and_predicts_from_the_command_line(tmp_path, capsys):
    """A 1-channel model (in_chans=1), as a checkpoint or exported, could not be used by eval and predict: they fed
    RGB and the model said "convert them (grayscale or RGB)", which no flag could do. Images are now read with the
    model's channels (greyscale for 1), normalised by its mean and std (three averaged for one channel)."""
    from cgavit.deploy import export_model
    from cgavit.testing import randomize_
    from cgavit.train.data import build_transform
    from cgavit.weights import WeightsMeta

    model = randomize_(create_model("m0", num_classes=2, img_size=32, in_chans=1), seed=4).eval()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    meta = WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=2, img_size=32, crop_pct=1.0,
                       interpolation="bilinear", mean=mean, std=std, class_names=("p", "q"), in_chans=1)
    checkpoint = save_weights(model, tmp_path / "gray.safetensors", meta)
    _, info = load_model(checkpoint)
    exported = export_model(model, tmp_path / "gray.onnx", "onnx", 32, info=info)
    rng = np.random.default_rng(0)
    for name in ("p", "q"):
        (tmp_path / "data" / name).mkdir(parents=True)
        Image.fromarray((rng.random((40, 40, 3)) * 255).astype(np.uint8)).save(tmp_path / "data" / name / "0.png")
    image = tmp_path / "data" / "q" / "0.png"
    grey = build_transform(32, False, interpolation="bilinear", crop_pct=1.0, mean=(0.4,), std=(0.25,))(
        Image.open(image).convert("L"))
    with torch.no_grad():
        expected = model(grey[None]).softmax(1)[0]
    for path in (checkpoint, exported):
        assert main(["predict", "--checkpoint", str(path), str(image), "--json"]) == 0, capsys.readouterr().err
        top = json.loads(capsys.readouterr().out)[0]["top"]
        assert {row["name"]: row["prob"] for row in top} == pytest.approx({"p": float(expected[0]),
                                                                           "q": float(expected[1])}, abs=1e-4)
        assert main(["eval", "--data", str(tmp_path / "data"), "--checkpoint", str(path), "--workers", "0",
                     "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["n"] == 2
    # the file beside the checkpoint it was exported from: normalised alike once the channels take the values (it
    # was refused, three values against their one average); a reference of other channels is named as such
    eval_ref = ["eval", "--data", str(tmp_path / "data"), "--workers", "0", "--json"]
    assert main([*eval_ref, "--checkpoint", str(exported), "--reference", str(checkpoint)]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["agreement"] == pytest.approx(100.0)
    rgb = save_weights(create_model("m0", num_classes=2, img_size=32).eval(), tmp_path / "rgb.safetensors", replace(meta, in_chans=3))
    assert main([*eval_ref, "--checkpoint", str(checkpoint), "--reference", str(rgb)]) == 2
    assert "--reference rgb.safetensors takes 3-channel images and the model evaluated 1-channel ones" in capsys.readouterr().err
