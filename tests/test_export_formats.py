"""Every export format, run in its own runtime against PyTorch: fp32 within 1e-4 relative error, int8
within the agreement target on the trained digits model. Each format is skipped, with the extra to
install, when its runtime is missing."""

import pytest
import torch

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
                        trained_digits.calibration(), batch=16)
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


@need("executorch")
def test_executorch_runs_on_the_threads_asked_for(trained_digits, tmp_path):
    """ExecuTorch's threadpool starts with a thread per core: the module sets it to ``threads`` (the
    paper's CPU protocol is one thread)."""
    from executorch.extension.pybindings import portable_lib

    path = export_model(trained_digits.model, tmp_path / "m.pte", "executorch", (48, 48))
    for threads in (2, 1):
        module = load_exported(path, "executorch", threads=threads)
        assert portable_lib._threadpool_get_thread_count() == threads
        assert module(torch.randn(2, 3, 48, 48)).shape == (2, 10)


@need("openvino")
def test_openvino_export_takes_a_stem_and_carries_metadata(tmp_path, capsys):
    """The README's command: --output m0_ov writes m0_ov.xml + m0_ov.bin (OpenVINO IR is always NAME.xml)."""
    from cgavit.deploy import open_exported

    code = main(["export", "--model", "efficientvit_m0", "--format", "openvino", "--output", str(tmp_path / "m0_ov"),
                 "--img-size", "64", "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0_ov.bin", "m0_ov.xml"]
    assert "m0_ov.xml" in capsys.readouterr().out
    module, info = open_exported(tmp_path / "m0_ov.xml")
    assert info.img_size == (64, 64) and info.precision == "fp32" and info.version
    assert module(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
    assert main(["export", "--model", "m0", "--format", "openvino", "--output", str(tmp_path / "m.bin")]) == 2
    assert "NAME or NAME.xml" in capsys.readouterr().err
