"""timm's model conventions on cgavit models, so they drop into existing pipelines."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import timm.data
import torch
from timm.layers import resize_rel_pos_bias_table_levit
from timm.models import group_parameters
from timm.optim import create_optimizer_v2, param_groups_layer_decay

import cgavit
from cgavit.attention import CascadedGroupAttention, FusedCascadedGroupAttention
from cgavit.testing import randomize_, rel_err
from cgavit.variants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from cgavit.attention import resize_bias_table

REPO = Path(__file__).resolve().parent.parent
SMALL = dict(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(3, 3))


def test_pretrained_cfg_gives_our_preprocessing_through_timm():
    model = cgavit.create_model("m4", num_classes=10, img_size=256)
    cfg = timm.data.resolve_data_config({}, model=model)
    assert cfg == dict(input_size=(3, 256, 256), interpolation="bicubic", mean=IMAGENET_DEFAULT_MEAN,
                       std=IMAGENET_DEFAULT_STD, crop_pct=0.875, crop_mode="center")
    assert model.pretrained_cfg["architecture"] == "efficientvit_m4" and model.pretrained_cfg["num_classes"] == 10
    t = timm.data.create_transform(**cfg)
    assert "Resize(size=292" in repr(t) and "CenterCrop(size=(256, 256))" in repr(t)  # 256 / 0.875
    model.reset_classifier(3)
    assert model.pretrained_cfg["num_classes"] == 3 and model.get_classifier().out_features == 3
    # timm's older name, read by code written for timm < 0.9, is the same dict (timm's models set both)
    assert model.default_cfg is model.pretrained_cfg
    assert timm.create_model("efficientvit_m0", pretrained=False).default_cfg["mean"] == model.default_cfg["mean"]


def test_a_loaded_model_gives_timm_the_preprocessing_its_file_records(tmp_path):
    """load_model gave the file's mean, std, crop and interpolation in its ModelInfo, but the model's pretrained_cfg
    kept ImageNet's: timm.data.resolve_data_config({}, model=m) then fed the images another normalisation."""
    from cgavit.schema import WeightsMeta

    saved = cgavit.create_model("m0", num_classes=2, img_size=64, **SMALL)
    record = WeightsMeta(model="efficientvit_m0", config=saved.cfg, num_classes=2, img_size=64, crop_pct=1.0,
                         interpolation="bilinear", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    cgavit.save_weights(saved, tmp_path / "w.safetensors", record)
    model, info = cgavit.load_model(tmp_path / "w.safetensors")
    cfg = timm.data.resolve_data_config({}, model=model)
    assert (cfg["mean"], cfg["std"], cfg["crop_pct"], cfg["interpolation"]) == (info.mean, info.std, info.crop_pct,
                                                                                info.interpolation)
    assert cfg["mean"] == (0.5, 0.4, 0.3) and cfg["crop_pct"] == 1.0 and cfg["input_size"] == (3, 64, 64)


def test_pretrained_cfg_overlay_as_timms_create_model_takes_it(tmp_path):
    """timm's create_model(..., pretrained_cfg_overlay=dict(...)) was refused as 'no design dial'. Its preprocessing
    entries now reach timm's data config, checked; its file is where pretrained=True reads the weights (the offline
    idiom), classifier dropped for another count as for the release; what would make it lie about the network, or a
    file without pretrained=True (random weights), is refused in one line."""
    model = cgavit.create_model("m0", features_only=True,
                                pretrained_cfg_overlay=dict(mean=[0.5] * 3, std=(0.25,) * 3, crop_pct=1, interpolation="bilinear"))
    cfg = timm.data.resolve_data_config({}, model=model)
    assert (cfg["mean"], cfg["std"], cfg["crop_pct"], cfg["interpolation"]) == ((0.5,) * 3, (0.25,) * 3, 1.0, "bilinear")
    source = randomize_(cgavit.create_model("m0", **SMALL), 0).eval()
    torch.save({"model": source.state_dict()}, tmp_path / "w.pth")
    model = cgavit.create_model("m0", pretrained=True, pretrained_cfg_overlay=dict(file=tmp_path / "w.pth"), **SMALL)
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(model.eval()(x), source(x))
    model = cgavit.create_model("m0", pretrained=True, num_classes=4, pretrained_cfg_overlay=dict(file=str(tmp_path / "w.pth")), **SMALL)
    assert torch.equal(model.eval().forward_features(x), source.forward_features(x)) and model.num_classes == 4
    for overlay, words in ((dict(file=tmp_path / "w.pth"), "with pretrained=True"), (dict(url="https://x/w.pth"), "file=path"),
                           (dict(num_classes=10), "give num_classes instead"), (dict(input_size=(3, 256, 256)), "img_size"),
                           (dict(mean=(0.5, 0.5)), "1 or 3 numbers"), (dict(std=(0, 1, 1)), "std values must be in"),
                           (dict(crop_pct=87.5), r"crop_pct must be in \[0.2, 1.0\], got 87.5"),
                           (dict(interpolation="lanczos"), "interpolation must be one of"), ("mean=0.5", "must be a dict")):
        with pytest.raises(ValueError, match=words):
            cgavit.create_model("m0", pretrained_cfg_overlay=overlay, **SMALL)


@pytest.mark.parametrize("made", ["create_model", "load_model"])
def test_timms_transform_from_pretrained_cfg_feeds_a_grey_model(made, tmp_path):
    """A model built for 1 input channel kept the three RGB means and stds in its pretrained_cfg, so timm's
    transform, made from it, raised on the grey images it was for (a (1, H, W) tensor against three means)."""
    from PIL import Image

    model = cgavit.create_model("m0", in_chans=1, img_size=64, **SMALL).eval()
    if made == "load_model":
        cgavit.save_weights(model, tmp_path / "grey.safetensors")
        model, _ = cgavit.load_model(tmp_path / "grey.safetensors")
    cfg = timm.data.resolve_data_config({}, model=model)
    assert cfg["mean"] == (pytest.approx(sum(IMAGENET_DEFAULT_MEAN) / 3),)
    assert cfg["std"] == (pytest.approx(sum(IMAGENET_DEFAULT_STD) / 3),)
    grey = Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 90), dtype=np.uint8), "L")
    x = timm.data.create_transform(**cfg)(grey)
    assert tuple(x.shape) == (1, 64, 64)
    assert model(x[None]).shape == (1, 1000)


def test_core_constants_equal_timms():
    assert IMAGENET_DEFAULT_MEAN == timm.data.IMAGENET_DEFAULT_MEAN
    assert IMAGENET_DEFAULT_STD == timm.data.IMAGENET_DEFAULT_STD


def test_group_matcher_drives_timm_layer_decay():
    model = cgavit.create_model("m0")
    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75, no_weight_decay_list=model.no_weight_decay())
    scales = sorted({g["lr_scale"] for g in groups})
    # the same layers as timm's port: stem, then blocks (a stage's subsample joins its first block), head
    port = timm.create_model("efficientvit_m0")
    assert len(scales) == len(group_parameters(port, port.group_matcher())) == 8 and scales[-1] == 1.0
    stem = {id(p) for p in model.patch_embed.parameters()}
    assert all(g["lr_scale"] == scales[0] for g in groups if any(id(p) in stem for p in g["params"]))
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    coarse = model.group_matcher(coarse=True)
    assert coarse["stem"] == r"^patch_embed"
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.025)
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    biases = [p for n, p in model.named_parameters() if n.endswith("attention_biases")]
    assert biases and all(id(p) in no_decay for p in biases)


def test_forward_head_types():
    model = cgavit.create_model("m0", num_classes=5, distillation=True, **SMALL)
    x = torch.randn(2, 3, 64, 64)
    out = model.train()(x)
    assert isinstance(out, tuple) and len(out) == 2 and out[0].shape == (2, 5)
    assert model.eval()(x).shape == (2, 5)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 48)


def test_grad_checkpointing_gives_the_same_gradients_and_statistics():
    torch.manual_seed(0)
    plain = randomize_(cgavit.create_model("m0", num_classes=10, drop_path_rate=0.2)).train()
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x, y = torch.randn(3, 3, 96, 128), torch.randint(0, 10, (3,))
    for net in (plain, ckpt):
        torch.manual_seed(1)  # same drop-path draws
        torch.nn.functional.cross_entropy(net(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), f"{name}: recomputation changed a BatchNorm statistic"
    with torch.no_grad():  # off in inference
        torch.testing.assert_close(ckpt.eval()(x), plain.eval()(x))


def test_grad_checkpointing_compiles_with_the_same_gradients_and_statistics():
    """torch.compile failed on the checkpoint's context_fn (InternalTorchDynamoError)."""
    torch.manual_seed(0)
    plain = randomize_(cgavit.create_model("m0", num_classes=10, img_size=64)).train()
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 64, 64)
    plain(x).sum().backward()
    torch.compile(ckpt, backend="aot_eager")(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(a, b, msg=f"{name}: a statistic counted twice")


_MEASURE = """
import sys, torch, cgavit
torch.set_num_threads(1)
model = cgavit.create_model("m0", num_classes=10).train()
model.set_grad_checkpointing(sys.argv[1] == "1")
model(torch.randn(2, 3, 64, 64)).sum().backward()  # warm the allocator and autograd once
model.zero_grad(set_to_none=True)
x = torch.randn(8, 3, 448, 448)
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current resident size
before = status("VmRSS:")
model(x).sum().backward()
print(status("VmHWM:") - before)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_grad_checkpointing_lowers_peak_training_memory():
    """Peak resident memory of one training step above the memory before it (the kernel's peak counter
    reset just before the step), in a fresh process each; glibc is told to return large blocks to the
    system at once, so resident memory follows live tensors."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO))
    peak = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", _MEASURE, flag], env=env, capture_output=True, text=True, check=True)
        peak[flag] = int(out.stdout.split()[-1])
    assert peak["1"] < 0.75 * peak["0"], peak


def test_hubconf_local_entry_points():
    spec = importlib.util.spec_from_file_location("hubconf", REPO / "hubconf.py")
    hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hub)
    assert hub.dependencies == ["torch"] and all(callable(getattr(hub, f"efficientvit_m{i}")) for i in range(6))
    model = torch.hub.load(str(REPO), "efficientvit_m4", source="local", num_classes=7, img_size=128)
    assert isinstance(model, cgavit.EfficientViT) and model.num_classes == 7 and model.img_size == (128, 128)


def test_fused_attention_is_its_own_class_and_can_be_randomised():
    attn = randomize_(CascadedGroupAttention(32, key_dim=8, num_heads=4, window=5)).eval()
    fused = attn.fuse()
    assert type(fused) is FusedCascadedGroupAttention and not isinstance(fused, CascadedGroupAttention)
    assert not hasattr(fused, "attention_biases") and isinstance(attn.attention_biases, torch.nn.Parameter)
    x = torch.randn(2, 32, 5, 4)
    with torch.no_grad():
        assert rel_err(fused(x), attn(x)) < 1e-5
    model = cgavit.fuse(randomize_(cgavit.create_model("m0", **SMALL)))
    before = [m.bias_full.clone() for m in model.modules() if isinstance(m, FusedCascadedGroupAttention)]
    randomize_(model, seed=3)
    after = [m.bias_full for m in model.modules() if isinstance(m, FusedCascadedGroupAttention)]
    assert before and all(not torch.equal(a, b) for a, b in zip(before, after))
    # still an offset table: pairs with the same (|dy|, |dx|) share a bias
    b = after[0][0]
    w = model.stages[0].blocks[0].mixer.m.window
    assert torch.equal(b[0, 1], b[1, 0]) and (w < 2 or torch.equal(b[0, w], b[w, 0]))


def test_bias_table_resize_matches_timms_levit_resize_without_antialias():
    """Ours is the official (Cream) resize: bicubic, no antialias. timm's LeViT helper defaults to
    antialias=True, which changes the cubic kernel even when upsampling, so it differs there."""
    torch.manual_seed(0)
    for n, window in ((16, 7), (49, 4), (49, 7)):
        table = torch.randn(4, n)
        ours = resize_bias_table(table, window)
        theirs = resize_rel_pos_bias_table_levit(table.T, (window * window, 4), antialias=False).T
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    table = torch.randn(4, 16)
    assert (resize_bias_table(table, 7) - resize_rel_pos_bias_table_levit(table.T, (49, 4)).T).abs().max() > 1e-2


def test_prune_intermediate_layers_keeps_the_stages_asked_for(tmp_path):
    """timm's FeatureGetterNet prunes a model that has prune_intermediate_layers: the stages after the last one asked
    for and the classifier go, and the maps are the whole model's."""
    import copy

    from timm.models._features import FeatureGetterNet

    whole = randomize_(cgavit.create_model("m0"), 7).eval()
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        maps = whole.forward_intermediates(x, intermediates_only=True)
    model = copy.deepcopy(whole)
    wrapped = FeatureGetterNet(model, out_indices=(-3, -2))
    assert wrapped.out_indices == [0, 1] and len(model.stages) == 2 and len(model.feature_info) == 2
    assert model.num_features == whole.feature_info[1]["num_chs"] and model.num_classes == 0
    with torch.no_grad():
        pruned = wrapped(x)
        assert len(pruned) == 2 and all(torch.equal(a, b) for a, b in zip(pruned, maps))
        assert torch.equal(model(x), maps[1])  # the last kept stage's map, as timm's pruned models give it
        timms = timm.create_model("efficientvit_m0").eval()  # at 224 px, where timm's maps are ours (no map is
        timms.load_state_dict(cgavit.model.to_timm_state_dict(whole.state_dict()))  # smaller than its window)
        timms.prune_intermediate_layers([0, 1])
        x224 = torch.randn(1, 3, 224, 224)
        assert torch.equal(timms(x224), model(x224))
    assert wrapped.feature_info.channels() == [m.shape[1] for m in maps[:2]]
    kept = copy.deepcopy(whole)
    assert kept.prune_intermediate_layers(2, prune_head=False) == [1, 2] and len(kept.stages) == 3
    assert kept.num_classes == 1000  # nothing removed, the classifier kept as asked
    for bad in ([3], "12", [1.0], [True]):
        with pytest.raises(ValueError, match="stage indices must be in -3..2|indices must be"):
            kept.prune_intermediate_layers(bad)
    assert len(kept.stages) == 3 and kept.num_classes == 1000  # a refused prune changes nothing
    # as timm's models: any iterable of integers (numpy's too); stages removed take the classifier with them
    assert kept.prune_intermediate_layers(range(2), prune_head=False) == [0, 1] and kept.num_classes == 0
    assert copy.deepcopy(whole).prune_intermediate_layers([np.int64(-3)]) == [0]
    with pytest.raises(ValueError, match="pruned to 2 of its 3 stages"):  # load_model could not rebuild it
        cgavit.save_weights(model, tmp_path / "pruned.safetensors")
    assert not list(tmp_path.iterdir())


def test_timms_feature_wrapper_takes_the_model():
    """timm's FeatureGetterNet calls forward_intermediates(x, indices=, norm=, output_fmt=, intermediates_only=True):
    it raised TypeError on `norm`, so the models did not drop into timm's feature pipelines."""
    from timm.models._features import FeatureGetterNet

    model = randomize_(cgavit.create_model("m0"), 6).eval()
    wrapped = FeatureGetterNet(model, out_indices=(0, 1, 2))
    x = torch.randn(2, 3, 128, 96)
    with torch.no_grad():
        maps, (_, ours) = wrapped(x), model.forward_intermediates(x)
    assert len(maps) == 3 and all(torch.equal(a, b) for a, b in zip(maps, ours))
    assert wrapped.feature_info.channels() == [m.shape[1] for m in maps]
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")


def test_unpooled_features_as_timms_reset_classifier_gives_them(tmp_path):
    """``reset_classifier(0, "")``, timm's way to the last stage's unpooled map, raised "only average pooling"."""
    x = torch.randn(2, 3, 224, 224)  # a size where timm's maps are ours (none smaller than its window)
    ours = randomize_(cgavit.create_model("m0"), 3).eval()
    theirs = timm.create_model("efficientvit_m0").eval()
    theirs.load_state_dict(cgavit.model.to_timm_state_dict(ours.state_dict()))
    for model in (ours, theirs):
        model.reset_classifier(0, "")
    with torch.no_grad():
        out = ours(x)
        assert out.shape == (2, 192, 4, 4) and torch.equal(out, theirs(x))
        assert torch.equal(ours.forward_head(out, pre_logits=True), out)
    for bad, message in (("max", "global_pool must be 'avg'"), (None, "a classifier needs pooled features")):
        with pytest.raises(ValueError, match=message):
            ours.reset_classifier(5, bad)
    assert ours.global_pool == "" and ours.num_classes == 0  # a refused change changes nothing
    ours.reset_classifier(5, "avg")
    assert ours(x).shape == (2, 5)
    with pytest.raises(ValueError, match="a classifier needs pooled features"):
        cgavit.create_model("m0", global_pool="")
    # the pooling is part of what a saved file rebuilds
    features = cgavit.create_model("m0", num_classes=0, global_pool="").eval()
    cgavit.save_weights(features, tmp_path / "f.safetensors")
    loaded, _ = cgavit.load_model(tmp_path / "f.safetensors")
    with torch.no_grad():
        assert loaded.global_pool == "" and torch.equal(loaded(x), features(x))


def test_symbolic_tracing_with_the_attention_as_a_leaf():
    """torch.fx tracing stopped at the input check ("expected a torch.Tensor image batch, got Proxy"), so
    torchvision's create_feature_extractor and timm's FeatureGraphNet could not take the model. With the window
    attention a leaf (its forward branches on the map's size, as timm's own does) both give forward_intermediates'
    maps."""
    from timm.layers import register_notrace_module
    from timm.models import FeatureGraphNet
    from torchvision.models.feature_extraction import create_feature_extractor

    from cgavit.attention import LocalWindowAttention

    model = randomize_(cgavit.create_model("m0"), 4).eval()
    x = torch.randn(2, 3, 160, 200)
    with torch.no_grad():
        maps = model.forward_intermediates(x, indices=[1, 2], intermediates_only=True)
        torchvisions = create_feature_extractor(model, return_nodes={"stages.1": "c4", "stages.2": "c5"},
                                                tracer_kwargs={"leaf_modules": [LocalWindowAttention]})
        assert all(torch.equal(a, b) for a, b in zip(torchvisions(x).values(), maps))
        register_notrace_module(LocalWindowAttention)
        timms = FeatureGraphNet(model, out_indices=(1, 2))
        assert all(torch.equal(a, b) for a, b in zip(timms(x), maps))
    with pytest.raises(ValueError, match="expected 3 input channels"):  # a real tensor is still checked
        model(torch.randn(1, 1, 64, 64))


def test_set_input_size_is_the_model_built_for_that_size(tmp_path, monkeypatch):
    """timm's ``set_input_size``: the windows of the new size, the bias tables resized. It must equal a model built
    for that size given the same weights (trainable and fused forms), and timm's port once timm resizes as we do."""
    weights = randomize_(cgavit.create_model("m0", num_classes=10), 5).state_dict()
    for size, windows in ((384, [7, 7, 6]), (96, [6, 3, 2]), ((160, 256), [7, 5, 3])):
        hw = (size, size) if isinstance(size, int) else size
        built = cgavit.create_model("m0", num_classes=10, img_size=size, checkpoint_path=weights).eval()
        resized = cgavit.create_model("m0", num_classes=10, checkpoint_path=weights).eval()
        fused = cgavit.deploy.fuse(resized)
        resized.set_input_size(size)
        fused.set_input_size(size)
        assert [s.blocks[0].mixer.m.window for s in resized.stages] == windows
        assert resized.img_size == hw and resized.pretrained_cfg["input_size"] == (3, *hw)
        x = torch.randn(2, 3, *hw)
        with torch.no_grad():
            assert torch.equal(resized(x), built(x))
            torch.testing.assert_close(fused(x), built(x), rtol=0, atol=1e-4)
        cgavit.save_weights(resized, tmp_path / "r.safetensors")  # the file rebuilds the new size
        assert cgavit.load_model(tmp_path / "r.safetensors")[0].img_size == hw
    monkeypatch.setattr("timm.models.efficientvit_msra.resize_rel_pos_bias_table_levit",
                        lambda table, size: resize_rel_pos_bias_table_levit(table, size, antialias=False))
    theirs = timm.create_model("efficientvit_m0", num_classes=10).eval()
    theirs.load_state_dict(cgavit.model.to_timm_state_dict(weights))
    theirs.set_input_size(384)
    x = torch.randn(2, 3, 384, 384)
    with torch.no_grad():
        torch.testing.assert_close(resized_at(weights, 384)(x), theirs(x), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="img_size must be >= 32"):
        resized.set_input_size(16)
    with pytest.raises(ValueError, match="before a fast path"):
        cgavit.deploy.fusion.export_form(built, (384, 384)).set_input_size(384)
    pruned = cgavit.create_model("m0", num_classes=0, checkpoint_path=weights)
    pruned.prune_intermediate_layers([0])  # the stages a pruned model keeps are resized
    pruned.set_input_size(96)
    assert [s.blocks[0].mixer.m.window for s in pruned.stages] == [6]


def test_set_input_size_without_a_size_keeps_the_built_one_as_timms_does():
    """timm's set_input_size(img_size=None) keeps the current size; here it was a TypeError (a required argument)."""
    model = cgavit.create_model("m0", img_size=96, **SMALL)
    windows = [s.blocks[0].mixer.m.window for s in model.stages]
    model.set_input_size()
    assert model.img_size == (96, 96) and [s.blocks[0].mixer.m.window for s in model.stages] == windows
    assert model.pretrained_cfg["input_size"] == (3, 96, 96)
    assert timm.create_model("efficientvit_m0", img_size=96).set_input_size() is None  # timm's takes it too


def resized_at(weights: dict, size: int) -> torch.nn.Module:
    model = cgavit.create_model("m0", num_classes=10, checkpoint_path=weights).eval()
    model.set_input_size(size)
    return model


def test_drop_rate_device_and_dtype_as_timm_takes_them():
    """timm's ``drop_rate`` (dropout before the classifier), ``device`` and ``dtype`` were "unknown option(s)"."""
    model = cgavit.create_model("m0", num_classes=10, drop_rate=0.5, dtype=torch.bfloat16)
    assert model.head.drop.p == 0.5 and model.head_dist is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x = torch.randn(4, 3, 64, 64, dtype=torch.bfloat16)
    model.train()
    assert not torch.equal(model(x), model(x))  # the dropout is live in training
    model.eval()
    assert torch.equal(model(x), model(x)) and model(x).dtype == torch.bfloat16
    model.reset_classifier(5)
    assert model.head.drop.p == 0.5 and model.head.linear.weight.dtype == torch.bfloat16
    assert not hasattr(cgavit.create_model("m0").head, "drop")  # the official head's modules by default
    assert next(cgavit.create_model("m0", device="meta").parameters()).is_meta
    weights = randomize_(cgavit.create_model("m0"), 2).state_dict()
    loaded = cgavit.create_model("m0", checkpoint_path=weights, dtype=torch.float64)
    assert torch.equal(loaded.head.linear.weight, weights["head.linear.weight"].double())
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        cgavit.create_model("m0", dtype=torch.int8)
    with pytest.raises(ValueError, match=r"drop_rate must be in \[0, 1\)"):
        cgavit.create_model("m0", drop_rate=1.0)


def test_features_only_as_timms_create_model_takes_it(tmp_path):
    """create_model(..., features_only=True, out_indices=...), timm's way to a feature extractor, was refused as an
    unknown dial. It gives the stage maps forward_intermediates gives, with the weights loaded, timm's feature_info
    accessors and preprocessing record; out_indices without it is refused saying what to do."""
    import timm.data

    from cgavit.testing import randomize_

    model = randomize_(cgavit.create_model("m0"), 8).eval()
    cgavit.save_weights(model, tmp_path / "m0.safetensors")
    feats = cgavit.create_model("m0", features_only=True, checkpoint_path=tmp_path / "m0.safetensors").eval()
    x = torch.randn(2, 3, 97, 131)
    with torch.no_grad():
        for got, want in zip(feats(x), model.forward_intermediates(x, intermediates_only=True), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert feats.feature_info.channels() == [64, 128, 192] and feats.feature_info.reduction() == [16, 32, 64]
    assert feats.feature_info.module_name(0) == "stages.0" and feats.feature_info.channels(-1) == 192
    two = cgavit.create_model("m0", features_only=True, out_indices=(0, 1))
    assert [tuple(m.shape) for m in two(x)] == [(2, 64, 7, 9), (2, 128, 4, 5)] and len(two.model.stages) == 2
    assert next(iter(two.state_dict())).startswith("model.")  # as timm's FeatureGetterNet names them
    assert timm.data.resolve_data_config({}, model=two)["input_size"] == (3, 224, 224)
    with pytest.raises(ValueError, match="out_indices selects .* give features_only=True"):
        cgavit.create_model("m0", out_indices=(0, 1))
    with pytest.raises(ValueError, match="stage indices must be in -3..2"):
        cgavit.create_model("m0", features_only=True, out_indices=(3,))


def test_feature_info_accessors_read_stage_numbers_as_timms_do():
    """With out_indices=(1, 2), feature_info.channels(0) gave stage 1's 128 channels where timm's FeatureInfo gives
    stage 0's 64 (its idx is a stage of the network, whatever out_indices is): a neck written for timm was sized
    wrong without a word. timm's get, get_dicts and out_indices were missing. Each now answers as timm's does."""
    import pickle

    for out_indices in ((1, 2), (0, 1), (-1,), None):
        given = {} if out_indices is None else dict(out_indices=out_indices)
        ours = cgavit.create_model("m0", features_only=True, **given).feature_info
        theirs = timm.create_model("efficientvit_m0", features_only=True, **given).feature_info
        for call in ("channels()", "channels(0)", "channels(-1)", "reduction([0, 2])", "module_name(1)", "get('num_chs')",
                     "get_dicts(keys=['num_chs'])", "get_dicts(idx=1, keys=['reduction'])"):
            assert eval("ours." + call) == eval("theirs." + call), (out_indices, call)
        assert ours.out_indices == tuple(i % 3 for i in theirs.out_indices)
    copied = pickle.loads(pickle.dumps(ours))
    assert copied == ours and copied.channels(0) == 64 and copy.deepcopy(ours).out_indices == (0, 1, 2)


def test_a_features_only_models_pretrained_cfg_is_its_networks_as_it_is_now():
    """A features_only model's pretrained_cfg was the network's dict as it was at creation: after
    feats.model.set_input_size(256) (the network is its public attribute), timm's resolve_data_config still gave the
    old input size, and images were resized for the size the network was no longer built for."""
    feats = cgavit.create_model("m0", features_only=True, img_size=128, **SMALL)
    feats.model.set_input_size(256)
    assert timm.data.resolve_data_config({}, model=feats)["input_size"] == (3, 256, 256)
    assert feats.pretrained_cfg is feats.default_cfg is feats.model.pretrained_cfg
    feats.pretrained_cfg = dict(feats.pretrained_cfg, crop_pct=1.0)  # set through it, as timm's builder sets it
    assert feats.model.pretrained_cfg["crop_pct"] == 1.0 and "pretrained_cfg" not in feats.__dict__


def test_features_only_from_a_checkpoint_warns_of_no_classifier(tmp_path, caplog):
    """A features_only model was built with a classifier, loaded, then had it removed: a checkpoint without a
    classifier (a saved backbone) was warned about as 'its outputs mean nothing until it is trained', and one with a
    distillation head as 'the model's outputs are its class head's alone', of a model that gives neither."""
    import logging

    from cgavit.testing import randomize_

    backbone = randomize_(cgavit.create_model("m0", num_classes=0, img_size=64), 4)
    distilled = randomize_(cgavit.create_model("m0", distillation=True, img_size=64), 5)
    for source, net in ((backbone.state_dict(), backbone), (distilled.state_dict(), distilled)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cgavit"):
            feats = cgavit.create_model("m0", features_only=True, img_size=64, checkpoint_path=source).eval()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        x = torch.randn(2, 3, 64, 80)
        with torch.no_grad():
            assert torch.equal(feats(x)[-1], net.eval().forward_features(x))


@pytest.mark.parametrize("out_indices", [None, (0, 1)])
def test_a_features_only_model_scripts_as_timms_does(out_indices):
    """torch.jit.script on a features_only model (timm's scripts) failed on the Python checks of
    forward_intermediates; the scripted model gives the eager one's maps, at any size, saved and loaded too."""
    import io

    from cgavit.testing import randomize_

    net = randomize_(cgavit.create_model("m0", img_size=64), 6)
    feats = cgavit.model.FeatureMaps(net, (0, 1, 2) if out_indices is None else out_indices).eval()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(feats), buffer)
    scripted = torch.jit.load(io.BytesIO(buffer.getvalue()))
    with torch.no_grad():
        for size in ((64, 96), (129, 67)):
            x = torch.randn(2, 3, *size)
            got, want = scripted(x), feats(x)
            assert len(got) == len(want) == len(feats.out_indices)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
