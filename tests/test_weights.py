"""Checkpoint formats, equivalence with timm's port, the pretrained download, and refusals."""

import errno
import functools
import http.server
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

import cgavit
from cgavit.testing import randomize_
from cgavit.io import CheckpointError, WriteError
from cgavit.loading import load_checkpoint
from cgavit.weights import read_metadata, save_weights

timm = pytest.importorskip("timm")


def _timm_pair(name, size=224, seed=0):
    """timm's port with random weights and BN statistics, and our model loaded from its state dict."""
    ref = randomize_(timm.create_model(name, img_size=size), seed).eval()
    ours = cgavit.create_model(name, img_size=size).eval()
    load_checkpoint(ours, ref.state_dict())
    return ref, ours


def _official_state_dict(timm_sd):
    """Rename a timm state dict the way the authors' release files name things (written
    independently of cgavit.weights), storing 1x1 qkv/FFN weights 2-D like some release files."""
    out = {}
    for key, value in timm_sd.items():
        m = re.match(r"patch_embed\.conv(\d)\.(.*)", key)
        if m:
            key = f"patch_embed.{2 * (int(m.group(1)) - 1)}.{m.group(2)}"
        m = re.match(r"stages\.(\d)\.downsample\.(res1|patchmerge|res2)\.(.*)", key)
        if m:
            key = f"blocks{int(m.group(1)) + 1}.{['res1', 'patchmerge', 'res2'].index(m.group(2))}.{m.group(3)}"
        m = re.match(r"stages\.(\d)\.blocks\.(\d+)\.(.*)", key)
        if m:
            s, j = int(m.group(1)), int(m.group(2))
            key = f"blocks{s + 1}.{j + (0 if s == 0 else 3)}.{m.group(3)}"
        key = re.sub(r"\.conv\.(weight|bias|running_mean|running_var|num_batches_tracked)$", r".c.\1", key)
        key = re.sub(r"\.linear\.(weight|bias)$", r".l.\1", key)
        key = key.replace(".bn.", ".bn.")
        if (".qkvs." in key or ".pw1." in key) and key.endswith(".c.weight"):
            value = value.flatten(1)  # (out, in, 1, 1) -> (out, in)
        out[key] = value
        if key.endswith("attention_biases"):
            side = int(value.shape[1] ** 0.5)
            pts = [(i, j) for i in range(side) for j in range(side)]
            offs, idxs = {}, []
            for p in pts:
                for q in pts:
                    idxs.append(offs.setdefault((abs(p[0] - q[0]), abs(p[1] - q[1])), len(offs)))
            out[key.replace("attention_biases", "attention_bias_idxs")] = torch.tensor(idxs).view(len(pts), -1)
    return out


@pytest.mark.parametrize("name", cgavit.list_models())
def test_equivalent_to_timm_at_224(name):
    ref, ours = _timm_pair(name)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_equivalent_to_timm_at_other_build_and_input_sizes():
    ref, ours = _timm_pair("efficientvit_m2", size=288)
    with torch.no_grad():
        # build size, then a larger non-square input whose maps are never smaller than a window
        # (where a map is smaller, timm pads it with zero tokens; cgavit attends to the real ones)
        for shape in [(1, 3, 288, 288), (1, 3, 448, 320)]:
            x = torch.randn(shape)
            torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_a_new_model_starts_with_the_batchnorm_scales_of_the_official_code():
    """Training from scratch starts where the official code (and timm's port) start: every residual branch of a
    sandwich block ends in a BatchNorm scaled 0, but the depthwise convolutions of the subsample blocks are scaled
    1 (cgavit started those 0 too, so the four branches began as identities)."""
    from cgavit.model import to_timm_state_dict

    ours = to_timm_state_dict(cgavit.create_model("efficientvit_m0").state_dict())
    ref = timm.create_model("efficientvit_m0").state_dict()
    scales = [k for k in ref if k.endswith("bn.weight")]
    assert len(scales) > 40 and all(k in ours for k in scales)
    differ = [k for k in scales if not torch.equal(ours[k], ref[k])]
    assert not differ, differ
    assert {float(ref[k].unique()) for k in scales} == {0.0, 1.0}


def test_official_release_file_loads_and_matches(tmp_path):
    ref = randomize_(timm.create_model("efficientvit_m1"), 3).eval()
    path = tmp_path / "efficientvit_m1.pth"
    sd = _official_state_dict(ref.state_dict())
    assert any(v.ndim == 2 and ".qkvs." in k for k, v in sd.items())
    torch.save({"model": sd}, path)
    ours = cgavit.create_model("efficientvit_m1", checkpoint_path=path).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_pretrained_download_through_local_http_server(tmp_path, monkeypatch):
    served = tmp_path / "served"
    served.mkdir()
    ref = randomize_(timm.create_model("efficientvit_m0"), 5).eval()
    torch.save({"model": _official_state_dict(ref.state_dict())}, served / "efficientvit_m0.pth")
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
        monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"http://127.0.0.1:{server.server_address[1]}/")
        model = cgavit.create_model("efficientvit_m0", pretrained=True).eval()
    finally:
        server.shutdown()
    cached = tmp_path / "hub" / "hub" / "checkpoints" / "efficientvit_m0.pth"
    assert cached.is_file()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    # the second call uses the cache (the server is gone)
    cgavit.create_model("efficientvit_m0", pretrained=True)


def test_download_failure_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", "http://127.0.0.1:9/")  # discard port: refused
    with pytest.raises(CheckpointError, match="checkpoint_path"):
        cgavit.create_model("efficientvit_m0", pretrained=True)


class _Payload:
    """An object that pickle would reconstruct: exactly what a safe loader must refuse."""


def test_unsafe_pickle_is_refused_and_opt_in_works(tmp_path):
    model = cgavit.create_model("efficientvit_m0")
    path = tmp_path / "unsafe.pth"
    torch.save({"model": model.state_dict(), "extra": _Payload()}, path)
    with pytest.raises(CheckpointError, match="trust=True"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), path)
    load_checkpoint(cgavit.create_model("efficientvit_m0"), path, trust=True)


def test_trust_is_never_taken_by_position_as_timms_use_ema_is(tmp_path):
    """timm's load_checkpoint(model, path, True) means use_ema=True; here the same call was trust=True, and
    unpickled the file's objects (running any code in it) for a caller who asked for EMA weights."""
    path = tmp_path / "unsafe.pth"
    torch.save({"model": cgavit.create_model("efficientvit_m0").state_dict(), "extra": _Payload()}, path)
    for positional in ((True,), (False, True)):
        with pytest.raises(TypeError, match="positional argument"):
            load_checkpoint(cgavit.create_model("efficientvit_m0"), path, *positional)


def test_use_ema_is_taken_by_keyword_as_timm_names_it(tmp_path):
    """timm's load_checkpoint(model, path, use_ema=True) (load_model's name too) was a TypeError; it is prefer_ema by
    that name: the EMA weights are loaded, and a contradicting prefer_ema is refused."""
    ema, plain = (randomize_(cgavit.create_model("efficientvit_m0"), seed) for seed in (1, 2))
    torch.save({"model": plain.state_dict(), "model_ema": ema.state_dict()}, tmp_path / "both.pth")
    for use_ema, want in ((True, ema), (False, plain)):
        model = cgavit.create_model("efficientvit_m0")
        load_checkpoint(model, tmp_path / "both.pth", use_ema=use_ema)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))
    with pytest.raises(ValueError, match="prefer_ema=True and use_ema=False ask for both weights"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), tmp_path / "both.pth", prefer_ema=True, use_ema=False)
    with pytest.raises(TypeError, match="use_ema"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), tmp_path / "both.pth", use_ema="yes")


def test_strict_false_loads_what_fits_as_timm_does_and_says_what_it_left(caplog):
    """timm's load_checkpoint(model, path, strict=False) was a TypeError here. It now loads what fits: a tensor the
    model has no name for is left out, one the file lacks is left as initialised, both warned of and returned; a
    shape mismatch is refused all the same, and so is a file none of whose tensors fits (timm loads nothing)."""
    source = randomize_(cgavit.create_model("efficientvit_m0", num_classes=10), 0)
    sd = {k: v for k, v in source.state_dict().items() if not k.startswith("stages.2.blocks.0.")}
    sd["neck.weight"] = torch.ones(3)
    model = cgavit.create_model("efficientvit_m0", num_classes=10)
    with pytest.raises(CheckpointError, match="'neck.weight'.*strict=False"):
        load_checkpoint(model, sd)
    with caplog.at_level(logging.WARNING, logger="cgavit.loading"):
        report = load_checkpoint(model, sd, strict=False)
    assert report["unexpected"] == ["neck.weight"]
    assert report["missing"] and all(k.startswith("stages.2.blocks.0.") for k in report["missing"])
    assert "1 of its tensors have no name in the model" in caplog.text and "left as initialised (strict=False)" in caplog.text
    loaded = model.state_dict()
    assert torch.equal(loaded["stages.1.blocks.0.pre.0.m.conv.weight"], sd["stages.1.blocks.0.pre.0.m.conv.weight"])
    with pytest.raises(CheckpointError, match="shape mismatch at 'stages.0.blocks.0.pre.0.m.conv.weight'"):
        load_checkpoint(model, dict(sd, **{"stages.0.blocks.0.pre.0.m.conv.weight": torch.zeros(1)}), strict=False)
    with pytest.raises(CheckpointError, match="none of its .* tensors has a name the model has"):
        load_checkpoint(model, {"backbone." + k: v for k, v in sd.items()}, strict=False)
    with pytest.raises(TypeError, match="strict must be True or False"):
        load_checkpoint(model, sd, strict="no")


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_file_of_a_newer_pickle_protocol_is_not_said_to_hold_code(tmp_path, protocol):
    """torch's safe loader reads pickle protocol 2 and 3 only: a plain state dict saved with protocol 4 or 5 was
    refused as "holds pickled Python objects that could run code", which it does not hold."""
    model = cgavit.create_model("efficientvit_m0")
    path = tmp_path / "newer.pth"
    torch.save({"model": model.state_dict()}, path, pickle_protocol=protocol)
    with pytest.raises(CheckpointError, match="was written with a pickle instruction .* that torch's safe loader does "
                                              "not read, so it could not be checked for code .*trust=True") as caught:
        load_checkpoint(cgavit.create_model("efficientvit_m0"), path)
    assert "could run code" not in str(caught.value)
    load_checkpoint(cgavit.create_model("efficientvit_m0"), path, trust=True)


def test_truncated_files_are_refused(tmp_path):
    model = cgavit.create_model("efficientvit_m0")
    for name, save in [("w.pth", lambda p: torch.save(model.state_dict(), p)), ("w.safetensors", lambda p: save_weights(model, p))]:
        path = tmp_path / name
        save(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match="truncated"):
            load_checkpoint(cgavit.create_model("efficientvit_m0"), path)


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.pth"
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), path)
    torch.save({"epoch": 3, "name": "x"}, tmp_path / "dict.pth")
    with pytest.raises(CheckpointError, match="no state dict"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), tmp_path / "dict.pth")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(cgavit.create_model("efficientvit_m0"), tmp_path / "missing.pth")


def test_other_variant_names_first_mismatched_key_and_shapes(tmp_path):
    path = tmp_path / "m1.pth"
    torch.save({"model": cgavit.create_model("efficientvit_m1").state_dict()}, path)
    target = cgavit.create_model("efficientvit_m0")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"shape mismatch at 'patch_embed.conv1.conv.weight': checkpoint \(16, 3, 3, 3\), model \(8, 3, 3, 3\)"):
        load_checkpoint(target, path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing copied


def test_other_class_count_drops_classifier(tmp_path, caplog):
    src = randomize_(cgavit.create_model("efficientvit_m0"))
    path = save_weights(src, tmp_path / "w.safetensors")
    with caplog.at_level(logging.INFO, logger="cgavit.loading"):
        model = cgavit.create_model("efficientvit_m0", checkpoint_path=path, num_classes=10)
    assert "classifier left as initialised" in caplog.text
    assert model.head.linear.weight.shape == (10, 192)
    torch.testing.assert_close(model.stages[2].blocks[0].mixer.m.attn.attention_biases,
                               src.stages[2].blocks[0].mixer.m.attn.attention_biases)


def test_own_format_roundtrip_and_wrappers(tmp_path):
    src = randomize_(cgavit.create_model("efficientvit_m0", distillation=True)).eval()
    x = torch.randn(1, 3, 224, 224)
    st = save_weights(src, tmp_path / "w.safetensors", {"classes": "a,b"})
    meta = read_metadata(st)
    assert meta["format"] == "cgavit" and meta["classes"] == "a,b" and '"embed_dim"' in meta["config"]
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}, "epoch": 1}, tmp_path / "ddp.pt")
    torch.save({"model_ema": src.state_dict(), "model": src.state_dict()}, tmp_path / "ema.pt")
    with torch.no_grad():
        for f in ("w.safetensors", "ddp.pt", "ema.pt"):
            model = cgavit.create_model("efficientvit_m0", distillation=True, checkpoint_path=tmp_path / f).eval()
            torch.testing.assert_close(model(x), src(x))
    # a checkpoint with a distillation head loads into a model without one (and vice versa)
    plain = cgavit.create_model("efficientvit_m0", checkpoint_path=st)
    assert plain.head_dist is None


def test_timm_state_dict_file_at_another_window_resizes_bias(tmp_path):
    # a 224-built checkpoint (last-stage window 4) into a model built at 512 (windows 7): tables resized
    ref = timm.create_model("efficientvit_m0")
    path = tmp_path / "timm.pth"
    torch.save(ref.state_dict(), path)
    model = cgavit.create_model("efficientvit_m0", img_size=512)
    report = load_checkpoint(model, path)
    assert report["resized"] and all(".stages.2." in f".{k}" for k in report["resized"])
    assert model.stages[2].blocks[0].mixer.m.attn.attention_biases.shape == (4, 49)


def test_atomic_write_keeps_the_usual_file_mode(tmp_path):
    import os

    from cgavit.io import atomic_write

    path = atomic_write(tmp_path / "f.txt", lambda tmp: open(tmp, "w").write("x"))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary file left behind


def test_written_files_reach_the_disk_before_they_replace_the_old_ones(tmp_path, monkeypatch):
    """A power cut after a rename but before the data is flushed can leave an empty file as the only copy: the
    new contents are flushed before the rename, and the folder's entry after it, for one file and for a set."""
    import os

    import cgavit.io as cio

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(cio.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                      real_fsync(fd))[1])
    monkeypatch.setattr(cio.os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))),
                                                          real_replace(a, b))[1])
    (tmp_path / "old.txt").write_text("old")
    cio.atomic_write(tmp_path / "old.txt", lambda tmp: Path(tmp).write_text("new"))
    tmp = events[1][1]
    assert events == [("fsync", tmp), ("replace", tmp, str(tmp_path / "old.txt")), ("fsync", str(tmp_path))]
    assert (tmp_path / "old.txt").read_text() == "new"

    events.clear()
    with cio.staging(tmp_path / "a.bin") as folder:
        for name in ("a.bin", "a.xml"):
            (folder / name).write_text(name)
        cio.replace_together([(folder / "a.bin", tmp_path / "a.bin"), (folder / "a.xml", tmp_path / "a.xml")])
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "fsync", "replace", "replace", "fsync"]
    assert {e[1] for e in events[:2]} == {str(folder / "a.bin"), str(folder / "a.xml")}
    assert events[-1][1] == str(tmp_path)


def test_an_exported_model_given_as_weights_is_named_as_such(tmp_path):
    """An .onnx or OpenVINO .xml handed to a weights reader (cgavit quantize --checkpoint q/int8.xml) is named as
    an exported model, with what to give instead; other unknown bytes get the generic line."""
    for name in ("int8.onnx", "int8.xml"):
        (tmp_path / name).write_bytes(b"\x08\x07not weights")
        with pytest.raises(CheckpointError, match="is an exported model, not weights: give the checkpoint"):
            cgavit.load_model(tmp_path / name)
    (tmp_path / "w.pth").write_bytes(b"\x08\x07not weights")
    with pytest.raises(CheckpointError, match="neither safetensors nor a PyTorch checkpoint"):
        cgavit.load_model(tmp_path / "w.pth")


@pytest.mark.parametrize("build", [dict(distillation=True, num_classes=5), dict(img_size=(160, 64)),
                                   dict(in_chans=1, num_classes=4)], ids=["distilled", "non-square", "one-channel"])
def test_saved_weights_load_back_as_the_same_network(tmp_path, build):
    """save_weights left out the distillation head (reloaded without it, outputs changed entirely), a non-square
    size (rebuilt square, bias tables resized: 1.4 % off) and the input channels (a 1-channel file was refused)."""
    src = randomize_(cgavit.create_model("m0", **build), 2).eval()
    model, info = cgavit.load_model(save_weights(src, tmp_path / "w.safetensors"))
    assert (model.distillation, tuple(model.img_size), model.in_chans) == (src.distillation, tuple(src.img_size), src.in_chans)
    x = torch.randn(2, src.in_chans, *src.img_size)
    with torch.no_grad():
        assert torch.equal(model(x), src(x))


def test_what_cannot_be_loaded_back_is_not_saved(tmp_path):
    """A fused model saved fine and was refused on load ("key 'head.bias' ... another architecture?"); a model
    built for a size a file may not record was made."""
    with pytest.raises(ValueError, match="fused model"):
        save_weights(cgavit.fuse(cgavit.create_model("m0")), tmp_path / "f.safetensors")
    fused = cgavit.fuse(cgavit.create_model("m0"))
    fused.reset_classifier(10)  # a new head brings a BatchNorm back, which was taken for "not fused"
    with pytest.raises(ValueError, match="fused model"):
        save_weights(fused, tmp_path / "f.safetensors")
    assert not (tmp_path / "f.safetensors").exists()
    with pytest.raises(ValueError, match="img_size must be <= 4096"):
        cgavit.create_model("m0", img_size=4100)



def test_a_fused_models_state_dict_is_named_as_such_when_loaded(tmp_path):
    """torch.save(cgavit.fuse(model).state_dict()) loaded back was refused as "another architecture?", naming its
    first conv, which sent the user looking for a wrong variant or dial."""
    path = tmp_path / "fused.pth"
    torch.save(cgavit.fuse(cgavit.create_model("m0", img_size=64)).state_dict(), path)
    with pytest.raises(CheckpointError, match=r"holds a fused model's tensors .*save the model before fusing it"):
        cgavit.create_model("m0", img_size=64, checkpoint_path=path)

def test_load_checkpoint_takes_what_torch_load_returns():
    """A file's {"model": ...} or DDP-prefixed dict loaded from disk, but the same dict in memory was refused."""
    src = randomize_(cgavit.create_model("m0"), 3).eval()
    sd = src.state_dict()
    x = torch.randn(1, 3, 96, 96)
    for held in ({"model": sd}, {"state_dict": {f"module.{k}": v for k, v in sd.items()}}, sd):
        model = cgavit.create_model("m0").eval()
        load_checkpoint(model, held)
        with torch.no_grad():
            assert torch.equal(model(x), src(x))


def test_a_download_that_is_no_weights_file_is_not_cached(tmp_path, monkeypatch):
    """A download cut short (or an error page) was cached, and every later call failed on it for good."""
    served = tmp_path / "served"
    served.mkdir()
    good = tmp_path / "good.pth"
    torch.save({"model": _official_state_dict(randomize_(timm.create_model("efficientvit_m0"), 5).state_dict())}, good)
    (served / "efficientvit_m0.pth").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path / "hub" / "hub" / "checkpoints"
    try:
        monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
        monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"http://127.0.0.1:{server.server_address[1]}/")
        with pytest.raises(CheckpointError, match="is not a weights file .*nothing was cached"):
            cgavit.create_model("efficientvit_m0", pretrained=True)
        assert not any(cache.iterdir())
        (served / "efficientvit_m0.pth").write_bytes(good.read_bytes())  # the server works again
        cgavit.create_model("efficientvit_m0", pretrained=True)
    finally:
        server.shutdown()
    assert (cache / "efficientvit_m0.pth").read_bytes() == good.read_bytes()
    (cache / "efficientvit_m0.pth").write_bytes(b"damaged since")  # a cache gone bad says how to mend it
    with pytest.raises(CheckpointError, match="delete .*efficientvit_m0.pth to download it again"):
        cgavit.create_model("efficientvit_m0", pretrained=True)


@pytest.fixture
def published(tmp_path, monkeypatch):
    """A release file of efficientvit_m0 (official names, a distillation head too) behind a file:// mirror,
    and an empty torch hub cache; returns the model the file was made from."""
    ref = randomize_(cgavit.create_model("efficientvit_m0", distillation=True), 4).eval()
    (tmp_path / "mirror").mkdir()
    torch.save({"model": ref.state_dict()}, tmp_path / "mirror" / "efficientvit_m0.pth")
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", (tmp_path / "mirror").as_uri())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
    return ref


def test_a_model_without_classifier_takes_pretrained_weights(published, tmp_path, caplog):
    """D5: num_classes=0 (timm's feature extractor) kept the classifier's BatchNorm and failed, saying to delete a
    good file."""
    x = torch.randn(1, 3, 96, 96)
    with caplog.at_level(logging.INFO, logger="cgavit.loading"):
        model = cgavit.create_model("efficientvit_m0", pretrained=True, num_classes=0).eval()
    assert "checkpoint classifier (1000 classes) dropped: the model has none (num_classes=0)" in caplog.text
    file = tmp_path / "mirror" / "efficientvit_m0.pth"
    headless = cgavit.create_model("efficientvit_m0", num_classes=0).eval()
    report = load_checkpoint(headless, file)
    assert {"head.bn.weight", "head.linear.weight", "head_dist.bn.weight"} <= set(report["skipped"])
    with torch.no_grad():
        want = published.forward_head(published.forward_features(x), pre_logits=True)
        assert torch.equal(model(x), want) and torch.equal(headless(x), want)


def test_arguments_that_refuse_pretrained_weights_are_named(published):
    """D6: a mismatch the caller's arguments caused said to delete the (good) cached file."""
    with pytest.raises(CheckpointError, match="cascade=False, group_split=False cannot") as info:
        cgavit.create_model("efficientvit_m0", pretrained=True, cascade=False, group_split=False)
    assert "delete" not in str(info.value)


def test_pretrained_weights_adapt_the_first_convolution_to_other_channel_counts(published, caplog):
    """timm adapts the RGB stem for in_chans != 3; cgavit refused. One channel sums the filters: exactly the RGB
    model fed the grey image on all three channels."""
    grey = torch.randn(2, 1, 64, 64)
    with caplog.at_level(logging.INFO, logger="cgavit.loading"):
        one = cgavit.create_model("efficientvit_m0", pretrained=True, in_chans=1, distillation=True).eval()
    assert "first convolution adapted from 3 input channels to 1" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(one(grey), published(grey.repeat(1, 3, 1, 1)), rtol=0, atol=1e-5)
    rgb = published.patch_embed.conv1.conv.weight
    four = cgavit.create_model("efficientvit_m0", pretrained=True, in_chans=4).patch_embed.conv1.conv.weight
    assert torch.equal(four, torch.cat([rgb, rgb[:, :1]], dim=1) * 0.75)


def test_a_compiled_models_state_dict_loads(tmp_path):
    """torch.compile's wrapper names every tensor ``_orig_mod.…`` (``_orig_mod.module.…`` around DDP): such a state
    dict, in memory or saved, was refused as "another architecture" by create_model, load_checkpoint and load_model."""
    src = randomize_(cgavit.create_model("m0", num_classes=5), 4).eval()
    compiled = {f"_orig_mod.{k}": v for k, v in src.state_dict().items()}  # torch.compile(src).state_dict()
    both = {f"_orig_mod.module.{k}": v for k, v in src.state_dict().items()}
    torch.save({"model": compiled}, tmp_path / "compiled.pth")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for held in (compiled, both, tmp_path / "compiled.pth"):
            model = cgavit.create_model("m0", num_classes=5, checkpoint_path=held).eval()
            assert torch.equal(model(x), src(x))
        assert torch.equal(cgavit.load_model(tmp_path / "compiled.pth", "m0")[0](x), src(x))


def test_saving_weights_to_a_full_disk_is_one_clear_error_and_keeps_the_old_file(mount_tmpfs):
    """safetensors reports a full disk as its own SafetensorError, which atomic_write let through: a traceback in
    place of "the disk is full ...; free some space"."""
    disk = mount_tmpfs(size="12m")  # room for one M0 file (about 9 MB), not for a second one beside it
    old = cgavit.create_model("m0", num_classes=3)
    save_weights(old, disk / "w.safetensors")
    with pytest.raises(WriteError, match=r"the disk is full .*free some space") as info:
        save_weights(cgavit.create_model("m0", num_classes=4), disk / "w.safetensors")
    assert info.value.errno == errno.ENOSPC
    assert [p.name for p in disk.iterdir()] == ["w.safetensors"]
    assert cgavit.load_model(disk / "w.safetensors")[0].num_classes == 3


def test_detection_body_takes_what_torch_load_returns_and_names_the_file(tmp_path):
    """D11: {"model": sd} passed as a mapping was refused at 'head.bn.weight'; a mismatch said 'state dict'."""
    pytest.importorskip("torchvision")
    from cgavit.detection.backbone import detection_body

    sd = randomize_(cgavit.create_model("efficientvit_m0"), 2).state_dict()
    torch.save({"model": sd}, tmp_path / "w.pth")
    x = torch.randn(1, 3, 64, 64)
    bodies = [detection_body("efficientvit_m0", held) for held in
              ({"model": sd}, {"state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "w.pth")]
    with torch.no_grad():
        assert torch.equal(bodies[0].forward_features(x), bodies[2].forward_features(x))
        assert torch.equal(bodies[1].forward_features(x), bodies[2].forward_features(x))
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "w.pth")) + ": shape mismatch"):
        detection_body("efficientvit_m0", tmp_path / "w.pth", key_dim=8)


def test_a_damaged_cached_backbone_says_which_file_to_delete(published, tmp_path):
    """D16: --pretrained-backbone imagenet read a damaged cached file without saying it is the cache to delete."""
    pytest.importorskip("torchvision")
    from cgavit.detection.backbone import detection_body

    cache = tmp_path / "hub" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    (cache / "efficientvit_m0.pth").write_bytes((tmp_path / "mirror" / "efficientvit_m0.pth").read_bytes()[:300_000])
    with pytest.raises(CheckpointError, match=re.escape(f"delete {cache / 'efficientvit_m0.pth'} to download it again")):
        detection_body("efficientvit_m0", "imagenet")
    (cache / "efficientvit_m0.pth").unlink()
    detection_body("efficientvit_m0", "imagenet")


@pytest.mark.parametrize("pretrained", ["False", "weights.safetensors", 1, None])
def test_pretrained_takes_a_bool_only(pretrained):
    """A path or the string "False" was truthy: it fetched (and would have loaded) the published weights."""
    with pytest.raises(TypeError, match="pretrained must be True or False.*give checkpoint_path="):
        cgavit.create_model("efficientvit_m0", pretrained=pretrained)


def test_a_record_does_not_change_the_network_saved(tmp_path):
    from cgavit.schema import WeightsMeta

    x = torch.randn(2, 3, 96, 96)
    for model, record in (  # a record written for the variant, and one giving the size images are fed at
        (cgavit.create_model("efficientvit_m0", cascade=False, num_classes=4, img_size=96),
         WeightsMeta(model="efficientvit_m0", config=cgavit.VARIANTS["efficientvit_m0"].cfg, num_classes=4, img_size=96)),
        (cgavit.create_model("efficientvit_m0", num_classes=4, img_size=512),
         WeightsMeta(model="efficientvit_m0", config=cgavit.VARIANTS["efficientvit_m0"].cfg, num_classes=4, img_size=224)),
    ):
        model = randomize_(model, 1).eval()
        save_weights(model, tmp_path / "w.safetensors", record)
        loaded, info = cgavit.load_model(tmp_path / "w.safetensors")
        assert loaded.cfg == model.cfg and loaded.img_size == model.img_size and info.img_size == record.img_size
        with torch.no_grad():
            assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match="names 2 classes and the model has 4"):
        save_weights(model, tmp_path / "w2.safetensors", WeightsMeta(model=None, config=model.cfg, num_classes=4,
                                                                     class_names=("a", "b")))
    assert not (tmp_path / "w2.safetensors").exists()


def test_saved_weights_keep_the_variant_name(tmp_path, caplog):
    model = cgavit.create_model("efficientvit_m2", num_classes=3, img_size=64)
    save_weights(model, tmp_path / "m2.safetensors")
    loaded, _ = cgavit.load_model(tmp_path / "m2.safetensors")
    assert loaded.pretrained_cfg["architecture"] == "efficientvit_m2"
    save_weights(model, tmp_path / "unnamed.safetensors", {"note": "no name"})
    raw = dict(read_metadata(tmp_path / "unnamed.safetensors"))
    del raw["model"]  # a file from before names were recorded
    from safetensors.torch import load_file, save_file

    save_file(load_file(tmp_path / "unnamed.safetensors"), tmp_path / "unnamed.safetensors", metadata=raw)
    with caplog.at_level(logging.WARNING):
        loaded, _ = cgavit.load_model(tmp_path / "unnamed.safetensors", "efficientvit_m0")
    assert loaded.cfg == model.cfg and "not efficientvit_m0's" in caplog.text


@pytest.mark.parametrize("kw", [{"num_classes": 0}, {"in_chans": 1, "num_classes": 5}])
def test_a_plain_state_dict_without_head_or_with_other_channels_loads(tmp_path, kw):
    model = randomize_(cgavit.create_model("efficientvit_m0", img_size=64, **kw), 2).eval()
    torch.save(model.state_dict(), tmp_path / "sd.pth")
    loaded, _ = cgavit.load_model(tmp_path / "sd.pth", "efficientvit_m0", img_size=64)  # its build size: no resizing
    x = torch.randn(2, kw.get("in_chans", 3), 64, 64)
    with torch.no_grad():
        assert loaded.num_classes == model.num_classes and torch.allclose(loaded(x), model(x), atol=1e-6)


def test_a_dropped_distillation_head_is_said(tmp_path, caplog):
    distilled = cgavit.create_model("efficientvit_m0", num_classes=3, img_size=64, distillation=True)
    plain = cgavit.create_model("efficientvit_m0", num_classes=3, img_size=64)
    with caplog.at_level(logging.WARNING):
        load_checkpoint(plain, distilled.state_dict())
    assert "distillation head" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # fine-tuning (cgavit train --finetune) retrains the heads: nothing to warn
        load_checkpoint(plain, distilled.state_dict(), expect_dropped_heads=True)
    assert "distillation head" not in caplog.text
    with caplog.at_level(logging.WARNING):  # a new classifier: nothing of the file's network is kept to warn about
        load_checkpoint(cgavit.create_model("efficientvit_m0", num_classes=5, img_size=64), distilled.state_dict())
    assert "distillation head" not in caplog.text


def test_argument_types_are_named(tmp_path):
    with pytest.raises(TypeError, match="checkpoint_path must be a file path"):
        cgavit.create_model("efficientvit_m0", checkpoint_path=5)
    torch.save(cgavit.create_model("efficientvit_m0", img_size=64).state_dict(), tmp_path / "sd.pth")
    with pytest.raises(TypeError, match="dials must be a mapping"):
        cgavit.load_model(tmp_path / "sd.pth", "efficientvit_m0", ["cascade"])


def test_values_a_pickle_nests_without_end_are_refused_in_a_line():
    """A .pt of 9 MB hung predict (and took memory without bound): its 'format' was 40 tuples, each holding the one
    below twice, whose repr is 2**40 items long; values nested 200,000 deep, or 50,000 dicts each wrapping the next
    under 'model', raised RecursionError."""
    from cgavit.schema import is_training_checkpoint, shown
    from cgavit.weights import unwrap_state_dict

    tower, deep = [], []
    for _ in range(40):
        tower = (tower, tower)
    for _ in range(200_000):
        deep = [deep]
    assert len(shown(tower)) <= 80 and len(shown(deep)) <= 80 and shown("a\x1b[31m") == "'a\\x1b[31m'"
    assert not is_training_checkpoint({"format": tower}) and not is_training_checkpoint({"format": deep})
    chain = cgavit.create_model("m0", num_classes=2, embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2)).state_dict()
    for _ in range(3):
        chain = {"model": chain}
    assert set(unwrap_state_dict(chain)) == set(cgavit.create_model(
        "m0", num_classes=2, embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2)).state_dict())
    for _ in range(50_000):
        chain = {"model": chain}
    with pytest.raises(CheckpointError, match="nests more than 8 wrapping dicts"):
        unwrap_state_dict(chain, "f.pt")


def test_float8_weights_are_checked_for_nan_as_others():
    """float8 tensors raised NotImplementedError ("isfinite" not implemented for 'Float8_e4m3fn') in the NaN check."""
    small = dict(num_classes=2, embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))
    sd = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
          for k, v in randomize_(cgavit.create_model("m0", **small), 1).state_dict().items()}
    model = cgavit.create_model("m0", **small)
    load_checkpoint(model, sd)
    assert torch.equal(model.head.linear.weight, sd["head.linear.weight"].float())
    sd["head.linear.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN/inf"):
        load_checkpoint(cgavit.create_model("m0", **small), sd)


def test_a_file_recording_a_distillation_head_it_does_not_hold_is_refused(tmp_path):
    """A file whose metadata said distillation=True without head_dist tensors loaded with a head of random weights
    averaged into every logit (other logits on each load), and the note about it reached no one."""
    from safetensors.torch import load_file, save_file

    small = dict(num_classes=3, embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))
    model = randomize_(cgavit.create_model("m0", distillation=True, **small), 2)
    path = save_weights(model, tmp_path / "whole.safetensors")
    assert cgavit.load_model(path)[0].head_dist is not None
    cut = {k: v for k, v in load_file(path).items() if not k.startswith("head_dist.")}
    save_file(cut, tmp_path / "cut.safetensors", metadata=read_metadata(path))
    with pytest.raises(CheckpointError, match="records a distillation head but holds no head_dist tensors"):
        cgavit.load_model(tmp_path / "cut.safetensors")


def test_predict_and_eval_name_a_model_without_a_classifier(tmp_path, capsys):
    """cgavit predict on a saved feature extractor (num_classes=0) crashed with IndexError."""
    from PIL import Image

    from cgavit.cli import main

    small = dict(embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))
    path = save_weights(cgavit.create_model("m0", num_classes=0, **small), tmp_path / "features.safetensors")
    Image.new("RGB", (40, 40), (120, 30, 200)).save(tmp_path / "x.png")
    assert main(["predict", str(tmp_path / "x.png"), "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert "has no classifier (num_classes 0: a feature extractor)" in err and len(err.strip().splitlines()) == 1, err


def test_switches_that_run_code_or_change_weights_take_true_or_false_only(tmp_path):
    """trust="no" (a setting read as text) unpickled arbitrary objects; use_ema="no" took the EMA weights; a file with
    pretrained=True loaded the file and silently not the published weights."""
    model = cgavit.create_model("efficientvit_m0", num_classes=3)
    torch.save({"model": model.state_dict(), "note": object.__new__(WrappedNote)}, tmp_path / "pickled.pt")
    calls = [lambda v: cgavit.load_model(tmp_path / "pickled.pt", "efficientvit_m0", trust=v),
             lambda v: load_checkpoint(model, tmp_path / "pickled.pt", trust=v),
             lambda v: cgavit.weights.read_weights_file(tmp_path / "pickled.pt", trust=v),
             lambda v: cgavit.load_model(tmp_path / "pickled.pt", "efficientvit_m0", use_ema=v),
             lambda v: load_checkpoint(model, tmp_path / "pickled.pt", prefer_ema=v)]
    for call in calls:
        for value in ("no", "False", 0, None):
            with pytest.raises(TypeError, match=r"must be True or False, got"):
                call(value)
    with pytest.raises(ValueError, match="not both"):
        cgavit.load_model(tmp_path / "pickled.pt", "efficientvit_m0", pretrained=True)


class WrappedNote:
    """A class the weights-only loader refuses: what only trust=True may unpickle."""


def test_inference_builds_the_network_for_the_size_asked(trained_digits):
    """predict/eval --img-size kept the network built for the recorded size, where load_model(img_size=) rebuilds it:
    the command line and the API ran different networks at the same size."""
    from cgavit.train.inference import open_for_inference

    model, info, _ = open_for_inference(trained_digits.checkpoint, img_size=128)
    built, _ = cgavit.load_model(trained_digits.checkpoint, img_size=128)
    windows = [[s.blocks[0].mixer.m.window for s in m.stages] for m in (model, built)]
    assert windows[0] == windows[1] != [s.blocks[0].mixer.m.window for s in trained_digits.model.stages]
    assert info.img_size == 128  # the size it is built for, as load_model(img_size=) gives it


def test_load_model_at_another_size_gives_that_size_to_feed_and_to_export(tmp_path):
    """load_model(path, img_size=N) built the network for N but its ModelInfo kept the file's size: images read
    by it, and an export at info.img_size, were of the training size, not the one the model was built for."""
    from cgavit.deploy import export_model, open_exported
    from cgavit.weights import WeightsMeta

    saved = cgavit.create_model("efficientvit_m0", num_classes=3, img_size=64)
    record = WeightsMeta(model="efficientvit_m0", config=saved.cfg, num_classes=3, img_size=64, crop_pct=1.0)
    cgavit.save_weights(saved, tmp_path / "w.safetensors", record)
    assert cgavit.load_model(tmp_path / "w.safetensors")[1].img_size == 64  # the recorded size, none asked for
    model, info = cgavit.load_model(tmp_path / "w.safetensors", img_size=96)
    assert model.img_size == (96, 96) and info.img_size == 96 and info.crop_pct == 1.0
    pytest.importorskip("onnxruntime")
    export_model(model, tmp_path / "w.onnx", "onnx", img_size=info.img_size, info=info)
    assert open_exported(tmp_path / "w.onnx")[1].img_size == (96, 96)


def test_a_record_load_model_would_refuse_is_not_saved(tmp_path):
    """save_weights wrote a one-channel model's per-channel mean (0.5,) and img_size 9999, which load_model, predict
    and eval then refused: "load_model rebuilds exactly what was saved" did not hold."""
    from cgavit.weights import WeightsMeta

    grey = cgavit.create_model("efficientvit_m0", in_chans=1, num_classes=3)
    base = dict(model="efficientvit_m0", config=grey.cfg, num_classes=3, in_chans=1)
    for record, says in ((WeightsMeta(**base, mean=(0.5,), std=(0.25,)), "mean must be a list of 3 numbers"),
                         ({"img_size": "9999"}, "img_size must be in 32..4096")):
        with pytest.raises(ValueError, match=rf"not saved: load_model would refuse this record \({says}"):
            save_weights(grey, tmp_path / "g.safetensors", record)
    assert not list(tmp_path.iterdir())
    with pytest.raises(TypeError, match="save_weights takes the model"):
        save_weights(grey.state_dict(), tmp_path / "g.safetensors")
    save_weights(grey, tmp_path / "g.safetensors", WeightsMeta(**base, mean=(0.5,) * 3, std=(0.25,) * 3))
    assert cgavit.load_model(tmp_path / "g.safetensors")[0].in_chans == 1


def test_a_file_recording_another_cascade_is_refused_by_a_model_built_without_it(tmp_path, caplog):
    """cascade changes no tensor shape: a cascade-off file loaded into a default model gave another network silently."""
    saved = randomize_(cgavit.create_model("efficientvit_m0", cascade=False, img_size=64)).eval()
    path = save_weights(saved, tmp_path / "no-cascade.safetensors")
    with pytest.raises(CheckpointError, match="records cascade=False and the model was built with cascade=True"):
        cgavit.create_model("efficientvit_m0", checkpoint_path=path, img_size=64)
    same = cgavit.create_model("efficientvit_m0", checkpoint_path=path, img_size=64, cascade=False).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(same(x), saved(x))
    windows = save_weights(cgavit.create_model("efficientvit_m0", window_size=3, img_size=64), tmp_path / "w3.safetensors")
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        load_checkpoint(cgavit.create_model("efficientvit_m0", img_size=64), windows)  # tables resized, and said
    assert "window_size=(3, 3, 3) in the file, (7, 7, 7) in the model" in caplog.text


def test_a_file_for_other_input_channels_is_named_as_such(tmp_path):
    path = save_weights(cgavit.create_model("m0", img_size=64), tmp_path / "rgb.safetensors")
    with pytest.raises(CheckpointError, match=r"takes 3 input channels and the model's 1 \(in_chans\): build the model "
                                              r"with in_chans=3"):
        cgavit.create_model("m0", img_size=64, in_chans=1, checkpoint_path=path)


def test_a_training_checkpoint_naming_its_model_as_a_command_takes_it_loads(tmp_path):
    """A run trained with --model EfficientViT-M0 recorded that spelling; load_checkpoint then refused the file as
    'unknown model', and a checkpoint's dict (torch.load of it) was not compared with the model at all."""
    from cgavit.train import TrainConfig
    from cgavit.train import checkpoint as train_checkpoint

    model = cgavit.create_model("m0", num_classes=3, img_size=64, cascade=False)
    cfg = TrainConfig(data=str(tmp_path), model="EfficientViT-M0", img_size=64, dials={"cascade": False})
    path = train_checkpoint.save(tmp_path / "last.pt", {
        "model": model.state_dict(), "model_ema": None, "optimizer": {}, "scheduler": {}, "scaler": None,
        "next_epoch": 1, "next_step": 0, "global_step": 1, "rng": [], "progress": {}, "world_size": 1,
        "args": cfg.to_record(), "classes": ["a", "b", "c"], "saved": "x"})
    load_checkpoint(cgavit.create_model("m0", num_classes=3, img_size=64, cascade=False), path)
    for given in (path, torch.load(path, weights_only=True)):
        with pytest.raises(CheckpointError, match="records cascade=False"):
            load_checkpoint(cgavit.create_model("m0", num_classes=3, img_size=64), given)


def test_a_missing_safetensors_package_is_named_as_such(tmp_path, monkeypatch):
    """Without the package a .safetensors file was called truncated or corrupt before the pip line."""
    import sys

    path = save_weights(cgavit.create_model("m0", img_size=64), tmp_path / "m.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for read in (cgavit.load_model, read_metadata):
        with pytest.raises(CheckpointError, match=r"^reading or writing \.safetensors files needs pip install"):
            read(path)


def test_attention_modules_at_one_window_share_one_index():
    """Each attention module kept its own (window**2, window**2) int64 index (128 MiB at window 64), so a 1.7 MB
    file of many small modules at that window asked for gigabytes when built. One tensor per window and device is
    now shared (it is arithmetic, in no state dict), and stays shared after the model is moved or cast."""
    model = cgavit.create_model("m0", num_classes=3, img_size=64, embed_dim=(16, 16, 16), num_heads=(1, 1, 1),
                                key_dim=4, depth=(3, 3, 3))
    attns = [m for m in model.modules() if hasattr(m, "attention_bias_idxs")]
    assert len(attns) == 9
    for moved in (model, model.to(torch.float64)):
        by_window = {}
        for m in attns:
            by_window.setdefault(m.window, set()).add(m.attention_bias_idxs.data_ptr())
        assert all(len(ptrs) == 1 for ptrs in by_window.values()) and len(by_window) == 3
    with torch.device("meta"):  # a meta build's index stays on the meta device, apart from the real ones
        cgavit.create_model("m0", num_classes=3, img_size=64)
    from cgavit.attention import relative_bias_index

    attn = cgavit.create_model("m0", num_classes=3, img_size=64).stages[2].blocks[0].mixer.m.attn
    assert torch.equal(attn.attention_bias_idxs, relative_bias_index(attn.window, attn.window, attn.window))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_named_without_its_index_shares_the_index_of_the_current_one():
    """``shared_window_index(w, "cuda")`` looked its tensor up under "cuda" and stored it under "cuda:0", so every
    such call made another; and a key "cuda" would go on naming the device that was current when it was made."""
    from cgavit.attention import shared_window_index

    plain = shared_window_index(7, "cuda")
    assert plain.device == torch.device("cuda", torch.cuda.current_device())
    assert shared_window_index(7, "cuda") is plain is shared_window_index(7, plain.device)


def test_state_dicts_torch_would_load_are_loaded_and_damaged_ones_refused(caplog):
    """From a model-core review: a classifier-less file (num_classes=0) into a model with a classifier was
    refused as incomplete, where another class count is fine-tuned from; a state dict without BatchNorm's
    num_batches_tracked, which load_state_dict(strict=True) takes, was refused; a distillation model loaded from a
    file without that head averaged in a head of random weights (3.0 off the file's logits); a negative BatchNorm
    variance made every output NaN; a fused model was told the file was of another architecture."""
    from cgavit.deploy import fuse

    x = torch.randn(2, 3, 64, 64)
    src = randomize_(cgavit.create_model("m0", num_classes=5, img_size=64), seed=1).eval()
    headless = randomize_(cgavit.create_model("m0", num_classes=0, img_size=64), seed=1).eval()
    body = cgavit.create_model("m0", num_classes=10, img_size=64, checkpoint_path=headless.state_dict()).eval()
    with torch.no_grad():
        assert torch.equal(body.forward_features(x), headless.forward_features(x))
    counters = {k: v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    with caplog.at_level(logging.INFO, logger="cgavit.loading"):
        for sd, kwargs in ((counters, {}), (src.state_dict(), {"distillation": True})):
            model = cgavit.create_model("m0", num_classes=5, img_size=64, checkpoint_path=sd, **kwargs).eval()
            with torch.no_grad():
                assert torch.equal(model(x), src(x))
    assert "has no distillation head: the model's starts as a copy of its class head" in caplog.text
    damaged = dict(src.state_dict())
    damaged["stages.1.blocks.0.pre.0.m.bn.running_var"] = -damaged["stages.1.blocks.0.pre.0.m.bn.running_var"]
    with pytest.raises(CheckpointError, match="running_var' holds negative values.*damaged"):
        cgavit.create_model("m0", num_classes=5, img_size=64, checkpoint_path=damaged)
    with pytest.raises(ValueError, match="the model is fused .* load into the model before fusing it"):
        load_checkpoint(fuse(src), src.state_dict())


def test_load_model_checks_the_size_it_is_given_and_same_kernels_are_no_change(tmp_path, caplog):
    """img_size=0 was taken as no size (the recorded one), where -5 or 16 are refused; kernels=5 and the four 5s
    it stands for were reported as a changed dial."""
    from cgavit.variants import VARIANTS

    path = save_weights(cgavit.create_model("m0", num_classes=2, img_size=64), tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="img_size must be >= 32, got 0"):
        cgavit.load_model(path, img_size=0)
    cfg = VARIANTS["efficientvit_m0"].cfg
    assert cfg.with_dials(kernels=5).differs_from(cfg) == [] and cfg.with_dials(kernels=3).differs_from(cfg) == ["kernels"]


def test_a_file_recording_a_classifier_it_does_not_hold_is_refused(tmp_path, caplog):
    """A classifier-less file may load into a model with a classifier (left as initialised, warned about), but a
    file whose record says it has a classifier of 10 classes and holds none of its tensors is incomplete: it loaded
    with a classifier of random weights, and predict guessed (10 % for each class)."""
    from safetensors.torch import load_file, save_file

    from cgavit.weights import read_weights_file

    path = save_weights(randomize_(cgavit.create_model("m0", num_classes=10, img_size=64), seed=1), tmp_path / "m.safetensors")
    stripped = {k: v for k, v in load_file(path).items() if not k.startswith("head.")}
    save_file(stripped, tmp_path / "cut.safetensors", metadata=read_weights_file(path).metadata)
    with pytest.raises(CheckpointError, match="records a classifier of 10 classes but holds no head tensors"):
        cgavit.load_model(tmp_path / "cut.safetensors")
    with caplog.at_level(logging.WARNING, logger="cgavit.loading"):
        cgavit.create_model("m0", num_classes=10, img_size=64, checkpoint_path=stripped)
    assert "holds no classifier (a file saved with num_classes=0?): the model's is left as initialised" in caplog.text


def test_a_features_only_model_is_saved_and_loaded_as_its_network(tmp_path):
    """save_weights wrote a features_only model's tensors under its wrapper's names (``model.stages...``), a file
    load_model and create_model then refused as 'another architecture'; load_checkpoint into one refused a file of
    its own network the same way, and into one without the last stage it blamed the file."""
    from safetensors.torch import load_file

    x = torch.randn(2, 3, 64, 96)
    features = cgavit.create_model("m0", features_only=True, img_size=64)
    randomize_(features.model, seed=3)
    features.eval()
    path = save_weights(features, tmp_path / "backbone.safetensors")
    assert set(load_file(path)) == set(features.model.state_dict())  # the network's names
    again = cgavit.create_model("m0", features_only=True, out_indices=(1, 2), img_size=64, checkpoint_path=path).eval()
    assert all(torch.equal(a, b) for a, b in zip(again(x), features(x)[1:]))
    network, _ = cgavit.load_model(path)
    assert torch.equal(network(x), features(x)[-1])
    into = cgavit.create_model("m0", features_only=True, img_size=64)
    load_checkpoint(into, path)
    assert all(torch.equal(a, b) for a, b in zip(into.eval()(x), features(x)))
    short = cgavit.create_model("m0", features_only=True, out_indices=(0, 1), img_size=64)
    with pytest.raises(ValueError, match=r"pruned to 2 of its 3 stages .* load first: cgavit.create_model"):
        load_checkpoint(short, path)
    with pytest.raises(ValueError, match="pruned to 2 of its 3 stages"):
        save_weights(short, tmp_path / "short.safetensors")
    assert not (tmp_path / "short.safetensors").exists()


@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "compiled_features"])
def test_a_wrapped_model_loads_into_its_network(wrap, tmp_path):
    """load_checkpoint into a torch.compile'd (or DataParallel) model compared the file with the wrapper's names
    (``_orig_mod.stages...``) and refused every file as 'another architecture?'; it now loads into the network
    inside, whose parameters the wrapper computes with. save_weights of a DataParallel model wrote ``module.`` names
    and no architecture, a file load_model could not rebuild."""
    source = randomize_(cgavit.create_model("m0", img_size=64), seed=7).state_dict()
    if wrap == "compiled_features":
        net = cgavit.create_model("m0", features_only=True, img_size=64)
        model, inner = torch.compile(net), net.model
    else:
        inner = cgavit.create_model("m0", img_size=64)
        model = torch.compile(inner) if wrap == "compile" else torch.nn.DataParallel(inner)
    load_checkpoint(model, source)
    loaded = inner.state_dict()
    assert all(torch.equal(loaded[k], source[k]) for k in loaded)
    if wrap == "data_parallel":  # saved by the network's names, with its architecture: load_model rebuilds it
        path = save_weights(model, tmp_path / "dp.safetensors")
        rebuilt, _ = cgavit.load_model(path)
        assert all(torch.equal(v, source[k]) for k, v in rebuilt.state_dict().items())


def test_loading_into_a_model_on_the_meta_device_is_refused():
    """load_checkpoint into a model built on the meta device returned its report as if it had loaded, after torch
    warned once per tensor that the copy was a no-op: the model kept no weights. It is refused saying what to do,
    and the way it names works."""
    source = randomize_(cgavit.create_model("m0", img_size=64), seed=2).state_dict()
    model = cgavit.create_model("m0", img_size=64, device="meta")
    with pytest.raises(ValueError, match=r"meta device.*model.to_empty\(device='cpu'\)"):
        load_checkpoint(model, source)
    load_checkpoint(model.to_empty(device="cpu"), source)
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items())


def test_a_classifier_of_another_class_count_is_warned_about_unless_expected(tmp_path, caplog):
    """create_model(checkpoint_path=) with a fine-tuned 10-class file and num_classes left at 1000 gave a model whose
    classifier was random, said only at INFO (shown by nobody's default logging): every prediction was a guess. It is
    a warning now, naming the cure; fine-tuning from the published weights, and callers that expect it, stay at INFO."""
    path = save_weights(randomize_(cgavit.create_model("m0", num_classes=10, img_size=64), seed=4),
                        tmp_path / "ten.safetensors")
    with caplog.at_level(logging.INFO, logger="cgavit"):
        cgavit.create_model("m0", img_size=64, checkpoint_path=path)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "classifier for another class count" in warned[0] and "load_model" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cgavit"):
        load_checkpoint(cgavit.create_model("m0", img_size=64), path, expect_dropped_heads=True)
        cgavit.create_model("m0", num_classes=0, img_size=64, checkpoint_path=path)
    assert "classifier left as initialised" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
