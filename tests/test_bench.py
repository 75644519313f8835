"""`cgavit bench` smoke runs (tiny sizes, few repeats; no timing assertions)."""

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import cgavit
from cgavit.bench import BenchConfig, BenchProtocol, BenchReport, Result, format_table, run_bench, timm_port
from cgavit.bench.candidates import PEERS_TOP1
from cgavit.bench.report import environment
from cgavit.bench.run import resolve_protocol
from cgavit.cli import main
from cgavit.info import count_macs
from cgavit.testing import randomize_, rel_err
from cgavit.timing import Timings, iqr, round_robin
from cgavit.model import to_timm_state_dict


def test_timm_port_gets_our_weights():
    model = randomize_(cgavit.create_model("m0", img_size=64)).eval()
    port = timm_port(model, "m0", (64, 64))  # the short name as create_model takes it; loads strictly
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in port.modules())  # timm fused it
    assert "stages.0.blocks.0.dw0.m.conv.weight" in to_timm_state_dict(model.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(port(x), model(x)) <= 1e-5


def test_bench_cli_writes_table_csv_json_plot(tmp_path, capsys):
    code = main(["bench", "--models", "m0", "--peers", "mobilenetv3_large_100", "--img-size", "64", "--batch", "2",
                 "--warmup", "1", "--repeats", "2", "--no-compile", "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "Batch size decides throughput" in text and "x timm port" in text
    assert "fp32 ceiling efficientvit_m0: " in text
    record = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["name"]: r for r in record["results"]}
    assert record["protocol"] == dict(device="cpu", threads=1, batch=2, precision="fp32", img_size=[64, 64],
                                      warmup=1, repeats=2)
    port = rows["timm efficientvit_m0 (fused, traced)"]
    assert port["ratio_to_timm"] == 1.0 and len(port["ips"]) == 2
    ours = [r for r in record["results"] if r["kind"] == "ours"]
    assert len(ours) == 3 and all(r["rel_err_vs_timm"] <= 1e-5 and r["ratio_to_timm"] > 0 for r in ours)
    assert rows["timm mobilenetv3_large_100 (traced)"]["top1"] == PEERS_TOP1["mobilenetv3_large_100"]
    assert (tmp_path / "bench.csv").read_text().count("\n") == 6  # header + port, fuse, 2 x optimize, peer
    assert (tmp_path / "accuracy_vs_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_peer_accuracy_is_the_papers_the_efficientvit_paper_compares_with():
    """The abstract: M5 is 1.9 points above MobileNetV3-Large, M2 1.8 above MobileViT-XXS. The table had timm's
    evaluation of its own weights (75.8, 68.9), said to be the papers', which put M5 1.3 points ahead."""
    ahead = {"mobilenetv3_large_100": ("efficientvit_m5", 1.9), "mobilevit_xxs": ("efficientvit_m2", 1.8)}
    for peer, (ours, points) in ahead.items():
        assert round(cgavit.VARIANTS[ours].top1 - PEERS_TOP1[peer], 1) == points, peer


def test_the_top1_notes_name_each_peers_published_resolution():
    """The table's note and the plot's y axis said every published top-1 was at 224 px; MobileViT-XXS's 69.0 is
    at 256 px (its paper, and timm's input size for it)."""
    from cgavit.bench import report

    timm = pytest.importorskip("timm")
    for peer in PEERS_TOP1:
        side = timm.models.get_pretrained_cfg(peer).input_size[-1]
        if side != 224:
            assert f"{peer} {side} px" in report.TABLE_NOTE and f"{peer} {side} px" in report.PLOT_TOP1_LABEL, peer
    assert "224 px" in report.PLOT_TOP1_LABEL

def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--models", "m9", "--out", ""]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["bench", "--models", "m0", "--peers", "resnet50", "--img-size", "64", "--batch", "1", "--warmup", "0",
                 "--repeats", "1", "--no-compile", "--out", ""]) == 2


def test_format_table_lists_every_result():
    rows = [Result("a", "timm-port", "efficientvit_m0", 63.2, [10.0, 12.0], ratio_to_timm=1.0),
            Result("b", "ours", "efficientvit_m0", 63.2, [20.0], rel_err_vs_timm=1e-7, ratio_to_timm=1.8)]
    text = format_table(rows)
    assert "1.80" in text and "11.0" in text and "1e-07" in text


def test_progress_bars_show_on_a_terminal_only(monkeypatch, capsys):
    """Long loops (the per-layer sensitivity, QAT epochs) iterate every item under a bar on stderr when it is a
    terminal, with no bar in logs and CI, and plainly without tqdm (an optional dependency)."""
    import io
    import sys

    from cgavit.timing import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(progress_bar(range(5), "sensitivity")) == list(range(5))
        assert ("sensitivity: " in stream.getvalue()) is shown, stream.getvalue()
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    items = [1, 2]
    assert progress_bar(items, "sensitivity") is items


def test_round_robin_warms_up_then_calls_in_turn():
    calls = []
    timings = round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=2, repeats=3)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3  # warm-up per candidate, then one call each per round
    assert list(timings) == ["a", "b"] and all(len(t.seconds) == 3 for t in timings.values())
    assert all(s >= 0 for t in timings.values() for s in t.seconds)
    with pytest.raises(ValueError, match="repeats"):
        round_robin({"a": lambda: None}, warmup=0, repeats=0)


def test_timings_statistics():
    t = Timings([0.5, 0.25, 0.125, 1.0])  # 2, 4, 8 and 1 items/s for 1 item per call
    assert t.per_second(2) == [4.0, 8.0, 16.0, 2.0]
    assert t.median_rate(1) == 3.0
    assert t.iqr_rate(1) == iqr([2.0, 4.0, 8.0, 1.0]) == (1.75, 5.0)
    assert iqr([7.0]) == (7.0, 7.0)


def test_run_bench_typed_config(tmp_path):
    cfg = BenchConfig(models=("m0",), peers=(), img_size=(64, 64), batch=2, warmup=0, repeats=1, compile=False,
                      onnx=False, out=tmp_path)
    sections = []
    report = run_bench(cfg, on_section=lambda name, rep: sections.append((name, len(rep.results))))
    assert sections == [("table", 3)]
    assert [r.kind for r in report.results] == ["timm-port", "ours", "ours"]  # port, fuse, optimize torch eager
    assert all(len(r.ips) == 1 and r.median > 0 for r in report.results)
    assert report.protocol.threads == 1 and report.protocol.precision == "fp32"
    assert [p.name for p in report.files] == ["bench.csv", "bench.json", "accuracy_vs_throughput.png"]
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(report.record()))
    (ceiling,) = report.ceilings  # CPU fp32: the FLOPs at the measured matmul peak
    macs = count_macs(cgavit.create_model("m0", img_size=(64, 64)), (64, 64))
    assert ceiling["model"] == "efficientvit_m0" and ceiling["gflop_per_image"] == pytest.approx(2 * macs / 1e9)
    assert ceiling["ceiling_img_s"] == pytest.approx(ceiling["peak_gflops"] / ceiling["gflop_per_image"])
    best = max(r.median for r in report.results if r.kind == "ours")
    assert ceiling["share_of_ceiling"] == pytest.approx(best / ceiling["ceiling_img_s"])
    assert ceiling["timm_img_s"] == report.results[0].median
    with pytest.raises(ValueError, match="--skip-table leaves nothing to measure"):  # it ran, wrote nothing, exit 0
        run_bench(BenchConfig(models=("m0",), peers=(), skip_table=True, out=tmp_path / "none"))
    assert not (tmp_path / "none").exists()


def test_a_size_taller_than_wide_builds_timms_port_with_our_windows(tmp_path):
    """Our windows follow the shorter side; timm's port was built from the height alone, so 96x64 (windows 6 and 4)
    crashed loading the weights, with a traceback (and --train the same)."""
    cfg = BenchConfig(models=("m0",), peers=(), img_size=(96, 64), batch=1, warmup=0, repeats=1, compile=False,
                      onnx=False, out=tmp_path, train=True, train_batch=2)
    report = run_bench(cfg)
    assert all(r.rel_err_vs_timm < 1e-4 for r in report.results if r.kind == "ours")
    assert report.training[0]["timm_ips"] > 0 and "96x64px" in report.plot_title()


def test_options_the_run_would_ignore_are_refused():
    """Precision-check options without --precision-check, --no-onnx beside --runtimes onnxruntime, --train-batch
    without --train, --batch with --skip-table --train alone: accepted and ignored (exit 0)."""
    for given, flag in ((dict(eval_images=5), "--eval-images"), (dict(calibration_images=3), "--calibration-images"),
                        (dict(train_split="nope"), "--train-split"), (dict(trust_checkpoint=True), "--trust-checkpoint")):
        with pytest.raises(ValueError, match=f"{flag} is read by --precision-check alone"):
            resolve_protocol(BenchConfig(**given))
    with pytest.raises(ValueError, match="--no-onnx leaves ONNX Runtime out"):
        resolve_protocol(BenchConfig(onnx=False, runtimes=("onnxruntime",)))
    with pytest.raises(ValueError, match="--train-batch is read by --train alone"):  # it timed the table, exit 0
        resolve_protocol(BenchConfig(train_batch=8))
    assert resolve_protocol(BenchConfig(train_batch=8, train=True)).batch == 16
    with pytest.raises(ValueError, match="--train's batch is --train-batch"):  # it timed training at 64, exit 0
        resolve_protocol(BenchConfig(batch=8, train=True, skip_table=True))


def test_an_image_size_no_part_of_the_run_reads_is_refused():
    """--skip-table --precision-check --img-size 64: the check read the images at the checkpoint's recorded size, and
    --img-size, read by the table and --train alone, was accepted and ignored (exit 0)."""
    check = dict(precision_check=True, skip_table=True, checkpoint="absent.safetensors", data="absent")
    with pytest.raises(ValueError, match=r"--img-size 64x64 is the table's and --train's size, and neither runs"):
        resolve_protocol(BenchConfig(img_size=(64, 64), **check))
    assert resolve_protocol(BenchConfig(img_size=(64, 64), train=True, skip_table=True)).img_size == (64, 64)


def test_models_and_peers_no_part_of_the_run_reads_are_refused(tmp_path, capsys):
    """--skip-table --precision-check --models X measured the checkpoint's model and ignored --models without a word
    (exit 0); --skip-table --peers X likewise. --train still takes --models."""
    out = tmp_path / "out"
    check = ["bench", "--skip-table", "--precision-check", "--checkpoint", "absent.safetensors", "--data", "absent",
             "--output", str(out)]
    assert main([*check, "--models", "efficientvit_m5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--models efficientvit_m5 are the table's and --train's variants, and neither runs" in err
    assert "leave --models out" in err and len(err.splitlines()) == 1 and not out.exists()
    assert main([*check, "--peers", "levit_128s"]) == 2
    assert "--peers levit_128s are timed in the main table alone" in capsys.readouterr().err
    assert resolve_protocol(BenchConfig(models=("m5",), peers=(), train=True, skip_table=True)).models == ("efficientvit_m5",)


def test_training_steps_are_timed_on_the_cpu_only(monkeypatch):
    """--train --device cuda built its models and batch on the CPU, so its line was a CPU figure labelled GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--train runs on the CPU only"):
        resolve_protocol(BenchConfig(device="cuda", train=True))
    with pytest.raises(ValueError, match="--precision-check runs on the CPU only"):  # it ran on the CPU at batch 2048
        resolve_protocol(BenchConfig(device="cuda", precision_check=True, skip_table=True))


def test_the_gpu_table_runs_under_the_precision_asked_for(monkeypatch):
    """On a GPU every row ran under fp16 autocast whatever --precision said: --precision fp32 or bf16 was accepted,
    recorded in the protocol and bench.json, and timed as fp16 AMP. (No GPU needed: the candidates, the timing and
    torch.autocast are stood in for, and what autocast each row ran under is recorded.)"""
    from cgavit.bench import candidates, run
    from cgavit.bench.candidates import Candidate
    from cgavit.timing import Timings

    contexts = []

    def autocast(device_type, dtype=None, enabled=True, **kwargs):
        contexts.append((device_type, enabled, (dtype or torch.float16) if enabled else None))  # fp16: cuda's default
        return contextlib.nullcontext()

    def round_robin(calls, warmup, repeats, **kwargs):
        return {name: Timings([0.5 if fn() is None else 1.0] * repeats) for name, fn in calls.items()}

    fake = [Candidate("timm efficientvit_m0 (fused, traced)", "timm-port", "efficientvit_m0", 63.2, lambda x: None),
            Candidate("cgavit efficientvit_m0 fuse", "ours", "efficientvit_m0", 63.2, lambda x: None)]
    monkeypatch.setattr(run, "build_candidates", lambda *args, **kwargs: fake)
    monkeypatch.setattr(candidates, "round_robin", round_robin)
    monkeypatch.setattr(torch, "autocast", autocast)
    x = torch.zeros(2, 3, 32, 32)
    for precision, wanted in (("fp32", (False, None)), ("bf16", (True, torch.bfloat16)), ("amp", (True, torch.float16))):
        protocol = run.BenchProtocol(torch.device("cuda"), 1, 2, precision, (32, 32), 0, 1, ("efficientvit_m0",), ())
        contexts.clear()
        results = run.measure_table(protocol, x)
        assert [r.ratio_to_timm for r in results] == [1.0, 1.0]
        assert contexts == [("cuda", *wanted)], precision
    contexts.clear()
    run.measure_table(run.BenchProtocol(torch.device("cpu"), 1, 2, "bf16", (32, 32), 0, 1, ("efficientvit_m0",), ()), x)
    assert contexts == [("cpu", False, None)]  # on the CPU the bf16 rows are optimize()'s own; no autocast


def test_a_peer_at_a_size_it_cannot_run_is_refused_before_anything_is_built():
    """timm's LeViT at 100 px failed with a traceback after every candidate was built (minutes at real sizes)."""
    with pytest.raises(ValueError, match="levit_128s runs only at sides that are multiples of 16.*--img-size 96"):
        resolve_protocol(BenchConfig(img_size=(100, 100)))
    assert resolve_protocol(BenchConfig(img_size=(100, 100), peers=("deit_tiny_patch16_224",))).img_size == (100, 100)


def test_a_missing_checkpoint_is_named_before_the_output_folder_is_made(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--skip-table", "--precision-check", "--checkpoint", str(tmp_path / "missing.pt"),
                 "--data", str(tmp_path), "--output", str(out)]) == 2
    assert "missing.pt does not exist" in capsys.readouterr().err and not out.exists()


def test_a_checkpoint_without_its_network_says_what_the_precision_check_needs(tmp_path, capsys):
    """A bare state dict was refused with load_model's advice, to give --model NAME: no option of cgavit bench (and
    argparse took --model as --models, which changed nothing)."""
    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            Image.new("RGB", (32, 32), (40, 90, 200)).save(tmp_path / "data" / split / name / "x.png")
    torch.save(cgavit.create_model("m0", num_classes=2, img_size=32).state_dict(), tmp_path / "bare.pt")
    assert main(["bench", "--skip-table", "--precision-check", "--checkpoint", str(tmp_path / "bare.pt"), "--data",
                 str(tmp_path / "data"), "--no-onnx", "--no-compile", "--output", ""]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint bare.pt does not record its network" in err and "cgavit train's" in err and "--model" not in err


def test_training_alone_records_the_protocol_it_ran(tmp_path, capsys):
    """--train --skip-table printed and recorded batch 16, 0 warm-up, grad off: the table's protocol, not measured."""
    code = main(["bench", "--models", "m0", "--peers", "none", "--img-size", "32", "--warmup", "0", "--repeats", "2",
                 "--no-compile", "--no-onnx", "--train", "--skip-table", "--train-batch", "2", "--output", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "grad off" not in out and "batch 2, train mode, 1 warm-up + 2 timed rounds" in out
    record = json.loads((tmp_path / "bench.json").read_text())
    assert "batch" not in record["protocol"] and (record["training"][0]["batch"], record["training"][0]["warmup"]) == (2, 1)


def test_a_reader_that_leaves_early_loses_nothing(tmp_path, monkeypatch):
    """`cgavit bench ... | head`: the table's print raised BrokenPipeError, so the command died with a traceback
    (exit 1) and its measurements were never written."""
    import io
    import sys

    class GoneReader(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", GoneReader())
    assert main(["bench", "--models", "m0", "--peers", "none", "--img-size", "64", "--batch", "1", "--warmup", "0",
                 "--repeats", "1", "--no-compile", "--no-onnx", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy_vs_throughput.png", "bench.csv", "bench.json"]
    assert main(["info", "--model", "m0", "--json"]) == 0


def test_bench_config_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown model"):
        resolve_protocol(BenchConfig(models=("m9",)))
    with pytest.raises(ValueError, match="unknown peer"):
        resolve_protocol(BenchConfig(peers=("resnet50",)))
    with pytest.raises(ValueError, match="amp"):
        resolve_protocol(BenchConfig(precision="amp"))
    with pytest.raises(ValueError, match="--repeats"):
        resolve_protocol(BenchConfig(repeats=0))
    assert resolve_protocol(BenchConfig(models=("m4", "efficientvit_m4"))).models == ("efficientvit_m4",)


def test_precision_check_on_a_trained_checkpoint(trained_digits, capsys, tmp_path):
    """--checkpoint/--data: every path on the held-out images, int8 calibrated on training images, auto's choice;
    without the main table, --out gets bench.json alone (it was left empty, without a word)."""
    code = main(["bench", "--skip-table", "--precision-check", "--checkpoint", str(trained_digits.checkpoint),
                 "--data", str(trained_digits.data), "--no-compile", "--warmup", "0", "--repeats", "1",
                 "--eval-images", "100", "--calibration-images", "64", "--out", str(tmp_path / "b")])
    text = capsys.readouterr().out
    assert code == 0
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["bench.json"] and f"wrote {tmp_path / 'b' / 'bench.json'}" in text
    record = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert len(record["precision"]) == 4 and record["results"] == []
    paths = ["fp32 torch eager", "fp32 ONNX Runtime", "bf16 torch eager", "int8 ONNX Runtime (static)"]
    rows = [line for line in text.splitlines() if line.startswith("digits.safetensors"[:16])]
    assert [next(p for p in paths if p in row) for row in rows] == paths
    assert all(" 100 " in row and ("meets" in row or "MISSES" in row) for row in rows)
    assert "int8 calibrated on 64 training images" in text and "never on the evaluated ones" in text
    assert "optimize(precision='auto') chose:" in text and "Why: CPU" in text
    # 100 of the split's 360, drawn: the note and bench.json said "every image"
    assert record["precision_images"]["every"] is False and "Evaluated: 100 images, drawn at random" in text
    assert text.startswith("protocol:") and "the checkpoint's image size" in text.splitlines()[0]
    # for scale, fp32's own decisions under pixel noise, on the same 100 images, in the checkpoint's grey levels
    from cgavit import load_model
    from cgavit.bench import load_labelled
    from cgavit.deploy import fuse, noise_floor

    model, info = load_model(trained_digits.checkpoint)
    floor = noise_floor(fuse(model), load_labelled(trained_digits.data, "val", info, 100).images, info.std)
    assert f"For scale: on these images, {floor.describe()}" in text and floor.n == 100


def test_precision_check_needs_checkpoint_and_data(capsys):
    """The random-weight probe is gone (issue 17): agreement needs a trained model, so both are required."""
    assert main(["bench", "--skip-table", "--precision-check", "--checkpoint", "x.pt", "--out", ""]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["bench", "--skip-table", "--precision-check", "--out", ""]) == 2
    assert "needs a trained model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trained model"):
        resolve_protocol(BenchConfig(precision_check=True))
    with pytest.raises(ValueError, match="unknown runtime"):
        resolve_protocol(BenchConfig(runtimes=("tensorrt",)))
    with pytest.raises(ValueError, match="--precision-check"):
        resolve_protocol(BenchConfig(checkpoint="x.pt", data="d"))


def test_bench_out_on_a_read_only_file_system_is_one_line_before_measuring(mount_tmpfs, capsys):
    """`--out` on a read-only file system ended, after the whole measurement, in an OSError traceback."""
    ro = mount_tmpfs(read_only=True)
    out = ro / "bench"
    assert main(["bench", "--models", "m0", "--peers", "none", "--warmup", "0", "--repeats", "1", "--img-size", "64",
                 "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and f"{out}: the file system is read-only" in err[0], captured.err
    assert "img/s" not in captured.out  # refused before anything was timed


def test_the_precision_note_says_which_images_and_at_what_size():
    """--eval-images N judges N images drawn at random: the note said "every image" whatever was asked, and named no
    size where the protocol line above it gives the table's (224 px)."""
    from cgavit.bench.report import precision_note

    base = dict(evaluated="data/val", calibration="data/train", calibration_images=256, img_size=48)
    some = precision_note({**base, "evaluated_images": 20, "every": False})
    assert "Evaluated: 20 images, drawn at random (a fixed seed), of data/val at the checkpoint's 48x48 px." in some
    assert "Evaluated: every image of data/val at the checkpoint's 48x48 px." in precision_note(
        {**base, "evaluated_images": 360, "every": True})


@pytest.mark.parametrize("size", [(100, 100), (250, 200)])
def test_timm_port_and_training_rows_at_sizes_off_the_patch_grid(size):
    """At 100 px our first stage is 7x7 (padded convolutions round up) and timm's 6x6: its bias tables did not take
    our weights, and bench crashed at 33-47, 49-63, ..., 100 and 200 px."""
    from cgavit.bench.train_speed import train_throughput

    model = randomize_(cgavit.create_model("m0", img_size=size)).eval()
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        assert rel_err(timm_port(model, "m0", size)(x), cgavit.fuse(model)(x)) <= 1e-5
    row, = train_throughput(["efficientvit_m0"], 2, size, 0, 1)
    assert row["cgavit_ips"] > 0 and row["timm_ips"] > 0


def test_the_report_files_are_one_run_s(tmp_path, monkeypatch):
    """bench.csv, bench.json and the plot are replaced together: a run stopped while writing them left new ones beside
    an old plot, and a --skip-table run left an earlier run's csv and plot beside its json."""
    from cgavit.bench import report

    results = [Result("cgavit m0", "ours", "efficientvit_m0", 63.2, [10.0, 11.0])]
    report.write_report(tmp_path, {"run": 1}, results, "first")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"bench.csv", "bench.json", report.PLOT_NAME}

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot", stopped)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(tmp_path, {"run": 2}, results + results, "second")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary left either
    monkeypatch.undo()
    written = report.write_report(tmp_path, {"run": 3}, [], "table skipped")
    assert written == [tmp_path / "bench.json"] and [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    assert json.loads((tmp_path / "bench.json").read_text()) == {"run": 3}


def test_a_traced_path_pays_its_compilation_before_the_timing(monkeypatch):
    """TorchScript profiles a traced module's first call and optimises on its second: with --warmup 0 those slow calls
    fell in the timed rounds (a table said 8.5x timm's port for 0.73x)."""
    from cgavit.bench import candidates

    calls = []
    real = torch.jit.trace

    def counted(module, x):
        traced = real(module, x)
        return lambda y: calls.append(y.shape) or traced(y)

    monkeypatch.setattr(torch.jit, "trace", counted)
    traced = candidates.trace(cgavit.create_model("m0", img_size=64).eval(), torch.randn(2, 3, 64, 64))
    assert len(calls) == 2
    traced(torch.randn(2, 3, 64, 64))
    assert len(calls) == 3


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    import cgavit.cli.bench as bench_cli

    def too_big(cfg, on_section=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 824633720832 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(bench_cli, "run_bench", too_big)
    assert main(["bench", "--models", "m0", "--batch", "4096", "--img-size", "4096", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "out of memory (768.0 GiB asked for at once); give a smaller batch or image size" in err
    assert "Traceback" not in err


def test_the_throughput_axis_is_ticked_in_plain_numbers(tmp_path, monkeypatch):
    """accuracy_vs_throughput.png's log axis read '1000' beside '2 x 10^3' and '3 x 10^3' (its minor ticks)."""
    import matplotlib.pyplot as plt

    from cgavit.bench.report import plot

    results = [Result("cgavit efficientvit_m0 fuse", "ours", "efficientvit_m0", 63.2, [937.0]),
               Result("timm efficientvit_m0", "timm-port", "efficientvit_m0", 63.2, [1147.0]),
               Result("cgavit efficientvit_m0 onnxruntime", "ours", "efficientvit_m0", 63.2, [3682.0])]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    plot(results, tmp_path / "p.png", "title")
    monkeypatch.undo()
    (fig,) = figures
    fig.canvas.draw()
    (ax,) = fig.axes
    lo, hi = ax.get_xlim()
    ticks = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
             if t.get_text() and lo <= t.get_position()[0] <= hi]
    assert "1000" in ticks and "2000" in ticks and all(t.isdigit() for t in ticks), ticks
    plt.close(fig)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_script(name: str):
    """The developer script ``benchmarks/NAME.py``, imported (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize("script,argv,said", [
    ("gpu_bench", ["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    ("gpu_bench", ["--size", "-1"], "argument --size: the side must be between 32 and 4096 pixels, got -1"),
    ("gpu_bench", ["--models", "m0", "efficientvit_m9"], "argument --models: unknown model 'efficientvit_m9'"),
    ("gpu_bench", ["--latency-batches", "1", "x"], "argument --latency-batches: expected a whole number, got 'x'"),
    ("int8_layers", ["--img-size", "x"], "argument --img-size: expected a whole number of pixels, got 'x'"),
    ("int8_layers", ["--runs", "0"], "argument --runs: must be at least 1, got 0"),
    ("int8_choices", ["--checkpoint", "absent.safetensors", "--data", "."], "argument --checkpoint: file absent.safetensors "
     "does not exist; check the path"),
    ("int8_choices", ["--checkpoint", __file__, "--data", "absent"], "argument --data: folder absent does not exist"),
    ("int8_choices", ["--checkpoint", __file__, "--data", ".", "--eval-images", "-1"],
     "argument --eval-images: must be at least 0, got -1"),
])
def test_benchmark_scripts_refuse_bad_values_in_one_line(script, argv, said, monkeypatch, capsys):
    """The scripts in benchmarks/ took --batch 0, --img-size -1, an unknown variant or a missing checkpoint and failed
    later with a Python traceback (gpu_bench said only that it needs a GPU); argparse now refuses each, exit 2."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run: they import this folder's other scripts
    main_of = benchmark_script(script).main
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exited:
        main_of()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err.splitlines()[-1] and "Traceback" not in err


def test_gpu_bench_keeps_throughput_and_latency_apart_when_one_batch_is_both():
    """benchmarks/gpu_bench.py stored both figures of a batch under the batch's number: with --batch 64 and 64
    among --latency-batches the ms per batch replaced the images/s, and the table's img/s and ratio were ms."""
    gpu_bench = benchmark_script("gpu_bench")
    args = argparse.Namespace(batch=64, latency_batches=[1, 64])
    rows = {label: {"model": "efficientvit_m0", "path": label, "ms": {}, "rel_err_fp32": 0.0}
            for label in (gpu_bench.ANCHOR, "cgavit fuse, compile")}
    gpu_bench.record(rows, 1, {gpu_bench.ANCHOR: Timings([0.001]), "cgavit fuse, compile": Timings([0.0005])}, args)
    gpu_bench.record(rows, 64, {gpu_bench.ANCHOR: Timings([0.032]), "cgavit fuse, compile": Timings([0.016])}, args)
    anchor, ours = rows[gpu_bench.ANCHOR], rows["cgavit fuse, compile"]
    assert anchor["img_s"] == pytest.approx(2000) and ours["img_s"] == pytest.approx(4000)  # 64 images per call
    assert anchor["ms"] == pytest.approx({1: 1.0, 64: 32.0}) and ours["ms"] == pytest.approx({1: 0.5, 64: 16.0})
    for row in rows.values():
        row["ratio"] = row["img_s"] / anchor["img_s"]
    assert "| efficientvit_m0 | cgavit fuse, compile | 4,000 | 2.00 | 0.50 | 16.00 |" in gpu_bench.table(list(rows.values()), args)


def test_a_gpu_run_records_and_titles_the_gpu_it_ran_on(monkeypatch):
    """A --device cuda run's bench.json named only the host CPU, and its plot was titled with it: nothing said which
    GPU the figures came from."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    env = environment(torch.device("cuda"))
    assert env["gpu"] == "NVIDIA H100 80GB HBM3" and env["cpu"] == environment()["cpu"]
    assert "gpu" not in environment(torch.device("cpu"))
    protocol = BenchProtocol(torch.device("cuda"), 1, 2048, "amp", (224, 224), 0, 1, ("efficientvit_m0",), ())
    title = BenchReport(protocol, environment=env).plot_title()
    assert title.startswith("NVIDIA H100 80GB HBM3 | cuda 1 thread(s), batch 2048, amp, 224px")


def test_a_cpu_run_records_and_titles_the_cpu_class(monkeypatch, tmp_path):
    """bench.json and the plot's title named the CPU by its model name alone: on these VMs "AMD EPYC" both for the
    AVX2-only class and for the AVX-512 one, whose fp32 peaks and ceilings differ."""
    import cgavit.bench.report as report

    for flags, cls in (("fpu avx2", "avx2"), ("fpu avx2 avx512f avx512_bf16", "avx512_bf16")):
        (tmp_path / "cpuinfo").write_text(f"model name\t: AMD EPYC\nflags\t\t: {flags}\n")
        monkeypatch.setattr(report, "cpu_features", lambda: cgavit.deploy.cpu_features(tmp_path / "cpuinfo", {}, {}))
        env = environment()
        assert (env["cpu"], env["cpu_class"]) == ("AMD EPYC", cls)
        protocol = BenchProtocol(torch.device("cpu"), 1, 16, "fp32", (224, 224), 0, 1, ("efficientvit_m0",), ())
        assert BenchReport(protocol, environment=env).plot_title().startswith(f"AMD EPYC (class {cls}) | cpu 1 thread")

def test_runtimes_on_a_gpu_are_refused(monkeypatch):
    """--device cuda --runtimes openvino was accepted and the table held no OpenVINO row (the GPU table is torch's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--runtimes openvino are CPU runtimes"):
        resolve_protocol(BenchConfig(device="cuda", runtimes=("openvino",), peers=()))
    assert resolve_protocol(BenchConfig(device="cuda", peers=())).batch == 2048  # onnx's default on: nothing asked


def test_peers_none_beside_a_peer_says_none_stands_alone(capsys):
    """--peers none levit_128s said "unknown peer(s) ['none']; choose from ... or 'none'", refusing what it offered."""
    assert main(["bench", "--models", "m0", "--peers", "none", "levit_128s", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "--peers none means no peers, and levit_128s was given beside it" in err and "unknown" not in err


def test_a_missing_matplotlib_is_named_before_anything_is_measured(tmp_path, monkeypatch):
    """Without matplotlib (timm installed by hand) the bench measured for minutes and then failed at the plot with a
    ModuleNotFoundError traceback, writing neither bench.csv nor bench.json."""
    from cgavit.bench import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails, as where it is not installed
    monkeypatch.setattr(run, "measure_table", lambda *args, **kwargs: pytest.fail("measured before the plot was checked"))
    cfg = BenchConfig(models=("m0",), peers=(), img_size=(32, 32), batch=1, warmup=0, repeats=1, compile=False,
                      onnx=False, out=tmp_path / "out")
    with pytest.raises(ValueError, match=r"the bench's plot needs matplotlib.*pip install 'cgavit\[bench\]'"):
        run_bench(cfg)
    assert not (tmp_path / "out").exists()


def test_a_run_that_fails_while_measuring_leaves_no_empty_folder(tmp_path, monkeypatch):
    """A bench that failed while measuring (a broken compiler cache, a Ctrl-C) left the empty output folder it had made,
    and its parents; they are removed, and a folder that was there before is kept."""
    from cgavit.bench import run

    def failing(*args, **kwargs):
        raise RuntimeError("inductor failed")

    monkeypatch.setattr(run, "measure_table", failing)
    for out in (tmp_path / "new" / "bench", tmp_path / "kept"):
        if out.name == "kept":
            out.mkdir()
        cfg = BenchConfig(models=("m0",), peers=(), img_size=(32, 32), batch=1, warmup=0, repeats=1, compile=False,
                          onnx=False, out=out)
        with pytest.raises(RuntimeError, match="inductor failed"):
            run_bench(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_missing_onnxruntime_says_the_default_row_can_be_left_out(monkeypatch):
    """Without ONNX Runtime a plain `cgavit bench` said only what to install, not that --no-onnx times without it."""
    from cgavit.bench import run

    def missing(name, precision="fp32"):
        raise ValueError(f"{name} files need a runtime that is not installed: pip install 'cgavit[deploy]'")

    monkeypatch.setattr(run, "require_format", missing)
    with pytest.raises(ValueError, match=r"cgavit\[deploy\]'; or give --no-onnx to time without ONNX Runtime"):
        resolve_protocol(BenchConfig(peers=()))
    with pytest.raises(ValueError) as asked:  # asked for by name: leaving it out is no answer
        resolve_protocol(BenchConfig(peers=(), runtimes=("onnxruntime",)))
    assert "--no-onnx" not in str(asked.value)
    assert resolve_protocol(BenchConfig(peers=(), onnx=False)).runtimes == ()


def test_runtimes_no_row_would_time_are_refused():
    """--precision bf16 --runtimes openvino (the runtime rows are fp32) or --skip-table --train --runtimes openvino:
    accepted, and the run held no OpenVINO row."""
    for given, fix in ((dict(precision="bf16"), "the table runs bf16\\); give --precision fp32"),
                       (dict(skip_table=True, train=True), "the table is skipped\\); give --precision-check")):
        with pytest.raises(ValueError, match=f"--runtimes openvino are timed in the main table's fp32 rows.*{fix}"):
            resolve_protocol(BenchConfig(runtimes=("openvino",), peers=(), **given))
    assert resolve_protocol(BenchConfig(precision="bf16", peers=())).precision == "bf16"  # onnx's default: nothing asked


def test_a_cpu_bf16_run_says_the_baselines_ran_fp32():
    """On the CPU --precision bf16 is our optimize() rows' alone, the port and the peers running fp32; the protocol
    line and the plot's title said plain "bf16" over every point."""
    cpu = BenchProtocol(torch.device("cpu"), 1, 16, "bf16", (224, 224), 0, 1, ("efficientvit_m0",), ())
    env = dict(cpu="AMD EPYC", date="2026-12-07 17:00 UTC")
    assert "batch 16, bf16 (ours; timm's fp32), 224x224" in cpu.describe()
    assert "batch 16, bf16 (ours; timm's fp32), 224px" in BenchReport(cpu, environment=env).plot_title()
    gpu = BenchProtocol(torch.device("cuda"), 1, 2048, "bf16", (224, 224), 0, 1, ("efficientvit_m0",), ())
    assert "batch 2048, bf16, 224x224" in gpu.describe()  # on a GPU every row runs under bf16 autocast
    fp32 = BenchProtocol(torch.device("cpu"), 1, 16, "fp32", (224, 224), 0, 1, ("efficientvit_m0",), ())
    assert "batch 16, fp32, 224x224" in fp32.describe()
