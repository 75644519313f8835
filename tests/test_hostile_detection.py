"""Hostile inputs for ``cgavit detect`` and the bounds of the analysis commands' arguments (#13).

Every command that reads a file gets zero-byte, truncated, wrong-format, folder, FIFO, unreadable and
missing paths, and files that declare huge sizes; every bounded option gets values past its bounds.
Each must end with a non-zero exit and one line on stderr, never a traceback, a hang or a crash.
Cases that could hang (FIFOs) or kill the process (pycocotools on a huge run-length mask) or blow up
memory run in one subprocess with a timeout and an address-space limit; the rest call
``cgavit.cli.main`` in-process. The COCO schema is fuzzed with hypothesis.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

pytest.importorskip("torchvision")
pytest.importorskip("pycocotools")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cgavit import create_model  # noqa: E402
from cgavit.cli import main  # noqa: E402
from cgavit.detection import CocoDetection, check_coco, load_detector, write_shapes_dataset  # noqa: E402
from cgavit.detection.checkpoint import CHECKPOINT_FORMAT, check_against_tensors, check_config  # noqa: E402
from cgavit.detection.coco import coco_metrics, decode_masks, encode_masks, segmentation_rle  # noqa: E402
from cgavit.detection.engine import param_groups, plot_losses, read_checkpoint  # noqa: E402
from cgavit.detection.models import build_detector, detector_resize, resize_problem  # noqa: E402
from cgavit.detection.schema import compressed_counts, segmentation_problem  # noqa: E402
from cgavit.io import DataError, save_torch  # noqa: E402
from cgavit.io import CheckpointError  # noqa: E402
from cgavit.train.distributed import DistEnv, RunLock  # noqa: E402

SIZE = 64
ROOT = os.geteuid() == 0  # root reads files whatever their permissions
CONFIG = dict(kind="retinanet", backbone="efficientvit_m0", num_classes=4, categories=[[1, "square"], [3, "circle"], [7, "triangle"]],
              freeze_bn=False, dials={}, min_size=SIZE, max_size=SIZE, model_kwargs={})


pytestmark = pytest.mark.usefixtures("one_thread")  # detection tests run on one intra-op thread


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small shapes dataset, an (untrained) detection checkpoint and an ImageNet-style backbone file."""
    root = tmp_path_factory.mktemp("hostile")
    train_dir, train_json = write_shapes_dataset(root, 2, SIZE, seed=0, split="train")
    val_dir, val_json = write_shapes_dataset(root, 2, SIZE, seed=1, split="val")
    ckpt = save_torch(root / "model.pth", dict(format=CHECKPOINT_FORMAT, config=CONFIG, model=build_detector(CONFIG).state_dict()))
    backbone = save_torch(root / "m0.pth", create_model("efficientvit_m0").state_dict())
    return dict(root=root, train_images=train_dir, train_json=train_json, val_images=val_dir, val_json=val_json,
                checkpoint=ckpt, backbone=backbone, image=val_dir / "val_00000.png")


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` pixels in a few dozen bytes (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _hostile(kind: str, good: Path, folder: Path) -> Path:
    """A file standing where ``good`` should: zero-byte, truncated, text, a folder, unreadable, missing, a FIFO."""
    path = folder / f"{kind}-{good.name}"
    if kind == "zero-byte":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "text":
        path.write_text("this is not the file you are looking for\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "unreadable":
        path.write_bytes(good.read_bytes())
        path.chmod(0)
    elif kind == "fifo":
        os.mkfifo(path)
    return path  # "missing": nothing there


def _commands(files: dict, role: str, path: Path, out: Path) -> list[str]:
    """The ``cgavit`` argv that reads ``path`` as ``role``."""
    train = ["detect", "train", "--backbone", "m0", "--train-bn", "--device", "cpu", "--workers", "0", "--epochs", "1",
             "--min-size", str(SIZE), "--max-size", str(SIZE), "--output", str(out)]
    data = ["--train-json", str(files["train_json"]), "--train-images", str(files["train_images"])]
    val = ["--val-json", str(files["val_json"]), "--val-images", str(files["val_images"])]
    return {
        "train --train-json": [*train, "--train-json", str(path), "--train-images", str(files["train_images"])],
        "train --train-images": [*train, "--train-json", str(files["train_json"]), "--train-images", str(path)],
        "train --pretrained-backbone": [*train, *data, "--pretrained-backbone", str(path)],
        "train --resume": [*train, *data, "--resume", str(path)],
        "eval --checkpoint": ["detect", "eval", "--checkpoint", str(path), *val, "--workers", "0", "--device", "cpu"],
        "eval --val-json": ["detect", "eval", "--checkpoint", str(files["checkpoint"]), "--val-json", str(path),
                            "--val-images", str(files["val_images"]), "--workers", "0", "--device", "cpu"],
        "predict --checkpoint": ["detect", "predict", str(files["image"]), "--checkpoint", str(path), "--device", "cpu",
                                 "--out", str(out / "drawn.png")],
        "predict IMAGE": ["detect", "predict", str(path), "--checkpoint", str(files["checkpoint"]), "--device", "cpu",
                          "--out", str(out / "drawn.png")],
    }[role]


ROLES = {  # role -> the good file a hostile one replaces
    "train --train-json": "train_json", "train --train-images": "train_images", "train --pretrained-backbone": "backbone",
    "train --resume": "checkpoint", "eval --checkpoint": "checkpoint", "eval --val-json": "val_json",
    "predict --checkpoint": "checkpoint", "predict IMAGE": "image",
}


def _one_error_line(err: str, command: str = "detect") -> str:
    """The error line of a failed command, checking it is the only line and no traceback was printed."""
    assert "Traceback" not in err, err
    lines = [line.split("\r")[-1] for line in err.split("\n")]  # what a terminal shows: progress bars overwritten
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"cgavit {command}: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------- files, in-process
@pytest.mark.parametrize("kind", ["zero-byte", "truncated", "text", "folder", "unreadable", "missing"])
@pytest.mark.parametrize("role", list(ROLES))
def test_hostile_file_gives_one_line(files, role, kind, tmp_path, capsys):
    good = Path(files[ROLES[role]])
    if good.is_dir() and kind in ("truncated", "unreadable"):
        pytest.skip("not a file")
    if kind == "unreadable" and ROOT:
        pytest.skip("root reads any file")
    path = _hostile(kind, good, tmp_path)
    if good.is_dir() and kind == "folder":
        path = files["train_json"]  # a file where a folder should be
    capsys.readouterr()
    assert main(_commands(files, role, path, tmp_path / "out")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(path) in line or path.name in line, line
    assert not (tmp_path / "out" / "model.pth").exists() and not (tmp_path / "out" / "checkpoint.pth").exists()


# ------------------------------------------------------ hangs, crashes and memory, in a subprocess
SUBPROCESS_CASES = textwrap.dedent(
    """
    import contextlib, io, json, re, resource, sys
    import torch
    torch.set_num_threads(1)
    from cgavit.cli import main
    import cgavit.detection.checkpoint, cgavit.detection.annotations  # everything imported before the limit
    vm = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + 1536 * 2**20, resource.RLIM_INFINITY))
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results[name] = [code, err.getvalue()]
        print(json.dumps({name: results[name]}), flush=True)
    """
)


def _forged_checkpoint(path: Path, config: dict, state: dict | None = None) -> Path:
    state = build_detector(CONFIG).state_dict() if state is None else state
    return save_torch(path, dict(format=CHECKPOINT_FORMAT, config={**CONFIG, **config}, model=state))


def _huge_window_state() -> dict:
    """Weights whose attention-bias tables honestly match a 200x200 window: small to store, but the
    model's index tables would take 200**4 entries per block."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build_detector(CONFIG).state_dict().items()}
    return {k: torch.zeros((s[0], 200 * 200) if k.endswith("attention_biases") else s) for k, s in shapes.items()}


def test_hangs_crashes_and_memory_blow_ups_end_in_one_line(files, tmp_path):
    root = tmp_path
    coco = json.loads(Path(files["train_json"]).read_text())
    coco["annotations"][0]["segmentation"] = {"size": [1_000_000, 1_000_000], "counts": "abc"}  # pycocotools segfaults
    huge_rle = root / "huge_rle.json"
    huge_rle.write_text(json.dumps(coco))
    bomb = root / "bomb.png"
    bomb.write_bytes(_png_header(20_000, 20_000))
    fifos = {suffix: _hostile("fifo", Path(f"good.{suffix}"), root) for suffix in ("json", "pth", "png")}
    cases = {
        "fifo --train-json": _commands(files, "train --train-json", fifos["json"], root / "o1"),
        "fifo --checkpoint": _commands(files, "eval --checkpoint", fifos["pth"], root / "o2"),
        "fifo --pretrained-backbone": _commands(files, "train --pretrained-backbone", fifos["pth"], root / "o3"),
        "fifo IMAGE": _commands(files, "predict IMAGE", fifos["png"], root / "o4"),
        "RLE size 1e6": _commands(files, "train --train-json", huge_rle, root / "o5") + ["--model", "maskrcnn"],
        "20000x20000 image": _commands(files, "predict IMAGE", bomb, root / "o6"),
        "num_classes 2e6": _commands(files, "predict --checkpoint", _forged_checkpoint(
            root / "classes.pth", dict(num_classes=2_000_000)), root / "o7"),
        "embed_dim 4096": _commands(files, "eval --checkpoint", _forged_checkpoint(
            root / "wide.pth", dict(dials={"embed_dim": [4096, 4096, 4096]})), root / "o8"),
        "window 200": _commands(files, "predict --checkpoint", _forged_checkpoint(
            root / "window.pth", dict(dials={"window_size": [200, 200, 200]}), _huge_window_state()), root / "o9"),
    }
    cases = {k: [str(a) for a in v] for k, v in cases.items()}
    res = subprocess.run([sys.executable, "-c", SUBPROCESS_CASES, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, f"exit {res.returncode} after {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    results = {k: v for line in res.stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
    assert set(results) == set(cases), res.stdout
    expected = {
        "fifo --train-json": "not a regular file", "fifo --checkpoint": "not a regular file",
        "fifo --pretrained-backbone": "not a regular file", "fifo IMAGE": "not a regular file",
        "RLE size 1e6": "run-length 'size' [1000000, 1000000] disagrees", "20000x20000 image": "too large to decode",
        "num_classes 2e6": "'num_classes' must be an integer in 2..", "embed_dim 4096": "embed_dim entries must be at most",
        "window 200": "window_size entries must be at most",
    }
    for name, (code, err) in results.items():
        assert code == 2, (name, err)
        assert expected[name] in _one_error_line(err), (name, err)


# ----------------------------------------------------------------------------------- COCO schema
def _write(tmp: Path, data: dict, name: str = "ann.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(data))
    return path


def _edited(files: dict, edit) -> dict:
    data = json.loads(Path(files["train_json"]).read_text())
    edit(data)
    return data


@pytest.mark.parametrize(
    "edit, names",
    [
        (lambda d: d["images"][0].update(file_name=5), ["image 1", "'file_name'"]),
        # a file name out of the image folder made the loader read any image on the machine
        (lambda d: d["images"][0].update(file_name="/etc/passwd"), ["image 1", "'file_name'", "inside the image folder"]),
        (lambda d: d["images"][0].update(file_name="../other/x.png"), ["image 1", "no '..'"]),
        (lambda d: d["images"][0].update(file_name="a\\..\\..\\x.png"), ["image 1", "no '..'"]),
        (lambda d: d["images"][0].update(width="96"), ["image 1", "'width'", "'96'"]),
        (lambda d: d["images"][0].update(height=-3), ["image 1", "'height'", "-3"]),
        (lambda d: d["images"][0].update(width=0), ["image 1", "'width'"]),
        (lambda d: d["images"][0].update(width=100_000, height=100_000), ["image 1", "megapixel"]),
        (lambda d: d["images"][0].update(id=[1]), ["images[0]", "'id'"]),
        (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), ["annotation 1", "bbox [1, 2, 3]"]),
        (lambda d: d["annotations"][0].update(bbox=[True, 2, 3, 4]), ["annotation 1", "bbox"]),
        (lambda d: d["annotations"][0].update(bbox=[1, 2, 10**400, 4]), ["annotation 1", "bbox"]),
        (lambda d: d["annotations"][0].update(image_id={"a": 1}), ["annotation 1", "'image_id'"]),
        (lambda d: d["annotations"][0].update(iscrowd="yes"), ["annotation 1", "'iscrowd'"]),
        (lambda d: d["annotations"][0].update(area="big"), ["annotation 1", "'area'"]),
        (lambda d: d["categories"][0].update(name=[1]), ["category 1", "'name'"]),
    ],
)
def test_malformed_coco_fields_are_named(files, tmp_path, edit, names, capsys):
    path = _write(tmp_path, _edited(files, edit))
    with pytest.raises(DataError) as err:
        check_coco(path, files["train_images"])
    for name in [str(path), *names]:
        assert name in str(err.value), str(err.value)
    assert main(["detect", "train", "--train-json", str(path), "--train-images", str(files["train_images"]),
                 "--output", str(tmp_path / "o")]) == 2
    _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "seg, why",
    [
        ({"size": [1_000_000, 1_000_000], "counts": "abc"}, "disagrees with the image's"),
        ({"size": [SIZE, SIZE], "counts": [SIZE * SIZE + 1]}, "cover 4097 pixels"),  # decoding would overrun its buffer
        ({"size": [SIZE, SIZE], "counts": "0"}, "cover 0 pixels"),
        ({"size": [SIZE, SIZE], "counts": "\x7f\x7f"}, "not a valid compressed"),
        ({"size": [SIZE, SIZE], "counts": "o"}, "not a valid compressed"),  # ends inside a count
        ({"size": "64", "counts": "abc"}, "'size' must be [height, width]"),
        ({"size": [SIZE, SIZE], "counts": 5}, "'counts' must be"),
        ([[0, 0, 10, 0, 1e9, 1e9]], "far outside"),  # the rasteriser would allocate in proportion
        ([[0, 0, 10, "a", 5, 5]], "finite x, y numbers"),
        ([[0, 0, 10, 0, 10, 10, 5]], "polygon 1 has 7 numbers, an odd count"),  # pycocotools dropped the 5 silently
        ([[0, 0, 10, 0, 10, 10], [1, 2, 3]], "polygon 2 has 3 numbers, an odd count"),
        ("mask", "polygons (a list) or run-length"),
    ],
)
def test_masks_are_checked_before_pycocotools_sees_them(files, tmp_path, seg, why):
    path = _write(tmp_path, _edited(files, lambda d: d["annotations"][0].update(segmentation=seg)))
    with pytest.raises(DataError, match="annotation 1 .*" + why.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_coco(path, files["train_images"], require_masks=True)
    with pytest.raises(DataError, match="cannot use a mask"):
        segmentation_rle(seg, SIZE, SIZE)


@pytest.mark.parametrize("name", ["\x1b[2J\x1b]0;owned\x07square", "circle\r", "tri\u202eelgna", "a\x00b", "", "x" * 1025])
def test_category_names_that_would_rewrite_the_terminal_are_refused(files, tmp_path, name, capsys):
    """`detect predict` printed the names a training file gave its categories, escape sequences and all
    (and the checkpoint reader refuses such names, so the trained run could not be used)."""
    path = _write(tmp_path, _edited(files, lambda d: d["categories"][0].update(name=name)))
    with pytest.raises(DataError, match=r"category 1: 'name' must be printable text of 1 to 1024 characters"):
        check_coco(path, files["train_images"])
    argv = ["detect", "train", "--train-json", str(path), "--train-images", str(files["train_images"]), "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    assert _one_error_line(capsys.readouterr().err).isprintable() and not (tmp_path / "o").exists()


def test_predicted_file_names_reach_the_terminal_escaped(files, tmp_path, capsys):
    image = tmp_path / "\x1b]0;owned\x07\x1b[2J\u202e.png"  # set the title, clear the screen, reverse the line
    image.write_bytes(Path(files["image"]).read_bytes())
    assert main(["detect", "predict", str(image), "--checkpoint", str(files["checkpoint"]), "--device", "cpu",
                 "--out", str(tmp_path / "drawn")]) == 0
    out = capsys.readouterr().out
    assert out and all(line.isprintable() for line in out.splitlines()) and "\\x1b]0;owned" in out, out


def test_a_newline_in_a_predicted_file_name_cannot_forge_a_line(files, tmp_path, capsys):
    """A name holding a newline printed a line of its own: here a forged result for another image."""
    image = tmp_path / "a.png\nb.png: 5 detections >= 0.5 -> forged.png"
    image.write_bytes(Path(files["image"]).read_bytes())
    assert main(["detect", "predict", str(image), "--checkpoint", str(files["checkpoint"]), "--device", "cpu",
                 "--out", str(tmp_path / "drawn")]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("  ")]
    assert len(heads) == 1 and "a.png\\nb.png" in heads[0], heads


def test_image_sizes_come_from_the_files_and_crowd_masks_are_checked(files, tmp_path):
    half = _write(tmp_path, _edited(files, lambda d: d["images"][0].pop("width")), "half.json")
    with pytest.raises(DataError, match="image 1: needs both 'width' and 'height', or neither"):
        check_coco(half, files["train_images"])
    # docs/detection.md: an entry without them takes its file's; Mask R-CNN's masks too (they were refused)
    no_size = _write(tmp_path, _edited(files, lambda d: [d["images"][0].pop(k) for k in ("width", "height")]))
    for masks in (False, True):
        image = check_coco(no_size, files["train_images"], require_masks=masks).dataset["images"][0]
        assert (image["width"], image["height"]) == (SIZE, SIZE)
    # a size that is not the file's stopped training an epoch in, at the image's first load
    wrong = _write(tmp_path, _edited(files, lambda d: d["images"][1].update(width=SIZE + 16)), "wrong.json")
    with pytest.raises(DataError, match=rf"image 2 \(train_00001.png\): the entry says {SIZE + 16}x{SIZE}, the file is {SIZE}x{SIZE}"):
        check_coco(wrong, files["train_images"])

    def crowd(d):
        d["annotations"][0].update(iscrowd=1, segmentation={"size": [SIZE + 1, SIZE], "counts": [SIZE * SIZE + SIZE]})
    with pytest.raises(DataError, match="annotation 1 .*disagrees"):  # COCOeval decodes crowd masks too
        check_coco(_write(tmp_path, _edited(files, crowd)), files["train_images"], require_masks=True)


def test_odd_and_empty_polygons_are_refused_or_skipped_by_name(files, tmp_path, capsys):
    """Issue 19: polygons of odd length, or empty, trained silently (crowd regions were not looked at)."""
    def seg(segmentation, crowd):
        return lambda d: d["annotations"][0].update(segmentation=segmentation, iscrowd=crowd)

    odd = _write(tmp_path, _edited(files, seg([[4, 4, 24, 4, 24, 24, 9]], 1)), "odd.json")
    with pytest.raises(DataError, match=r"annotation 1 \(image 1 train_00000.png\): 'segmentation': polygon 1 has 7 numbers"):
        check_coco(odd, files["train_images"], require_masks=True)
    argv = ["detect", "train", "--model", "maskrcnn", "--train-json", str(odd), "--train-images", str(files["train_images"]),
            "--output", str(tmp_path / "o")]
    assert main(argv) == 2 and "polygon 1 has 7 numbers" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
    assert check_coco(odd, files["train_images"]).dataset  # RetinaNet trains on boxes and never reads segmentation
    for empty, says in (([], "empty segmentation"), ([[]], "polygon 1 has 0 points"), ([[1, 2, 3, 4]], "polygon 1 has 2 points")):
        for crowd in (0, 1):
            path = _write(tmp_path, _edited(files, seg(empty, crowd)), "empty.json")
            check = check_coco(path, files["train_images"], require_masks=True)
            assert check.skipped == [f"annotation 1 (image 1 train_00000.png): {says} (a polygon needs 3 or more)"
                                     if "points" in says else f"annotation 1 (image 1 train_00000.png): {says} (no polygon)"]
            assert all(a["id"] != 1 for a in check.dataset["annotations"])
            with pytest.raises(DataError, match="refused with --strict"):
                check_coco(path, files["train_images"], require_masks=True, strict=True)


def test_json_that_is_no_coco_file(files, tmp_path):
    for text in ("[" * 100_000 + "]" * 100_000, "1" * 5000, "[1, 2]", '{"images": 5, "categories": []}', "\xff\xfe"):
        path = tmp_path / "x.json"
        path.write_bytes(text.encode("latin-1"))
        with pytest.raises(DataError, match=str(path)):
            check_coco(path, files["train_images"])


def test_missing_area_is_the_box_area(files, tmp_path):
    path = _write(tmp_path, _edited(files, lambda d: d["annotations"][0].pop("area")))
    ann = check_coco(path, files["train_images"]).dataset["annotations"][0]
    assert ann["area"] == ann["bbox"][2] * ann["bbox"][3]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
COUNTS = st.text(alphabet=st.characters(min_codepoint=48, max_codepoint=111), max_size=12) | st.text(max_size=6)
HOSTILE = st.one_of(  # what one field of an entry may hold instead of its good value
    JSON,
    st.integers(-(2**70), 2**70),
    st.lists(st.floats(-1e12, 1e12) | st.integers(-(2**60), 2**60), max_size=8),
    st.lists(st.lists(st.floats(-1e4, 1e4) | st.integers(-(2**60), 2**60), max_size=10), max_size=3),
    st.fixed_dictionaries({"size": st.lists(st.integers(-5, 10**7), max_size=3) | st.just([SIZE, SIZE]) | JSON,
                           "counts": COUNTS | st.lists(st.integers(-5, SIZE * SIZE), max_size=6) | JSON}),
)
GOOD_IMAGE = {"id": 1, "file_name": "train_00000.png", "width": SIZE, "height": SIZE}
GOOD_ANNOTATIONS = [  # a polygon mask and a run-length one
    {"id": 1, "image_id": 1, "category_id": 3, "bbox": [4, 4, 20, 20], "iscrowd": 0, "area": 400.0,
     "segmentation": [[4, 4, 24, 4, 24, 24, 4, 24]]},
    {"id": 1, "image_id": 1, "category_id": 7, "bbox": [30, 30, 10, 10], "iscrowd": 0, "area": 64.0,
     "segmentation": {"size": [SIZE, SIZE], "counts": [30 * SIZE + 30, 8, 56, 8, SIZE * SIZE - 30 * SIZE - 30 - 72]}},
]


def _edited_entry(good: dict, edits: list[tuple[str, bool, object]]) -> dict:
    """``good`` with each edit applied: the field dropped, or given the hostile value."""
    out = dict(good)
    for key, drop, value in edits:
        if drop:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _entries(good: dict) -> st.SearchStrategy:
    """A good entry with up to two fields dropped or replaced by hostile values."""
    edit = st.tuples(st.sampled_from(sorted(good)), st.booleans(), HOSTILE)
    return st.builds(_edited_entry, st.just(good), st.lists(edit, max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(image=_entries(GOOD_IMAGE), annotations=st.lists(st.sampled_from(GOOD_ANNOTATIONS).flatmap(_entries), max_size=3),
       masks=st.booleans())
def test_any_coco_entry_gives_a_data_error_or_works(files, tmp_path, image, annotations, masks):
    for i, ann in enumerate(annotations):
        if ann.get("id") == 1:
            ann["id"] = i + 1  # distinct ids unless the id itself was edited
    data = dict(images=[image], annotations=annotations, categories=[{"id": 1, "name": "a"}, {"id": 3, "name": "b"}, {"id": 7, "name": "c"}])
    path = _write(tmp_path, data)  # NaN and Infinity written as Python's json does
    try:
        check = check_coco(path, files["train_images"], require_masks=masks)
        dataset = CocoDetection(check, files["train_images"], masks=masks)
        for i in range(len(dataset)):
            image_tensor, target = dataset[i]
            assert image_tensor.shape == (3, SIZE, SIZE) and len(target["boxes"]) == len(target["labels"])
            assert not masks or target["masks"].shape == (len(target["labels"]), SIZE, SIZE)
    except DataError:
        pass


@settings(max_examples=300, deadline=None)
@given(counts=COUNTS, h=st.integers(1, 6), w=st.integers(1, 6))
def test_compressed_counts_agree_with_pycocotools(counts, h, w):
    """Any string: refused, or decoded by pycocotools into exactly the runs our parser reads."""
    runs = compressed_counts(counts)
    if segmentation_problem({"size": [h, w], "counts": counts}, h, w) is None:
        assert runs is not None and sum(runs) == h * w
    if runs is None or not 0 < sum(runs) <= 10**5:
        return
    rle = {"size": [1, sum(runs)], "counts": counts}  # a mask these runs fill exactly
    assert segmentation_problem(rle, 1, sum(runs)) is None
    expected = [v % 2 for v, n in enumerate(runs) for _ in range(n)]
    assert decode_masks([rle])[0, :, 0].tolist() == expected
    assert compressed_counts(encode_masks(decode_masks([rle]).transpose(2, 0, 1))[0]["counts"]) is not None


# ---------------------------------------------------------------------------------------- images
def test_image_problems_are_named_and_the_other_images_still_predicted(files, tmp_path, capsys):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_header(20_000, 20_000))
    big = tmp_path / "big.png"
    big.write_bytes(_png_header(8_000, 8_000))  # under PIL's own limit, above ours
    broken = tmp_path / "broken.png"
    broken.write_bytes(Path(files["image"]).read_bytes()[:-40])  # the last pixel rows and IEND cut off
    out = tmp_path / "drawn"
    capsys.readouterr()
    argv = ["detect", "predict", str(bomb), str(files["image"]), str(big), str(broken), "--checkpoint", str(files["checkpoint"]),
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 1  # some were drawn (2: none), as `cgavit predict`
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert "3 of 4 images skipped" in line and "too large to decode" in line and "megapixel" in line and "broken.png" in line
    assert (out / "val_00000_pred.png").is_file() and "val_00000.png" in captured.out



def test_drawings_never_replace_an_image_nor_each_other(files, tmp_path, capsys):
    """`detect predict mine.jpg --out mine.jpg` replaced the user's photo (with PNG bytes under a .jpg name), and
    two images of one name from two folders were drawn to one file, the first lost."""
    from PIL import Image

    mine = tmp_path / "mine.png"
    mine.write_bytes(Path(files["image"]).read_bytes())
    kept = mine.read_bytes()
    run = ["detect", "predict", "--checkpoint", str(files["checkpoint"]), "--device", "cpu"]
    assert main([*run, str(mine), "--out", str(mine)]) == 2
    assert "would replace the image" in _one_error_line(capsys.readouterr().err) and mine.read_bytes() == kept
    assert main([*run, str(mine), "--out", str(tmp_path)]) == 0  # mine_pred.png beside it
    assert main([*run, str(mine), "--out", str(tmp_path / "drawn.jpg")]) == 0
    with Image.open(tmp_path / "drawn.jpg") as img:
        assert img.format == "JPEG"
    for suffix in ("tiffx", "h5", "xbm"):  # HDF5: a stub writer; XBM: 1-bit only (both failed after the model ran)
        assert main([*run, str(mine), "--out", str(tmp_path / f"drawn.{suffix}")]) == 2
        assert "not an image format a colour drawing can be written in" in _one_error_line(capsys.readouterr().err)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    for folder in "ab":
        (tmp_path / folder / "img.png").write_bytes(kept)
    assert main([*run, str(tmp_path / "a" / "img.png"), str(tmp_path / "b" / "img.png"), "--out", str(tmp_path / "o")]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["img-2_pred.png", "img_pred.png"]
    assert mine.read_bytes() == kept

def test_unreadable_training_images_stop_training_before_any_checkpoint(files, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    for p in Path(files["train_images"]).iterdir():
        (images / p.name).write_bytes(p.read_bytes()[:100])  # truncated: found only when decoded
    for workers in ("0", "1"):  # a loader worker's error arrives as the same one line
        out = tmp_path / f"out{workers}"
        assert main(["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(images),
                     "--backbone", "m0", "--train-bn", "--device", "cpu", "--workers", workers, "--epochs", "1",
                     "--min-size", str(SIZE), "--max-size", str(SIZE), "--output", str(out)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "train_0000" in line and "image file is truncated" in line and "Caught" not in line
        assert not (out / "checkpoint.pth").exists() and not (out / "model.pth").exists()


def test_an_unreadable_validation_image_keeps_the_epoch_it_evaluates(files, tmp_path, capsys):
    """A validation image found damaged by the evaluation threw the epoch just trained away (no checkpoint, no
    record): on COCO, hours. The checkpoint is now written first, and the record appended with the error."""
    images = tmp_path / "val"
    shutil.copytree(files["val_images"], images)
    damaged = images / "val_00001.png"
    damaged.write_bytes(damaged.read_bytes()[:200])  # its header is whole: found only when decoded
    out = tmp_path / "run"
    argv = ["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
            "--val-json", str(files["val_json"]), "--val-images", str(images), "--backbone", "m0", "--train-bn",
            "--device", "cpu", "--workers", "0", "--epochs", "2", "--min-size", str(SIZE), "--max-size", str(SIZE),
            "--output", str(out)]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "val_00001.png" in line and "Epoch 1 was saved before its evaluation" in line and "--resume auto" in line
    assert read_checkpoint(out / "checkpoint.pth")["epoch"] == 1
    assert [r["epoch"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"] == [1]
    # Ctrl-C during an evaluation: the epoch's record is kept beside its checkpoint as well (it was lost for good)
    from cgavit.detection import engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    stopped = tmp_path / "stopped"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "evaluate", interrupted)
        assert main([*argv[:argv.index("--val-images") + 1], str(files["val_images"]),
                     *argv[argv.index("--val-images") + 2:-1], str(stopped)]) == 130  # as Ctrl-C ends any command
    assert [r["epoch"] for r in map(json.loads, (stopped / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"] == [1]


def test_images_under_the_backbones_side_once_padded_are_skipped_by_name(files, tmp_path, capsys):
    """With size_divisible=1 (a documented --model-arg), a wide image padded to under 32 px stopped `detect predict`
    at that image (the others never drawn) and training mid-epoch, in the backbone's input check."""
    config = {**CONFIG, "model_kwargs": {"size_divisible": 1}}
    ckpt = save_torch(tmp_path / "div1.pth", dict(format=CHECKPOINT_FORMAT, config=config, model=build_detector(config).state_dict()))
    wide = tmp_path / "wide.png"
    Image.new("RGB", (200, 50), (90, 30, 200)).save(wide)  # 64x16 at the resize, 64x16 padded to multiples of 1
    out = tmp_path / "drawn"
    argv = ["detect", "predict", str(wide), str(files["image"]), "--checkpoint", str(ckpt), "--device", "cpu", "--out", str(out)]
    assert main(argv) == 1  # the other image is drawn
    line = _one_error_line(capsys.readouterr().err)
    assert "wide.png: too small: 200x50 px" in line and "padded to 64x16 (size_divisible 1)" in line
    assert (out / "val_00000_pred.png").is_file()
    resize = detector_resize(config)
    assert resize_problem(64, 64, resize) is None and resize_problem(200, 50, detector_resize(CONFIG)) is None
    assert "fixed_size" in resize_problem(64, 64, detector_resize({**CONFIG, "model_kwargs": {"fixed_size": [64, 16], "size_divisible": 8}}))
    # training skips it before the first step, with its annotations, instead of stopping mid-epoch
    data = _edited(files, lambda d: d["images"].append(dict(id=99, file_name="wide.png", width=200, height=50)))
    folder = tmp_path / "images"
    shutil.copytree(files["train_images"], folder)
    shutil.copy(wide, folder / "wide.png")
    check = check_coco(_write(tmp_path, data), folder, resize=resize)
    assert [img["id"] for img in check.dataset["images"]] == [1, 2] and "wide.png: too small" in check.skipped[0]


def test_no_annotations_warns_or_is_refused_with_strict(files, tmp_path, caplog, capsys):
    path = _write(tmp_path, _edited(files, lambda d: d.update(annotations=[])))
    with caplog.at_level("WARNING"):
        check_coco(path, files["train_images"])
    assert "no usable annotation" in caplog.text and "background only" in caplog.text
    with pytest.raises(DataError, match="no annotations"):
        check_coco(path, files["train_images"], strict=True)
    assert main(["detect", "train", "--train-json", str(path), "--train-images", str(files["train_images"]), "--strict",
                 "--output", str(tmp_path / "o")]) == 2
    assert "no annotations" in _one_error_line(capsys.readouterr().err)


def test_nan_loss_stops_training(files, tmp_path, capsys):
    """Also the run folder's lock: a live run's lock refuses the folder; a dead run's lock is taken
    over and its half-written temporaries are removed; the lock is released when training fails."""
    state = create_model("efficientvit_m0").state_dict()
    key = next(k for k in state if k.endswith("conv.weight"))
    state[key].mul_(1e38)  # finite weights (NaN ones are refused when loaded) whose activations overflow
    backbone = save_torch(tmp_path / "nan.pth", state)
    out = tmp_path / "o"
    argv = ["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
            "--backbone", "m0", "--device", "cpu", "--workers", "0", "--epochs", "1", "--min-size", str(SIZE),
            "--max-size", str(SIZE), "--pretrained-backbone", str(backbone), "--output", str(out)]
    out.mkdir()
    with RunLock(out, DistEnv()):  # a live run holds the folder (here this process, through another open file)
        assert main(argv) == 2
    assert f"another run (pid {os.getpid()})" in _one_error_line(capsys.readouterr().err)
    (out / "run.lock").write_text("999999999")  # left by a process that is gone
    stale = out / ".checkpoint.pth.k9x2a.tmp"  # what kill -9 mid-write leaves
    stale.write_bytes(b"half")
    assert main(argv) == 2
    assert "the loss became nan" in _one_error_line(capsys.readouterr().err)
    assert not (out / "checkpoint.pth").exists() and not stale.exists() and not (out / "run.lock").exists()


# ------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(
    "config, state, why",
    [
        (dict(dials={"checkpoint_path": "/etc/passwd"}), None, "'dials' must be a dict with keys among"),
        (dict(dials={"pretrained": True}), None, "'dials' must be a dict with keys among"),
        (dict(dials={"depth": [100_000, 1, 1]}), None, "depth entries must be at most"),
        (dict(kind="yolo"), None, "'kind' must be one of"),
        (dict(min_size=100_000), None, "'min_size' must be an integer in 32..4096"),
        (dict(model_kwargs={"score_thresh": {"a": 1}}), None, "detector setting (--model-arg) score_thresh"),
        (dict(categories="abc"), None, "'categories' must list 3"),
        (dict(num_classes=5, categories=[[1, "a"], [2, "b"], [3, "c"], [4, "d"]]), None, "config and its weights disagree"),
        ({}, "nan", "NaN/inf"),
        ({}, "missing", "missing, e.g."),
    ],
)
def test_untrusted_checkpoint_config_is_checked_before_building(files, tmp_path, config, state, why):
    weights = build_detector(CONFIG).state_dict()
    if state == "nan":
        weights[next(iter(weights))].view(-1)[0] = float("nan")
    elif state == "missing":
        weights.pop(next(iter(weights)))
    path = _forged_checkpoint(tmp_path / "forged.pth", config, weights)
    with pytest.raises(CheckpointError) as err:
        load_detector(path)
    assert str(path) in str(err.value) and why in str(err.value)


def test_checkpoint_without_training_state_cannot_be_resumed(files, tmp_path, capsys):
    argv = _commands(files, "train --resume", files["checkpoint"], tmp_path / "o")
    assert main(argv) == 2
    assert "cannot be resumed from" in _one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------- argument bounds
DETECT_TRAIN = ["detect", "train", "--train-json", "x.json", "--train-images", "x"]
BOUNDS = [
    (DETECT_TRAIN + ["--min-size", "0"], "--min-size"), (DETECT_TRAIN + ["--max-size", "100000"], "--max-size"),
    (DETECT_TRAIN + ["--batch-size", "0"], "--batch-size"), (DETECT_TRAIN + ["--epochs", "0"], "--epochs"),
    (DETECT_TRAIN + ["--lr", "0"], "--lr"), (DETECT_TRAIN + ["--lr", "nan"], "--lr"),
    (DETECT_TRAIN + ["--weight-decay", "-1"], "--weight-decay"), (DETECT_TRAIN + ["--warmup-ratio", "2"], "--warmup-ratio"),
    (DETECT_TRAIN + ["--warmup-iters", "-1"], "--warmup-iters"), (DETECT_TRAIN + ["--hflip", "1.5"], "--hflip"),
    (DETECT_TRAIN + ["--workers", "-1"], "--workers"), (DETECT_TRAIN + ["--seed", "-1"], "--seed"),
    (DETECT_TRAIN + ["--eval-every", "-1"], "--eval-every"), (DETECT_TRAIN + ["--log-every", "-1"], "--log-every"),
    (DETECT_TRAIN + ["--lr-steps", "-3"], "--lr-steps"), (DETECT_TRAIN + ["--model-arg", "x=[1e300]"], "--model-arg"),
    (DETECT_TRAIN + ["--val-images", "v"], "--val-images needs --val-json"),
    (["detect", "eval", "--checkpoint", "m.pth", "--val-json", "v.json", "--val-images", "v", "--batch-size", "0"], "--batch-size"),
    (["detect", "predict", "a.png", "--checkpoint", "m.pth", "--score-threshold", "1.5"], "--score-threshold"),
    (["detect", "predict", "a.png", "--checkpoint", "m.pth", "--score-threshold", "-0.1"], "--score-threshold"),
    (["detect", "shapes", "--out", "s", "--size", "5"], "--size"), (["detect", "shapes", "--out", "s", "--num-train", "-1"], "--num-train"),
    (["detect", "shapes", "--out", "s", "--max-shapes", "0"], "--max-shapes"),
    (["info", "--img-size", "-5"], "--img-size"), (["info", "--img-size", "100000"], "--img-size"),
    (["info", "--img-size", "0"], "--img-size"), (["info", "--img-size", "64", "64", "64"], "--img-size"),
    (["roofline", "--img-size", "100000"], "--img-size"), (["roofline", "--batch", "0"], "--batch"),
    (["roofline", "--batch", "4096", "--img-size", "1024"], "--batch"), (["roofline", "--threads", "0"], "--threads"),
    (["roofline", "--repeats", "0"], "--repeats"), (["roofline", "--top", "0"], "--top"),
    (["roofline", "--peak-seconds", "0"], "--peak-seconds"), (["roofline", "--peak-gflops", "-1"], "--peak-gflops"),
    (["roofline", "--bandwidth-gbs", "nan"], "--bandwidth-gbs"),
]
ANALYZE = [
    (["--img-size", "100000"], "--img-size"), (["--img-size", "-5"], "--img-size"), (["--crop-pct", "0.001"], "--crop-pct"),
    (["--crop-pct", "nan"], "--crop-pct"), (["--num-images", "-1"], "--num-images"), (["--batch-size", "0"], "--batch-size"),
    (["--num-classes", "0"], "--num-classes"), (["--num-classes", "2000000"], "--num-classes"), (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("argv, flag", BOUNDS + [(["analyze", "heads", "--data", "d", "--output", "o", *a], f) for a, f in ANALYZE]
                         + [(["analyze", "taylor", "--data", "d", "--output", "o", "--prune-ratio", "1"], "--prune-ratio"),
                            (["analyze", "taylor", "--data", "d", "--output", "o", "--list-pruned", "-1"], "--list-pruned")])
def test_out_of_bounds_arguments_are_named(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing is written, but if it were, it would land here
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, argv[0])
    assert flag in line, line
    assert not any(tmp_path.iterdir())


def test_analysis_sample_is_bounded_by_pixels(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    for i in range(20):
        Image.new("RGB", (40, 40)).save(tmp_path / "d" / f"{i}.png")
    assert main(["analyze", "heads", "--data", str(tmp_path / "d"), "--output", str(tmp_path / "o"), "--img-size", "4096",
                 "--num-images", "0"]) == 2
    assert "--num-images 16 or fewer" in _one_error_line(capsys.readouterr().err, "analyze")


def test_read_only_output_is_one_line(files, mount_tmpfs, capsys):
    """Issue 19: `--output` on a read-only file system gave an OSError traceback."""
    ro = mount_tmpfs(folders=("run",), read_only=True)
    for out in (ro / "run", ro / "new"):
        argv = ["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
                "--backbone", "m0", "--device", "cpu", "--workers", "0", "--epochs", "1", "--min-size", str(SIZE),
                "--max-size", str(SIZE), "--output", str(out)]
        assert main(argv) == 2
        assert re.search(rf"cannot .*{out}: the file system is read-only; ", _one_error_line(capsys.readouterr().err))


def test_damaged_metrics_stop_the_run_at_its_start_and_odd_rows_are_not_plotted(files, tmp_path, capsys):
    """A metrics.jsonl edited by hand ended the run, after its last epoch, in an AttributeError or KeyError."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"type": "step", "iter": 1, "lr": 0.1, "loss": 2.0}\n[1]\n')
    argv = ["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
            "--backbone", "m0", "--device", "cpu", "--workers", "0", "--epochs", "1", "--min-size", str(SIZE),
            "--max-size", str(SIZE), "--output", str(out)]
    assert main(argv) == 2
    assert "metrics.jsonl line 2 is not a JSON record" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # nothing trained, the lock let go
    rows = ['{"type": "step", "iter": "x", "lr": 0.1}', '{"type": "step", "lr": 0.1}', '{"type": "epoch"}',
            '{"type": "step", "iter": 2, "lr": 0.1, "loss": "high"}', '{"type": "step", "iter": 3, "lr": 0.1, "loss": 2.0}']
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert plot_losses(out / "metrics.jsonl", out / "loss.png") == out / "loss.png" and (out / "loss.png").stat().st_size


@pytest.mark.parametrize("held", ["checkpoint.pth", "model.pth"])
def test_a_new_run_does_not_overwrite_a_finished_one(files, tmp_path, held, capsys):
    """`detect train` twice with the default --output (runs/detect) overwrote the first run's model."""
    out = tmp_path / "o"
    out.mkdir()
    (out / held).write_bytes(b"the first run's weights")
    argv = ["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
            "--backbone", "m0", "--device", "cpu", "--workers", "0", "--epochs", "1", "--min-size", str(SIZE),
            "--max-size", str(SIZE), "--output", str(out)]
    assert main(argv) == 2
    assert f"already holds a run ({held}); continue it with --resume auto" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == [held] and (out / held).read_bytes() == b"the first run's weights"


def test_output_that_is_a_file_is_refused(files, capsys):
    assert main(["detect", "train", "--train-json", str(files["train_json"]), "--train-images", str(files["train_images"]),
                 "--output", str(files["train_json"])]) == 2
    assert "is not a folder" in _one_error_line(capsys.readouterr().err)


DIAL_NAMES = ["embed_dim", "depth", "num_heads", "window_size", "kernels", "key_dim", "attn_ratio", "ffn_ratio",
              "ffn_per_side", "cascade", "group_split", "checkpoint_path", "pretrained"]
DIAL_VALUES = HOSTILE | st.integers(-3, 10**6) | st.lists(st.integers(-3, 10**6), max_size=4) | st.booleans()
GOOD_CONFIG = {**CONFIG, "dials": {}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config=_entries(GOOD_CONFIG), dials=st.none() | st.dictionaries(st.sampled_from(DIAL_NAMES), DIAL_VALUES, max_size=3))
def test_any_checkpoint_config_is_refused_or_matches_its_weights(files, config, dials):
    """The schema of a detection checkpoint's config: a ValueError naming the field, a CheckpointError
    when it disagrees with the stored tensors, or a config that rebuilds exactly those tensors."""
    if dials is not None:
        config["dials"] = dials
    state = _good_state()
    try:
        checked = check_config(config)
    except ValueError:
        return
    try:
        check_against_tensors(checked, state, "forged.pth")
    except CheckpointError:
        return
    assert build_detector(checked).state_dict().keys() == state.keys()


_STATE: dict = {}  # the weights of CONFIG's detector, built once


def _good_state() -> dict:
    if not _STATE:
        _STATE.update(build_detector(CONFIG).state_dict())
    return _STATE


class _CallsAFunction:
    """Pickles as a call of a (harmless) function: what a malicious checkpoint holds."""

    def __reduce__(self):
        return (os.getpid, ())


def test_a_pickled_detection_checkpoint_is_refused_without_a_trust_hint(tmp_path):
    """``detect eval/predict`` read only what ``detect train`` writes, never pickled objects: the refusal says so
    and offers no opt-in the commands do not have."""
    path = tmp_path / "model.pth"
    torch.save({"format": CHECKPOINT_FORMAT, "model": _CallsAFunction()}, path)
    with pytest.raises(CheckpointError, match="never writes") as err:
        load_detector(path)
    assert "--trust-checkpoint" not in str(err.value)


# ------------------------------------------------------------------- review 4: the detection part
def _train_argv(json_path, images, out, *extra) -> list[str]:
    """``detect train`` of a RetinaNet m0 with trained BatchNorm at SIZE px, one epoch, on the CPU."""
    return ["detect", "train", "--train-json", str(json_path), "--train-images", str(images), "--backbone", "m0",
            "--train-bn", "--device", "cpu", "--workers", "0", "--epochs", "1", "--warmup-iters", "1", "--min-size",
            str(SIZE), "--max-size", str(SIZE), "--output", str(out), *extra]


def _resumable_checkpoint(folder: Path) -> Path:
    """A checkpoint.pth after epoch 1 of the run :func:`_train_argv` makes on the ``files`` data."""
    model = build_detector(CONFIG)
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: 1.0)
    folder.mkdir()
    return save_torch(folder / "checkpoint.pth", dict(format=CHECKPOINT_FORMAT, config=CONFIG, model=model.state_dict(),
                                                     optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                                                     epoch=1, iteration=1))


def test_a_resumed_run_does_not_overwrite_another_runs_folder(files, tmp_path, capsys):
    """D1: `--resume A/checkpoint.pth --output B` replaced the checkpoint.pth and model.pth of run B, an
    unrelated run, and appended A's epochs to B's metrics.jsonl."""
    first = tmp_path / "a"
    resume = ["--epochs", "2", "--resume", str(_resumable_checkpoint(first))]
    other = tmp_path / "b"
    other.mkdir()
    for name in ("checkpoint.pth", "model.pth", "metrics.jsonl"):
        (other / name).write_bytes(b"run B's " + name.encode())
    capsys.readouterr()
    assert main([*_train_argv(files["train_json"], files["train_images"], other), *resume]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{other} already holds a run (checkpoint.pth, model.pth); continue the run of {first / 'checkpoint.pth'} " \
           f"in its own folder (--output {first})" in line and "nothing in it was changed" in line, line
    assert sorted(p.name for p in other.iterdir()) == ["checkpoint.pth", "metrics.jsonl", "model.pth"]
    assert all((other / n).read_bytes() == b"run B's " + n.encode() for n in ("checkpoint.pth", "model.pth", "metrics.jsonl"))
    assert main([*_train_argv(files["train_json"], files["train_images"], first), *resume]) == 0  # its own folder
    assert read_checkpoint(first / "checkpoint.pth")["epoch"] == 2 and (first / "model.pth").is_file()


MIRRORED_AWAY = [1e-7, 10, 1e-7, 5]  # 32-bit [1e-7, 2e-7]: mirrored, 64 - 2e-7 and 64 - 1e-7 are both 64
RESIZED_AWAY = [41.00019836425781, 10, 3.814697265625e-06, 5]  # one float32 step: none left at 100/64 the size


@pytest.mark.parametrize("bbox", [[SIZE - 1e-7, 10, 5, 5], [50, 10, 1e-6, 5], [-10, -10, 10.0000001, 15], [10, 10, 5, 1e-7],
                                  MIRRORED_AWAY])
def test_boxes_are_judged_as_the_detector_takes_them(files, tmp_path, bbox):
    """D2: boxes of positive width and height whose 32-bit [x0, y0, x1, y1] clipped to the image (or mirrored,
    as the training augmentation does) is empty passed the check, even with --strict, and stopped training
    with torchvision's assertion at their batch."""
    for sized in (True, False):  # an image entry without width/height is judged by its file's header
        def edit(d):
            d["annotations"][0]["bbox"] = bbox
            if not sized:
                del d["images"][0]["width"], d["images"][0]["height"]
        path = _write(tmp_path, _edited(files, edit))
        check = check_coco(path, files["train_images"])
        assert len(check.skipped) == 1 and check.skipped[0].startswith("annotation 1 (image 1 train_00000.png): bbox")
        assert "or too thin to keep" in check.skipped[0], check.skipped
        with pytest.raises(DataError, match="refused with --strict"):
            check_coco(path, files["train_images"], strict=True)
        for i in range(2):
            boxes = CocoDetection(check, files["train_images"])[i][1]["boxes"]
            assert bool((boxes[:, 2:] > boxes[:, :2]).all()), boxes


def test_boxes_are_judged_after_the_resize_and_such_runs_train(files, tmp_path, capsys):
    """D2: a box with an area at the image's size may have none once the detector resizes it; the runs with
    such boxes (here without --strict) train instead of dying mid-epoch in a traceback."""
    def edit(d):
        d["annotations"][0]["bbox"] = MIRRORED_AWAY
        d["annotations"][1]["bbox"] = RESIZED_AWAY
    path = _write(tmp_path, _edited(files, edit))
    assert [s.split(":")[0] for s in check_coco(path, files["train_images"]).skipped] == ["annotation 1 (image 1 train_00000.png)"]
    skipped = check_coco(path, files["train_images"], resize=(100, 100)).skipped
    assert len(skipped) == 2 and skipped[1].startswith("annotation 2 ") and "resized" in skipped[1], skipped
    argv = _train_argv(path, files["train_images"], tmp_path / "o", "--hflip", "1", "--min-size", "100", "--max-size", "100")
    assert main(argv) == 0
    assert "Traceback" not in capsys.readouterr().err and (tmp_path / "o" / "model.pth").is_file()


def test_images_too_thin_for_the_resize_are_named_and_skipped(files, tmp_path, capsys):
    """D9: an image whose resize gives a side of 0 (3x400 px at --max-size 64) stopped `detect predict` in a
    traceback before the other images were drawn, and `detect train` and `detect eval` the same way."""
    thin = tmp_path / "thin.png"
    Image.new("RGB", (400, 3), (200, 30, 30)).save(thin)
    out = tmp_path / "drawn"
    run = ["detect", "predict", "--checkpoint", str(files["checkpoint"]), "--device", "cpu", "--out", str(out)]
    capsys.readouterr()
    assert main([*run, str(thin), str(files["image"])]) == 1
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert f"1 of 2 images skipped: image {thin}: too thin: 400x3 px becomes 64x0 px" in line and "side ratio under 64:1" in line
    assert (out / "val_00000_pred.png").is_file() and not (out / "thin_pred.png").exists()
    assert main([*run, str(thin)]) == 2 and "too thin" in _one_error_line(capsys.readouterr().err)

    images = tmp_path / "images"
    shutil.copytree(files["train_images"], images)
    shutil.copy(thin, images / "thin.png")

    def add(d):  # no width/height: the check reads them from the file's header
        d["images"].append({"id": 99, "file_name": "thin.png"})
        d["annotations"].append({"id": 999, "image_id": 99, "category_id": 1, "bbox": [10, 0, 20, 2], "iscrowd": 0})
    path = _write(tmp_path, _edited(files, add))
    check = check_coco(path, images, resize=(SIZE, SIZE))
    assert check.skipped == ["image 99 thin.png: too thin: 400x3 px becomes 64x0 px at the detector's resize (shorter side "
                             "to 64, longer side at most 64); crop it to a side ratio under 64:1 (its annotations are left out with it)"]
    assert 99 not in check.coco().imgs and all(a["image_id"] != 99 for a in check.dataset["annotations"])
    assert len(check_coco(path, images).dataset["images"]) == 3  # no resize given: no image's shape judged
    with pytest.raises(DataError, match="(?s)refused with --strict.*image 99 thin.png: too thin"):
        check_coco(path, images, strict=True, resize=(SIZE, SIZE))
    assert main(_train_argv(path, images, tmp_path / "o")) == 0
    assert main(["detect", "eval", "--checkpoint", str(tmp_path / "o" / "model.pth"), "--val-json", str(path),
                 "--val-images", str(images), "--device", "cpu", "--workers", "0", "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("crowd", [0, 1])
@pytest.mark.parametrize("seg", [
    [[100, 100, 110, 100, 110, 110]],  # wholly outside the 64-px image (within the allowed reach)
    [[10, 10, 20, 20, 30, 30]],  # three points on a line
    {"size": [SIZE, SIZE], "counts": [SIZE * SIZE]},  # uncompressed, all zero
    "compressed",  # all zero
])
def test_masks_that_cover_no_pixel_are_skipped_or_refused(files, tmp_path, seg, crowd):
    """D10: masks that cover no pixel passed the check and trained as all-zero targets without a word,
    while `"segmentation": []` was skipped with a warning."""
    if seg == "compressed":
        seg = encode_masks(torch.zeros(1, SIZE, SIZE, dtype=torch.uint8).numpy())[0]
    path = _write(tmp_path, _edited(files, lambda d: d["annotations"][0].update(segmentation=seg, iscrowd=crowd)))
    check = check_coco(path, files["train_images"], require_masks=True)
    assert check.skipped == ["annotation 1 (image 1 train_00000.png): empty segmentation (it covers no pixel of the 64x64 image)"]
    assert all(a["id"] != 1 for a in check.dataset["annotations"])
    with pytest.raises(DataError, match="(?s)refused with --strict.*annotation 1 .*covers no pixel"):
        check_coco(path, files["train_images"], require_masks=True, strict=True)
    assert check_coco(path, files["train_images"]).skipped == []  # RetinaNet never reads masks


def test_train_bn_runs_never_meet_a_one_image_batch(files, tmp_path, capsys):
    """D12: with --train-bn at 64 px, an odd image count died at the last batch (one image, a 1x1 stride-64 map,
    so one value per channel for BatchNorm) with nothing saved; --batch-size 1 died at its first batch."""
    images, ann = write_shapes_dataset(tmp_path, 3, SIZE, seed=0, split="train")
    assert main(_train_argv(ann, images, tmp_path / "odd", "--log-every", "1")) == 0  # the last batch of one is dropped
    rows = [json.loads(line) for line in (tmp_path / "odd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows] == ["step", "epoch"] and rows[-1]["iter"] == 1
    capsys.readouterr()
    assert main(_train_argv(ann, images, tmp_path / "one", "--batch-size", "1")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--train-bn with batches of one image cannot train on image 1 (train_00000.png): resized to 64x64 px" in line
    assert "its stride-64 map is 1x1" in line and "use --batch-size 2 or more" in line, line
    assert not (tmp_path / "one").exists()
    assert main(_train_argv(files["train_json"], files["train_images"], tmp_path / "big", "--batch-size", "1",
                            "--min-size", "96", "--max-size", "96")) == 0  # a 2x2 map: two values per channel


def test_size_bands_without_objects_score_minus_one_with_or_without_detections(files):
    """D13: no detections scored 0.0 for the size bands without any ground-truth object, where COCOeval (and
    any run that detected something) gives -1."""
    gt = CocoDetection(check_coco(files["val_json"], files["val_images"]), files["val_images"]).coco
    areas = [a["area"] for a in gt.dataset["annotations"]]
    bands = {"s": (0, 32**2), "m": (32**2, 96**2), "l": (96**2, 1e10)}
    found = {b: any(lo <= a < hi for a in areas) for b, (lo, hi) in bands.items()}
    assert not found["l"]  # a 64-px image holds no large object
    exact = [dict(image_id=a["image_id"], category_id=a["category_id"], bbox=a["bbox"], score=1.0) for a in gt.dataset["annotations"]]
    for results in ([], exact):
        metrics, _ = coco_metrics(gt, results, "bbox")
        for band, present in found.items():
            for kind in ("AP", "AR"):
                assert (metrics[f"{kind}{band}"] == -1) != present, (band, kind, metrics, len(results))


def test_an_existing_folder_is_a_folder_whatever_its_name(files, tmp_path, capsys):
    """D14: `detect predict --out out.v1` refused the existing folder out.v1 as an unknown image format."""
    folder = tmp_path / "out.v1"
    folder.mkdir()
    assert main(["detect", "predict", str(files["image"]), "--checkpoint", str(files["checkpoint"]), "--device", "cpu",
                 "--out", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["val_00000_pred.png"]


def test_predict_reads_a_photo_as_training_does_as_stored(files, tmp_path):
    """``load_image`` turns a photo upright by its EXIF orientation; detection reads it as stored, the frame its COCO
    boxes are in, in training and evaluation, and ``detect predict`` read it turned: its boxes were in another frame."""
    stored = Image.open(files["image"]).convert("RGB").crop((0, 0, 40, 24))  # not square: a turn shows
    exif = Image.Exif()
    exif[0x0112] = 6  # shown after a quarter turn
    photo = tmp_path / "photo.jpg"
    stored.save(photo, exif=exif.tobytes(), quality=95)
    assert main(["detect", "predict", str(photo), "--checkpoint", str(files["checkpoint"]), "--device", "cpu",
                 "--out", str(tmp_path / "drawn")]) == 0
    (drawn,) = (tmp_path / "drawn").iterdir()
    assert Image.open(drawn).size == (40, 24)  # the picture the detector saw, as stored (turned: 24 x 40)


def test_ground_truth_the_detector_cannot_take_counts_as_missed_as_pycocotools_scores_the_file(files, tmp_path, caplog):
    """Degenerate boxes and masks, and images too thin for the resize, were left out of the evaluation's ground truth
    as well as of the detector's input: perfect detections of the rest scored 1.0 where pycocotools, scoring the file
    as given, misses them. They now count as missed, and the warning says how many and on which images."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def edit(d):
        first = d["annotations"][0]
        d["annotations"].append({**first, "id": 900, "bbox": [5, 5, 0, 10]})  # no area: the detector cannot take it
        d["annotations"].append({**first, "id": 901, "image_id": 2, "segmentation": [[1, 1, 9, 9]]})  # a 2-point polygon
        d["images"].append(dict(id=3, file_name="thin.png", width=200, height=1))  # 64x0 px once resized
        d["annotations"].append({**first, "id": 902, "image_id": 3, "bbox": [1, 0, 20, 1], "segmentation": [[1, 0, 20, 0, 20, 1]]})

    folder = tmp_path / "images"
    shutil.copytree(files["val_images"], folder)
    Image.new("RGB", (200, 1)).save(folder / "thin.png")
    data = json.loads(Path(files["val_json"]).read_text())
    edit(data)
    path = _write(tmp_path, data)
    for masks in (False, True):
        caplog.clear()
        with caplog.at_level("WARNING"):
            check = check_coco(path, folder, require_masks=masks, resize=(SIZE, SIZE), purpose="evaluation")
        dropped = 3 if masks else 2  # RetinaNet never reads masks: annotation 901 is a good box
        assert f"{dropped} ground-truth annotations on {dropped} images (ids {'1, 2, 3' if masks else '1, 3'}; " \
               "1 of them left out whole) are not given to the detector; they count as missed" in caplog.text
        dataset = CocoDetection(check, folder, masks=masks)
        assert len(dataset) == 2 and dataset.ground_truth().getImgIds() == [1, 2, 3]
        exact = [dict(image_id=a["image_id"], category_id=a["category_id"], bbox=a["bbox"], score=1.0)
                 for a in check.dataset["annotations"]]
        metrics, _ = coco_metrics(dataset.ground_truth(), exact, "bbox", [1, 2, 3])
        raw = COCO(str(path))  # pycocotools on the file as given (bbox only: it cannot read every polygon)
        ev = COCOeval(raw, raw.loadRes(exact), "bbox")
        ev.evaluate(), ev.accumulate(), ev.summarize()
        assert metrics["AR100"] == pytest.approx(ev.stats[8]) and metrics["AR100"] < 1
        if masks:
            segm = [dict(image_id=a["image_id"], category_id=a["category_id"], score=1.0,
                         segmentation=segmentation_rle(a["segmentation"], SIZE, SIZE)) for a in check.dataset["annotations"]]
            scores, _ = coco_metrics(dataset.ground_truth(), segm, "segm", [1, 2, 3])
            assert 0 < scores["AR100"] < 1  # the 2-point polygon is read, as an empty mask, and missed


def test_the_annotation_checks_words_fit_the_command_that_read_the_file(files, tmp_path, caplog, capsys):
    """`detect eval` (and a training run's validation file) said a file without annotations would train a detector
    on background only, told to point "--*-images" at the image folder and to "train RetinaNet" for boxes only."""
    empty = _write(tmp_path, _edited(files, lambda d: d.update(annotations=[])), "empty.json")
    with caplog.at_level("WARNING"):
        check_coco(empty, files["train_images"], purpose="evaluation")
    assert "nothing to find: its COCO scores are -1" in caplog.text and "trained" not in caplog.text
    caplog.clear()
    degenerate = _write(tmp_path, _edited(files, lambda d: [a.update(bbox=[1, 1, 0, 0]) for a in d["annotations"]]), "deg.json")
    with caplog.at_level("WARNING"):
        check_coco(degenerate, files["train_images"], purpose="evaluation")
    assert "has no usable annotation: each of its objects counts as missed" in caplog.text and "-1" not in caplog.text
    missing = _write(tmp_path, _edited(files, lambda d: d["images"][0].update(file_name="gone.png")), "missing.json")
    with pytest.raises(DataError, match=r"(?s)not used for evaluation:.*point --val-images at the folder"):
        check_coco(missing, files["train_images"], purpose="evaluation")
    with pytest.raises(DataError, match=r"(?s)not used for training:.*point --train-images at the folder"):
        check_coco(missing, files["train_images"])
    no_mask = _write(tmp_path, _edited(files, lambda d: d["annotations"][0].pop("segmentation")), "nomask.json")
    config = {**CONFIG, "kind": "maskrcnn"}
    ckpt = save_torch(tmp_path / "maskrcnn.pth", dict(format=CHECKPOINT_FORMAT, config=config, model=build_detector(config).state_dict()))
    assert main(["detect", "eval", "--checkpoint", str(ckpt), "--val-json", str(no_mask), "--val-images",
                 str(files["train_images"]), "--device", "cpu", "--workers", "0"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "no segmentation" in line and "train RetinaNet" not in line and "--val-images" in line, line
    fewer = _write(tmp_path, _edited(files, lambda d: d.update(categories=d["categories"][:2], annotations=[
        a for a in d["annotations"] if a["category_id"] != 7])), "fewer.json")
    assert main(["detect", "eval", "--checkpoint", str(files["checkpoint"]), "--val-json", str(fewer), "--val-images",
                 str(files["train_images"]), "--device", "cpu", "--workers", "0"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "lists categories [1, 3] but the model was trained on [1, 3, 7]; evaluate it on a file of the categories" in line
    with pytest.raises(ValueError, match="purpose must be one of training, evaluation"):
        check_coco(empty, files["train_images"], purpose="eval")
