"""The one schema for untrusted checkpoints (cgavit.schema): tensors of the wrong kind, metadata of
unbounded structure, strings that would rewrite the terminal, and arguments of the wrong type all end
in one clear line (exit 2) or a ValueError, never a traceback, a hang or silent nonsense."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import cgavit
from cgavit.cli import main
from cgavit.io import CheckpointError, DataError
from cgavit.schema import WeightsMeta
from cgavit.train.data import list_split
from cgavit.train.inference import split_for_model
from cgavit.weights import save_weights

TINY = dict(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(3, 3))
CLASSES = ["a", "b", "c"]


def _model() -> torch.nn.Module:
    return cgavit.create_model("efficientvit_m0", num_classes=3, img_size=64, **TINY).eval()


def _record() -> dict:
    return {"model": "efficientvit_m0", "img_size": 64, "crop_pct": 1.0, "interpolation": "bilinear",
            **{k: list(v) for k, v in TINY.items()}}


def _training_checkpoint(path, sd, classes=CLASSES, args=None):
    torch.save({"format": "cgavit-train/1", "model": sd, "model_ema": None, "optimizer": {}, "scheduler": {},
                "next_epoch": 1, "args": args or _record(), "classes": classes}, path)
    return path


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    return path


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _sd() -> dict:
    return {k: v.clone() for k, v in _model().state_dict().items()}


def _sparse(sd):
    sd["head.linear.weight"] = sd["head.linear.weight"].to_sparse()
    return sd


def _on_meta(sd):
    sd["head.linear.weight"] = torch.empty(sd["head.linear.weight"].shape, device="meta")
    return sd


def _zero_dim(sd):
    sd["patch_embed.conv1.conv.weight"] = torch.tensor(0.5)
    return sd


def _complex(sd):
    sd["head.linear.weight"] = sd["head.linear.weight"].to(torch.complex64)
    return sd


def _integer_key(sd):
    sd[7] = torch.zeros(1)
    return sd


def _bias(shape):
    def change(sd):
        key = next(k for k in sd if k.endswith("attention_biases"))
        sd[key] = torch.zeros(shape)
        return sd

    return change


TENSOR_ATTACKS = {
    "integer key": (_integer_key, "printable text"),
    "0-dim value": (_zero_dim, "shape mismatch"),
    "sparse tensor": (_sparse, "sparse"),
    "meta tensor": (_on_meta, "meta device"),
    "complex tensor": (_complex, "complex"),
    "bias table (2, 5)": (_bias((2, 5)), "window side squared"),
    "bias table (2, 0)": (_bias((2, 0)), "window side squared"),
    "bias table (2, 3000000)": (_bias((2, 3_000_000)), "window side squared"),
}


@pytest.mark.parametrize("attack", list(TENSOR_ATTACKS))
def test_tensors_of_the_wrong_kind_give_one_line(attack, tmp_path, image, capsys):
    change, words = TENSOR_ATTACKS[attack]
    path = _training_checkpoint(tmp_path / "c.pt", change(_sd()))
    assert words in _one_line(capsys, ["predict", str(image), "--checkpoint", str(path)])
    with pytest.raises(CheckpointError, match=words):
        cgavit.load_model(path)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int64])
def test_integer_and_bool_weights_are_refused_not_cast(dtype, tmp_path, image, capsys):
    """An all-bool file predicted "prob": NaN (invalid JSON) with exit 0 before."""
    model = _model()
    meta = WeightsMeta("efficientvit_m0", model.cfg, 3, img_size=64, class_names=tuple(CLASSES))
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata=meta.to_strings())
    line = _one_line(capsys, ["predict", str(image), "--checkpoint", str(path), "--json"])
    assert str(dtype) in line and "floating-point" in line


def test_bias_tables_of_the_wrong_shape_stop_the_explorer_at_startup(tmp_path):
    path = _training_checkpoint(tmp_path / "c.pt", _bias((2, 5))(_sd()))
    run = subprocess.run([sys.executable, "-m", "cgavit", "explore", "--checkpoint", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "window side squared" in run.stderr


def _safetensors_with(tmp_path, **changes):
    model = _model()
    meta = dict(WeightsMeta("efficientvit_m0", model.cfg, 3, img_size=64, class_names=tuple(CLASSES)).to_strings())
    meta.update(changes)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("field", ["class_names", "config"])
def test_deeply_nested_metadata_is_refused(field, tmp_path, image, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    line = _one_line(capsys, ["predict", str(image), "--checkpoint", str(_safetensors_with(tmp_path, **{field: deep}))])
    assert "nested deeper" in line


@pytest.mark.parametrize("name", ["a\x00b", "evil\rname", "\u202etxt.exe", "\x1b[31mred\x1b[0m", "tab\there", ""])
def test_class_names_that_would_rewrite_the_terminal_are_refused(name, tmp_path, image, capsys):
    names = json.dumps(["a", name, "c"])
    line = _one_line(capsys, ["predict", str(image), "--checkpoint", str(_safetensors_with(tmp_path, class_names=names))])
    assert "class name 1" in line
    assert line.isprintable()  # the offending name is shown escaped
    path = _training_checkpoint(tmp_path / "c.pt", _sd(), classes=["a", name, "c"])
    assert "class name 1" in _one_line(capsys, ["predict", str(image), "--checkpoint", str(path)])


def test_eval_checks_the_folders_against_the_checkpoints_classes(tmp_path, capsys):
    """A checkpoint trained on a, b, c evaluated on b/, d/ reported top-1 0.0 and exit 0 before."""
    path = save_weights(_model(), tmp_path / "w.safetensors",
                        WeightsMeta("efficientvit_m0", _model().cfg, 3, img_size=64, class_names=tuple(CLASSES)))
    rng = np.random.default_rng(0)

    def folder(root, classes):
        for c in classes:
            (root / c).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / c / "0.png")
        return root

    line = _one_line(capsys, ["eval", "--data", str(folder(tmp_path / "bd", ["b", "d"])), "--checkpoint", str(path), "-j", "0"])
    assert "class folders are not the checkpoint's classes: 'd' is not among them" in line
    assert "'x', 'y' are not among them" in _one_line(capsys, ["eval", "--data", str(folder(tmp_path / "xy", ["x", "y"])),
                                                             "--checkpoint", str(path), "-j", "0"])
    assert main(["eval", "--data", str(folder(tmp_path / "c", ["c"])), "--checkpoint", str(path), "-j", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 1  # a subset of the classes is evaluated, matched by name
    _, info = cgavit.load_model(path)
    classes, samples = split_for_model(tmp_path / "c", info, 3)
    assert classes == CLASSES and [label for _, label in samples] == [2]  # "c" is the checkpoint's class 2, not 0


@pytest.mark.parametrize("kwargs, words", [
    ({"ffn_ratio": 0.01}, "no hidden channel"),
    ({"key_dim": True}, "whole numbers"),
    ({"num_classes": True}, "num_classes"),
    ({"num_classes": 5.0}, "num_classes"),
    ({"num_classes": "10"}, "num_classes"),
    ({"img_size": 64.0}, "img_size"),
    ({"embed_dim": (64.5, 128, 192)}, "whole numbers"),
    ({"cascade": np.bool_(True)}, "True or False"),
])
def test_create_model_refuses_arguments_of_the_wrong_type(kwargs, words):
    with pytest.raises(ValueError, match=words):
        cgavit.create_model("efficientvit_m0", **kwargs)


def test_create_model_takes_numpy_integers():
    model = cgavit.create_model("efficientvit_m0", num_classes=np.int64(4), img_size=np.int32(64), num_heads=np.int16(2))
    assert model.num_classes == 4 and model.img_size == (64, 64) and model.cfg.num_heads == (2, 2, 2)


def test_an_empty_batch_gives_empty_logits():
    model = _model()
    x = torch.randn(0, 3, 64, 64)
    assert model(x).shape == (0, 3)
    fast = cgavit.optimize(model, torch.randn(2, 3, 64, 64), backend="torch", compile=False)
    assert fast(x).shape == (0, 3)


def test_optimize_needs_an_example_image_and_says_so():
    with pytest.raises(ValueError, match="at least one image"):
        cgavit.optimize(_model(), torch.randn(0, 3, 64, 64))


def test_class_folders_the_checkpoint_could_not_record_are_refused_before_training(tmp_path):
    """A run on a folder named with an ANSI escape would train, then write a checkpoint its own
    predict refuses: the data layout refuses the name first, escaped."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("ok", "evil\x1b[2J"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / split / c / "0.png")
    with pytest.raises(DataError, match=r"printable text.*evil\\x1b\[2J"):
        list_split(tmp_path, "train")


def test_metadata_holding_an_integer_too_long_to_read_is_refused_without_pythons_advice():
    """An exported file's img_size holding a 5,000-digit number was refused with Python's own message, which told the
    user to raise the interpreter's limit with sys.set_int_max_str_digits(). It is refused as a value no valid file
    holds, naming the key."""
    from cgavit.deploy.metadata import ExportInfo

    props = ExportInfo(img_size=(32, 32)).to_props()
    with pytest.raises(ValueError, match="'cgavit.img_size' holds an integer of more digits than Python reads") as err:
        ExportInfo.from_props({**props, "cgavit.img_size": "[" + "9" * 5000 + ", 32]"})
    assert "set_int_max_str_digits" not in str(err.value)
