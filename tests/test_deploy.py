"""The fast inference paths against the plain model (random inputs, randomised BatchNorm)."""

import os
import sys

import pytest
import torch

import cgavit
from cgavit.attention import LocalWindowAttention
from cgavit.deploy import optimize
from cgavit.deploy.fastpath import TOLERANCE, choose_backend
from cgavit.deploy.onnx import OnnxModule, export_onnx, onnxruntime_available, quantize_onnx
from cgavit.fast import FastWindowAttention, fold_depthwise_residual, swap_fast_modules
from cgavit.layers import Residual
from cgavit.testing import full_fp32, randomize_, rel_err

TINY = dict(embed_dim=(32, 48, 64), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(5, 3))


def tiny(img_size=64, seed=0, images=None):
    return randomize_(cgavit.create_model("efficientvit_m0", img_size=img_size, **TINY), seed=seed, images=images).eval()


#: Whole-model logits of a path against the plain model's, for a model whose logits depend on its input (``tiny``
#: with ``images``): fp32's own rounding then differs by a few 1e-6 (up to 1e-5), a path computing on the wrong
#: pixels (a flipped image, two windows swapped) by about 1.
MODEL_TOLERANCE = 1e-4


def test_fuse_matches_plain_model():
    model = tiny()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(cgavit.fuse(model)(x), model(x)) <= 1e-5
    assert any(m.training for m in model.modules()) is False  # untouched, still eval


@pytest.mark.parametrize("size", [64, 160, 224])
def test_fast_path_without_compile_matches(size):
    """Maps within the window (64), padded and partitioned (160: 10x10 -> 14x14), partitioned (224)."""
    model = tiny(img_size=224, images=torch.randn(4, 3, size, size))
    x = torch.randn(2, 3, size, size)
    fast = optimize(model, x, backend="torch", compile=False)
    assert fast.rel_err is not None and fast.rel_err <= TOLERANCE["fp32"]
    assert any(isinstance(m, FastWindowAttention) for m in fast.modules())
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) <= MODEL_TOLERANCE
        y = torch.randn(3, 3, size, size)  # another batch size works too
        assert rel_err(fast(y), model(y)) <= MODEL_TOLERANCE
        assert rel_err(fast(y.flip(3)), model(y)) > 0.1  # the check sees the image


def test_folded_depthwise_residual_matches():
    torch.manual_seed(0)
    for kernel, padding in ((3, 1), (5, 2)):
        conv = torch.nn.Conv2d(8, 8, kernel, 1, padding, groups=8)
        res = Residual(conv).eval()
        folded = fold_depthwise_residual(res)
        x = torch.randn(2, 8, 9, 7)
        with torch.no_grad():
            assert rel_err(folded(x), res(x)) <= 1e-6
    # what cannot be folded is left alone: strided, not depthwise, not same-padded
    assert fold_depthwise_residual(Residual(torch.nn.Conv2d(8, 8, 3, 2, 1, groups=8))) is None
    assert fold_depthwise_residual(Residual(torch.nn.Conv2d(8, 8, 3, 1, 1))) is None
    assert fold_depthwise_residual(Residual(torch.nn.Conv2d(8, 8, 3, 1, 0, groups=8))) is None


@pytest.mark.parametrize("size", [64, 160])
def test_size_specialised_fast_modules_match_and_refuse_other_sizes(size):
    """The export form: constant-size reshapes and biases for one image size, another size refused."""
    model = tiny(img_size=224, images=torch.randn(4, 3, size, size))
    fast = swap_fast_modules(cgavit.fuse(model), img_size=(size, size))
    foldable = [m for m in fast.modules() if isinstance(m, Residual) and fold_depthwise_residual(m) is not None]
    assert not foldable  # every depthwise residual folded
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) <= MODEL_TOLERANCE
        with pytest.raises(ValueError, match="built for"):
            fast(torch.randn(1, 3, size + 32, size + 32))


def test_swap_fast_modules_takes_one_side_and_refuses_an_unfused_model_untouched():
    """img_size=64 was a TypeError; an unfused model was refused after four of its ReLUs were made in-place."""
    model = tiny(img_size=64)
    before = {name: type(m) for name, m in model.named_modules()}, [m.inplace for m in model.modules() if isinstance(m, torch.nn.ReLU)]
    with pytest.raises(ValueError, match="needs a fused model"):
        swap_fast_modules(model)
    assert ({name: type(m) for name, m in model.named_modules()},
            [m.inplace for m in model.modules() if isinstance(m, torch.nn.ReLU)]) == before
    fast = swap_fast_modules(cgavit.fuse(model), img_size=64)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) <= 1e-5
    with pytest.raises(ValueError, match="img_size must be a whole number"):
        swap_fast_modules(cgavit.fuse(model), img_size="64")


@pytest.mark.skipif(not onnxruntime_available(), reason="needs the deploy extra (onnxruntime)")
def test_onnx_export_has_no_shape_arithmetic(tmp_path):
    """The exported graph computes no shapes at run time: no Shape/Gather ops; one Conv per conv, each
    head's qkv conv as three (query, key, value: no Split)."""
    import onnx

    model = tiny(img_size=224)
    graph = onnx.load(str(export_onnx(model, tmp_path / "m.onnx", (160, 160)))).graph
    ops = [node.op_type for node in graph.node]
    assert "Shape" not in ops and "Gather" not in ops
    fused = cgavit.fuse(model)
    heads = sum(m.num_heads for m in fused.modules() if hasattr(m, "bias_full"))
    assert ops.count("Conv") == sum(isinstance(m, torch.nn.Conv2d) for m in fused.modules()) + 2 * heads
    residuals = [m for m in fused.modules() if isinstance(m, Residual)]
    folded = sum(fold_depthwise_residual(m) is not None for m in residuals)
    cascades = sum(m.num_heads - 1 for m in fused.modules() if hasattr(m, "bias_full"))
    assert folded > 0 and ops.count("Add") == len(residuals) - folded + heads + cascades  # bias + cascade adds


def test_optimize_compiled_matches():
    """The one torch.compile test (inductor with freezing), on a tiny model and input."""
    model = tiny()
    x = torch.randn(2, 3, 64, 64)
    fast = optimize(model, x, backend="torch")
    with torch.no_grad():
        out = fast(x)
        assert out.dtype == torch.float32
        assert rel_err(out, model(x)) <= 1e-5


def test_the_torch_path_compiles_each_shape_statically(monkeypatch):
    """torch.compile's default compiled a dynamic-shape graph at the second input shape a torch-path model met: many
    minutes on the CPU (M0, 64 then 96 px), where compiling that shape alone takes about as long as the first. The
    torch path now compiles each shape as it comes (dynamic=False), on the CPU and on a GPU alike."""
    seen = []

    def recorded(module, **kwargs):  # torch.compile, recorded, the module left eager
        seen.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", recorded)
    model, x = tiny(), torch.randn(2, 3, 64, 64)
    fast = optimize(model, x, backend="torch")
    assert seen == [{"dynamic": False, "options": {"freezing": True}}]
    y = torch.randn(3, 3, 96, 96)
    with torch.no_grad():
        assert rel_err(fast(y), model(y)) <= 1e-5  # any shape still runs


def test_default_optimize_runs_onnxruntime_and_matches():
    model = tiny()
    x = torch.randn(2, 3, 64, 64)
    fast = optimize(model, x)  # auto: ONNX Runtime for fp32 on the CPU
    assert isinstance(fast, OnnxModule) and fast.rel_err <= 1e-5
    y = torch.randn(5, 3, 64, 64)  # batch is dynamic
    with torch.no_grad():
        assert rel_err(fast(y), model(y)) <= 1e-5
    with pytest.raises(ValueError, match=r"takes images \(B, 3, 64, 64\), got \(2, 3, 96, 96\): build it again"):
        fast(torch.randn(2, 3, 96, 96))  # the size is fixed: one line, not the runtime's InvalidArgument
    with pytest.raises(ValueError, match=r"got \(2, 1, 64, 64\): it takes 3-channel images: convert them"):
        fast(torch.randn(2, 1, 64, 64))  # the size is right: "build it again for that size" sent users the wrong way


def test_bf16_within_tolerance():
    model = tiny()
    x = torch.randn(4, 3, 64, 64)
    fast = optimize(model, x, "bf16", backend="torch", compile=False)
    with torch.no_grad():
        err = rel_err(fast(x), model(x))
    assert 0 < err <= TOLERANCE["bf16"]  # reduced precision really ran, within its stated tolerance


def test_torch_path_follows_to_and_copies():
    """``.double()`` / ``.to(dtype)`` on the torch path's module: the input is cast to what its weights are now
    (it was cast to the dtype of build time, and the call failed: "Input type (float) and bias type (double)")."""
    import copy

    model = tiny()
    x = torch.randn(2, 3, 64, 64)
    fast = optimize(model, x, backend="torch", compile=False)
    with torch.no_grad():
        reference = model(x)
        assert rel_err(copy.deepcopy(fast)(x), reference) <= 1e-5
        assert rel_err(fast.double()(x), reference) <= 1e-5 and fast(x).dtype == torch.float32
        assert rel_err(fast.to(torch.bfloat16)(x), reference) <= TOLERANCE["bf16"]


@pytest.mark.parametrize("dial", [dict(drop_path_rate=0.3), dict(distillation=True)], ids=["drop-path", "distilled"])
def test_torch_path_stays_an_inference_form_in_a_module_set_to_train(dial):
    """An optimized teacher inside a student's module: ``.train()`` reached the fused model, whose stochastic depth
    then dropped branches at random (about 4e-01 off, another answer each call), and a distilled model returned its
    two heads' logits as a tuple (AttributeError: 'tuple' object has no attribute 'float')."""
    model = randomize_(cgavit.create_model("efficientvit_m0", img_size=64, **TINY, **dial)).eval()
    x = torch.randn(2, 3, 64, 64)
    holder = torch.nn.ModuleDict(dict(student=torch.nn.Linear(2, 2),
                                      teacher=optimize(model, x, backend="torch", compile=False)))
    holder.train()
    with torch.no_grad():
        reference = model(x)
        for _ in range(2):
            assert rel_err(holder.teacher(x), reference) <= 1e-5
    assert holder.teacher.training and not holder.teacher.inner.training


def test_optimize_rejects_bad_arguments():
    model = tiny()
    with pytest.raises(ValueError, match="fp16 runs in the Triton kernel on a CUDA GPU only; on the CPU use fp32"):
        optimize(model, torch.randn(1, 3, 64, 64), "fp16")
    with pytest.raises(ValueError, match="example_input"):
        optimize(model, torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match=r"calibration must be image batches shaped like example_input, \(B, 3, 64, 64\)"):
        optimize(model, torch.randn(1, 3, 64, 64), "int8", calibration=[torch.randn(4, 3, 32, 32)])
    with pytest.raises(ValueError, match="calibration must be image batches"):
        optimize(model, torch.randn(1, 3, 64, 64), "int8", calibration=[[1, 2]])
    pixels = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8)  # cast to float and used as they were
    for kwargs, says in ((dict(example_input=pixels), "expected float example_input images"),
                         (dict(example_input=pixels.float(), precision="int8", calibration=[pixels]),
                          "expected float calibration images")):
        with pytest.raises(ValueError, match=says):
            optimize(model, **kwargs)
    broken = tiny()
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    with pytest.raises(ValueError, match="not finite"):  # a check that cannot fail is no check
        optimize(broken, torch.randn(1, 3, 64, 64), backend="torch", compile=False)
    with pytest.raises(ValueError, match="backend"):
        optimize(model, torch.randn(1, 3, 64, 64), "bf16", backend="onnxruntime")
    with pytest.raises(ValueError, match="backend"):
        optimize(model, torch.randn(1, 3, 64, 64), backend="tensorrt")


def test_choose_backend():
    assert choose_backend("int8") == "onnxruntime"
    assert choose_backend("bf16") == "torch"
    assert choose_backend("fp32", device="cuda") == "torch"
    assert choose_backend("fp32") == ("onnxruntime" if onnxruntime_available() else "torch")
    assert choose_backend("fp32", "torch") == "torch"
    with pytest.raises(ValueError, match="not offered by the torch backend"):
        choose_backend("int8", "torch")
    with pytest.raises(ValueError, match="precision"):
        choose_backend("fp8")


def test_onnx_export_matches_pytorch_at_batch_1_and_16(tmp_path):
    model = tiny(img_size=112)
    path = export_onnx(model, tmp_path / "m.onnx", (112, 112))
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temporary file left behind
    ort = OnnxModule(path)
    fused = cgavit.fuse(model)
    for batch in (1, 16):
        x = torch.randn(batch, 3, 112, 112)
        with torch.no_grad():
            assert rel_err(ort(x), fused(x)) <= 1e-4


def test_int8_onnx_within_tolerance(tmp_path):
    model = tiny()
    fp32 = export_onnx(model, tmp_path / "m.onnx", (64, 64))
    calib = [torch.randn(4, 3, 64, 64) for _ in range(2)]
    q = quantize_onnx(fp32, tmp_path / "m.int8.onnx", calib)
    assert q.stat().st_size < fp32.stat().st_size  # weights really stored in int8
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        err = rel_err(OnnxModule(q)(x), cgavit.fuse(model)(x))
    assert err <= TOLERANCE["int8"]


def test_export_cli(tmp_path, capsys):
    from cgavit.cli import main

    out = tmp_path / "m0.onnx"
    assert main(["export", "--model", "m0", "--output", str(out), "--img-size", "64", "--embed-dim", "32,48,64",
                 "--depth", "1,1,1", "--num-heads", "2"]) == 0
    text = capsys.readouterr().out
    assert out.exists() and "batch 16" in text and "TOO LARGE" not in text
    assert main(["export", "--model", "m0", "--output", str(out), "--dynamic-size"]) == 2
    assert "export once per size" in capsys.readouterr().err
    assert main(["export", "--model", "m0", "--output", os.fspath(tmp_path / "missing" / "m.onnx")]) == 2


def test_export_says_how_to_use_the_file_it_wrote(tmp_path, capsys):
    """export wrote the file, checked it and stopped; eval and predict take an ONNX file with class names, and the
    command now says so (and only then: a file without class names is refused by both)."""
    import shlex

    from cgavit.cli import main
    from cgavit.schema import WeightsMeta

    model = cgavit.create_model("m0", img_size=64, embed_dim=(32, 48, 64), depth=(1, 1, 1), num_heads=(2, 2, 2),
                                num_classes=2)
    ckpt = tmp_path / "two classes.safetensors"
    cgavit.save_weights(model, ckpt, WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=2,
                                                 img_size=64, class_names=("cat", "dog")))
    out = tmp_path / "m 0.onnx"
    assert main(["export", "--checkpoint", str(ckpt), "--output", str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("try:")]
    predict, evaluate = (shlex.split(part) for part in line[len("try:"):].split("   or   "))
    assert predict == ["cgavit", "predict", "IMAGE", "--checkpoint", str(out)]
    assert evaluate == ["cgavit", "eval", "--checkpoint", str(out), "--data", "DIR"]
    assert main(["export", "--model", "m0", "--output", str(tmp_path / "random.onnx"), "--img-size", "64",
                 "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"]) == 0
    assert "try:" not in capsys.readouterr().out  # random weights, no class names: eval and predict refuse it


def test_a_runtime_installed_but_broken_is_passed_over_and_named(tmp_path, monkeypatch):
    """From a fast-path review: a runtime found on the path counted as available though it failed to import (a
    missing shared library), so optimize's default fp32 path and precision='auto' were ImportError tracebacks. It
    now counts as missing: the default falls back to torch, and naming it gives one line with the reason."""
    import importlib.util

    from cgavit.deploy import fastpath
    from cgavit.deploy.auto import untried_paths
    from cgavit.deploy.cpu import CpuFeatures
    from cgavit.deploy.formats import require_format

    pytest.importorskip("onnxruntime")
    broken = tmp_path / "broken"
    (broken / "onnxruntime").mkdir(parents=True)
    (broken / "onnxruntime" / "__init__.py").write_text("raise ImportError('libonnxruntime.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(broken))
    for name in [n for n in list(sys.modules) if n == "onnxruntime" or n.startswith("onnxruntime.")]:
        monkeypatch.delitem(sys.modules, name)
    model, x = tiny(), torch.randn(2, 3, 64, 64)
    assert type(optimize(model, x, compile=False)).__name__ == "OptimizedModel"  # torch
    with pytest.raises(ValueError, match="the onnxruntime backend cannot be used: onnxruntime is installed but cannot "
                                         r"be imported \(ImportError: libonnxruntime.so.1.*pip install 'cgavit\[deploy\]'"):
        optimize(model, x, backend="onnxruntime")
    avx2 = CpuFeatures(frozenset({"avx2", "fma"}))  # auto's row for it, as optimize(precision="auto") reads it
    assert "int8 onnxruntime (not tried: onnxruntime is not installed or fails to import)" in \
        untried_paths(avx2, True, fastpath.backend_available)
    with pytest.raises(ValueError, match=r"onnx files need ONNX Runtime \(onnxruntime is installed but cannot be imported"):
        require_format("onnx")
    if importlib.util.find_spec("openvino"):  # OpenVINO's fp32 and bf16 need no NNCF; its int8 does
        monkeypatch.setitem(sys.modules, "nncf", None)
        assert choose_backend("fp32", "openvino") == "openvino"
        with pytest.raises(ValueError, match="the openvino backend cannot be used: nncf is not installed"):
            choose_backend("int8", "openvino")


def test_openvino_without_nncf_exports_reads_and_is_tried_in_float(monkeypatch):
    """NNCF quantises and nothing else, but the format table counted OpenVINO as missing without it: `cgavit export
    --format openvino` at fp32, reading an .xml file, and auto's bf16 OpenVINO path were refused for want of it. The
    one table (:data:`FORMATS`) now says what each precision needs, and every caller reads it."""
    import importlib.util

    from cgavit.deploy import fastpath
    from cgavit.deploy.auto import untried_paths
    from cgavit.deploy.cpu import CpuFeatures
    from cgavit.deploy.formats import FORMATS, require_format

    pytest.importorskip("openvino")
    monkeypatch.setitem(sys.modules, "nncf", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _real=importlib.util.find_spec:
                        None if name == "nncf" else _real(name, *a))
    assert require_format("openvino") is FORMATS["openvino"]
    with pytest.raises(ValueError, match=r"openvino files need OpenVINO \(nncf is not installed\): "
                                         r"pip install 'cgavit\[openvino\]'"):
        require_format("openvino", "int8")
    amx = CpuFeatures(frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}))
    untried = untried_paths(amx, True, fastpath.backend_available)
    assert "int8 openvino (not tried: openvino is not installed or fails to import)" in untried
    assert not any(p.startswith(("bf16 openvino", "fp32 openvino")) for p in untried)


def test_a_model_and_example_on_two_devices_are_refused_before_anything_is_built():
    """From a fast-path review: with a CPU model and a CUDA example, optimize computed its fp32 reference before the
    Triton path moved the model, and the torch path failed at its first call. Refused up front now (a model on the
    meta device stands for the other device here: an example on it, since a model on it has no weights and is refused
    as such); a runtime backend asked to serve a GPU example is refused too."""
    model, x = tiny(), torch.randn(2, 3, 64, 64)
    for precision in ("fp32", "auto"):
        with pytest.raises(ValueError, match="the model is on cpu and example_input on meta: put them on one device"):
            optimize(model, x.to("meta"), precision, compile=False)
    with pytest.raises(ValueError, match="the onnxruntime backend runs on the CPU, and example_input is on cuda"):
        choose_backend("fp32", "onnxruntime", "cuda")
    assert choose_backend("fp32", "torch", "cuda") == "torch"


def test_the_format_table_is_the_one_home_of_each_runtime():
    """Suffixes, runtimes, display names and extras are read from FORMATS by every caller (they were written out
    again in five modules)."""
    from cgavit.bench.precision import RUNTIMES, path_label
    from cgavit.deploy.formats import FORMATS, QUANT_RUNTIMES, SUFFIX_FORMATS, runtime_format

    assert RUNTIMES == ("onnxruntime", "openvino", "executorch", "tflite")
    assert QUANT_RUNTIMES == ("onnxruntime", "openvino")
    assert SUFFIX_FORMATS == {".onnx": "onnx", ".xml": "openvino"}
    assert [runtime_format(r).name for r in RUNTIMES] == list(FORMATS)
    assert path_label("int8", "openvino") == "int8 OpenVINO"
    assert path_label("fp32", "executorch") == "fp32 ExecuTorch (XNNPACK)"
    with pytest.raises(ValueError, match="unknown runtime 'ort'; choose from onnxruntime, openvino, executorch, tflite"):
        runtime_format("ort")


def test_a_module_onnx_cannot_hold_is_named_as_such_not_as_the_disk():
    """The exporter's refusal (an operator ONNX has not) came out as a WriteError ending "check the disk"."""
    pytest.importorskip("onnxruntime")

    class Spectrum(torch.nn.Module):
        def forward(self, x):
            return torch.fft.rfft2(x).abs().mean((2, 3))

    with pytest.raises(ValueError, match="cannot export the model to ONNX: Exporting the operator 'aten::fft_rfft2'.*"
                                         "backend='torch'"):
        optimize(Spectrum(), torch.randn(2, 3, 32, 32), fast_attention=False)


def test_folding_optimising_and_exporting_leave_the_callers_random_stream_alone(tmp_path):
    """Each folded layer drew initial weights, and exports drew their example batch, from the global generator: a
    seeded script's later draws changed with what it had fused, optimised or exported."""
    from cgavit.deploy import export_model, fuse

    model, x = tiny(), torch.randn(2, 3, 64, 64)
    steps = [lambda: fuse(model), lambda: optimize(model, x, backend="torch", compile=False),
             lambda: export_model(model, tmp_path / "m.onnx", "onnx", 64)]
    for step in steps:
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        step()
        assert torch.equal(torch.rand(3), expected)


def test_optimize_refuses_switches_that_are_not_switches():
    """compile="no" is truthy (it compiled, for minutes); features="amx" was an AttributeError deep in the bf16
    check, and silently ignored for fp32."""
    model, x = tiny(), torch.randn(2, 3, 64, 64)
    for kwargs, message in (({"compile": "no"}, "compile must be True or False, got 'no'"),
                            ({"check": 0}, "check must be True or False"),
                            ({"features": "amx"}, "features must be a CpuFeatures .* got str")):
        with pytest.raises(TypeError, match=message):
            optimize(model, x, backend="torch", **kwargs)


class _ReusesItsReluInput(torch.nn.Module):
    """A cgavit backbone under a head whose ReLU's input is read again: ``cat([f, relu(f)])``."""

    def __init__(self):
        super().__init__()
        self.backbone = cgavit.create_model("efficientvit_m0", img_size=64, num_classes=0, **TINY)
        self.act = torch.nn.ReLU()
        self.fc = torch.nn.Linear(2 * TINY["embed_dim"][-1], 5)

    def forward(self, x):
        f = self.backbone(x)
        return self.fc(torch.cat([f, self.act(f)], 1))


def test_fast_path_leaves_other_modules_relus_out_of_place():
    """swap_fast_modules made every ReLU in-place, a user's module's too: ``cat([f, relu(f)])`` then read the
    rectified ``f`` twice (4.6e-01 off), and optimize raised, suggesting check=False to keep the wrong model.
    cgavit's own ReLUs (after a conv, or an FFN's, patch merging's or SE's ``act``) are still made in-place."""
    wrapped = randomize_(_ReusesItsReluInput()).eval()
    x = torch.randn(2, 3, 64, 64)
    fast = swap_fast_modules(cgavit.fuse(wrapped))
    with torch.no_grad():
        assert rel_err(fast(x), wrapped(x)) <= 1e-5
    assert not fast.act.inplace
    relus = [m for m in fast.backbone.modules() if isinstance(m, torch.nn.ReLU)]
    assert relus and all(m.inplace for m in relus)
    assert optimize(wrapped, x, backend="torch", compile=False).rel_err <= TOLERANCE["fp32"]


def test_optimize_refuses_what_is_not_a_model_in_one_line():
    """A variant's name, a class or a state dict was an AttributeError/TypeError from reading its weights."""
    x = torch.randn(1, 3, 64, 64)
    for model, says in (("efficientvit_m0", r"got str: a name; build the model first, e\.g\. cgavit\.create_model\("
                                            r"'efficientvit_m0', pretrained=True\)"),
                        (cgavit.EfficientViT, "got type \\(the class EfficientViT\\): build an instance first"),
                        (tiny().state_dict(), "got OrderedDict \\(a state dict\\?\\): build the model with its weights"),
                        (None, "optimize takes a model, an nn.Module instance; got NoneType")):
        for precision in ("fp32", "auto"):
            with pytest.raises(ValueError, match=says):
                optimize(model, x, precision, compile=False)



def test_a_features_only_model_is_refused_by_optimize_and_export_before_anything_is_written(tmp_path):
    """A features_only model returns a list of maps: optimize failed with an AttributeError from its check, and an
    ONNX export wrote a file whose runtime returned the first map alone, as if it were the model's output."""
    features = randomize_(cgavit.create_model("efficientvit_m0", img_size=64, features_only=True, **TINY)).eval()
    x = torch.randn(1, 3, 64, 64)
    for backend in ("torch", "onnxruntime"):
        with pytest.raises(ValueError, match="optimize takes a model that returns one tensor.*features_only"):
            optimize(features, x, backend=backend, compile=False)
    with pytest.raises(ValueError, match="an export takes a model that returns one tensor.*num_classes=0, global_pool=''"):
        cgavit.deploy.export_model(features, tmp_path / "features", "onnx", img_size=64)
    assert not list(tmp_path.iterdir())

def test_optimize_says_what_is_wrong_with_a_meta_model_a_headless_one_for_auto_and_a_dataloaders_pairs():
    """A model built on the meta device was told to move to the example's device (model.to fails on meta); auto judged
    a model without a classifier by the argmax of its pooled features; a DataLoader of (images, labels) pairs and one
    tensor of calibration images were both 'must be image batches shaped like example_input', the tensor iterated
    image by image (quantize takes a tensor)."""
    x = torch.randn(2, 3, 64, 64)
    with torch.device("meta"):
        ghost = cgavit.create_model("efficientvit_m0", num_classes=5, img_size=64, **TINY)
    with pytest.raises(ValueError, match="optimize takes a model with weights, and this one's are on the meta device"):
        optimize(ghost, x, compile=False)
    headless = randomize_(cgavit.create_model("efficientvit_m0", num_classes=0, img_size=64, **TINY)).eval()
    with pytest.raises(ValueError, match=r"precision='auto' judges .* no classifier \(num_classes=0"):
        optimize(headless, x, "auto", compile=False)
    assert optimize(headless, x, "fp32", backend="torch", compile=False).rel_err <= 1e-5  # a fixed precision is checked
    pairs = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3, 64, 64), torch.zeros(8)),
                                        batch_size=4)
    with pytest.raises(ValueError, match=r"calibration gave a list of 2 .* DataLoader of \(images, labels\)\? give "
                                         r"the images alone"):
        optimize(tiny(), x, "int8", calibration=pairs)
    if onnxruntime_available():
        images = torch.randn(8, 3, 64, 64)
        assert optimize(tiny(), x, "int8", calibration=images, check=False).precision == "int8"


def test_fast_modules_stay_frozen_like_the_fused_model():
    """fuse freezes every parameter, and swap_fast_modules' new convs required gradients again: a call outside
    no_grad built an autograd graph and gave logits that require grad (``.numpy()`` refused them)."""
    model, x = tiny(), torch.randn(2, 3, 64, 64)
    for fast in (swap_fast_modules(cgavit.fuse(model)), swap_fast_modules(cgavit.fuse(model), img_size=64)):
        assert not any(p.requires_grad for p in fast.parameters())
        out = fast(x)
        assert not out.requires_grad and rel_err(out, model(x)) <= 1e-5


def test_fast_attention_refuses_maps_it_cannot_attend_as_the_fused_one_does():
    """Used on its own, FastCascadedGroupAttention took a 5x9 map on a 7x7 window (the fused module refuses it) and
    gave its tokens the biases of other offsets; built for 5x5 maps, a 5x10 map became a batch of two."""
    from cgavit.attention import CascadedGroupAttention
    from cgavit.fast import FastCascadedGroupAttention

    fused = randomize_(CascadedGroupAttention(16, 8, 2, window=7, kernels=[3, 3])).eval().fuse()
    x = torch.randn(2, 16, 5, 6)
    with torch.no_grad():
        assert rel_err(FastCascadedGroupAttention(fused)(x), fused(x)) <= 1e-5
        assert rel_err(FastCascadedGroupAttention(fused, (5, 6))(x), fused(x)) <= 1e-5
        with pytest.raises(ValueError, match="a 5x9 map is larger than this attention's 7x7 window; give it to "
                                             "FastWindowAttention"):
            FastCascadedGroupAttention(fused)(torch.randn(1, 16, 5, 9))
        with pytest.raises(ValueError, match="this attention was built for 5x5 maps, got 5x10: build it again"):
            FastCascadedGroupAttention(fused, (5, 5))(torch.randn(1, 16, 5, 10))



def test_fast_attention_refuses_to_be_built_for_maps_past_its_window():
    """Built for a 9x9 map on a 7x7 window it failed with an IndexError from inside the bias gather; for 3x8 it was
    built with the biases of other offsets (refused only when called)."""
    from cgavit.attention import CascadedGroupAttention
    from cgavit.fast import FastCascadedGroupAttention

    fused = randomize_(CascadedGroupAttention(16, 8, 2, window=7, kernels=[3, 3])).eval().fuse()
    for size in ((9, 9), (3, 8), (-1, 4)):
        with pytest.raises(ValueError, match=rf"size {size[0]}x{size[1]} is not a map .*\(at most 7 a side.*FastWindowAttention"):
            FastCascadedGroupAttention(fused, size)


def test_a_backend_without_the_precision_names_the_backends_that_offer_it():
    """``backend='torch'`` with fp16 said only "use backend='auto'", which on the CPU refuses fp16 in turn: two steps to
    learn that the Triton kernel on a CUDA GPU is where fp16 runs."""
    for precision, backend, says in (
            ("fp16", "torch", r"triton offers it \(on a CUDA GPU\): use backend='triton', or backend='auto'"),
            ("int8", "torch", "onnxruntime and openvino offer it: use backend='onnxruntime', or backend='auto'"),
            ("bf16", "onnxruntime", "torch, openvino and triton offer it: use backend='torch', or backend='auto'")):
        with pytest.raises(ValueError, match=f"precision {precision} is not offered by the {backend} backend .*; {says}"):
            choose_backend(precision, backend)


#: torch's TF32 flags (cuDNN convolutions, CUDA matrix products) as each call of a _RecordsTf32 saw them
TF32_SEEN = []


def _tf32_flags():
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


class _RecordsTf32(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        TF32_SEEN.append(_tf32_flags())
        return self.conv(x).mean((2, 3))


def test_optimize_checks_in_full_fp32_and_leaves_the_flags_as_they_were():
    """On a GPU torch's default runs float32 convolutions in TF32 (~1e-3 relative): the reference and the checked
    call of optimize's 1e-5 check ran so, against the Triton kernel's IEEE float32 products. Both now run with TF32
    off; the path's own calls keep the caller's flags, which are restored (the flags are readable on the CPU)."""
    TF32_SEEN.clear()
    before = _tf32_flags()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True  # a caller who turned both on
    try:
        optimize(_RecordsTf32().eval(), torch.randn(2, 3, 32, 32), backend="torch", compile=False, fast_attention=False)
        after = _tf32_flags()
        with pytest.raises(ZeroDivisionError), full_fp32():
            1 / 0
        after_error = _tf32_flags()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
    assert TF32_SEEN[0] == (False, False)  # the reference
    assert (True, True) in TF32_SEEN[1:-1]  # the build's call: the caller's flags
    assert TF32_SEEN[-1] == (False, False)  # the check
    assert after == after_error == (True, True)


def test_swap_fast_modules_given_a_window_attention_itself_returns_its_fast_form():
    """A fused LocalWindowAttention given alone came back unchanged (no fast form, silently), and with img_size the
    dry run fed it a 3-channel image (a RuntimeError about conv channels). As swap_triton_modules does, it is now
    replaced, and img_size is its map's size."""
    fused = cgavit.fuse(randomize_(LocalWindowAttention(16, 7, num_heads=2, kernels=[3, 3]), 4))
    x = torch.randn(2, 16, 10, 9)
    fast, sized = swap_fast_modules(fused), swap_fast_modules(fused, img_size=(10, 9))
    assert isinstance(fast, FastWindowAttention) and isinstance(sized, FastWindowAttention)
    with torch.no_grad():
        assert rel_err(fast(x), fused(x)) <= 1e-5 and rel_err(sized(x), fused(x)) <= 1e-5
        with pytest.raises(ValueError, match="built for 10x9"):
            sized(torch.randn(1, 16, 9, 10))
    with pytest.raises(ValueError, match="size of its map"):
        swap_fast_modules(fused, img_size=(10, 0))
    with pytest.raises(ValueError, match="the model is not fused"):
        swap_fast_modules(LocalWindowAttention(16, 7, num_heads=2))


def test_export_without_a_checkpoint_says_the_weights_are_random(tmp_path, caplog):
    """``cgavit export --model efficientvit_m4 --output m4.onnx`` wrote and checked a file of random weights without a
    word: a newcomer took it for the published model (analyze says so for the same case)."""
    from cgavit.cli import main

    with caplog.at_level("WARNING", logger="cgavit"):
        assert main(["export", "--model", "m0", "--output", str(tmp_path / "m0.onnx"), "--img-size", "64",
                     "--embed-dim", "32,48,64", "--depth", "1,1,1", "--num-heads", "2"]) == 0
    assert "no --checkpoint: exporting randomly initialised weights" in caplog.text
