"""Roofline: the analytic model on the design notes' worked example, and a smoke run."""

import pytest
import torch

import cgavit
from cgavit.analysis.roofline import (
    attention_costs,
    elementwise_cost,
    OpRow,
    format_rows,
    format_summary,
    given_peaks,
    matmul_cost,
    profile_model,
    summarize,
)


def test_seed_worked_example():
    """T=196 tokens, C=192 channels, fp16: score matmul ~64 FLOP/byte, softmax ~1.3 (design notes, chapter 1)."""
    costs = attention_costs(196, 192, 2)
    score, softmax = costs["score matmul Q·Kᵀ"], costs["softmax"]
    assert score.flops == pytest.approx(14.7e6, rel=0.01)
    assert score.bytes == pytest.approx(0.23e6, rel=0.02)
    assert score.intensity == pytest.approx(64, rel=0.03)
    assert softmax.flops == pytest.approx(0.19e6, rel=0.02)
    assert softmax.intensity == pytest.approx(1.3, abs=0.06)
    assert score.intensity / softmax.intensity == pytest.approx(50, rel=0.06)  # "~50x more arithmetic per byte"


def test_cost_formulas():
    assert matmul_cost(2, 3, 4, 4).flops == 2 * 2 * 3 * 4
    assert matmul_cost(2, 3, 4, 4).bytes == (8 + 12 + 6) * 4
    add = elementwise_cost(100, 1, 4, reads=2)
    assert add.bytes == 1200 and add.intensity == pytest.approx(100 / 1200)


def test_given_peaks_replace_measured_ones():
    measured = dict(flops=50e9, bandwidth=10e9, ridge=5.0)
    assert given_peaks(measured, peak_gflops=100) == dict(flops=100e9, bandwidth=10e9, ridge=10.0)
    assert given_peaks(measured, bandwidth_gbs=25) == dict(flops=50e9, bandwidth=25e9, ridge=2.0)
    assert given_peaks(measured) == measured
    text = format_summary({"m0": dict(flops=2e9, bytes=1e8, total_s=0.01, memory_share=0.5, view_share=0.1)})
    assert text.splitlines()[1].split() == ["m0", "2.00", "100.0", "20.0", "10.0", "50.0%", "10.0%"]


def test_profile_model_verdicts():
    model = cgavit.fuse(cgavit.create_model("m0", img_size=64, embed_dim=(32, 48, 64), depth=(1, 1, 1),
                                            num_heads=(2, 2, 2)))
    peaks = dict(flops=50e9, bandwidth=10e9, ridge=5.0)  # fixed, so the verdicts are deterministic
    rows = profile_model(model, torch.randn(2, 3, 64, 64), peaks, repeats=1)
    by_op = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    assert all(r.bound == "memory" for r in by_op["aten::add"])  # one FLOP per 12 bytes
    assert all(r.bound == "memory" for r in by_op["aten::_softmax"])
    assert any(r.bound == "compute" for r in by_op["aten::convolution"])
    assert all(r.bound == "view" and r.bytes == 0 for r in by_op.get("aten::view", []))
    assert all(r.time_s > 0 for r in rows if r.bound != "view")  # every call measured by the profiler
    s = summarize(rows)
    assert 0 < s["memory_share"] < 1 and s["flops"] > 0
    from cgavit.info import count_macs

    flop_sum = sum(r.flops for r in rows if r.op in ("aten::convolution", "aten::addmm", "aten::bmm"))
    assert flop_sum == pytest.approx(2 * count_macs(model, (64, 64)) * 2, rel=0.01)  # batch 2, 2 FLOPs per MAC


def test_rows_of_one_operator_are_told_apart_by_their_input_shapes():
    """A row is one operator at one set of input shapes; the table printed the operator alone, so a model's
    top rows read 'aten::convolution' eight times with nothing to tell them apart."""
    peaks = dict(flops=50e9, bandwidth=10e9, ridge=5.0)
    rows = [OpRow("aten::convolution", "[(4, 3, 64, 64), (8, 3, 3, 3)]", 1, 1e6, 1e5, 1e-3, "compute"),
            OpRow("aten::convolution", "[(4, 8, 32, 32), (16, 8, 3, 3)]", 1, 1e6, 1e5, 1e-3, "compute")]
    head, _, first, second = format_rows(rows, peaks).splitlines()
    assert "input shapes" in head
    assert first.endswith("[(4, 3, 64, 64), (8, 3, 3, 3)]") and second.endswith("[(4, 8, 32, 32), (16, 8, 3, 3)]")


def test_roofline_cli(capsys):
    from cgavit.cli import main

    assert main(["roofline", "--model", "m0", "--compare", "", "--batch", "1", "--img-size", "64", "--repeats", "1",
                 "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "ridge point" in out and "memory-bound" in out and "aten::convolution" in out


def test_roofline_names_are_checked_before_the_peaks_are_measured(capsys, monkeypatch):
    """A typo in --compare was found after the peaks were measured and the first model profiled (minutes at M4)."""
    from cgavit.cli import main
    import cgavit.cli.roofline as cli

    def measured(**kwargs):
        raise AssertionError("the peaks were measured before the names were checked")

    monkeypatch.setattr(cli, "measure_peaks", measured)
    assert main(["roofline", "--model", "m0", "--compare", "no_such_model", "--img-size", "64"]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err


def test_a_timm_model_is_built_for_the_size_or_refused_in_one_line(capsys, monkeypatch):
    """Swin, BEiT and others were built for 224 px whatever --img-size said, and failed with a traceback."""
    from cgavit.analysis.roofline import _timm_model
    from cgavit.cli import main
    import cgavit.cli.roofline as cli

    pytest.importorskip("timm")
    with torch.no_grad():
        assert _timm_model("swin_tiny_patch4_window7_224", 64)(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    monkeypatch.setattr(cli, "measure_peaks", lambda **kwargs: pytest.fail("measured before the model was checked"))
    assert main(["roofline", "--model", "levit_128s", "--compare", "", "--img-size", "40"]) == 2
    assert "timm's levit_128s cannot run 40x40 images" in capsys.readouterr().err


def test_roofline_json_is_the_whole_output(capsys):
    """``--json`` printed the tables first and the JSON after them, so ``| jq`` or ``json.loads`` of the output failed."""
    import json

    from cgavit.cli import main

    assert main(["roofline", "--model", "m0", "--compare", "", "--batch", "1", "--img-size", "64", "--repeats", "1",
                 "--top", "3", "--peak-seconds", "0.05", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"] == dict(batch=1, img_size=64, threads=1, repeats=1, peak_gflops=None, bandwidth_gbs=None)
    assert report["peaks"]["flops"] > 0 and 0 < report["summaries"]["m0"]["memory_share"] < 1
    rows = report["operators"]["m0"]
    assert len(rows) == 3 and all(r["calls"] > 0 and r["bound"] in ("compute", "memory", "view") for r in rows)


def test_roofline_json_says_which_peaks_were_given(capsys):
    """With --peak-gflops or --bandwidth-gbs the JSON's peaks were the given figures, and nothing in it said they were
    not this machine's measured ones (the line that says so is not printed with --json)."""
    import json

    from cgavit.cli import main

    assert main(["roofline", "--model", "m0", "--compare", "", "--batch", "1", "--img-size", "32", "--repeats", "1",
                 "--top", "1", "--peak-seconds", "0.05", "--peak-gflops", "94", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["peak_gflops"] == 94 and report["setup"]["bandwidth_gbs"] is None
    assert report["machine"] == cgavit.deploy.cpu_features().describe()  # whose peaks were measured: this CPU's class
    assert report["peaks"]["flops"] == 94e9 and report["peaks"]["ridge"] == 94e9 / report["peaks"]["bandwidth"]


def test_the_peaks_line_says_which_figure_was_given_and_which_measured(capsys):
    """With --peak-gflops alone the peaks line read 'machine (1 thread(s)): fp32 matmul peak 94.0 GFLOP/s, copy
    bandwidth ... GB/s', one figure given (perhaps another CPU's) and one measured here, and neither said which."""
    from cgavit.cli import main

    assert main(["roofline", "--model", "m0", "--compare", "", "--batch", "1", "--img-size", "32", "--repeats", "1",
                 "--top", "1", "--peak-seconds", "0.05", "--peak-gflops", "94"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "ridge point" in ln)
    flops, bandwidth = line.split("GFLOP/s")[1], line.split("GB/s")[1]
    assert flops.startswith(" (given on the command line, not measured here)")
    assert bandwidth.startswith(" read+write (measured here, 1 thread(s))")


def test_the_output_says_its_flops_are_twice_the_macs_of_cgavit_info(capsys):
    """The table printed GFLOP beside `cgavit info`'s MACs with nothing saying a FLOP is half a multiply-accumulate or
    that the totals are for the whole batch: M0's 0.32 GFLOP at batch 2 read as four times its 79 M MACs."""
    from cgavit.cli import main

    assert main(["roofline", "--model", "m0", "--compare", "", "--batch", "1", "--img-size", "32", "--repeats", "1",
                 "--top", "1", "--peak-seconds", "0.05"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 per multiply-accumulate (cgavit info counts MACs)" in out and "per forward pass of the whole batch" in out


def test_batchnorm_and_hardsigmoid_count_their_arithmetic():
    """timm's CNN peers (MobileNetV3, EfficientNet) keep their BatchNorms and MobileNetV3 gates with hardsigmoid:
    both were counted 0 FLOPs per element, so their rows said 0 MFLOP and FLOP/B 0.0."""
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.Hardsigmoid())
    x = torch.randn(2, 4, 3, 3)
    flops = {r.op.split("::")[1]: r.flops for r in profile_model(model, x, dict(ridge=1.0), repeats=1)}
    assert flops["native_batch_norm"] == 2 * x.numel() and flops["hardsigmoid"] == 3 * x.numel(), flops
