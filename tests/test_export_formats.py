"""Every export format, run in its own runtime against PyTorch: fp32 within 1e-4 relative error, int8
within the agreement target on the trained digits model. Each format is skipped, with the extra to
install, when its runtime is missing."""

import html
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import cgavit
from cgavit.cli import main
from cgavit.deploy import EXPORT_TOLERANCE, FORMATS, check_parity, export_model, load_exported


def need(name: str):
    fmt = FORMATS[name]
    return pytest.mark.skipif(not fmt.available(), reason=f"{fmt.runtime} missing: pip install 'cgavit[{fmt.extra}]'")


FP32 = [pytest.param(name, marks=need(name)) for name in FORMATS]
INT8 = [pytest.param(name, marks=need(name)) for name, fmt in FORMATS.items() if "int8" in fmt.precisions]


@pytest.mark.parametrize("name", FP32)
def test_fp32_parity_in_the_runtime(name, trained_digits, tmp_path):
    fmt = FORMATS[name]
    path = export_model(trained_digits.model, tmp_path / f"m{fmt.suffix}", name, (48, 48))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left
    module = load_exported(path, name)
    parity = check_parity(module, trained_digits.model, (48, 48), runtime=fmt.runtime,
                          images=trained_digits.images, labels=trained_digits.labels, batches=(1, 16))
    assert parity.ok and all(e <= EXPORT_TOLERANCE for e in parity.rel_err.values()), parity.lines()
    assert parity.agreement.top1_agreement == 1.0
    assert module(torch.randn(3, 3, 48, 48)).shape == (3, 10)  # another batch works (fixed-batch formats: padded)


@pytest.mark.parametrize("name", INT8)
def test_int8_meets_the_agreement_target_in_the_runtime(name, trained_digits, tmp_path):
    fmt = FORMATS[name]
    path = export_model(trained_digits.model, tmp_path / f"m.int8{fmt.suffix}", name, (48, 48), "int8",
                        trained_digits.calibration(), batch=16 if fmt.fixed_batch else 1)  # onnx, openvino: dynamic
    module = load_exported(path, name, "int8")
    parity = check_parity(module, trained_digits.model, (48, 48), "int8", fmt.runtime,
                          trained_digits.images, trained_digits.labels, batches=(16,))
    assert parity.ok, parity.lines()
    assert parity.agreement.max_rel_err > 1e-3  # really quantised (random images say little: not judged)


def test_int8_needs_calibration_and_formats_name_their_extra(trained_digits, tmp_path):
    with pytest.raises(ValueError, match="calibration"):
        export_model(trained_digits.model, tmp_path / "m.onnx", "onnx", (48, 48), "int8")
    with pytest.raises(ValueError, match="offers fp32"):
        export_model(trained_digits.model, tmp_path / "m.tflite", "tflite", (48, 48), "int8", [torch.randn(1, 3, 48, 48)])
    with pytest.raises(ValueError, match="unknown format"):
        export_model(trained_digits.model, tmp_path / "m.trt", "tensorrt", (48, 48))


@need("openvino")
def test_export_cli_int8_with_data(trained_digits, tmp_path, capsys):
    """A trained checkpoint records its model and preprocessing: --checkpoint alone is enough."""
    out = tmp_path / "digits.xml"
    code = main(["export", "--checkpoint", str(trained_digits.checkpoint), "--format", "openvino", "--precision", "int8",
                 "--data", str(trained_digits.data), "--calibration-images", "128", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and out.exists() and out.with_suffix(".bin").exists()
    assert "size 48x48 fixed" in text and "calibrated on 128 images" in text
    assert "meets the target" in text and "360 images" in text
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--precision", "int8",
                 "--output", str(tmp_path / "m.onnx")]) == 2
    assert "needs --data" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--precision", "int8", "--data",
                 str(trained_digits.data), "--val-split", "train", "--output", str(tmp_path / "m.onnx")]) == 2
    assert "calibration and evaluation must be different images" in capsys.readouterr().err
    # fewer calibration images than asked: int8 calibrated on what there was, exit 0 (quantize refuses it)
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--precision", "int8", "--data",
                 str(trained_digits.data), "--calibration-images", "5000", "--output", str(tmp_path / "m.onnx")]) == 2
    assert "5000" in capsys.readouterr().err
    # options that change nothing for what is asked were accepted and ignored
    for extra in (["--batch", "8"], ["--calibration-images", "64"], ["--eval-images", "10"]):
        assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--output", str(tmp_path / "m.onnx"),
                     *extra]) == 2
        assert f"{extra[0]} would change nothing here" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_fp32_export_with_data_is_checked_on_the_validation_images_alone(trained_digits, tmp_path, capsys):
    """fp32 --data loaded 256 training images it never used, said "fp32 calibrated on 256 images", and refused a
    folder without a training split."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "val").symlink_to(trained_digits.data / "val", target_is_directory=True)
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--data", str(data), "--eval-images", "40",
                 "--output", str(tmp_path / "m")]) == 0
    text = capsys.readouterr().out
    assert "calibrated" not in text and "40 images" in text
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--data", str(data), "--train-split", "x",
                 "--output", str(tmp_path / "m")]) == 2
    assert "--train-split would change nothing here" in capsys.readouterr().err


def test_export_at_another_size_reads_data_at_that_size(trained_digits, tmp_path, capsys):
    """--img-size 64 with --data read the images at the checkpoint's 48 px and stopped on "takes images (B, 3, 64, 64),
    got (16, 3, 48, 48)"; a size that is not square, which --data cannot be read at, is refused before any work. The
    agreement line gave no interval, so 100 % on 40 images read as certain as on 4,000."""
    out = tmp_path / "m.onnx"
    args = ["export", "--checkpoint", str(trained_digits.checkpoint), "--data", str(trained_digits.data),
            "--eval-images", "40", "--output", str(out)]
    assert main([*args, "--img-size", "64"]) == 0
    text = capsys.readouterr().out
    assert "agreement 100.0% on 40 images" in text and "try:   cgavit predict IMAGE" in text
    assert "(95% interval of the agreement: 91.24-100.00%;" in text  # 40 images pin it down no closer
    out.unlink()
    assert main([*args, "--img-size", "64", "40"]) == 2
    assert "this file takes 64x40: export at one size" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_square_is_not_offered_to_predict(trained_digits, tmp_path, capsys):
    """A 48x40 export ended with "try: cgavit predict IMAGE --checkpoint m.onnx", which refuses it (eval and predict
    read images square)."""
    out = str(tmp_path / "m.onnx")
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--img-size", "48", "40", "--output", out]) == 0
    assert "cgavit predict" not in capsys.readouterr().out
    assert main(["predict", str(next((trained_digits.data / "val" / "0").iterdir())), "--checkpoint", out]) == 2
    assert "eval and predict use square inputs" in capsys.readouterr().err


@need("executorch")
def test_executorch_runs_on_the_threads_asked_for(fixed_batch_exports):
    """ExecuTorch's threadpool starts with a thread per core: the module sets it to ``threads`` (the
    paper's CPU protocol is one thread)."""
    from executorch.extension.pybindings import portable_lib

    for threads in (2, 1):
        module = load_exported(fixed_batch_exports["executorch"], "executorch", threads=threads)
        assert portable_lib._threadpool_get_thread_count() == threads
        assert module(torch.randn(2, 3, 48, 40)).shape == (2, 10)


FIXED_BATCH = [pytest.param(name, marks=need(name)) for name, fmt in FORMATS.items() if fmt.fixed_batch]


@pytest.fixture(scope="module")
def fixed_batch_exports(trained_digits, tmp_path_factory):
    """The trained digits model exported once per fixed-batch format (ExecuTorch, LiteRT) where installed, for
    (48, 40) images in batches of 4, the files these formats' tests run or give to eval and predict: ``{name: path}``
    (each export takes 10-20 s, which the tests used to spend apiece)."""
    folder = tmp_path_factory.mktemp("fixed_batch_exports")
    return {name: export_model(trained_digits.model, folder / f"digits{fmt.suffix}", name, (48, 40), batch=4)
            for name, fmt in FORMATS.items() if fmt.fixed_batch and fmt.available()}


@pytest.mark.parametrize("name", FIXED_BATCH)
def test_a_fixed_batch_file_refuses_images_of_another_size_or_channels_in_one_line(name, fixed_batch_exports):
    """An ExecuTorch or LiteRT file declared no input shape, so images of another size or channel count reached the
    runtime, which printed its C++ log and raised "method->set_inputs() ... failed with error 0x10" (ExecuTorch) or
    its own ValueError about a tensor's dimensions (LiteRT); any batch still runs."""
    module = load_exported(fixed_batch_exports[name], name)
    assert module(torch.randn(9, 3, 48, 40)).shape == (9, 10)
    for shape, why in (((4, 3, 32, 32), "build it again for that size"), ((4, 1, 48, 40), "takes 3-channel images")):
        with pytest.raises(ValueError, match=rf"takes images \(B, 3, 48, 40\), got {re.escape(str(shape))}: .*{why}"):
            module(torch.randn(*shape))


def test_an_export_named_without_its_suffix_gets_it(tmp_path, capsys):
    """--output m0 writes m0.onnx, a file that cgavit predict and the runtimes recognise; a name ending in
    another kind of file's suffix is refused before any work."""
    small = ["--img-size", "64", "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"]
    assert main(["export", "--model", "efficientvit_m0", "--output", str(tmp_path / "m0"), *small]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0.onnx"]
    assert "m0.onnx" in capsys.readouterr().out
    assert main(["export", "--model", "efficientvit_m0", "--output", str(tmp_path / "m1.pt"), *small]) == 2
    assert "give NAME or NAME.onnx, not m1.pt" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0.onnx"]


def test_export_exits_1_when_its_own_check_fails(trained_digits, tmp_path, capsys, monkeypatch):
    """The check after writing is what makes a file shippable: a failed one (here logits that are not finite) is exit
    status 1 and a line saying not to ship the file, not a 0 under a TOO LARGE; and it replaced the good file that
    was there."""
    from cgavit.cli import export as export_cli
    from cgavit.deploy.formats import ParityCheck

    good = tmp_path / "m.xml"
    good.write_text("the user's file")
    good.with_suffix(".bin").write_text("its weights")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(export_cli, "check_parity", lambda *a, **k: ParityCheck("OpenVINO", "fp32", {1: float("nan")}))
    argv = ["export", "--checkpoint", str(trained_digits.checkpoint), "--output", str(good), "--img-size", "40"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "relative error nan NOT FINITE" in out and "m.failed.xml does not pass its check (above)" in out
    assert f"{good} was not written (the file there is as it was)" in out
    # a failed build never replaces the user's good file: it goes beside it, its weights with it
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.failed.bin", "m.failed.xml", "m.xml"]
    assert cgavit.deploy.open_exported(tmp_path / "m.failed.xml")[1].img_size == (40, 40)


def test_export_takes_the_checkpoints_model_and_refuses_what_contradicts_it(trained_digits, tmp_path, capsys):
    """--model names the variant of a file that records none and is no more than a check for one that does (the
    digits model is a reduced M0: building M0 itself failed); dial flags that contradict a recorded architecture are
    refused, where they were ignored."""
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--model", "efficientvit_m0",
                 "--output", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--cascade", "off",
                 "--output", str(tmp_path / "n")]) == 2
    assert "records its own architecture; drop the dial options (['cascade'])" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@need("openvino")
def test_openvino_export_never_writes_through_a_folder_of_that_name(tmp_path, capsys):
    """NAME.xml a folder: the export used to replace the user's NAME.bin first, then fail on the folder."""
    (tmp_path / "m.xml").mkdir()
    (tmp_path / "m.bin").write_text("the user's file")
    small = ["--img-size", "64", "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"]
    assert main(["export", "--model", "efficientvit_m0", "--format", "openvino", "--output", str(tmp_path / "m"), *small]) == 2
    assert "it is a folder (nothing was written)" in capsys.readouterr().err
    assert (tmp_path / "m.bin").read_text() == "the user's file"
    assert main(["export", "--model", "efficientvit_m0", "--output", "", *small]) == 2
    assert "the output is a file name" in capsys.readouterr().err
    # NAME.bin a folder: the build was made and checked, then the folder moved aside and the move failed half-done
    (tmp_path / "w.bin").mkdir()
    assert main(["export", "--model", "efficientvit_m0", "--output", str(tmp_path / "w.xml"), *small]) == 2
    assert f"cannot write {tmp_path / 'w.bin'}: it is a folder (nothing was written)" in capsys.readouterr().err
    (tmp_path / "w.bin").rmdir()
    # a folder's name, with or without a separator, wrote NAME.onnx beside the folder; quantize refused both
    (tmp_path / "out").mkdir()
    for name, says in ((tmp_path / "out", "is a folder; give a file name inside it"), (f"{tmp_path}/m0/", "is a file name")):
        assert main(["export", "--model", "efficientvit_m0", "--output", str(name), *small]) == 2
        assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.xml", "out"]


_CTRL_C_IN_CONVERSION = """
import os, signal, sys, time
import openvino
from cgavit.cli import main

real = openvino.convert_model


def converting(*args, **kwargs):  # a Ctrl-C that lands while the converter calls back into Python
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    except KeyboardInterrupt:
        raise RuntimeError("Converting input model KeyboardInterrupt")  # what OpenVINO's frontend made of it
    return real(*args, **kwargs)


openvino.convert_model = converting
sys.exit(main(sys.argv[1:]))
"""


@need("openvino")
def test_ctrl_c_during_the_openvino_conversion_interrupts_the_export(tmp_path):
    out = tmp_path / "m"
    argv = ["export", "--model", "efficientvit_m0", "--format", "openvino", "--output", str(out), "--img-size", "64",
            "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"]
    res = subprocess.run([sys.executable, "-c", _CTRL_C_IN_CONVERSION, *argv], capture_output=True, text=True, timeout=300)
    assert res.returncode == 130 and "cgavit export: interrupted" in res.stderr, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


@need("openvino")
def test_openvino_export_takes_a_stem_and_carries_metadata(tmp_path, capsys):
    """The README's command: --output m0_ov writes m0_ov.xml + m0_ov.bin (OpenVINO IR is always NAME.xml)."""
    from cgavit.deploy import open_exported

    code = main(["export", "--model", "efficientvit_m0", "--format", "openvino", "--output", str(tmp_path / "m0_ov"),
                 "--img-size", "64", "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0_ov.bin", "m0_ov.xml"]
    out = capsys.readouterr().out
    size = sum(f.stat().st_size for f in tmp_path.iterdir()) / 1e6  # the .bin holds the weights
    assert f"m0_ov.xml + {tmp_path / 'm0_ov.bin'} ({size:.1f} MB)" in out, out
    module, info = open_exported(tmp_path / "m0_ov.xml")
    assert info.img_size == (64, 64) and info.precision == "fp32" and info.version
    assert module(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    assert main(["export", "--model", "m0", "--format", "openvino", "--output", str(tmp_path / "m.bin")]) == 2
    assert "NAME or NAME.xml" in capsys.readouterr().err
    assert main(["export", "--model", "m0", "--format", "onnx", "--output", str(tmp_path / "m.xml")]) == 2
    assert "has the suffix of --format openvino" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [pytest.param(".onnx", marks=need("onnx")), pytest.param(".xml", marks=need("openvino"))])
def test_eval_and_predict_run_the_exported_file(suffix, trained_digits, tmp_path, capsys):
    """The file a user ships is the file they check: eval and predict take an exported file, with the
    preprocessing and class names its metadata carries, and decide as the checkpoint does."""
    out = tmp_path / f"digits{suffix}"
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--output", str(out)]) == 0
    capsys.readouterr()
    results = {}
    for source in (trained_digits.checkpoint, out):
        assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(source), "--json", "--workers", "0",
                     "--device", "cpu"]) == 0
        results[source] = json.loads(capsys.readouterr().out)
    ours, theirs = results[trained_digits.checkpoint], results[out]
    assert theirs["n"] == ours["n"] == len(trained_digits.labels)
    assert theirs["top1"] == pytest.approx(ours["top1"]) and theirs["loss"] == pytest.approx(ours["loss"], rel=1e-3)

    images = sorted((trained_digits.data / "val").glob("*/*"))[:6]
    tops = []
    for source in (trained_digits.checkpoint, out):
        assert main(["predict", "--checkpoint", str(source), "--json", "--topk", "2", *map(str, images)]) == 0
        tops.append([[t["name"] for t in row["top"]] for row in json.loads(capsys.readouterr().out)])
    assert tops[0] == tops[1] and tops[0][0][0] == images[0].parent.name


@need("onnx")
def test_an_exported_file_refuses_what_only_a_checkpoint_takes(trained_digits, tmp_path, capsys):
    """Options a file cannot honour are named, one line, exit 2; a file without cgavit metadata too."""
    out = tmp_path / "digits.onnx"
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--output", str(out)]) == 0
    capsys.readouterr()
    image = str(sorted((trained_digits.data / "val").glob("*/*"))[0])
    for extra, message in ((["--model", "efficientvit_m0"], "drop --model"), (["--ema"], "drop --ema"),
                           (["--img-size", "64"], "exported for 48 px"), (["--device", "cuda"], "--device cpu")):
        assert main(["predict", "--checkpoint", str(out), *extra, image]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    bare = tmp_path / "bare.onnx"
    torch.onnx.export(torch.nn.Conv2d(3, 10, 48), (torch.randn(1, 3, 48, 48),), str(bare), dynamo=False)
    assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(bare), "--workers", "0"]) == 2
    assert "carries no cgavit metadata" in capsys.readouterr().err


@need("onnx")
def test_eval_names_a_file_this_cpu_would_run_wrongly_once(trained_digits, tmp_path, monkeypatch, caplog, capfd):
    """An int8 file with 8-bit weights, opened where uint8 x int8 sums saturate: the library warns (a
    ``RuntimeWarning``, once), and ``cgavit eval`` shows that warning as one line of its own log, not twice."""
    from cgavit import load_model
    from cgavit.deploy.metadata import export_info
    from cgavit.deploy import Int8Options, formats
    from test_precision import EPYC_AVX2, features

    model, info = load_model(trained_digits.checkpoint)
    path = export_model(model, tmp_path / "d8.onnx", "onnx", (48, 48), "int8", trained_digits.calibration(32),
                        options=Int8Options(reduce_range=False), info=export_info(info, (48, 48)))
    monkeypatch.setattr(formats, "cpu_features", lambda environ=None: features(EPYC_AVX2))
    with pytest.warns(RuntimeWarning, match="full 8-bit weights") as caught:
        formats.open_exported(path)
    assert len(caught) == 1
    capfd.readouterr()
    with caplog.at_level("WARNING"):
        assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(path), "--workers", "0",
                     "--device", "cpu"]) == 0
    said = [r for r in caplog.records if "saturate" in r.getMessage()]
    assert len(said) == 1 and said[0].name == "cgavit", caplog.text
    assert said[0].getMessage().startswith("d8.onnx: this int8 file has full 8-bit weights")
    assert "RuntimeWarning" not in capfd.readouterr().err


EXPORTED = [pytest.param(".onnx", marks=need("onnx")), pytest.param(".xml", marks=need("openvino"))]


@pytest.fixture(scope="module")
def digits_exports(trained_digits, tmp_path_factory):
    """The trained digits checkpoint exported once, as ``cgavit export`` writes it (its class names and
    preprocessing in the file), in fp32 ONNX and OpenVINO IR where installed: ``{suffix: path}``."""
    from cgavit import load_model
    from cgavit.deploy.metadata import export_info

    model, info = load_model(trained_digits.checkpoint)
    folder = tmp_path_factory.mktemp("digits_exports")
    return {fmt.suffix: export_model(model, folder / f"digits{fmt.suffix}", name, (48, 48), info=export_info(info, (48, 48)))
            for name, fmt in FORMATS.items() if name in ("onnx", "openvino") and fmt.available()}


def test_an_exported_file_runs_on_the_cpu_by_default_on_a_machine_with_a_gpu(digits_exports, trained_digits, capsys,
                                                                             monkeypatch):
    """eval's --device defaults to auto, which is the GPU where there is one, and an exported file runs on the CPU
    only: `cgavit eval --checkpoint model.onnx --data DIR`, as docs/deploy.md gives it, was 'give --device cpu' (exit
    2) on every machine with a GPU; so was predict(..., device="auto")."""
    from cgavit.train import predict

    if not digits_exports:
        pytest.skip("neither ONNX Runtime nor OpenVINO is installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU, as the device choice sees it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    image = sorted((trained_digits.data / "val").glob("*/*"))[0]
    for path in digits_exports.values():
        assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(path), "-j", "0", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["n"] == len(trained_digits.labels)
        assert predict([image], path, device="auto")[0]["top"][0]["name"] == image.parent.name
        assert main(["predict", "--checkpoint", str(path), "--device", "cuda", str(image)]) == 2  # asked for: refused
        assert "--device cpu" in capsys.readouterr().err
        assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(trained_digits.checkpoint),
                     "--reference", str(path), "-j", "0", "--json"]) == 0  # an exported reference: on the CPU too
        assert json.loads(capsys.readouterr().out)["agreement"] > 99


def with_metadata(path, folder, name: str, **values: str):
    """A copy of the exported file ``path`` named ``name`` in ``folder``, its cgavit metadata keys given new JSON
    text, as a hostile user would edit it: ONNX with the ``onnx`` package, OpenVINO in the ``.xml`` text."""
    out = folder / f"{name}{path.suffix}"
    if path.suffix == ".onnx":
        import onnx

        model = onnx.load(str(path))
        for prop in model.metadata_props:
            prop.value = values.get(prop.key.removeprefix("cgavit."), prop.value)
        onnx.save(model, str(out))
        return out
    xml = path.read_text()
    for key, value in values.items():
        xml, n = re.subn(rf'<{key} value="[^"]*" />', lambda _: f'<{key} value="{html.escape(value)}" />', xml)
        assert n == 1, key
    out.write_text(xml)
    shutil.copy(path.with_suffix(".bin"), out.with_suffix(".bin"))
    return out


@pytest.mark.parametrize("suffix", EXPORTED)
@pytest.mark.parametrize("values, words", [
    ({"img_size": "[64, 64]"}, "its metadata says 64x64 images but the network takes 48x48"),
    ({"class_names": json.dumps(list("abc"))}, "names 3 classes but the network returns 10 logits"),
    ({"class_names": json.dumps([str(i) for i in range(12)])}, "names 12 classes but the network returns 10 logits"),
    ({"mean": "[0.5, 0.5]", "std": "[0.5, 0.5]"}, "2 mean and std values but the network takes 3-channel images"),
    ({"mean": "[NaN, 0.5, 0.5]"}, "its mean values must be in [0.0, 1.0], got [nan"),
    ({"std": "[Infinity, 1, 1]"}, "its std values must be in"),
    ({"std": "[0, 0.2, 0.2]"}, "its std values must be in"),
    ({"crop_pct": "NaN"}, "its crop fraction must be within"),
    ({"int8": "[1, 2]"}, "its int8 record must be an object, got [1, 2]"),
    ({"int8": json.dumps({"float_layers": 5})}, "its int8 float layers must be a list of layer names"),
    ({"int8": "[" * 100 + "]" * 100}, "nested deeper than"),
    # a hostile review: "false" counted as a met target, true as 100 % agreement, 1e400 as an int overflowed
    ({"int8": json.dumps({"meets_target": "false", "agreement": 0.999})}, "its int8 meets_target must be true or false"),
    ({"int8": json.dumps({"meets_target": True, "agreement": True})}, "its int8 agreement must be a number from 0 to 1"),
    ({"int8": '{"meets_target": true, "agreement": 1' + "0" * 400 + "}"}, "its int8 agreement must be a number from 0"),
    ({"class_names": json.dumps(["\x1b[31mRED\x1b[0m", "\n", *"23456789"])}, "control or formatting characters"),
    ({"class_names": json.dumps(["x" * 100_000] * 10)}, "must be text of 1 to 1024 characters"),
    # folder 8 was scored against the last output named 8: 88.9 % where the file keeps 99.7 %
    ({"class_names": json.dumps([*"012345678", "8"])}, "names '8' twice (classes 8 and 9)"),
])
def test_metadata_that_is_malformed_or_does_not_fit_its_network_is_refused_at_open(
        suffix, values, words, digits_exports, tmp_path):
    """The metadata is untrusted: each value is checked as a checkpoint's would be (class names printable and
    bounded, numbers finite and in range), and against the network it came with, before anything runs."""
    from cgavit.deploy import open_exported

    path = with_metadata(digits_exports[suffix], tmp_path, "tampered", **values)
    with pytest.raises(ValueError) as caught:
        open_exported(path)
    said = str(caught.value)
    assert words in said and said.startswith(str(path)) and "export" in said and "\n" not in said, said


def test_eval_agreement_breaks_ties_as_quantize_does():
    """Tied logits: the evaluated side took topk's class and the reference argmax's, which break ties differently,
    so a model compared with itself changed decisions."""
    from cgavit.train.data.loaders import Batch
    from cgavit.train.evaluation import evaluate

    logits = torch.randint(0, 3, (64, 10), generator=torch.Generator().manual_seed(0)).float()  # coarse: many ties
    assert (logits.topk(5, dim=1).indices[:, 0] != logits.argmax(dim=1)).any()

    class Tied(torch.nn.Module):
        def forward(self, x):
            return logits[:len(x)]

    model = Tied()
    batch = Batch(torch.randn(64, 3, 4, 4), torch.zeros(64, dtype=torch.long), torch.arange(64), [])
    res = evaluate(model, [batch], reference=model)
    assert (res["agreement"], res["changed"]) == (100.0, 0)


@pytest.mark.parametrize("suffix", EXPORTED)
def test_eval_reports_the_agreement_with_a_reference(suffix, digits_exports, trained_digits, tmp_path, capsys):
    """`cgavit eval --reference FILE`: the share of the reference's top-1 decisions the evaluated file keeps on the
    same images (how a user checks an int8 file on images of their own), counted as torch counts it; a reference for
    other classes or other preprocessing is one line, exit 2."""
    import safetensors.torch
    from safetensors import safe_open

    from cgavit.deploy import open_exported

    with safe_open(str(trained_digits.checkpoint), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(3)  # another model of the same classes and preprocessing: weights jittered
    jittered = {k: v * (1 + 0.5 * torch.randn(v.shape, generator=g)) if v.is_floating_point() and v.dim() > 1 else v
                for k, v in tensors.items()}
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file(jittered, str(other), metadata=meta)
    exported = digits_exports[suffix]
    with torch.no_grad():
        ours = open_exported(exported)[0](trained_digits.images).argmax(1)
        theirs = cgavit.load_model(other)[0](trained_digits.images).argmax(1)
    changed = int((ours != theirs).sum())
    assert 0 < changed < len(ours) // 2
    argv = ["eval", "--data", str(trained_digits.data), "--checkpoint", str(exported), "--workers", "0"]
    assert main([*argv, "--reference", str(other), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["changed"] == changed and res["reference"] == str(other)
    assert res["agreement"] == pytest.approx(100 * (1 - changed / len(ours)))
    assert main([*argv, "--reference", str(other)]) == 0
    assert f"{changed} of {len(ours)} decisions changed; 95% interval" in capsys.readouterr().out
    assert main([*argv[:-3], str(trained_digits.checkpoint), "--workers", "0", "--json", "--reference",
                 str(trained_digits.checkpoint)]) == 0
    assert json.loads(capsys.readouterr().out)["agreement"] == 100.0
    for values, words in (({"mean": "[0.1, 0.2, 0.3]"}, "normalises with mean"),
                          ({"class_names": json.dumps(list("abcdefghij"))}, "predicts other classes"),
                          ({"img_size": "[64, 64]"}, "--reference bad")):
        bad = with_metadata(exported, tmp_path, "bad", **values)
        assert main([*argv[:-3], str(trained_digits.checkpoint), "--workers", "0", "--reference", str(bad)]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    other_size = tmp_path / f"digits64{suffix}"
    assert main(["export", "--checkpoint", str(trained_digits.checkpoint), "--img-size", "64", "--output",
                 str(other_size)]) == 0
    capsys.readouterr()
    assert main([*argv[:-3], str(trained_digits.checkpoint), "--workers", "0", "--reference", str(other_size)]) == 2
    assert "was exported for 64 px images and the model evaluated runs at 48 px" in capsys.readouterr().err
    for missing, words in ((tmp_path / "nothing.safetensors", "--reference nothing.safetensors: "),
                           ("", "--reference needs a checkpoint")):
        assert main([*argv, "--reference", str(missing)]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("suffix", EXPORTED)
def test_eval_and_predict_refuse_metadata_that_does_not_fit_in_one_line(suffix, digits_exports, trained_digits,
                                                                      tmp_path, capsys):
    """Three names for ten logits crashed predict (IndexError) and a NaN mean let eval report 10 % with exit 0:
    both are one line and exit 2 now. No names (unnamed classes) and one mean/std for every channel still open."""
    from cgavit.deploy import open_exported

    path = digits_exports[suffix]
    image = str(sorted((trained_digits.data / "val").glob("*/*"))[0])
    three = with_metadata(path, tmp_path, "three", class_names=json.dumps(list("abc")))
    assert main(["predict", "--checkpoint", str(three), image]) == 2
    err = capsys.readouterr().err
    assert "names 3 classes but the network returns 10 logits" in err and len(err.strip().splitlines()) == 1, err
    nan = with_metadata(path, tmp_path, "nan", mean="[NaN, 0.5, 0.5]")
    assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(nan), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "its mean values must be in" in err and len(err.strip().splitlines()) == 1, err
    plain = with_metadata(path, tmp_path, "plain", class_names="[]", mean="[0.5]", std="[0.25]")
    module, info = open_exported(plain)
    assert info.class_names == () and info.mean == (0.5,) and info.std == (0.25,)
    assert module(trained_digits.images[:2]).shape == (2, 10)


@pytest.mark.parametrize("suffix", EXPORTED)
def test_a_damaged_exported_file_is_refused_in_one_line(suffix, digits_exports, trained_digits, tmp_path, capsys):
    """A file cut short or not a model at all (OpenVINO: its .xml or its .bin) was the runtime's traceback: it is
    one line naming the file and the runtime's reason, exit 2; optimize(quantized=...) raises ValueError."""
    from cgavit.deploy import optimize

    path = digits_exports[suffix]
    data, weights = path.read_bytes(), path.with_suffix(".bin")
    damaged = {"truncated": (data[: len(data) // 2], None), "garbage": (b"\x08\x07garbage" * 10, None)}
    if suffix == ".xml":
        damaged["short_bin"] = (data, weights.read_bytes()[:-4])
    for name, (model, bin_data) in damaged.items():
        out = tmp_path / f"{name}{suffix}"
        out.write_bytes(model)
        if suffix == ".xml":
            out.with_suffix(".bin").write_bytes(weights.read_bytes() if bin_data is None else bin_data)
        assert main(["eval", "--data", str(trained_digits.data), "--checkpoint", str(out), "--workers", "0"]) == 2
        err = capsys.readouterr().err
        if name == "short_bin":  # the .xml records its .bin's size: said as such
            assert f"{out.with_suffix('.bin')} is not the .bin {out.name} was written with" in err, err
        else:
            assert f"cannot read {out} as" in err and "(truncated or corrupt?)" in err, err
        assert "export it again" in err and len(err.strip().splitlines()) == 1, err
    if suffix == ".onnx":
        with pytest.raises(ValueError, match="as an ONNX model"):
            optimize(trained_digits.model, trained_digits.images[:1], precision="auto",
                     quantized=tmp_path / "truncated.onnx")


@need("onnx")
def test_an_onnx_file_with_external_weights_reads_them_from_beside_it(digits_exports, trained_digits, tmp_path,
                                                                       monkeypatch):
    """An .onnx saved with its weights in an external data file (onnx.save(..., save_as_external_data=True), as a
    user saves a file whose metadata they edited with the onnx package) was handed to ONNX Runtime as bytes, which
    looked for the data file in the current folder: from elsewhere it was 'truncated or corrupt?', and from a folder
    holding another file's data of that name, that file's weights ran without a word. They are read from beside the
    .onnx; a data file that is not there is one line naming it."""
    import onnx

    from cgavit.deploy import open_exported

    proto = onnx.load(str(digits_exports[".onnx"]))
    (tmp_path / "model").mkdir()
    onnx.save(proto, str(tmp_path / "model" / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    decoy = tmp_path / "elsewhere" / "m.onnx.data"  # another export's weights, under the same name
    decoy.parent.mkdir()
    decoy.write_bytes(bytes(reversed((tmp_path / "model" / "m.onnx.data").read_bytes())))
    monkeypatch.chdir(decoy.parent)
    images = trained_digits.images[:8]
    module, _ = open_exported(tmp_path / "model" / "m.onnx")
    torch.testing.assert_close(module(images), open_exported(digits_exports[".onnx"])[0](images))
    (tmp_path / "model" / "m.onnx.data").unlink()
    with pytest.raises(ValueError) as caught:
        open_exported(tmp_path / "model" / "m.onnx")
    said = str(caught.value)
    assert "external data files" in said and "m.onnx.data" in said and "\n" not in said, said


# Two OpenVINO models dropped in the order they were made, then a signal with a Python handler (SIGCHLD from a
# DataLoader's workers is the one that struck the suite): each OpenVINO Core's CPU plugin maps an alternate signal
# stack for this thread, and before cgavit kept the thread's own, the second left it with the first's, unmapped.
TWO_OPENVINO_MODELS = """
import gc, os, signal, sys
import torch
from cgavit.deploy.openvino import OpenVinoModule, convert_openvino, signal_stack
from cgavit.testing import randomize_
import cgavit
model = randomize_(cgavit.create_model("efficientvit_m0", img_size=32, embed_dim=(16, 16, 16), depth=(1, 1, 1),
                                       num_heads=(2, 2, 2), num_classes=3)).eval()
before = signal_stack()
first, second = (OpenVinoModule(convert_openvino(model, (32, 32)), threads=1) for _ in range(2))
first(torch.randn(1, 3, 32, 32)), second(torch.randn(1, 3, 32, 32))
del first; gc.collect()
del second; gc.collect()
assert signal_stack() == before, (signal_stack(), before)
handled = []
signal.signal(signal.SIGUSR1, lambda *_: handled.append(True))
os.kill(os.getpid(), signal.SIGUSR1)
assert handled
print("survived")
"""


@need("openvino")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenVINO sets alternate signal stacks on Linux")
@pytest.mark.parametrize("faulthandler", [False, True])
def test_openvino_models_leave_the_threads_signal_stack_as_they_found_it(faulthandler, tmp_path):
    """Run in a child process, since the failure is a segmentation fault; with and without faulthandler's stack."""
    script = tmp_path / "two_models.py"
    script.write_text(TWO_OPENVINO_MODELS)
    flags = ["-X", "faulthandler"] if faulthandler else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    run = subprocess.run([sys.executable, *flags, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "survived" in run.stdout, (run.returncode, run.stderr[-2000:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaltstack through the C library: Linux")
def test_kept_signal_stack_puts_back_the_threads_stack():
    import ctypes

    from cgavit.deploy.openvino import _SignalStack, _libc, kept_signal_stack, signal_stack

    before = signal_stack()
    buffer = ctypes.create_string_buffer(256 * 1024)
    theirs = _SignalStack(ctypes.cast(buffer, ctypes.c_void_p), 0, len(buffer))
    with kept_signal_stack():
        assert _libc().sigaltstack(ctypes.byref(theirs), None) == 0
        assert signal_stack() == (ctypes.addressof(buffer), len(buffer))
    assert signal_stack() == before


def test_kept_signal_stack_leaves_none_when_the_old_one_is_refused(monkeypatch):
    """The kernel refuses a stack too small for AMX frames once AMX is on: then no stack, never the plugin's."""
    import ctypes

    from cgavit.deploy import openvino

    class Libc:  # a thread whose stack changes inside the block and whose old one cannot be set again
        def __init__(self):
            self.now, self.set = (111, 8192), []

        def sigaltstack(self, new, old):
            if old is not None:
                out = ctypes.cast(old, ctypes.POINTER(openvino._SignalStack)).contents
                out.ss_sp, out.ss_size = self.now
                out.ss_flags = openvino._SS_DISABLE if self.now[0] is None else 0
            if new is not None:
                ask = ctypes.cast(new, ctypes.POINTER(openvino._SignalStack)).contents
                self.set.append((ask.ss_sp, ask.ss_flags))
                if ask.ss_flags != openvino._SS_DISABLE:
                    return -1
                self.now = (None, 0)
            return 0

    libc = Libc()
    monkeypatch.setattr(openvino, "_libc", lambda: libc)
    with openvino.kept_signal_stack():
        libc.now = (222, 20144)  # a plugin's
    assert libc.set == [(111, 0), (None, openvino._SS_DISABLE)]
    assert openvino.signal_stack() == (None, 0)


@pytest.mark.parametrize("suffix", EXPORTED)
def test_a_one_channel_network_exports_a_file_cgavit_opens(suffix, tmp_path):
    """A 1-channel model's file carried ImageNet's three mean and std values, so open_exported (and eval) refused the
    file cgavit had just written, with advice (export it again) that could not help."""
    import cgavit
    from cgavit.deploy import open_exported
    from cgavit.testing import randomize_

    model = randomize_(cgavit.create_model("m0", in_chans=1, num_classes=4, img_size=64), seed=2).eval()
    module, info = open_exported(export_model(model, tmp_path / f"gray{suffix}", suffix[1:].replace("xml", "openvino"),
                                              (64, 64)))
    assert len(info.mean) == len(info.std) == 1 and info.mean[0] == pytest.approx(sum((0.485, 0.456, 0.406)) / 3)
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        assert (module(x) - model(x)).abs().max() < 1e-3


def test_a_one_channel_checkpoint_is_exported_and_checked_on_greyscale_images(tmp_path, capsys):
    """``cgavit export --data`` (and quantize, bench's precision check) read the images as RGB whatever the model
    took: a 1-channel checkpoint's check was ONNX Runtime's "invalid dimensions" traceback, quantize's a line telling
    the user to convert the images. The images are now read with the model's channels, as eval reads them."""
    import numpy as np
    from PIL import Image

    from cgavit.bench.precision import calibration_and_evaluation
    from cgavit.testing import randomize_
    from cgavit.train.data import build_transform
    from cgavit.weights import WeightsMeta, save_weights

    model = randomize_(cgavit.create_model("m0", num_classes=2, img_size=32, in_chans=1), seed=3).eval()
    meta = WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=2, img_size=32, crop_pct=1.0,
                       interpolation="bilinear", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), class_names=("p", "q"),
                       in_chans=1)
    checkpoint = save_weights(model, tmp_path / "gray.safetensors", meta)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("p", "q"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(3):
                pixels = (rng.random((40, 40, 3)) * 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / name / f"{i}.png")
    _, info = cgavit.load_model(checkpoint)
    calib, evaluated = calibration_and_evaluation(tmp_path / "data", "train", "val", info, 2, 6, channels=1)
    grey = build_transform(32, False, interpolation="bilinear", crop_pct=1.0, mean=(0.4,), std=(0.25,))
    assert calib.images.shape == (6, 1, 32, 32)
    first = Image.open(evaluated.files[0]).convert("L")
    assert torch.equal(evaluated.images[0], grey(first))
    out = tmp_path / "gray.onnx"
    assert main(["export", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "data"),
                 "--output", str(out)]) == 0, capsys.readouterr().err
    assert "top-1 agreement 100.0% on 6 images" in capsys.readouterr().out


def test_export_info_records_the_models_own_preprocessing():
    """What a file records: a loaded model's names and preprocessing, or ImageNet's for none; a mean and std that
    fit no channel count are refused before anything is written."""
    from cgavit.deploy.metadata import ExportInfo, export_info
    from cgavit.factory import ModelInfo

    loaded = ModelInfo(list("abc"), img_size=48, crop_pct=1.0, interpolation="bilinear", mean=(0.3,) * 3, std=(0.4,) * 3)
    made = export_info(loaded, (48, 48))
    assert (made.class_names, made.mean, made.std, made.crop_pct, made.interpolation) == (
        ("a", "b", "c"), (0.3,) * 3, (0.4,) * 3, 1.0, "bilinear")
    assert export_info(None, (64, 32)) == ExportInfo(img_size=(64, 32))
    assert export_info(made, (96, 96)).img_size == (96, 96) and export_info(made, (96, 96)).mean == made.mean
    with pytest.raises(ValueError, match="2 mean and 2 std values for a 3-channel network"):
        export_info(ExportInfo(mean=(0.5, 0.5), std=(0.2, 0.2)), (48, 48))


def test_an_exported_file_records_its_own_precision_and_the_models_classes(trained_digits, tmp_path):
    """export_model given an int8 file's ExportInfo wrote an fp32 file claiming int8 and cgavit quantize's verdict
    (which optimize then trusted); an info naming 2 classes for a 10-class model was written, then refused on opening."""
    from cgavit.deploy import open_exported
    from cgavit.deploy.metadata import ExportInfo

    verdict = {"runtime": "onnxruntime", "agreement": 1.0, "meets_target": True, "weight_range": "8-bit"}
    theirs = ExportInfo(class_names=tuple("0123456789"), img_size=(48, 48), precision="int8", int8=verdict)
    path = export_model(trained_digits.model, tmp_path / "m", "onnx", (48, 48), info=theirs)
    _, info = open_exported(path)
    assert (info.precision, dict(info.int8), info.class_names) == ("fp32", {}, theirs.class_names)
    with pytest.raises(ValueError, match="info names 2 classes but the model predicts 10"):
        export_model(trained_digits.model, tmp_path / "n", "onnx", (48, 48), info=ExportInfo(class_names=("a", "b")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("suffix", EXPORTED)
def test_an_upper_case_suffix_names_the_file_its_format_writes(suffix, tmp_path, capsys):
    """--output m.XML was taken for OpenVINO, then OpenVINO's serializer refused the name, and the message said to
    check the disk."""
    given = tmp_path / f"m{suffix.upper()}"
    assert main(["export", "--model", "m0", "--img-size", "64", "--output", str(given)]) == 0, capsys.readouterr().err
    assert (tmp_path / f"m{suffix}").is_file() and f"wrote {tmp_path / f'm{suffix}'}" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".onnx", ".xml"])
def test_an_opened_file_is_its_own_copy_and_serves_threads(suffix, digits_exports, trained_digits, tmp_path):
    """An opened OpenVINO file was memory-mapped: its .bin rewritten in place changed the logits without a word (cut
    short, SIGBUS). Threads sharing one OpenVINO module got "Infer Request is busy" or another call's logits. Each
    runtime's module now holds its model in memory and serves one call at a time; neither can be copied, and says so."""
    import copy
    import threading

    from cgavit.deploy import open_exported

    if suffix not in digits_exports:
        pytest.skip("runtime missing")
    path = tmp_path / f"m{suffix}"
    shutil.copy(digits_exports[suffix], path)
    if suffix == ".xml":
        shutil.copy(digits_exports[suffix].with_suffix(".bin"), path.with_suffix(".bin"))
    module, _ = open_exported(path)
    images = trained_digits.images[:48]
    batches = list(images.split(6))
    expected = [module(b) for b in batches]
    for written in [path, path.with_suffix(".bin")] if suffix == ".xml" else [path]:
        written.write_bytes(bytes(written.stat().st_size))  # the same size, all zeros
    results, errors = {}, []

    def serve(worker: int) -> None:
        try:
            for _ in range(5):
                for i in range(worker, len(batches), 4):
                    results.setdefault(i, []).append(module(batches[i]))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=serve, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, outs in results.items():
        for out in outs:
            torch.testing.assert_close(out, expected[i], rtol=0, atol=0)
    torch.testing.assert_close(module(images[:5]), torch.cat(expected)[:5], rtol=1e-5, atol=1e-5)  # a new batch size
    with pytest.raises(TypeError, match="cannot be copied or pickled: keep the file"):
        copy.deepcopy(module)


def _small_onnx(tmp_path, name: str, *, logits=("batch", 3), twice=False, reshape=None, batch="batch",
                elem=None, channels=3) -> "os.PathLike":
    """An .onnx file with cgavit's metadata (3 classes, 32 px) whose network pools its (batch, 3, 32, 32) images to
    (batch, 3) logits, declaring its output ``logits``; ``twice``: it returns them twice side by side (batch, 6);
    ``reshape``: reshaped to that fixed shape; ``batch``/``elem``/``channels``: its input's batch dimension, element
    type and channels."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from cgavit.deploy.metadata import ExportInfo
    from cgavit.deploy.onnx import with_onnx_metadata

    nodes = [helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
             helper.make_node("Flatten", ["pooled"], ["flat"])]
    inits, last = [], "flat"
    if twice:
        nodes.append(helper.make_node("Concat", ["flat", "flat"], ["both"], axis=1))
        last = "both"
    if reshape:
        inits.append(helper.make_tensor("shape", TensorProto.INT64, [len(reshape)], list(reshape)))
        nodes.append(helper.make_node("Reshape", [last, "shape"], ["shaped"]))
        last = "shaped"
    nodes.append(helper.make_node("Identity", [last], ["logits"]))
    graph = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("images", elem or TensorProto.FLOAT, [batch, channels, 32, 32])],
        [helper.make_tensor_value_info("logits", elem or TensorProto.FLOAT, list(logits))], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    data = with_onnx_metadata(model.SerializeToString(), ExportInfo(class_names=("a", "b", "c"), img_size=(32, 32)))
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(data)
    return path


@need("onnx")
def test_exported_files_cgavit_cannot_feed_are_refused_in_one_line(tmp_path):
    """A hostile review's .onnx files: one declaring (N, 3) logits and computing others gave wrong metrics (top-5 of 3
    classes) or an IndexError; a fixed batch of 1, a float16 input, or a Reshape fixed at batch 1 gave the runtime's
    traceback, and a dynamic channel count let mean and std of another length through. Now the file's form is checked when it is opened and its outputs on every call."""
    from onnx import TensorProto

    from cgavit.deploy import open_exported

    x = torch.randn(2, 3, 32, 32)
    module, info = open_exported(_small_onnx(tmp_path, "good"))
    assert info.class_names == ("a", "b", "c") and torch.allclose(module(x), x.mean((2, 3)), atol=1e-6)
    refused = {"batch1": (dict(batch=1), "its batch is fixed at 1"),
               "fp16": (dict(elem=TensorProto.FLOAT16), "its input is not float32"),
               "channels": (dict(channels="C"), r"its input's shape is not a fixed \(batch, channels, height, width\)")}
    for name, (change, words) in refused.items():
        with pytest.raises(ValueError, match=f"{name}.onnx: {words}.*export it again"):
            open_exported(_small_onnx(tmp_path, name, **change))
    twice, _ = open_exported(_small_onnx(tmp_path, "twice", twice=True, reshape=(-1, 3)))  # declares (batch, 3)
    with pytest.raises(ValueError, match=r"twice.onnx: it returned \(4, 3\) for 2 images, not the \(batch, 3\) logits"):
        twice(x)
    fixed, _ = open_exported(_small_onnx(tmp_path, "fixed", reshape=(1, 3)))
    assert fixed(x[:1]).shape == (1, 3)
    with pytest.raises(ValueError, match=r"fixed.onnx: its runtime could not run it on \(2, 3, 32, 32\) images"):
        fixed(x)


@need("openvino")
def test_openvino_files_cgavit_cannot_feed_are_refused_in_one_line(tmp_path):
    """A hostile review's OpenVINO files opened and then crashed on the first call (dynamic height and width, a dynamic
    rank, two inputs) or gave a RuntimeError traceback when opened (an rt_info 'cgavit' entry that is a value, not a
    section of keys)."""
    import openvino

    from cgavit.deploy import open_exported
    from cgavit.deploy.metadata import ExportInfo
    from cgavit.deploy.openvino import save_openvino

    info = ExportInfo(class_names=("a", "b", "c"), img_size=(32, 32))
    model = openvino.convert_model(str(_small_onnx(tmp_path, "small")))
    save_openvino(model, tmp_path / "good.xml", info)
    module, read = open_exported(tmp_path / "good.xml")
    assert read.class_names == ("a", "b", "c") and module(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    model.reshape([-1, 3, -1, -1])
    save_openvino(model, tmp_path / "dynamic.xml", info)
    with pytest.raises(ValueError, match=r"dynamic.xml: its input's shape is not a fixed .*\(None, 3, None, None\)"):
        open_exported(tmp_path / "dynamic.xml")
    text = (tmp_path / "good.xml").read_text()
    flat = re.sub(r"<cgavit>.*</cgavit>", '<cgavit value="x" />', text, flags=re.S)
    assert flat != text
    (tmp_path / "flat.xml").write_text(flat)
    shutil.copy(tmp_path / "good.bin", tmp_path / "flat.bin")
    with pytest.raises(ValueError, match="flat.xml: its cgavit metadata .* is not a section of keys"):
        open_exported(tmp_path / "flat.xml")


@need("onnx")
def test_trust_checkpoint_applies_to_the_reference_of_an_exported_file(digits_exports, trained_digits, tmp_path, capsys):
    """--trust-checkpoint for a pickled reference was refused because the evaluated file is exported ("drop
    --trust-checkpoint"), and a reference that does not record its network was told to give --model, which a
    reference never takes; with an exported reference too, the flag was ignored without a word."""
    import fractions

    from cgavit import load_model

    model, _ = load_model(trained_digits.checkpoint)
    torch.save({"model": model.state_dict(), "share": fractions.Fraction(1, 3)}, tmp_path / "pickled.pt")
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    run = ["eval", "--data", str(trained_digits.data), "--checkpoint", str(digits_exports[".onnx"]), "--workers", "0"]
    said = []
    for extra in ([], ["--trust-checkpoint"]):
        assert main([*run, "--reference", str(tmp_path / "pickled.pt"), *extra]) == 2
        said.append(capsys.readouterr().err)
    assert "holds pickled Python objects" in said[0] and "--trust-checkpoint" in said[0]
    assert "does not record its network" in said[1] and "--model" not in said[1]  # it was read: trust applied to it
    assert main([*run, "--reference", str(tmp_path / "bare.pt")]) == 2
    assert "--reference bare.pt does not record its network" in capsys.readouterr().err
    assert main([*run, "--trust-checkpoint"]) == 2  # without a reference the flag has nothing to apply to
    assert "drop --trust-checkpoint" in capsys.readouterr().err
    assert main([*run, "--reference", str(digits_exports[".xml"]), "--trust-checkpoint"]) == 2  # it was ignored
    assert "are both exported files" in capsys.readouterr().err


def _tiny(classes: int = 3, **kw):
    """An untrained M0 at 32 px (what the export checks below need: a network of the right shape)."""
    return cgavit.create_model("m0", num_classes=classes, img_size=32, **kw).eval()


BAD_INFOS = [
    ({"class_names": ("a", "b\nc", "d")}, r"class name 1 'b\\nc' holds control"),
    ({"class_names": ("a", "a", "d")}, r"'class_names' names 'a' twice"),
    ({"mean": (5.0, 5.0, 5.0), "std": (0.0, 0.0, 0.0)}, r"its mean values must be in \[0.0, 1.0\]"),
    ({"interpolation": "lanczos", "crop_pct": 7.0}, r"its interpolation must be one of bicubic, bilinear, nearest"),
    ({"crop_pct": 7.0}, r"its crop fraction must be within 0.2..1.0, got 7.0"),
]


def test_a_file_that_records_no_class_names_exports_with_imagenets_as_its_own(tmp_path):
    """A 1000-class file that records no names (official, timm, a bare state dict) was refused by the check of
    metadata on writing: ImageNet's short names repeat 'crane' and 'maillot', which now carry their synsets."""
    from cgavit import load_model
    from cgavit.deploy.formats import export_metadata

    path = tmp_path / "official.pth"
    torch.save({"model": cgavit.create_model("efficientvit_m0", img_size=32).state_dict()}, path)
    _, info = load_model(path, "efficientvit_m0")
    made = export_metadata(info, "onnx", (32, 32))
    assert len(set(made.class_names)) == 1000 and made.class_names[134] == "crane (n02012849)"
    assert made.class_names[0] == "tench"


@pytest.mark.parametrize("suffix", EXPORTED)
@pytest.mark.parametrize("given, why", BAD_INFOS)
def test_metadata_its_reader_would_refuse_is_refused_before_anything_is_written(suffix, given, why, tmp_path):
    """export_model wrote files whose metadata open_exported then refused (a class name with a newline, names
    repeated, mean 5 and std 0, interpolation lanczos, crop 7.0), and the reader said to export again, which wrote
    the same file. The writer now checks with the reader's rules and says what to change."""
    from cgavit.deploy.metadata import ExportInfo

    fmt = "openvino" if suffix == ".xml" else "onnx"
    with pytest.raises(ValueError, match=f"cgavit cannot read back: {why}.*; change that value"):
        export_model(_tiny(), tmp_path / f"z{suffix}", fmt, 32, info=ExportInfo(**given))
    assert list(tmp_path.iterdir()) == []


def test_class_names_too_long_for_the_reader_are_refused_by_export(tmp_path, capsys):
    """cgavit export --checkpoint with 60,000 class names of 147 characters (within a checkpoint's bounds) wrote an
    .onnx whose 9 MB of names cgavit predict and open_exported refused. The export refuses them, in one line, before
    any work; formats that carry no metadata (ExecuTorch, LiteRT) are not refused for it."""
    from cgavit.deploy.formats import export_metadata
    from cgavit.factory import ModelInfo
    from cgavit.train import checkpoint

    names = tuple(f"{i:04d}" + "x" * 1000 for i in range(8500))  # 8.6 MB of JSON, over the reader's 8 MiB
    model = _tiny(len(names))
    checkpoint.save(tmp_path / "big.pt", {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "next_epoch": 1,
                                          "args": {"model": "efficientvit_m0", "img_size": 32}, "classes": list(names)})
    assert main(["export", "--checkpoint", str(tmp_path / "big.pt"), "--output", str(tmp_path / "big")]) == 2
    err = capsys.readouterr().err
    assert "'cgavit.class_names' is 8," in err and "change that value" in err and "export the file again" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]
    info = ModelInfo(list(names), img_size=32)
    for fmt in ("executorch", "tflite"):
        assert export_metadata(info, fmt, (32, 32)).class_names == names


@need("openvino")
def test_an_xml_refuses_weights_it_was_not_written_with(tmp_path):
    """An .xml beside another export's .bin (same network, other weights) ran without a word and gave the other
    model's logits, and a .bin with bytes appended was read too. The .xml records its .bin's size and SHA-256;
    an .xml written before it recorded them still opens, unchecked."""
    from cgavit.deploy import open_exported
    from cgavit.deploy.openvino import WEIGHTS_KEY

    path = export_model(cgavit.testing.randomize_(_tiny(), seed=2), tmp_path / "m.xml", "openvino", 32)
    weights = path.with_suffix(".bin").read_bytes()
    module, _ = open_exported(path)
    assert module(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    other = bytearray(weights)
    other[len(other) // 2] ^= 1  # other weights, the same size and layout: as another export of this network
    path.with_suffix(".bin").write_bytes(bytes(other))
    with pytest.raises(ValueError, match=r"m.bin is not the .bin m.xml was written with \(another SHA-256"):
        open_exported(path)
    with pytest.raises(ValueError, match=r"m.bin is not the .bin m.xml was written with"):
        load_exported(path, "openvino")
    path.with_suffix(".bin").write_bytes(weights + b"junk")
    with pytest.raises(ValueError, match=rf"m.bin is not the .bin m.xml was written with \({len(weights) + 4:,} bytes "
                                         rf"where it records {len(weights):,}\)"):
        open_exported(path)
    older = re.sub(rf"\s*<{WEIGHTS_KEY} value=[^>]*/>", "", path.read_text())  # as written before the record
    assert older != path.read_text()
    (tmp_path / "older.xml").write_text(older)
    (tmp_path / "older.bin").write_bytes(bytes(other))
    assert open_exported(tmp_path / "older.xml")[0](torch.randn(1, 3, 32, 32)).shape == (1, 3)


@need("openvino")
def test_an_xml_beside_the_bin_of_another_network_names_the_bin(tmp_path):
    """An .xml beside the .bin of another export of another size (a network exported again, the .xml alone copied)
    failed in OpenVINO's reader, and was 'cannot read m.xml ... (truncated or corrupt?): Output pattern dim[0] has
    invalid bounds', which named neither file at fault; it names the .bin and the size the .xml records. Without its
    .bin, load_exported says that it is missing."""
    from cgavit.deploy import open_exported

    path = export_model(_tiny(), tmp_path / "m.xml", "openvino", 32)
    other = export_model(_tiny(5, embed_dim=(24, 32, 48)), tmp_path / "other.xml", "openvino", 32)
    size = path.with_suffix(".bin").stat().st_size
    path.with_suffix(".bin").write_bytes(other.with_suffix(".bin").read_bytes())
    with pytest.raises(ValueError, match=rf"m.bin is not the .bin m.xml was written with \([\d,]+ bytes where it "
                                         rf"records {size:,}\): put the .bin exported with it"):
        open_exported(path)
    path.with_suffix(".bin").unlink()
    with pytest.raises(ValueError, match=r"OpenVINO weights \(.bin beside the .xml\) .*m.bin does not exist"):
        load_exported(path, "openvino")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("suffix", EXPORTED)
def test_a_reduced_precision_model_exports_its_float32_graph(suffix, dtype, tmp_path):
    """export_model on a bf16 or fp16 model failed: "the images are torch.float32 and the model's weights
    torch.bfloat16" for ONNX, a multi-line RuntimeError for OpenVINO. It exports the fused float32 model, as
    optimize does, and leaves the caller's model as it was."""
    from cgavit.deploy import open_exported

    model = cgavit.testing.randomize_(_tiny(), seed=3).to(dtype)
    module, _ = open_exported(export_model(model, tmp_path / f"m{suffix}", suffix[1:].replace("xml", "openvino"), 32))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        reference = cgavit.fuse(model).float()(x)
    assert next(model.parameters()).dtype == dtype
    assert (module(x) - reference).abs().max() <= 1e-3 * reference.abs().max()


def test_options_a_format_would_ignore_are_refused(tmp_path):
    """export_model wrote an ExecuTorch int8 file for Int8Options(float_layers=("no.such.layer",)), which its
    recipe never reads (ONNX refuses the name), and dropped options= for fp32 and batch=7 for ONNX without a word.
    Each is refused before anything is written, as calibration for fp32 already was."""
    from cgavit.deploy import Int8Options

    model, calibration = _tiny(), [torch.randn(4, 3, 32, 32)]
    cases = [("executorch", "int8", dict(calibration=calibration, options=Int8Options(float_layers=("no.such.layer",))),
              r"options are read for int8 in onnx and openvino only \(executorch int8 is XNNPACK's own recipe"),
             ("onnx", "fp32", dict(options=Int8Options()), r"\(onnx fp32 quantises nothing\): leave options out"),
             ("tflite", "fp32", dict(options=Int8Options()), r"\(tflite fp32 quantises nothing\)"),
             ("onnx", "fp32", dict(batch=7), r"batch is fixed in executorch and tflite files only \(onnx files take any"),
             ("openvino", "fp32", dict(batch=7), r"\(openvino files take any batch\): leave batch out, not 7")]
    for fmt, precision, given, why in cases:
        with pytest.raises(ValueError, match=why):
            export_model(model, tmp_path / "m", fmt, 32, precision, **given)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("threads", [-3, 0, 2.5, 10**6, True, "2"])
def test_a_thread_count_out_of_bounds_is_refused_before_the_file_is_read(threads, tmp_path):
    """threads=-3 on an .xml blamed the file, 2.5 on an .onnx was pybind's TypeError, 10**6 grew the process to
    14 GB: open_exported and load_exported check threads as --threads is (cgavit.bounds.check_threads)."""
    from cgavit.deploy import open_exported

    for opened in (lambda: open_exported(tmp_path / "not-read.onnx", threads=threads),
                   lambda: load_exported(tmp_path / "not-read.xml", "openvino", threads=threads)):
        with pytest.raises(ValueError, match=r"threads must be a whole number within 1..1024, got "):
            opened()


@pytest.mark.parametrize("name", FP32)
def test_load_exported_refuses_a_file_its_runtime_cannot_read_in_one_line(name, tmp_path):
    """load_exported of a .pte that was not an ExecuTorch program raised the runtime's RuntimeError ("Failed to load
    program, error: 0x:12"), a .tflite LiteRT's bare "not a valid Flatbuffer buffer" naming no file, and a missing
    file FileNotFoundError, where the docstring promised a ValueError. Each is one ValueError naming the file."""
    from cgavit.io import UnreadableFileError

    path = tmp_path / f"damaged{FORMATS[name].suffix}"
    path.write_bytes(b"not a model, " * 50)
    if name == "openvino":  # its .bin beside it: a missing one is refused first, as open_exported does
        path.with_suffix(".bin").write_bytes(b"not weights, " * 50)
    with pytest.raises(ValueError, match=f"cannot read {re.escape(str(path))} as .*; export it again"):
        load_exported(path, name)
    with pytest.raises(UnreadableFileError, match="does not exist"):
        load_exported(tmp_path / f"missing{FORMATS[name].suffix}", name)


@pytest.mark.parametrize("suffix", EXPORTED)
def test_class_names_for_a_model_without_a_classifier_are_refused_before_anything_is_written(suffix, tmp_path):
    """export_model of a model built with num_classes=0 and info naming 2 classes wrote the file, whose network
    returns 192 features, and open_exported then refused it ("names 2 classes but the network returns 192 logits;
    export it again"), which wrote the same file. The writer refuses it; without names the file opens."""
    from cgavit.deploy import open_exported
    from cgavit.deploy.metadata import ExportInfo

    fmt = "openvino" if suffix == ".xml" else "onnx"
    headless = _tiny(0)
    with pytest.raises(ValueError, match="info names 2 classes but the model has no classifier.*192 features"):
        export_model(headless, tmp_path / f"z{suffix}", fmt, 32, info=ExportInfo(class_names=("a", "b")))
    assert list(tmp_path.iterdir()) == []
    _, info = open_exported(export_model(headless, tmp_path / f"z{suffix}", fmt, 32, info=ExportInfo()))
    assert info.class_names == ()


@pytest.mark.parametrize("suffix", EXPORTED)
def test_a_feature_map_export_is_refused_at_open_with_what_runs_it(suffix, tmp_path):
    """A model without a classifier or pooling (num_classes=0, global_pool='') exports (its parity checked), and
    open_exported refused the file it wrote with "its output is not declared as (batch, classes) logits ... export it
    again", which wrote the same file. It says the file holds feature maps, and what runs it: load_exported."""
    from cgavit.deploy import open_exported

    fmt = "openvino" if suffix == ".xml" else "onnx"
    path = export_model(_tiny(0, global_pool=""), tmp_path / f"maps{suffix}", fmt, 32)
    with pytest.raises(ValueError, match=r"returns feature maps \(None, 192, 1, 1\), not .*load_exported") as err:
        open_exported(path)
    assert "export it again" not in str(err.value)
    assert load_exported(path, fmt)(torch.randn(2, 3, 32, 32)).shape == (2, 192, 1, 1)


@pytest.mark.parametrize("version, words", [('"\\u001b]0;owned\\u0007"', "holds control or formatting characters"),
                                            ('{"a": "b"}', "must be text"), ("5", "must be text")])
def test_a_files_cgavit_version_is_checked_like_its_other_text(version, words):
    """A file's metadata is read as untrusted and its class names and int8 notes must be printable text, but its
    version was taken as it was: an escape sequence that retitles the terminal reached info.version, and an object or
    a number was turned into its repr. It is checked as the other text is; a file that records none still opens."""
    from cgavit.deploy.metadata import ExportInfo

    props = ExportInfo(img_size=(32, 32), version="0.1.0").to_props()
    assert ExportInfo.from_props(props).version == "0.1.0"
    with pytest.raises(ValueError, match=f"bad cgavit metadata: its cgavit version .*{words}"):
        ExportInfo.from_props({**props, "cgavit.version": version})
    del props["cgavit.version"]
    assert ExportInfo.from_props(props).version == ""


def test_metadata_without_its_preprocessing_warns_of_what_is_assumed():
    """A file whose cgavit metadata had lost its mean and std (edited with the onnx package, say) opened with
    ImageNet's without a word, so eval and predict fed its images another way than the model was trained on; the
    file still opens, and a warning names what is missing and what was assumed. A whole record opens silently."""
    import warnings

    from cgavit.deploy.metadata import ExportInfo

    props = ExportInfo(img_size=(32, 32), mean=(0.5,), std=(0.25,), crop_pct=1.0).to_props()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ExportInfo.from_props(props).mean == (0.5,)
    for key in ("cgavit.mean", "cgavit.std", "cgavit.crop_pct"):
        del props[key]
    with pytest.warns(RuntimeWarning, match=r"m.onnx records no mean, std, crop_pct in its cgavit metadata, so "
                                            r"ImageNet's mean \(0.485, 0.456, 0.406\), std .*, crop 0.875 are assumed"):
        info = ExportInfo.from_props(props, "m.onnx")
    assert info.mean == (0.485, 0.456, 0.406) and info.crop_pct == 0.875


def test_metadata_of_a_newer_cgavit_warns_naming_both_versions(monkeypatch):
    """A file whose metadata a newer cgavit wrote opened without a word, though it may record what this version
    does not read. A newer major or minor version warns, naming both; the same release, an older one, a newer patch
    and a version that is not a number open silently."""
    import warnings

    from cgavit.deploy import metadata
    from cgavit.deploy.metadata import ExportInfo

    monkeypatch.setattr(metadata, "cgavit_version", lambda: "0.4.2")
    for newer in ("0.5.0", "1.0", "0.10.0.dev1"):
        props = ExportInfo(img_size=(32, 32), version=newer).to_props()
        with pytest.warns(RuntimeWarning, match=rf"m.onnx was written by cgavit {re.escape(newer)}, newer than the "
                                                r"installed 0.4.2: .*pip install -U cgavit"):
            assert ExportInfo.from_props(props, "m.onnx").version == newer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for same in ("0.4.2", "0.4.9", "0.3.7", "", "dev"):
            ExportInfo.from_props(ExportInfo(img_size=(32, 32), version=same).to_props())


@pytest.mark.parametrize("batch", [2.5, True, "2", 0])
def test_a_batch_that_is_no_whole_number_is_refused_in_one_line(batch, tmp_path):
    """export_model(..., "executorch", batch=2.5) raised torch.randn's TypeError (a page of its signatures), batch="2"
    for tflite a TypeError ('<' not supported), and batch=True built a program for one image. Each is one ValueError,
    before any work, for every format installed."""
    for fmt in [name for name, f in FORMATS.items() if f.available()]:
        with pytest.raises(ValueError, match=f"batch must be a whole number of images, at least 1, got {re.escape(repr(batch))}"):
            export_model(_tiny(), tmp_path / "b", fmt, 32, batch=batch)
    assert list(tmp_path.iterdir()) == []


@need("onnx")
@pytest.mark.parametrize("given, key", [({"mean": torch.tensor([0.5, 0.5, 0.5])}, "mean"),
                                        ({"crop_pct": __import__("numpy").float32(0.9)}, "crop_pct")])
def test_metadata_json_cannot_write_is_refused_in_one_line(given, key, tmp_path):
    """export_model with ExportInfo(mean=torch.tensor([...])) or a numpy float32 crop raised json's TypeError ("Object of
    type Tensor is not JSON serializable") from inside the writer. It is one ValueError naming the value and what to
    give, before anything is written."""
    from cgavit.deploy.metadata import ExportInfo

    with pytest.raises(ValueError, match=f"its {key} holds what JSON cannot write .*give Python numbers and text"):
        export_model(_tiny(), tmp_path / "z", "onnx", 32, info=ExportInfo(**given))
    assert list(tmp_path.iterdir()) == []


def test_class_names_given_as_one_text_are_refused():
    """ExportInfo(class_names="cat") was taken as the three classes c, a and t."""
    from cgavit.deploy.metadata import ExportInfo

    with pytest.raises(ValueError, match="class_names must be a sequence of names, one per class, got the text 'cat'"):
        ExportInfo(class_names="cat")
    assert ExportInfo(class_names=["cat"]).class_names == ["cat"]


@need("onnx")
@pytest.mark.parametrize("opset", [True, "17", 17.0, 6, 99])
def test_an_opset_torch_cannot_export_is_refused_before_the_export(opset, tmp_path, capfd):
    """export_onnx(opset=True) wrote an opset-1 file ONNX Runtime could not load, "17" raised a TypeError, and 99 made
    torch print its whole traced graph (891 lines at 32 px) before cgavit's error. Each is one ValueError first."""
    from cgavit.deploy.onnx import export_onnx, opset_range

    lo, hi = opset_range()
    with pytest.raises(ValueError, match=f"opset must be a whole number within {lo}..{hi} .*got {re.escape(repr(opset))}"):
        export_onnx(_tiny(), tmp_path / "m.onnx", (32, 32), opset=opset)
    assert list(tmp_path.iterdir()) == [] and "graph" not in capfd.readouterr().out


@need("onnx")
def test_predict_on_a_file_exported_without_class_names_says_how_it_was_made(tmp_path, capsys):
    """A 3-class model exported from Python without info= records no class names, and cgavit predict refused it as
    "no classifier (a model without one, num_classes=0, exports so)", which it is not. The refusal names both ways a
    file comes to record no names, and how to export one that does."""
    from PIL import Image

    path = export_model(_tiny(3), tmp_path / "m", "onnx", 32)
    Image.new("RGB", (40, 40), (120, 30, 200)).save(tmp_path / "x.png")
    assert main(["predict", "--checkpoint", str(path), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "records no class names" in err and "export_model without info=" in err and "is no classifier" not in err
    assert len(err.strip().splitlines()) == 1
    assert main(["export", "--model", "efficientvit_m0", "--img-size", "32", "--output", str(tmp_path / "random")]) == 0
    capsys.readouterr()  # the docs' first export: random weights, whose 1000 outputs name nothing
    assert main(["predict", "--checkpoint", str(tmp_path / "random.onnx"), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "cgavit export --model without --checkpoint (random weights" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", [pytest.param(n, marks=need(n)) for n, fmt in FORMATS.items() if not fmt.metadata])
def test_eval_and_predict_on_a_file_without_metadata_say_what_they_run(name, fixed_batch_exports, trained_digits,
                                                                       capsys):
    """cgavit eval / predict on the .pte or .tflite a user is about to ship said 'an exported model, not weights: give
    the checkpoint it was exported from': nothing of the files they do run, nor of how to run this one. The refusal
    (one line, exit 2; --reference too) names the .onnx and .xml files they run and load_exported for this one."""
    path = fixed_batch_exports[name]
    capsys.readouterr()  # the exporter's own chatter
    image = str(sorted((trained_digits.data / "val").glob("*/*"))[0])
    runs = (["predict", "--checkpoint", str(path), image],
            ["eval", "--data", str(trained_digits.data), "--workers", "0", "--checkpoint", str(path)],
            ["eval", "--data", str(trained_digits.data), "--workers", "0", "--checkpoint",
             str(trained_digits.checkpoint), "--reference", str(path)])
    for argv in runs:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{path.name}, a file for {FORMATS[name].runtime}, records no class names" in err, err
        assert "run .onnx and .xml files" in err and f"load_exported(path, '{name}')" in err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("suffix", EXPORTED)
def test_an_exported_file_under_another_name_is_named_by_its_first_bytes(suffix, digits_exports, trained_digits,
                                                                         tmp_path, capsys):
    """An exported file saved without its suffix (a download named 'model') or renamed .pt was read as weights:
    'its first bytes are neither safetensors nor a PyTorch checkpoint ... or a truncated download?'. eval and predict
    tell exported files by their suffix, and now say which format the file is and what to name it. A pipe given as
    the checkpoint is still refused from its type, never opened."""
    source = digits_exports[suffix]
    image = str(sorted((trained_digits.data / "val").glob("*/*"))[0])
    for name in ("model", "model.pt"):
        renamed = tmp_path / name
        renamed.write_bytes(source.read_bytes())
        for argv in (["predict", "--checkpoint", str(renamed), image],
                     ["eval", "--data", str(trained_digits.data), "--workers", "0", "--checkpoint", str(renamed)]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"{name} is a file for {'ONNX Runtime' if suffix == '.onnx' else 'OpenVINO'} by its first bytes" in err
            assert f"name it model{suffix}" in err and len(err.strip().splitlines()) == 1, err
    os.mkfifo(tmp_path / "pipe")
    assert main(["predict", "--checkpoint", str(tmp_path / "pipe"), image]) == 2
    assert "is not a regular file" in capsys.readouterr().err


@need("openvino")
@pytest.mark.timeout(120)
def test_an_xml_whose_bin_is_a_pipe_is_refused_not_waited_on(digits_exports, tmp_path):
    """load_exported(m.xml, "openvino") with a pipe named m.bin beside it hung for ever in OpenVINO's reader (only
    open_exported looked at the .bin first). Every reader of an .xml now refuses it in one line, from its type."""
    from cgavit.deploy import open_exported
    from cgavit.io import UnreadableFileError

    (tmp_path / "m.xml").write_bytes(digits_exports[".xml"].read_bytes())
    os.mkfifo(tmp_path / "m.bin")
    for read in (lambda: load_exported(tmp_path / "m.xml", "openvino"), lambda: open_exported(tmp_path / "m.xml")):
        with pytest.raises(UnreadableFileError, match=r"OpenVINO weights \(.bin beside the .xml\) .*m.bin is not a "
                                                      r"regular file \(a pipe"):
            read()


def test_an_xml_whose_bin_is_named_in_other_letter_case_says_to_rename_it(digits_exports, trained_digits, tmp_path,
                                                                          capsys):
    """M.XML beside M.BIN (a zip from a case-blind disk) was refused as 'M.bin does not exist', beside the M.BIN the
    user could see; the error now names the file there and what to rename it to."""
    (tmp_path / "M.XML").write_bytes(digits_exports[".xml"].read_bytes())
    (tmp_path / "M.BIN").write_bytes(digits_exports[".xml"].with_suffix(".bin").read_bytes())
    image = next(trained_digits.data.glob("val/*/*.png"))
    assert main(["predict", str(image), "--checkpoint", str(tmp_path / "M.XML")]) == 2
    assert "the folder holds M.BIN; rename M.BIN to M.bin" in capsys.readouterr().err
    (tmp_path / "M.BIN").rename(tmp_path / "M.bin")
    assert main(["predict", str(image), "--checkpoint", str(tmp_path / "M.XML"), "--topk", "1"]) == 0


@need("openvino")
def test_a_linked_xml_without_its_bin_beside_the_link_says_to_link_the_bin(digits_exports, trained_digits, tmp_path,
                                                                          capsys):
    """current.xml linked to a release's .xml was refused as 'current.bin does not exist; check the path', with the
    release's .bin beside the file it links to: OpenVINO reads the .bin beside the link (as any program the pair is
    shipped to does), so the error now says so, and which .bin to link where."""
    xml = digits_exports[".xml"]
    link = tmp_path / "current.xml"
    link.symlink_to(xml)
    image = next(trained_digits.data.glob("val/*/*.png"))
    assert main(["predict", str(image), "--checkpoint", str(link)]) == 2
    err = capsys.readouterr().err
    assert f"link {xml.resolve().with_suffix('.bin')} as {tmp_path / 'current.bin'} too" in err, err
    assert len(err.strip().splitlines()) == 1, err
    (tmp_path / "current.bin").symlink_to(xml.with_suffix(".bin"))
    assert main(["predict", str(image), "--checkpoint", str(link), "--topk", "1"]) == 0
