"""Head similarity and Taylor importance: exact cases, every dial combination, and the commands."""

import copy
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
import pytest
import torch
from torch import nn

from cgavit import create_model, fuse, save_weights
from cgavit.analysis import cosine_similarity_matrix, head_similarity, map_similarity, mean_off_diagonal, taylor_importance
from cgavit.analysis import heads as heads_module
from cgavit.analysis import reports
from cgavit.analysis.data import list_images
from cgavit.analysis.heads import BlockSimilarity, mean_similarity
from cgavit.analysis.reports import AnalysisConfig, load_sample, run_heads, run_taylor
from cgavit.analysis.taylor import BlockImportance, channel_importance, kept_fraction, plot_importance, pruning_order
from cgavit.attention import CascadedGroupAttention, LocalWindowAttention
from cgavit.cli import main
from cgavit.testing import randomize_

TINY = dict(embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))


# ----------------------------------------------------------------------------- head similarity
def test_cosine_matrix_identical_and_orthogonal():
    a = torch.rand(3, 5, 4, 4)
    same = cosine_similarity_matrix(torch.stack([a[0], a[0], a[0]]))
    assert torch.allclose(same, torch.ones(5, 3, 3, dtype=torch.float64))
    eye = torch.eye(4).expand(2, 4, 4)  # head 0: attends to itself
    shift = torch.roll(torch.eye(4), 1, dims=1).expand(2, 4, 4)  # head 1: to its neighbour
    sim = cosine_similarity_matrix(torch.stack([eye, shift]))
    assert torch.allclose(sim, torch.eye(2, dtype=torch.float64).expand(2, 2, 2))
    # a partial overlap: cos = <a,b>/(|a||b|) by hand
    half = torch.stack([torch.tensor([[1.0, 1.0], [0, 0]]), torch.tensor([[1.0, 0.0], [0, 0]])])[:, None]
    assert cosine_similarity_matrix(half)[0, 0, 1].item() == pytest.approx(1 / 2**0.5)


def _identical_heads_attention() -> CascadedGroupAttention:
    attn = CascadedGroupAttention(16, key_dim=4, num_heads=4, window=4, cascade=False, group_split=False)
    randomize_(attn)
    with torch.no_grad():
        for m in list(attn.qkvs)[1:]:
            m.load_state_dict(attn.qkvs[0].state_dict())
        for m in list(attn.dws)[1:]:
            m.load_state_dict(attn.dws[0].state_dict())
        attn.attention_biases.copy_(attn.attention_biases[:1].expand_as(attn.attention_biases))
    return attn


def test_identical_heads_give_one():
    net = nn.Sequential(LocalWindowAttention(16, 4, key_dim=4, num_heads=4, cascade=False, group_split=False))
    net[0].attn = _identical_heads_attention()
    (blk,) = head_similarity(net, torch.randn(3, 16, 8, 8))  # 8x8 map: four 4x4 windows per image
    assert blk.windows == 12 and blk.tokens == 16
    assert torch.allclose(blk.matrix, torch.ones(4, 4), atol=1e-6)
    assert blk.mean_off_diagonal == pytest.approx(1.0, abs=1e-6)


def test_constructed_disjoint_heads_give_zero():
    # scores = bias only (zero Q/K weights): head 0 attends to itself, head 1 to the token one column away
    attn = CascadedGroupAttention(8, key_dim=4, num_heads=2, window=3, cascade=False, group_split=True)
    with torch.no_grad():
        for m in attn.qkvs:
            m.conv.weight.zero_()
            m.bn.bias.zero_()
        attn.attention_biases.fill_(-60.0)
        attn.attention_biases[0, 0] = 60.0  # offset (0, 0)
        attn.attention_biases[1, 1] = 60.0  # offset (|dy|, |dx|) = (0, 1)
    (blk,) = head_similarity(attn, torch.randn(2, 8, 1, 2))  # two tokens side by side
    assert blk.matrix[0, 1].item() == pytest.approx(0.0, abs=1e-12)
    assert blk.matrix[0, 0].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "dials",
    [dict(), dict(cascade=False), dict(cascade=False, group_split=False), dict(ffn_per_side=(0, 1), key_dim=8, attn_ratio=1.0, cascade=False)],
)
def test_head_similarity_every_dial_combination(dials):
    model = randomize_(create_model("m0", num_classes=3, img_size=64, **TINY, **dials))
    model.train()
    blocks = head_similarity(model, [torch.randn(2, 3, 64, 64), torch.randn(1, 3, 64, 64)])
    assert model.training  # mode restored
    assert [b.name for b in blocks] == [f"stages.{i}.blocks.0.mixer.m.attn" for i in range(3)]
    assert [b.tokens for b in blocks] == [16, 4, 1]
    for b in blocks:
        assert b.windows == 3 and b.matrix.shape == (2, 2)
        assert torch.allclose(b.matrix.diagonal(), torch.ones(2), atol=1e-5)
        assert torch.allclose(b.matrix, b.matrix.T, atol=1e-6)
        assert 0 < b.mean_off_diagonal <= 1 + 1e-6
    assert blocks[2].mean_off_diagonal == pytest.approx(1.0)  # one token: every map is [[1]]
    # the one-token block is left out of the summary
    assert mean_similarity(blocks) == pytest.approx((blocks[0].mean_off_diagonal + blocks[1].mean_off_diagonal) / 2)


def test_head_similarity_matches_forward_maps():
    # the hook sees exactly the maps of the window the forward pass attends (no re-implementation)
    model = randomize_(create_model("m0", num_classes=3, img_size=64, **TINY)).eval()
    x = torch.randn(2, 3, 64, 64)
    blocks = head_similarity(model, x)
    attn = model.stages[0].blocks[0].mixer.m.attn
    feats = model.stages[0].blocks[0].pre(model.patch_embed(x))
    maps = torch.stack(attn.head_attention_maps(feats))
    want = cosine_similarity_matrix(maps).mean(0).float()
    assert torch.allclose(blocks[0].matrix, want, atol=1e-6)


def test_map_similarity_one_head_identical_orthogonal():
    """The one definition: per-window cosine of the flattened maps, averaged over windows."""
    one = map_similarity(torch.rand(1, 5, 4, 4))
    assert one.shape == (1, 1) and one.item() == pytest.approx(1.0)
    assert mean_off_diagonal(one) is None  # one head: no pairs, None (never NaN)
    a = torch.rand(5, 4, 4)
    assert torch.allclose(map_similarity(torch.stack([a, a, a])), torch.ones(3, 3, dtype=torch.float64))
    assert mean_off_diagonal(map_similarity(torch.stack([a, a]))) == pytest.approx(1.0)
    eye = torch.eye(4).expand(2, 4, 4)
    shift = torch.roll(torch.eye(4), 1, dims=1).expand(2, 4, 4)
    orth = map_similarity(torch.stack([eye, shift]))
    assert torch.allclose(orth, torch.eye(2, dtype=torch.float64)) and mean_off_diagonal(orth) == 0.0
    # averaged per window, not one cosine over all windows concatenated
    maps = torch.rand(3, 4, 9, 9)
    assert torch.allclose(map_similarity(maps), cosine_similarity_matrix(maps).mean(0))


def test_one_head_block_is_json_clean():
    blk = BlockSimilarity("stages.0.blocks.0.mixer.m.attn", 0, 0, torch.ones(1, 1), windows=2, tokens=16)
    assert blk.mean_off_diagonal is None
    assert json.loads(json.dumps(blk.to_dict(), allow_nan=False))["mean_off_diagonal"] is None
    assert mean_similarity([blk]) != mean_similarity([blk])  # no block with pairs: NaN summary


def test_head_similarity_block_equals_map_similarity():
    model = randomize_(create_model("m0", num_classes=3, img_size=64, **TINY)).eval()
    x = torch.randn(2, 3, 64, 64)
    blocks = head_similarity(model, x)
    attn = model.stages[0].blocks[0].mixer.m.attn
    feats = model.stages[0].blocks[0].pre(model.patch_embed(x))
    want = map_similarity(torch.stack(attn.head_attention_maps(feats)))
    assert torch.allclose(blocks[0].matrix.double(), want, atol=1e-6)
    assert blocks[0].mean_off_diagonal == pytest.approx(mean_off_diagonal(want), abs=1e-6)


# ----------------------------------------------------------------------------- Taylor importance
def test_channel_importance_by_hand():
    conv = nn.Conv2d(2, 2, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 0.5]]).view(2, 2, 1, 1))
    x = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    conv(x).sum().backward()  # dL/dw[o, i] = x[i]
    # channel 0: |1*1| + |-2*2| = 5; channel 1: |3*1| + |0.5*2| = 4
    assert channel_importance(conv.weight).tolist() == [5.0, 4.0]


def test_taylor_importance_splits_qkv_and_matches_autograd():
    model = randomize_(create_model("m0", num_classes=4, img_size=64, **TINY)).double()  # float64: no rounding noise
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.float64), torch.tensor([0, 1, 3, 2])
    blocks = taylor_importance(model, [(x[:2], y[:2]), (x[2:], y[2:])])
    assert all(p.grad is None for p in model.parameters())  # gradients cleared
    assert len(blocks) == 3
    b = blocks[1]
    attn = model.stages[1].blocks[0].mixer.m.attn
    assert [t.numel() for t in b.q] == [attn.key_dim] * 2 and [t.numel() for t in b.v] == [attn.value_dim] * 2
    assert b.proj.numel() == 24 and [t.numel() for t in b.ffn] == [48, 48]
    # the same quantity from one batch of four, by autograd directly
    model.eval()
    nn.functional.cross_entropy(model(x), y).backward()
    w = attn.qkvs[1].conv.weight
    ref = (w * w.grad).abs().flatten(1).sum(1).double()
    got = torch.cat([b.q[1], b.k[1], b.v[1]])
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-15)


def test_taylor_predictions_as_targets():
    model = randomize_(create_model("m0", num_classes=4, img_size=64, **TINY, cascade=False, group_split=False))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        pred = model.eval()(x).argmax(1)
    a = taylor_importance(model, [(x, None)])
    b = taylor_importance(model, [(x, pred)])
    assert torch.equal(a[0].channels()["ffn"], b[0].channels()["ffn"])
    with torch.no_grad():  # a RuntimeError "element 0 of tensors does not require grad" before
        c = taylor_importance(model, [(x, pred)])
    assert torch.equal(c[0].channels()["ffn"], b[0].channels()["ffn"])
    with torch.inference_mode(), pytest.raises(ValueError, match="torch.inference_mode"):
        taylor_importance(model, [(x, pred)])


def test_pruning_order_and_kept_fraction():
    blk = BlockImportance("stages.0.blocks.0", 0, 0)
    blk.q = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
    blk.k = [torch.tensor([3.0, 4.0], dtype=torch.float64)]
    blk.v = [torch.tensor([5.0, 6.0], dtype=torch.float64)]
    blk.ffn = [torch.tensor([7.0, 8.0], dtype=torch.float64)]
    order = pruning_order([blk])
    assert [r["kind"] for r in order] == ["q", "q", "k", "k", "v", "v", "ffn", "ffn"]
    assert order[0]["score"] == pytest.approx(1.0 / 4.5)  # normalised by the block mean 4.5
    kept = kept_fraction([blk], 0.25)
    assert kept["kept"][0] == {"q": 0.0, "k": 1.0, "v": 1.0, "ffn": 1.0}
    with pytest.raises(ValueError, match="prune ratio"):
        kept_fraction([blk], 1.5)


# ----------------------------------------------------------------------------- commands
def _image_folder(root, classes=2, per_class=3, size=40):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return root


def test_analyze_commands(tmp_path, capsys, trained_digits):
    data = _image_folder(tmp_path / "data")
    dials = ["--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "2,2,2", "--img-size", "64"]
    assert main(["analyze", "heads", "--data", str(data), "--output", str(tmp_path / "h"), "--num-images", "4", *dials]) == 0
    rep = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert rep["num_images"] == 4 and len(rep["blocks"]) == 3
    assert (tmp_path / "h" / "heads_matrices.png").stat().st_size > 0 and (tmp_path / "h" / "heads_mean.png").exists()
    ckpt = ["--checkpoint", str(trained_digits.checkpoint)]
    files = [str(p) for p in sorted((trained_digits.data / "val" / "3").iterdir())[:3]]
    assert main(["analyze", "taylor", *files, "--output", str(tmp_path / "t"), "--prune-ratio", "0.5", *ckpt]) == 0
    rep = json.loads((tmp_path / "t" / "taylor.json").read_text())
    assert rep["loss_targets"] == "predictions" and rep["num_images"] == 3
    assert rep["pruned_count"] > 0 and set(rep["kept_fraction"]) == {"0", "1", "2"}  # stages from 0, as in "blocks"
    assert (tmp_path / "t" / "taylor_spread.png").exists() and (tmp_path / "t" / "taylor_pruning.png").exists()
    # a labelled folder of the checkpoint's classes: labels are used
    val = str(trained_digits.data / "val")
    assert main(["analyze", "taylor", "--data", val, "--num-images", "20", "--output", str(tmp_path / "t2"), *ckpt]) == 0
    assert json.loads((tmp_path / "t2" / "taylor.json").read_text())["loss_targets"] == "labels"
    assert "folder labels" in capsys.readouterr().out


def test_analysis_runs_typed(tmp_path, trained_digits):
    data = _image_folder(tmp_path / "data")
    dials = dict(embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))
    cfg = AnalysisConfig(output=str(tmp_path / "h"), data=str(data), img_size=64, num_images=4, batch_size=3, dials=dials)
    heads = run_heads(cfg)
    assert heads.json_path == tmp_path / "h" / "heads.json" and all(p.exists() for p in heads.plots)
    assert json.loads(heads.json_path.read_text()) == json.loads(json.dumps(heads.report))
    assert heads.report["num_images"] == 4 and heads.report["dials"]["embed_dim"] == [16, 24, 32]
    assert [b.windows for b in heads.blocks] == [4, 4, 4]  # two batches of two, one window each at 64 px
    cfg = AnalysisConfig(output=str(tmp_path / "t"), checkpoint=str(trained_digits.checkpoint),
                         data=str(trained_digits.data / "val"), num_images=10, batch_size=4)
    taylor = run_taylor(cfg, prune_ratio=0.5, list_pruned=3)
    assert taylor.targets == "labels" and len(taylor.report["pruned_first"]) == 3
    assert run_taylor(cfg, targets="predictions").targets == "predictions"
    with pytest.raises(ValueError, match="targets must be one of"):
        run_taylor(cfg, targets="guess")
    with pytest.raises(ValueError, match="not both"):
        run_heads(AnalysisConfig(output=str(tmp_path), data=str(data), images=("a.png",)))


def test_a_checkpoint_is_analysed_as_the_network_built_for_the_image_size(trained_digits):
    """--img-size 112 analysed the network built for the recorded 48 px (its windows), not eval's or predict's."""
    from cgavit import load_model

    cfg = AnalysisConfig(output="unused", checkpoint=str(trained_digits.checkpoint), img_size=112)
    model, info = reports.load_analysis_model(cfg)
    built, _ = load_model(trained_digits.checkpoint, img_size=112)
    windows = [m.window for m in model.modules() if isinstance(m, CascadedGroupAttention)]
    assert info.img_size == 112 and windows == [m.window for m in built.modules() if isinstance(m, CascadedGroupAttention)]
    assert windows != [m.window for m in trained_digits.model.modules() if isinstance(m, CascadedGroupAttention)]
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), built.eval()(x))


def test_images_beside_class_folders_are_warned_about(tmp_path, caplog):
    """A folder of 36 images with one sub-folder of thumbnails was read as one class of 2 images, without a word."""
    import logging

    from cgavit.analysis.data import list_images

    (tmp_path / "thumbs").mkdir()
    for name in ("a.png", "b.png", "thumbs/c.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        files, labels, classes = list_images([tmp_path])
    assert classes == ["thumbs"] and len(files) == 1
    assert "2 image(s) directly in" in caplog.text and "are left out" in caplog.text


def test_a_labelled_folder_is_read_as_training_reads_it(tmp_path, capsys):
    """The analyses read a class folder without images as no class, shifting the index of every class after it
    (--targets labels by index then scored class 2's images as class 1), and a hidden folder of images as a class;
    training and evaluation refuse the first and leave the second out."""
    from cgavit.analysis.data import list_images

    for name in ("a/x.png", "c/y.png", ".thumbs/z.png"):
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "data" / name)
    files, labels, classes = list_images([tmp_path / "data"])
    assert classes == ["a", "c"] and labels == [0, 1] and [p.name for p in files] == ["x.png", "y.png"]
    (tmp_path / "data" / "b").mkdir()  # between a and c
    assert main(["analyze", "heads", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "h")]) == 2
    assert "1 class folder(s) in " in capsys.readouterr().err and not (tmp_path / "h").exists()


def test_analyze_bad_input(tmp_path, capsys):
    assert main(["analyze", "heads", "--data", str(tmp_path / "missing"), "--output", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["analyze", "heads", "--data", str(tmp_path / "empty"), "--output", str(tmp_path)]) == 2
    assert "no images" in capsys.readouterr().err


def test_the_images_are_found_before_the_weights_are_read(tmp_path, monkeypatch, capsys):
    def read_weights(*args, **kwargs):  # --pretrained would download them, and offline say only that it could not
        raise AssertionError("the weights were read before the images were looked for")

    monkeypatch.setattr(reports, "load_model", read_weights)
    (tmp_path / "empty").mkdir()
    for data, said in ((None, "give --data DIR"), (tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no images")):
        data = [] if data is None else ["--data", str(data)]
        assert main(["analyze", "heads", "--pretrained", *data, "--output", str(tmp_path / "h")]) == 2
        assert said in capsys.readouterr().err


def test_a_dataset_root_is_refused_with_the_split_to_give(tmp_path, capsys):
    """DIR/train/<class>/ and DIR/val/<class>/ given as --data (as train and eval take it) were read as two classes,
    'train' and 'val': both splits' images drawn, and labelled by split for the Taylor loss."""
    for split in ("train", "val"):
        _image_folder(tmp_path / "data" / split, per_class=1, size=8)
    with pytest.raises(ValueError, match=r"holds the splits train, val .*--data \S*data/val"):
        list_images([tmp_path / "data"])
    assert main(["analyze", "heads", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "h")]) == 2
    assert "give one split's folder" in capsys.readouterr().err and not (tmp_path / "h").exists()
    (tmp_path / "data" / "test").mkdir()  # a class folder beside them (images, no folders): classes after all
    (tmp_path / "data" / "test" / "0.png").write_bytes((tmp_path / "data" / "val" / "class0" / "0.png").read_bytes())
    assert list_images([tmp_path / "data"])[2] == ["test", "train", "val"]


def test_a_one_channel_model_is_fed_greyscale_images_as_eval_feeds_it(tmp_path):
    """A model of in_chans=1 was fed RGB images and refused them ('convert the images ... or build with in_chans=3'),
    though cgavit eval reads the same folder for it as greyscale."""
    model = randomize_(create_model("m0", in_chans=1, num_classes=2, img_size=32, **TINY))
    path = save_weights(model, tmp_path / "grey.safetensors")
    data = _image_folder(tmp_path / "data", per_class=2, size=32)
    cfg = AnalysisConfig(output=str(tmp_path / "h"), checkpoint=str(path), data=str(data))
    assert [x.shape[1] for x, _ in load_sample(cfg).batches] == [1]
    assert run_taylor(cfg).report["num_images"] == 4


# ----------------------------------------------------------------------------- review fixes
def _digits_folder(root, trained_digits, names: dict[str, str], per_class=3):
    """A class folder per entry of ``names`` (folder name -> digit), holding that digit's held-out images."""
    for name, digit in names.items():
        (root / name).mkdir(parents=True)
        for src in sorted((trained_digits.data / "val" / digit).iterdir())[:per_class]:
            shutil.copy(src, root / name / src.name)
    return root


def test_taylor_labels_are_matched_to_the_checkpoint_by_name(tmp_path, trained_digits):
    # the folder's classes 3 and 7 are its labels 0 and 1: the loss must see the model's classes 3 and 7
    data = _digits_folder(tmp_path / "data", trained_digits, {"3": "3", "7": "7"})
    cfg = AnalysisConfig(output=str(tmp_path / "t"), checkpoint=str(trained_digits.checkpoint), data=str(data), num_images=0)
    sample = load_sample(cfg)
    want = taylor_importance(sample.model, [(x, torch.tensor([3, 7])[y]) for x, y in sample.batches])
    for targets in ("labels", "auto"):
        run = run_taylor(cfg, targets=targets)
        assert run.targets == "labels"
        for got, ref in zip(run.blocks, want):
            assert torch.allclose(got.channels()["ffn"], ref.channels()["ffn"], rtol=1e-4, atol=1e-12)
        assert "matched" in run.report["loss_targets_reason"]


def test_taylor_refuses_or_skips_classes_the_checkpoint_lacks(tmp_path, trained_digits):
    # ten class folders, as many as the model has, but none of its names
    data = _digits_folder(tmp_path / "data", trained_digits, {f"d{i}": str(i) for i in range(10)}, per_class=1)
    cfg = AnalysisConfig(output=str(tmp_path / "t"), checkpoint=str(trained_digits.checkpoint), data=str(data), num_images=0)
    run = run_taylor(cfg)  # auto: the names do not match, so the model's own predictions
    assert run.targets == "predictions" and "not the checkpoint's" in run.report["loss_targets_reason"]
    with pytest.raises(ValueError, match="'d0', 'd1'.* not among them"):
        run_taylor(cfg, targets="labels")


def test_taylor_refuses_all_zero_importance(tmp_path):
    # fresh weights: every attention and FFN branch ends in a zero-initialised BatchNorm, so no gradient reaches any channel
    model = create_model("m0", num_classes=3, img_size=64, **TINY)
    with pytest.raises(ValueError, match="gradients are all zero.*trained --checkpoint"):
        taylor_importance(model, [(torch.randn(2, 3, 64, 64), None)])
    data = _image_folder(tmp_path / "data")
    cfg = AnalysisConfig(output=str(tmp_path / "t"), data=str(data), img_size=64, num_images=4, dials=TINY)
    with pytest.raises(ValueError, match="gradients are all zero"):
        run_taylor(cfg)
    assert not (tmp_path / "t").exists()


def test_taylor_refuses_random_weights_before_any_work(tmp_path, monkeypatch):
    """Without --checkpoint or --pretrained the importances are all zero by construction, yet analyze taylor read
    the images and ran every pass first (24 s at its defaults on 2 cores) to say so."""
    from cgavit.analysis import reports

    def never(cfg):
        raise AssertionError("images read for a refused run")

    monkeypatch.setattr(reports, "load_sample", never)
    cfg = AnalysisConfig(output=str(tmp_path / "t"), data=str(tmp_path / "data"), img_size=64, dials=TINY)
    with pytest.raises(ValueError, match="gradients are all zero.*give a trained --checkpoint or --pretrained"):
        run_taylor(cfg)
    assert not (tmp_path / "t").exists()


def test_taylor_no_gradient_kinds_are_marked_and_not_pruned(tmp_path, capsys, trained_digits):
    # at 48 px stage 3 attends over one token: its softmax is 1, so Q and K get no gradient at all
    blocks = taylor_importance(trained_digits.model, [(trained_digits.images[:16], trained_digits.labels[:16])])
    assert [b.no_gradient for b in blocks] == [(), (), ("q", "k")]
    assert not [r for r in pruning_order(blocks) if r["stage"] == 2 and r["kind"] in ("q", "k")]
    kept = kept_fraction(blocks, 0.3)["kept"]
    assert kept[2]["q"] is None and kept[2]["k"] is None and kept[2]["v"] is not None
    val = str(trained_digits.data / "val")
    assert main(["analyze", "taylor", "--checkpoint", str(trained_digits.checkpoint), "--data", val, "--num-images", "20",
                 "--output", str(tmp_path / "t")]) == 0
    rep = json.loads((tmp_path / "t" / "taylor.json").read_text())
    assert rep["kept_fraction"]["2"]["q"] is None and rep["no_gradient"] == {"stages.2.blocks.0": ["q", "k"]}
    assert rep["blocks"][2]["no_gradient"] == ["q", "k"]
    out = capsys.readouterr().out
    assert "stage 3 (stages.2): Q no gradient  K no gradient  V " in out
    assert "no gradient in s3.b1 (stages.2.blocks.0) Q K:" in out


def test_kept_fraction_lists_kinds_in_a_fixed_order():
    blk = BlockImportance("stages.0.blocks.0", 0, 0)
    blk.q = [torch.tensor([9.0, 8.0], dtype=torch.float64)]
    blk.k = [torch.tensor([7.0, 6.0], dtype=torch.float64)]
    blk.v = [torch.tensor([5.0, 4.0], dtype=torch.float64)]
    blk.ffn = [torch.tensor([1.0, 2.0], dtype=torch.float64)]  # least important: ranked first
    assert list(kept_fraction([blk], 0.25)["kept"][0]) == ["q", "k", "v", "ffn"]


def test_head_similarity_accepts_a_fused_model(trained_digits):
    x = trained_digits.images[:8]
    plain = head_similarity(trained_digits.model, x)
    fused = head_similarity(fuse(trained_digits.model), x)
    assert [b.name for b in fused] == [b.name for b in plain]
    for a, b in zip(fused, plain):
        assert torch.allclose(a.matrix, b.matrix, atol=1e-4)


def test_taylor_refuses_fused_or_frozen_models(trained_digits):
    batch = [(trained_digits.images[:4], None)]
    with pytest.raises(ValueError, match="unfused, trainable model.*FusedCascadedGroupAttention"):
        taylor_importance(fuse(trained_digits.model), batch)
    frozen = copy.deepcopy(trained_digits.model).requires_grad_(False)
    with pytest.raises(ValueError, match="do not require"):
        taylor_importance(frozen, batch)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_heads_report_is_strict_json_without_a_mean(tmp_path, capsys):
    data = _image_folder(tmp_path / "data")
    dials = ["--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "1,1,1", "--img-size", "64"]
    assert main(["analyze", "heads", "--data", str(data), "--output", str(tmp_path / "h"), "--num-images", "4", *dials]) == 0
    assert _strict((tmp_path / "h" / "heads.json").read_text())["mean_similarity"] is None
    assert "mean over blocks (more than one token): n/a" in capsys.readouterr().out


def test_report_names_the_analysed_model(tmp_path, trained_digits):
    val = str(trained_digits.data / "val")
    for typed in ("efficientvit_m4", None):  # the checkpoint's recorded variant wins over --model
        cfg = AnalysisConfig(output=str(tmp_path / "h"), checkpoint=str(trained_digits.checkpoint), model=typed, data=val,
                             num_images=4)
        assert run_heads(cfg).report["model"] == "efficientvit_m0"


@pytest.fixture
def drawn(monkeypatch):
    """The figures the analyses draw, by file name (matplotlib figures, kept after they are saved)."""
    from cgavit.analysis import plots

    figures, save = {}, plots._save

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_the_heatmaps_name_their_axes(tmp_path, drawn):
    """heads_matrices.png's panels were ticked 1..h on both axes with nothing saying these were heads."""
    cfg = AnalysisConfig(output=str(tmp_path / "h"), data=str(_image_folder(tmp_path / "data")), img_size=64,
                         num_images=2, dials=dict(embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2)))
    run_heads(cfg)
    panels = [ax for ax in drawn["heads_matrices.png"].axes if ax.images]
    assert len(panels) == 3 and all(ax.get_xlabel() == "head" for ax in panels)
    assert [ax.get_ylabel() for ax in panels] == ["head", "", ""]  # beside the row, not between its panels


def test_heads_plot_marks_one_token_blocks(tmp_path, trained_digits, drawn):
    cfg = AnalysisConfig(output=str(tmp_path / "h"), checkpoint=str(trained_digits.checkpoint),
                         data=str(trained_digits.data / "val"), num_images=4)
    assert [b.tokens for b in run_heads(cfg).blocks] == [9, 4, 1]
    ax = drawn["heads_mean.png"].axes[0]
    assert [bar.get_hatch() for bar in ax.patches] == [None, None, "//"]
    assert any("1-token" in t.get_text() for t in ax.get_legend().get_texts())


def test_taylor_plots_mark_zero_importance_all_pruned_and_missing(tmp_path, trained_digits, drawn):
    blocks = taylor_importance(trained_digits.model, [(trained_digits.images[:16], None)])
    plot_importance(blocks, 0.3, tmp_path)
    spread = drawn["taylor_spread.png"]
    # stage 3's Q and K (boxes 1 and 2) are all 0, which the log axis cannot draw
    notes = [(t.get_position()[0], t.get_text()) for t in spread.axes[2].texts]
    assert notes[:2] == [(1, "all 0"), (2, "all 0")] and _texts(spread).count("all 0") == 2
    blk = BlockImportance("stages.0.blocks.0", 0, 0)  # no FFN; the two Q channels are pruned first
    blk.q = [torch.tensor([0.1, 0.2], dtype=torch.float64)]
    blk.k = [torch.tensor([5.0, 6.0], dtype=torch.float64)]
    blk.v = [torch.tensor([5.0, 6.0], dtype=torch.float64)]
    plot_importance([blk], 0.3, tmp_path)
    assert sorted(_texts(drawn["taylor_pruning.png"])) == ["0: all pruned", "n/a"]


def test_the_pruning_legend_covers_no_bar(tmp_path, drawn):
    """At a small budget every kind keeps about all its channels, and the legend, drawn inside the axes where it
    overlapped least, sat on the top of stage 3's bars."""
    blocks = []
    for stage in range(3):
        blk = BlockImportance(f"stages.{stage}.blocks.0", stage, 0)
        blk.q, blk.k, blk.v = ([torch.linspace(1, 2, 16, dtype=torch.float64)] for _ in range(3))
        blk.ffn = [torch.linspace(1, 2, 32, dtype=torch.float64)]
        blocks.append(blk)
    plot_importance(blocks, 0.01, tmp_path)
    fig = drawn["taylor_pruning.png"]
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    bars = [bar.get_window_extent() for bar in ax.patches if bar.get_height() > 0]
    assert len(bars) == 12 and not any(legend.overlaps(bar) for bar in bars)


def test_the_importance_axis_is_labelled_in_plain_numbers(tmp_path, trained_digits, drawn):
    """The log axis of taylor_spread.png read 2x10^0, 3x10^-1 (matplotlib's notation) beside plain tick marks."""
    blocks = taylor_importance(trained_digits.model, [(trained_digits.images[:16], None)])
    plot_importance(blocks, 0.3, tmp_path)
    fig = drawn["taylor_spread.png"]
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels() + fig.axes[0].get_yticklabels(minor=True)]
    shown = [t for t in labels if t]
    assert "1" in shown and len(shown) > 2, labels
    assert all(float(t) > 0 for t in shown), labels  # plain numbers, not mathtext such as 2x10^0


def test_interrupted_analysis_keeps_the_previous_set(tmp_path, monkeypatch):
    data = _image_folder(tmp_path / "data")
    out = tmp_path / "h"
    cfg = AnalysisConfig(output=str(out), data=str(data), img_size=64, num_images=4, dials=TINY)
    run_heads(cfg)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["heads.json", "heads_matrices.png", "heads_mean.png"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(heads_module, "bar_chart", interrupted)  # stopped while drawing the second figure
    with pytest.raises(KeyboardInterrupt):
        run_heads(AnalysisConfig(output=str(out), data=str(data), img_size=64, num_images=4, dials={**TINY, "num_heads": (4, 4, 4)}))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous set, whole; no temporaries
    monkeypatch.undo()
    # a run that draws fewer figures removes the previous run's others
    draw = reports.plot_similarity
    monkeypatch.setattr(reports, "plot_similarity", lambda *a, **k: draw(*a, **k)[:1])
    run = run_heads(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["heads.json", "heads_matrices.png"] and run.plots == [out / "heads_matrices.png"]


def test_the_sample_is_fed_as_the_checkpoint_records(tmp_path):
    """The analyses read size, crop and normalisation from the checkpoint; the interpolation was always bicubic."""
    from cgavit import save_weights
    from cgavit.schema import WeightsMeta
    from cgavit.train.data import build_transform

    model = create_model("m0", num_classes=2, img_size=48, **TINY)
    feed = dict(img_size=48, crop_pct=0.9, interpolation="bilinear", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    save_weights(model, tmp_path / "w.safetensors", WeightsMeta(model="efficientvit_m0", config=model.cfg,
                                                                 num_classes=2, class_names=("a", "b"), **feed))
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (data / name).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (61, 83, 3), dtype=np.uint8)).save(data / name / "x.png")
    sample = load_sample(AnalysisConfig(output=str(tmp_path / "o"), checkpoint=str(tmp_path / "w.safetensors"),
                                        data=str(data), num_images=0))
    own = build_transform(48, False, interpolation="bilinear", crop_pct=0.9, mean=feed["mean"], std=feed["std"])
    want = torch.stack([own(Image.open(data / name / "x.png").convert("RGB")) for name in ("a", "b")])
    assert torch.equal(torch.cat([x for x, _ in sample.batches]), want)


def test_the_prune_ratio_is_printed_as_given(tmp_path, trained_digits, capsys):
    data = _digits_folder(tmp_path / "data", trained_digits, {"3": "3", "7": "7"})
    assert main(["analyze", "taylor", "--checkpoint", str(trained_digits.checkpoint), "--data", str(data),
                 "--num-images", "0", "--prune-ratio", "0.999", "--output", str(tmp_path / "t")]) == 0
    assert "least important 99.9 % of" in capsys.readouterr().out  # it said 100%, a ratio the command refuses


def test_the_pruning_figure_names_the_prune_ratio_as_given(tmp_path, drawn):
    """The figure's title rounded the ratio to a whole percent: 0.999 was "100%", 0.125 "12%", 0.004 "0%"."""
    blk = BlockImportance("stages.0.blocks.0", 0, 0)
    blk.q = [torch.tensor([0.1, 0.2], dtype=torch.float64)]
    blk.v = [torch.tensor([5.0, 6.0], dtype=torch.float64)]
    for ratio, said in ((0.999, "99.9 %"), (0.125, "12.5 %"), (0.004, "0.4 %"), (0.3, "30 %")):
        plot_importance([blk], ratio, tmp_path, title="(m0)")
        (ax,) = drawn["taylor_pruning.png"].axes
        assert ax.get_title() == f"kept after pruning the least important {said} (m0)"


def test_taylor_importance_of_a_model_without_cgavit_modules_says_so():
    """timm's own EfficientViT has .stages[i].blocks but none of cgavit's modules: the error said every gradient was
    zero and asked for a trained checkpoint, which would not have helped."""
    timm = pytest.importorskip("timm")
    from cgavit.analysis import taylor_importance

    model = timm.create_model("efficientvit_m0", num_classes=3)
    with pytest.raises(ValueError, match="has no cgavit attention or FFN modules.*cgavit.create_model"):
        taylor_importance(model, [(torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))])


# ----------------------------------------------------------------------------- second review: overflow, one class
def _saved(tmp_path, model, name="w.safetensors"):
    """``model`` written as a file of this package (48 px, two named classes or as many as it has)."""
    from cgavit import save_weights
    from cgavit.schema import WeightsMeta

    names = tuple("ab"[:model.num_classes]) if model.num_classes <= 2 else tuple(map(str, range(model.num_classes)))
    path = tmp_path / name
    save_weights(model, path, WeightsMeta(model="efficientvit_m0", config=model.cfg, num_classes=model.num_classes,
                                          class_names=names, img_size=48, crop_pct=1.0))
    return path


def _overflowing(scale=1e37):
    """A randomised tiny model whose first Q/K/V weights are multiplied by ``scale``: finite weights, whose
    attention logits overflow."""
    model = randomize_(create_model("m0", num_classes=2, img_size=48, **TINY))
    with torch.no_grad():
        model.stages[0].blocks[0].mixer.m.attn.qkvs[0].conv.weight.mul_(scale)
    return model


def test_analyses_refuse_outputs_that_overflow(tmp_path):
    """Weights x 1e37 (finite, so the load check passes them) gave NaN similarities and importances, null means and a
    pruning list of zeros, with exit 0."""
    model, x = _overflowing(), torch.randn(4, 3, 48, 48)
    with pytest.raises(ValueError, match=r"loss of image batch 1 of 2 is not finite: the model's outputs overflow from "
                                         r"stages\.0\.blocks\.0 on .*another checkpoint"):
        taylor_importance(model, [(x[:2], None), (x[2:], None)])
    with pytest.raises(ValueError, match=r"attention maps of stages\.0\.blocks\.0\.mixer\.m\.attn are not finite on image "
                                         r"batch 1: .*overflow .*another checkpoint"):
        head_similarity(model, [x[:2], x[2:]])


def test_analyze_commands_refuse_outputs_that_overflow_and_write_nothing(tmp_path, capsys):
    path = _saved(tmp_path, _overflowing())
    data = _image_folder(tmp_path / "data", size=48)
    for analysis in ("heads", "taylor"):
        out = tmp_path / analysis
        assert main(["analyze", analysis, "--checkpoint", str(path), "--data", str(data), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cgavit analyze: error: ") and "overflow" in err and len(err.strip().splitlines()) == 1
        assert not out.exists()


def test_importances_that_are_not_finite_are_refused():
    """The last guard: the loss of every batch was finite, but an importance is not (its float32 sum overflowed)."""
    from cgavit.analysis.taylor import _check_importances

    blk = BlockImportance("stages.1.blocks.0", 1, 0)
    blk.q = [torch.tensor([1.0, float("inf")], dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"importances of stages\.1\.blocks\.0 are not finite"):
        _check_importances([blk], 2.0)


def test_taylor_of_one_class_says_its_loss_is_zero(tmp_path, capsys):
    """A one-class model was refused as randomly initialised weights with zero BatchNorms: its cross-entropy is
    zero whatever the weights."""
    one = randomize_(create_model("m0", num_classes=1, img_size=48, **TINY))
    with pytest.raises(ValueError, match="two classes or more, but this one has 1: .*cross-entropy"):
        taylor_importance(one, [(torch.randn(2, 3, 48, 48), None)])
    data = _image_folder(tmp_path / "data", size=48)
    assert main(["analyze", "taylor", "--checkpoint", str(_saved(tmp_path, one)), "--data", str(data),
                 "--output", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "two classes or more" in err and "BatchNorm" not in err and not (tmp_path / "t").exists()


def test_taylor_of_a_model_without_classifier_says_so(tmp_path, capsys):
    """A features_only save (no classifier) was told to analyse 'a model trained on two classes or more', though it
    may have been trained on many: what it lacks is the classifier."""
    features = randomize_(create_model("m0", features_only=True, img_size=48, **TINY))
    saved = save_weights(features, tmp_path / "features.safetensors")
    data = _image_folder(tmp_path / "data", size=48)
    assert main(["analyze", "taylor", "--checkpoint", str(saved), "--data", str(data), "--output", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "has 0: no classifier (a features_only" in err and "trained on two" not in err and not (tmp_path / "t").exists()


def test_all_zero_importance_blames_a_zero_loss_only_when_it_is_zero():
    # the projection x 1e10 makes the model certain of its own predictions: a loss of exactly 0, BatchNorms not zero
    model = _overflowing(1.0)
    with torch.no_grad():
        model.stages[0].blocks[0].mixer.m.attn.proj[-1].conv.weight.mul_(1e10)
    with pytest.raises(ValueError, match="the loss is zero on every image") as err:
        taylor_importance(model, [(torch.randn(2, 3, 48, 48), None)])
    assert "BatchNorm" not in str(err.value)


def test_an_empty_output_is_refused(tmp_path, monkeypatch, capsys):
    """--output "" was accepted, and the report and figures were written into the folder the command ran in."""
    data = _image_folder(tmp_path / "data")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for output in ("", "  "):
        with pytest.raises(ValueError, match=f"--output must name a folder.*got {output!r}"):
            AnalysisConfig(output=output, data=str(data)).validate()
        assert main(["analyze", "heads", "--data", str(data), "--output", output, "--img-size", "64", "--num-images", "2",
                     "--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "2,2,2"]) == 2
        assert "cgavit analyze: error: --output must name a folder" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_an_output_inside_the_data_folder_is_refused(tmp_path, capsys):
    """--output DIR with --data DIR (or a folder under it) wrote the PNG figures among the images: the next run on
    that folder analysed them as images (a flat folder), or as a class of its own (DIR/heads)."""
    data = _image_folder(tmp_path / "data")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    small = ["--img-size", "64", "--num-images", "2", "--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "2,2,2"]
    for output in (data, data / "heads", data / "class0"):
        with pytest.raises(ValueError, match="is inside --data"):
            AnalysisConfig(output=str(output), data=str(data)).validate()
        assert main(["analyze", "heads", "--data", str(data), "--output", str(output), *small]) == 2
        assert f"cgavit analyze: error: --output {output} is inside --data {data}" in capsys.readouterr().err
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before
    AnalysisConfig(output=str(tmp_path / "data-heads"), data=str(data)).validate()  # beside it, with a shared prefix


def test_an_output_inside_the_folder_of_the_image_files_is_refused_as_inside_data(tmp_path, capsys):
    """Image files given with --output in their own folder (or under it) were analysed and the figures written beside
    them, where --data of that folder was refused: the next run on those files (photos/*.png) or that folder read the
    figures as images."""
    photos = tmp_path / "photos"
    _image_folder(photos, classes=1)
    files = [str(p) for p in sorted((photos / "class0").iterdir())]
    before = sorted(photos.rglob("*"))
    small = ["--img-size", "64", "--num-images", "2", "--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "2,2,2"]
    for output in (photos / "class0", photos / "class0" / "heads", photos / "class0" / "class0"):
        with pytest.raises(ValueError, match=f"is inside {photos / 'class0'}, the folder of {files[-1]}"):
            AnalysisConfig(output=str(output), images=tuple(files)).validate()
        assert main(["analyze", "heads", *files, "--output", str(output), *small]) == 2
        err = capsys.readouterr().err
        assert f"cgavit analyze: error: --output {output} is inside {photos / 'class0'}, the folder of" in err
        assert "give an --output outside it" in err and len(err.strip().splitlines()) == 1
    assert sorted(photos.rglob("*")) == before
    AnalysisConfig(output=str(photos / "heads"), images=tuple(files)).validate()  # beside the files' folder
    with pytest.raises(ValueError, match=f"is inside the image folder {photos}:"):  # a folder given as the one source
        AnalysisConfig(output=str(photos / "heads"), images=(str(photos),)).validate()


def test_an_output_that_is_a_file_is_refused_before_the_analysis_runs(tmp_path, monkeypatch, capsys):
    """--output naming a file (or a path under one) was refused only when the report was written, after the model had
    run on every image: minutes of a large Taylor analysis, lost to a typo."""
    data = _image_folder(tmp_path / "data")
    (tmp_path / "file").write_text("mine")
    monkeypatch.setattr(reports, "head_similarity", lambda *a: pytest.fail("the analysis ran"))
    small = ["--img-size", "64", "--num-images", "2", "--embed-dim", "16,24,32", "--depth", "1,1,1", "--num-heads", "2,2,2"]
    for output in (tmp_path / "file", tmp_path / "file" / "heads"):
        assert main(["analyze", "heads", "--data", str(data), "--output", str(output), *small]) == 2
        err = capsys.readouterr().err
        assert err == f"cgavit analyze: error: --output {output} cannot be a folder: {tmp_path / 'file'} is a file; give a " \
                      "folder for the report and figures, e.g. --output out/analysis\n"
    assert (tmp_path / "file").read_text() == "mine"


def test_stages_and_blocks_are_named_alike_in_the_figures_the_printout_and_the_json(tmp_path, capsys, trained_digits, drawn):
    """The figures named stages and blocks from 1 (s2.b1, stage 2), the printed tables and the JSON from 0 (the module
    path stages.1.blocks.0, stage 1): a reader comparing heads_mean.png with heads.json read the wrong block."""
    small = ["--img-size", "64", "--num-images", "2", "--embed-dim", "16,24,32", "--depth", "1,2,1", "--num-heads", "2,2,2"]
    data = str(_image_folder(tmp_path / "data"))
    assert main(["analyze", "heads", "--data", data, "--output", str(tmp_path / "h"), *small]) == 0
    blocks = json.loads((tmp_path / "h" / "heads.json").read_text())["blocks"]
    ticks = [t.get_text() for t in drawn["heads_mean.png"].axes[0].get_xticklabels()]
    assert ticks == [b["label"] for b in blocks] == ["s1.b1", "s2.b1", "s2.b2", "s3.b1"]
    assert blocks[2]["name"].startswith("stages.1.blocks.1.") and (blocks[2]["stage"], blocks[2]["block"]) == (1, 1)
    rows = capsys.readouterr().out.splitlines()[1:5]
    assert [r.split()[:2] for r in rows] == [[b["label"], b["name"]] for b in blocks]
    val = str(trained_digits.data / "val")
    assert main(["analyze", "taylor", "--checkpoint", str(trained_digits.checkpoint), "--data", val, "--num-images", "10",
                 "--output", str(tmp_path / "t")]) == 0
    rep = json.loads((tmp_path / "t" / "taylor.json").read_text())
    assert [b["label"] for b in rep["blocks"]] == ["s1.b1", "s2.b1", "s3.b1"] and list(rep["kept_fraction"]) == ["0", "1", "2"]
    assert [ax.get_title() for ax in drawn["taylor_spread.png"].axes] == ["stage 1", "stage 2", "stage 3"]
    out = capsys.readouterr().out
    assert "  stage 1 (stages.0): Q " in out and "\ns1.b1   stages.0.blocks.0 " in out


def test_labels_of_a_partial_folder_by_index_are_warned_about(tmp_path, capsys, caplog):
    """--targets labels with weights that record no class names took a folder of some of the model's classes as its
    first ones, by position, with no warning: folders 3 and 7 of a digits model were trained against classes 0 and 1."""
    model = randomize_(create_model("m0", num_classes=4, img_size=48, **TINY))
    save_weights(model, tmp_path / "w.safetensors")  # the architecture, no class names
    args = ["analyze", "taylor", "--checkpoint", str(tmp_path / "w.safetensors"), "--img-size", "48", "--targets", "labels"]
    for classes, output in ((2, "t2"), (4, "t4")):
        data = _image_folder(tmp_path / f"data{classes}", classes=classes, per_class=1, size=48)
        caplog.clear()
        with caplog.at_level("WARNING", logger=reports.log.name):
            assert main([*args, "--data", str(data), "--output", str(tmp_path / output)]) == 0
        warned = [r.getMessage() for r in caplog.records if r.name == reports.log.name]
        out = capsys.readouterr().out
        if classes == 4:  # as many classes as the model: by index, as auto takes them, without a word
            assert warned == [] and "(by index: the weights record no class names)" in out
            continue
        assert warned == ["the weights record no class names: the folder's 2 classes (class0, class1) are taken as the "
                          "model's classes 0-1 of 4 in sorted order; a folder of other classes is mislabelled: use "
                          "--targets predictions unless these are the model's first 2"]
        assert "(by index, as the model's first 2 of 4 classes: the weights record no class names)" in out


def test_the_speed_accuracy_labels_cover_no_other_label_point_or_frame(tmp_path, drawn):
    """ablation_speed_accuracy.png chose each label's corner by the rung's number (1 and 5 alike), not by where the
    points lie: rungs 1 and 5 at about the same speed and top-1 had their labels drawn over each other."""
    from cgavit.analysis.plots import scatter

    points = [(100, 40, "1 standard"), (300, 42, "2 sandwich"), (200, 45, "3 groups"), (250, 38, "4 cascade"),
              (102, 40.1, "5 realloc")]
    scatter(points, tmp_path / "s.png", "CPU images/s", "top-1 %")
    fig = drawn["s.png"]
    fig.canvas.draw()
    (ax,) = fig.axes
    boxes = [t.get_window_extent() for t in ax.texts]
    assert [t.get_text() for t in ax.texts] == [lab for *_, lab in points]
    assert not [(i, j) for i, j in itertools.combinations(range(len(boxes)), 2) if boxes[i].overlaps(boxes[j])]
    marks = [ax.transData.transform((x, y)) for x, y, _ in points]
    assert not [b for b in boxes for m in marks if b.contains(*m)]
    frame = ax.get_window_extent()
    assert all(frame.contains(b.x0, b.y0) and frame.contains(b.x1, b.y1) for b in boxes)
