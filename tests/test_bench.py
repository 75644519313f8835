"""`cgavit bench` smoke runs (tiny sizes, few repeats; no timing assertions)."""

import json

import torch

import cgavit
from cgavit.bench import (
    PEERS_TOP1,
    _to_timm_state_dict,
    fit_linear_probe,
    format_table,
    recalibrate_batchnorm,
    sample_photos,
    timm_port,
)
from cgavit.cli import main
from cgavit.testing import randomize_, rel_err


def test_timm_port_gets_our_weights():
    model = randomize_(cgavit.create_model("m0", img_size=64)).eval()
    port = timm_port(model, "efficientvit_m0", (64, 64))  # loads strictly: every key mapped
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in port.modules())  # timm fused it
    assert "stages.0.blocks.0.dw0.m.conv.weight" in _to_timm_state_dict(model.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(port(x), model(x)) <= 1e-5


def test_bench_cli_writes_table_csv_json_plot(tmp_path, capsys):
    code = main(["bench", "--models", "m0", "--peers", "mobilenetv3_large_100", "--img-size", "64", "--batch", "2",
                 "--warmup", "1", "--repeats", "2", "--no-compile", "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "Batch size decides throughput" in text and "x timm port" in text
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


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--models", "m9", "--out", ""]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["bench", "--models", "m0", "--peers", "resnet50", "--img-size", "64", "--batch", "1", "--warmup", "0",
                 "--repeats", "1", "--no-compile", "--out", ""]) == 2


def test_photos_probe_and_recalibration():
    imgs = sample_photos((32, 32))["photos"]
    assert imgs.shape[0] >= 9 and imgs.shape[1:] == (3, 32, 32)
    assert -3 < float(imgs.mean()) < 3  # normalised
    model = randomize_(cgavit.create_model("m0", img_size=64, embed_dim=(32, 48, 64), depth=(1, 1, 1),
                                           num_heads=(2, 2, 2)))
    x = torch.nn.functional.interpolate(imgs, size=(64, 64))
    recalibrate_batchnorm(model, x)
    labels = torch.arange(len(x)) % 3
    fit_linear_probe(model, x, labels)
    assert model.num_classes == 3 and not model.training
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x), pre_logits=True)
        acc = (model(x).argmax(1) == labels).float().mean()
    assert float(feats.std(0).mean()) > 1e-2  # features depend on the image after recalibration
    assert acc > 0.5  # the probe fits its own (training) images


def test_format_table_lists_every_result():
    from cgavit.bench import Result

    rows = [Result("a", "timm-port", "efficientvit_m0", 63.2, [10.0, 12.0], ratio_to_timm=1.0),
            Result("b", "ours", "efficientvit_m0", 63.2, [20.0], rel_err_vs_timm=1e-7, ratio_to_timm=1.8)]
    text = format_table(rows)
    assert "1.80" in text and "11.0" in text and "1e-07" in text
