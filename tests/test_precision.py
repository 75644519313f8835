"""Reduced precision on trained weights: the agreement target, the feature probe and ``auto``.

The figures that count come from a trained model (the session's digits model, ``trained_digits``):
bf16 and int8 must keep fp32's decisions (top-1 agreement >= 99.5 %, accuracy within 0.5 point).
The check must be able to fail: the same model with scrambled weights misses it.
"""

import re

import pytest
import torch

import cgavit
from cgavit.deploy import (
    AGREEMENT_TARGET,
    AUTO_RULES,
    CpuFeatures,
    compare_logits,
    cpu_features,
    fuse,
    optimize,
)
from cgavit.deploy.agreement import batched_logits
from cgavit.deploy.auto import RULE_EVIDENCE, auto_candidates, precision_warning
from cgavit.deploy.cpu import CPU_CLASSES, parse_cpuinfo
from cgavit.deploy.onnx import onnxruntime_available
from cgavit.deploy import fastpath
from cgavit.deploy.fusion import BATCHNORMS

EPYC_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse sse2 avx f16c fma bmi2 avx2 sha_ni\n"
XEON_AMX = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f avx512_vnni "
            "avx512_bf16 amx_bf16 amx_tile amx_int8\n")
EPYC_AVX512_BF16 = "model name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16 avx_vnni\n"  # no AMX
COOPER_LAKE = "model name\t: Intel(R) Xeon(R) Gold 6348H\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx2 avx512f\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd asimddp bf16 i8mm\nCPU implementer\t: 0x41\n"


def features(text: str) -> CpuFeatures:
    flags, model = parse_cpuinfo(text)
    return CpuFeatures(flags, "", model)


def agreement(module, trained_digits):
    reference = batched_logits(fuse(trained_digits.model), trained_digits.images)
    return compare_logits(batched_logits(module, trained_digits.images), reference, trained_digits.labels)


@torch.no_grad()
def recalibrate_batchnorm(model: torch.nn.Module, images: torch.Tensor, batch: int = 32) -> torch.nn.Module:
    """Every BatchNorm's running statistics set to their average over ``images`` (train-mode passes)."""
    norms = [m for m in model.modules() if isinstance(m, BATCHNORMS)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the passes
    model.train()
    for b in images.split(batch):
        model(b)
    return model.eval()


def scrambled(trained_digits) -> torch.nn.Module:
    """The trained model with each weight tensor's entries shuffled, BatchNorm statistics recalibrated on
    training images so the decisions still depend on the image (not one constant class)."""
    model = cgavit.create_model("efficientvit_m0", num_classes=10, img_size=48, embed_dim=(32, 48, 64),
                                depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(5, 5))
    model.load_state_dict(trained_digits.model.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.flatten()[torch.randperm(p.numel(), generator=g)].view_as(p))
    return recalibrate_batchnorm(model, trained_digits.train_images[:512])


def test_the_fixture_is_a_trained_model(trained_digits):
    assert trained_digits.accuracy >= 0.95
    assert len(trained_digits.images) == 360 and len(trained_digits.train_images) == 1437


def test_bf16_meets_the_target_on_trained_weights(trained_digits):
    bf16 = optimize(trained_digits.model, trained_digits.images[:16], "bf16", backend="torch", compile=False,
                    check=False, features=features(XEON_AMX))
    result = agreement(bf16, trained_digits)
    assert result.meets_target, result.describe()
    assert 0 < result.max_rel_err < 0.1  # reduced precision really ran


@pytest.mark.skipif(not onnxruntime_available(), reason="int8 runs on ONNX Runtime: pip install 'cgavit[deploy]'")
def test_int8_meets_the_target_on_trained_weights(trained_digits):
    int8 = optimize(trained_digits.model, trained_digits.images[:16], "int8", calibration=trained_digits.calibration(),
                    check=False)
    result = agreement(int8, trained_digits)
    assert result.meets_target, result.describe()


@pytest.mark.skipif(not onnxruntime_available(), reason="int8 runs on ONNX Runtime: pip install 'cgavit[deploy]'")
def test_scrambled_weights_miss_the_target(trained_digits):
    """The same check fails on a model whose logits are not those of a trained classifier."""
    model = scrambled(trained_digits)
    with torch.no_grad():
        assert model(trained_digits.images).argmax(1).unique().numel() >= 3  # image-dependent decisions
    x, calib = trained_digits.images[:16], trained_digits.calibration()
    bf16 = optimize(model, x, "bf16", backend="torch", compile=False, check=False, features=features(XEON_AMX))
    int8 = optimize(model, x, "int8", calibration=calib, check=False)
    for path in (bf16, int8):
        reference = batched_logits(fuse(model), trained_digits.images)
        result = compare_logits(batched_logits(path, trained_digits.images), reference, trained_digits.labels)
        assert not result.meets_target, result.describe()


def test_compare_logits_and_the_target():
    ref = torch.eye(10).repeat(36, 1) * 5  # 360 images, top-1 class i % 10
    labels = torch.arange(360) % 10
    out = ref.clone()
    out[0] = torch.roll(out[0], 1)  # one decision changes: 359/360 = 99.7 % agreement, -0.3 point
    one = compare_logits(out, ref, labels)
    assert one.top1_agreement == pytest.approx(359 / 360) and one.accuracy_change == pytest.approx(-100 / 360)
    assert one.meets_target and one.max_rel_err == pytest.approx(2**0.5)
    out[1] = torch.roll(out[1], 1)
    out[2] = torch.roll(out[2], 1)  # three changes: 99.2 %, misses
    assert not compare_logits(out, ref, labels).meets_target
    assert compare_logits(ref, ref).accuracy is None and compare_logits(ref, ref).meets_target
    with pytest.raises(ValueError, match="logit"):
        compare_logits(ref[:5], ref)


def test_cpu_features_reads_cpuinfo(tmp_path):
    (tmp_path / "cpuinfo").write_text(XEON_AMX)
    amx = cpu_features(tmp_path / "cpuinfo")
    assert amx.cpu_class == "amx" and amx.native_bf16 and amx.vnni and "Platinum" in amx.model_name
    assert [features(t).cpu_class for t in (COOPER_LAKE, EPYC_AVX512_BF16, SKYLAKE, EPYC_AVX2, GRAVITON)] == [
        "avx512_bf16", "avx512_bf16", "avx512", "avx2", "other"]
    assert not features(EPYC_AVX2).native_bf16 and not features(SKYLAKE).vnni
    assert features(GRAVITON).native_bf16 and features(GRAVITON).vnni  # Arm's bf16 and dot-product flags
    fallback = cpu_features(tmp_path / "missing")  # not Linux: torch's dispatch level only
    assert fallback.capability and not fallback.native_bf16
    assert cpu_features().describe()  # this machine


def test_cpuid_must_confirm_the_kernels_list(tmp_path):
    """A flag counts only where this process's CPUID confirms it too: under an emulator presenting an AVX2 EPYC on an
    AMX Xeon (qemu-user) the kernel still lists AMX, torch's CPUID probes deny it, and the probe says ``avx2``
    (also dropping ``avx_vnni``, which CPUID cannot be asked about); on a real machine the two agree."""
    from cgavit.deploy.cpu import CPUID_PROBES, confirmed_flags, cpuid_flags
    from cgavit.deploy.int8 import reduced_weight_range

    (tmp_path / "cpuinfo").write_text(XEON_AMX.replace("avx2 ", "avx2 avx_vnni "))
    on_amx = {flag: True for flag in CPUID_PROBES}
    on_zen3 = {**{flag: False for flag in CPUID_PROBES}, "avx2": True}
    real = cpu_features(tmp_path / "cpuinfo", environ={}, cpuid=on_amx)
    emulated = cpu_features(tmp_path / "cpuinfo", environ={}, cpuid=on_zen3)
    assert real.cpu_class == "amx" and not real.unconfirmed and "avx_vnni" in real.flags
    assert emulated.cpu_class == "avx2" and not emulated.vnni and reduced_weight_range(emulated)
    assert {"amx_bf16", "amx_int8", "avx512f", "avx512_vnni", "avx_vnni"} <= emulated.unconfirmed
    assert "not this process's CPUID (an emulator?)" in emulated.describe()
    assert cpu_features(tmp_path / "cpuinfo", environ={}).cpu_class == "amx"  # another machine's file: no CPUID
    vnni_laptop = frozenset({"avx2", "avx_vnni"})  # Alder Lake: AVX2 with VNNI, nothing denied, avx_vnni kept
    assert confirmed_flags(vnni_laptop, {**on_zen3}) == vnni_laptop and confirmed_flags(vnni_laptop, {}) == vnni_laptop
    here = cpuid_flags()  # this process: every probe answered on x86, none elsewhere
    assert set(here) in (set(CPUID_PROBES), set())
    probed = cpu_features()
    assert probed.flags == confirmed_flags(probed.flags | probed.unconfirmed, here)


def test_onednn_isa_cap_hides_what_its_kernels_may_not_use(tmp_path):
    """oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA) counts: an AMX Xeon capped at AVX2 is probed as the
    AVX2 class, so its int8 gets 7-bit weights and OpenVINO's bf16 is refused; an unknown value is ignored, as oneDNN
    ignores it, and Arm's flags are not oneDNN's x86 levels."""
    from cgavit.deploy.int8 import reduced_weight_range
    from cgavit.deploy.openvino import capped_bf16_error

    (tmp_path / "cpuinfo").write_text(XEON_AMX)
    probe = lambda **env: cpu_features(tmp_path / "cpuinfo", environ=env)  # noqa: E731
    capped = probe(ONEDNN_MAX_CPU_ISA="avx2")
    assert capped.cpu_class == "avx2" and not capped.vnni and not capped.native_bf16 and reduced_weight_range(capped)
    assert {"amx_bf16", "avx512_vnni", "avx512f"} <= capped.hidden and capped.flags == probe().flags
    assert "hidden by oneDNN's ISA cap AVX2" in capped.describe()
    assert "unset ONEDNN_MAX_CPU_ISA" in capped_bf16_error(capped)
    assert capped_bf16_error(probe()) is None and capped_bf16_error(features(EPYC_AVX2)) is None  # no bf16 to hide
    levels = ("AVX512_CORE", "avx512_core_vnni", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL", "no-such-isa")
    assert [probe(DNNL_MAX_CPU_ISA=level).cpu_class for level in levels] == [
        "avx512", "avx512", "avx512_bf16", "amx", "amx", "amx"]
    assert probe(DNNL_MAX_CPU_ISA="AVX512_CORE_VNNI").vnni and not probe(DNNL_MAX_CPU_ISA="AVX512_CORE").vnni
    assert probe(ONEDNN_MAX_CPU_ISA="AVX2", DNNL_MAX_CPU_ISA="ALL").cpu_class == "avx2"  # oneDNN's own name first
    assert probe().isa_cap == "" and not probe().hidden
    (tmp_path / "arm").write_text(GRAVITON)
    assert cpu_features(tmp_path / "arm", environ={"ONEDNN_MAX_CPU_ISA": "AVX2"}).native_bf16


def test_auto_rule_table_by_cpu_class():
    every = lambda backend, precision: True  # noqa: E731
    assert set(AUTO_RULES) == set(CPU_CLASSES) == set(RULE_EVIDENCE)
    assert all(rule[-1] == ("fp32", "torch") for rule in AUTO_RULES.values())  # fp32 always available
    epyc = auto_candidates(features(EPYC_AVX2), False, every)
    # the AVX2 row as measured again on the EPYC (BENCHMARKS.md, int8 on AVX2): fp32 OpenVINO after ONNX Runtime
    assert [(c.precision, c.backend) for c in epyc] == [("fp32", "onnxruntime"), ("fp32", "openvino"), ("fp32", "torch")]
    assert "12x slower" in epyc[0].reason  # why bf16 is not there
    assert auto_candidates(features(EPYC_AVX2), True, every)[0].precision == "int8"  # calibration given
    amx = auto_candidates(features(XEON_AMX), False, every)
    assert amx[0].precision == "bf16" and all(c.precision != "int8" for c in amx)  # no calibration, no int8
    assert auto_candidates(features(XEON_AMX), True, every)[0].precision == "int8"
    assert all(c.precision != "bf16" for rule in ("avx2", "avx512", "other") for c in auto_candidates(
        features({"avx2": EPYC_AVX2, "avx512": SKYLAKE, "other": GRAVITON}[rule]), True, every))
    # the avx512_bf16 row as measured on an AMD EPYC with avx512_bf16 and VNNI (BENCHMARKS.md): bf16 OpenVINO, then bf16
    # torch, before fp32 without calibration; int8 OpenVINO first with it
    bf16_class = auto_candidates(features(EPYC_AVX512_BF16), False, every)
    assert [(c.precision, c.backend) for c in bf16_class][:3] == [("bf16", "openvino"), ("bf16", "torch"),
                                                                  ("fp32", "onnxruntime")]
    assert [(c.precision, c.backend) for c in auto_candidates(features(EPYC_AVX512_BF16), True, every)][:3] == [
        ("int8", "openvino"), ("int8", "onnxruntime"), ("bf16", "openvino")]
    only_torch = auto_candidates(features(XEON_AMX), True, lambda backend, precision: backend == "torch")
    assert [(c.precision, c.backend) for c in only_torch] == [("bf16", "torch"), ("fp32", "torch")]


def test_explicit_slow_paths_warn():
    assert "12x slower" in precision_warning("bf16", features(EPYC_AVX2))
    assert precision_warning("bf16", features(XEON_AMX)) is None
    assert precision_warning("int8", features(EPYC_AVX2)) is None  # AVX2 int8 (7-bit): 1.36x fp32 ONNX Runtime on M4
    assert "int8" in precision_warning("int8", features("flags: sse2"))


def test_optimize_bf16_without_native_support_warns(trained_digits):
    x = trained_digits.images[:4]
    with pytest.warns(RuntimeWarning, match="no avx512_bf16 or AMX"):
        optimize(trained_digits.model, x, "bf16", backend="torch", compile=False, features=features(EPYC_AVX2))


def test_auto_takes_the_probe_and_explains(trained_digits, monkeypatch):
    """The feature probe patched: an AVX2-only CPU gets fp32; the choice says why."""
    monkeypatch.setattr(fastpath, "cpu_features", lambda: features(EPYC_AVX2))
    fast = optimize(trained_digits.model, trained_digits.images[:8], "auto", compile=False)
    assert fast.choice.precision == "fp32" and fast.choice.cpu_class == "avx2"
    assert "EPYC" in fast.choice.reason and fast.rel_err <= 1e-5


def test_auto_uses_bf16_only_where_native(trained_digits):
    x = trained_digits.images[:8]
    amx = optimize(trained_digits.model, x, "auto", compile=False, features=features(XEON_AMX))
    assert amx.choice.precision == "bf16" and "agreement" in amx.choice.reason
    with pytest.raises(ValueError, match="backend"):
        optimize(trained_digits.model, x, "auto", backend="torch")


def test_auto_judges_on_the_evaluation_images_when_given(trained_digits):
    """evaluation= (held-out images) is what a reduced path is judged on, not the training images it calibrates on;
    it is refused for a fixed precision, and when empty."""
    x = trained_digits.images[:8]
    held_out = list(trained_digits.images.split(64))
    amx = optimize(trained_digits.model, x, "auto", compile=False, features=features(XEON_AMX),
                   calibration=trained_digits.calibration(64), evaluation=held_out)
    assert amx.choice.precision != "fp32" and "measured on the evaluation images" in amx.choice.reason
    assert f"on {len(trained_digits.images)} images" in amx.choice.reason  # all 360, not the 64 calibration images
    with pytest.raises(ValueError, match="evaluation= is for precision='auto'"):
        optimize(trained_digits.model, x, "fp32", backend="torch", compile=False, evaluation=held_out)
    with pytest.raises(ValueError, match="evaluation is empty"):
        optimize(trained_digits.model, x, "auto", compile=False, evaluation=[])
    # images of another size failed deep inside, naming neither
    with pytest.raises(ValueError, match=r"evaluation must be image batches shaped like example_input, \(B, 3, 48, 48\)"):
        optimize(trained_digits.model, x, "auto", compile=False, evaluation=[torch.randn(8, 3, 32, 32)])
    # one tensor of images is one batch, as quantize takes it (it was iterated image by image, then refused)
    one = optimize(trained_digits.model, x, "auto", compile=False, features=features(XEON_AMX),
                   evaluation=trained_digits.images[:16])
    assert "on 16 images" in one.choice.reason and "measured on the evaluation images" in one.choice.reason


@pytest.mark.skipif(not onnxruntime_available(), reason="int8 runs on ONNX Runtime: pip install 'cgavit[deploy]'")
def test_auto_takes_int8_with_calibration_when_it_meets_the_target(trained_digits, monkeypatch):
    monkeypatch.setattr(fastpath, "backend_available", lambda backend, precision="fp32": backend != "openvino")
    fast = optimize(trained_digits.model, trained_digits.images[:8], "auto", calibration=trained_digits.calibration(),
                    compile=False, features=features(EPYC_AVX2))
    assert (fast.choice.precision, fast.choice.backend) == ("int8", "onnxruntime")
    assert f"{100 * AGREEMENT_TARGET:.1f}%" in fast.choice.reason and "meets" in fast.choice.reason
    assert agreement(fast, trained_digits).meets_target


def test_auto_int8_openvino_runs_its_float_part_in_bf16_where_native(trained_digits, monkeypatch):
    """With calibration, auto's first AMX path is int8 OpenVINO compiled with its float part in bf16 (OpenVINO's
    faster default there); an explicit int8 keeps it in fp32, and so does the AVX2 row."""
    from functools import partial

    from cgavit.deploy import openvino
    from cgavit.deploy.openvino import openvino_available

    if not openvino_available():
        pytest.skip("needs cgavit[openvino]")
    # only the precision each build compiles in is at stake: NNCF's builds skip bias correction (about 12 s each)
    monkeypatch.setattr(openvino, "Int8Options", partial(openvino.Int8Options, bias_correction="none"))
    x, cal = trained_digits.images[:8], trained_digits.calibration()
    seen = []  # each path auto builds, in order, with the precision OpenVINO was asked for
    build = fastpath._build

    def recording(fused, example, precision, backend, calibration, opts, float_part="fp32"):
        result = build(fused, example, precision, backend, calibration, opts, float_part)
        seen.append((precision, backend, getattr(result, "config", {}).get("INFERENCE_PRECISION_HINT")))
        return result

    monkeypatch.setattr(fastpath, "_build", recording)
    optimize(trained_digits.model, x, "auto", calibration=cal, compile=False, features=features(XEON_AMX))
    assert seen[0] == ("int8", "openvino", "bf16")
    seen.clear()
    optimize(trained_digits.model, x, "auto", calibration=cal, compile=False, features=features(EPYC_AVX2))
    assert seen[0] == ("int8", "openvino", "f32")
    seen.clear()
    optimize(trained_digits.model, x, "int8", backend="openvino", calibration=cal, check=False)
    assert seen == [("int8", "openvino", "f32")]


@pytest.mark.skipif(not onnxruntime_available(), reason="int8 runs on ONNX Runtime: pip install 'cgavit[deploy]'")
def test_auto_skips_a_path_that_misses_the_target(trained_digits, monkeypatch):
    """On scrambled weights int8 misses the target on the calibration images: auto falls back to fp32."""
    monkeypatch.setattr(fastpath, "backend_available", lambda backend, precision="fp32": backend != "openvino")
    model = scrambled(trained_digits)
    fast = optimize(model, trained_digits.images[:8], "auto", calibration=trained_digits.calibration(),
                    compile=False, features=features(EPYC_AVX2))
    assert fast.choice.precision == "fp32"
    # its reason names what it passed over, and why (it said only why fp32 qualifies)
    passed = fast.choice.reason.split("; passed over: ")[1]
    assert "int8 openvino (not tried: openvino is not installed or fails to import)" in passed
    assert re.search(r"int8 onnxruntime \(top-1 agreement [\d.]+% on 256 images, .*MISSES the target\)", passed)


def test_auto_says_which_paths_it_did_not_try(trained_digits):
    """Without calibration images the AMX row's int8 paths are not tried, and the reason says so."""
    fast = optimize(trained_digits.model, trained_digits.images[:8], "auto", compile=False, features=features(XEON_AMX))
    assert "int8 openvino (not tried: int8 needs calibration= images or a quantized= file)" in fast.choice.reason


def test_auto_names_the_runtime_of_the_quantized_file_it_could_not_use_for_another():
    """From a docs review: with an ONNX Runtime file from `cgavit quantize` and no calibration images, auto's reason
    passed over int8 OpenVINO as needing 'calibration= images or a quantized= file', though a file had been given."""
    from cgavit.deploy import fastpath
    from cgavit.deploy.auto import untried_paths

    untried = untried_paths(features(XEON_AMX), False, lambda backend, precision: True, "onnxruntime")
    assert ("int8 openvino (not tried: int8 needs calibration= images or a quantized= file of this runtime "
            "(the one given is onnxruntime's))") in untried
    assert not any(p.startswith("int8 onnxruntime") for p in untried)
    assert "int8 openvino (not tried: int8 needs calibration= images or a quantized= file)" in \
        untried_paths(features(XEON_AMX), False, fastpath.backend_available)


def test_auto_refuses_images_whose_logits_are_not_finite(trained_digits):
    """One all-NaN image: fixed fp32 refused it, and auto took bf16 saying "relative logit error nan: meets the
    target"."""
    x = trained_digits.images[:4].clone()
    x[1] = float("nan")
    with pytest.raises(ValueError, match="the model's logits on the example input are not finite"):
        optimize(trained_digits.model, x, "auto", compile=False, features=features(XEON_AMX))


def test_calibration_is_refused_where_nothing_uses_it(trained_digits):
    x = trained_digits.images[:8]
    for precision in ("fp32", "bf16"):
        with pytest.raises(ValueError, match=f"calibration= is for int8 .*precision='{precision}' does not use them"):
            optimize(trained_digits.model, x, precision, backend="torch", compile=False,
                     calibration=trained_digits.calibration(16))


def test_images_that_would_not_fit_in_memory_are_refused_before_loading(trained_digits, monkeypatch):
    """A whole ImageNet split, preprocessed, is tens of GB: the process would be killed without a word. Images that
    would take more than half the memory free are refused with what they need and how many would fit."""
    from cgavit.bench import precision

    info = cgavit.load_model(trained_digits.checkpoint)[1]
    monkeypatch.setattr(precision, "free_memory", lambda: 2**20)  # 1 MiB free: 18 digits of 48 px fit in half
    with pytest.raises(ValueError, match=r"360 images take 9\.5 MiB once preprocessed, more than 50% of the 1\.0 MiB free here; ask for at most about 18 "):
        precision.load_labelled(trained_digits.data, "val", info)
    assert len(precision.load_labelled(trained_digits.data, "val", info, 18).images) == 18
    monkeypatch.setattr(precision, "free_memory", lambda: None)  # not known: no check
    assert len(precision.load_labelled(trained_digits.data, "val", info).images) == 360
    monkeypatch.undo()  # this machine's own figure
    free = precision.free_memory()
    assert free is None or free > 0
