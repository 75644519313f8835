"""Detection: the paper's pyramid on EfficientViT, ImageNet weights, COCO data checks, training,
resume, COCOeval, the ``cgavit detect`` commands and ``torchrun``.

Everything runs on a generated COCO-format dataset of coloured shapes at 128 px with the smallest
backbone (m0), one intra-op thread.
"""

import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import cgavit
from cgavit.attention import CascadedGroupAttention
from cgavit.cli import main
from cgavit.testing import randomize_, rel_err
from cgavit.attention import resize_bias_table
from cgavit.io import CheckpointError, save_torch
from cgavit.weights import save_weights

pytest.importorskip("torchvision")
pytest.importorskip("pycocotools")

from torchvision.models.detection import MaskRCNN, RetinaNet  # noqa: E402
from timm.layers import freeze_batch_norm_2d  # noqa: E402
from torchvision.ops import FrozenBatchNorm2d  # noqa: E402
from torchvision.transforms.v2.functional import pil_to_tensor  # noqa: E402

from cgavit.detection import (  # noqa: E402
    CocoDetection,
    DetectionTrainConfig,
    check_coco,
    detection_body,
    draw_detections,
    evaluate,
    evaluate_checkpoint,
    load_detector,
    maskrcnn,
    predict_images,
    retinanet,
    train,
    write_shapes_dataset,
)
from cgavit.detection.coco import decode_masks, encode_masks, rle_box_area, segmentation_rle  # noqa: E402
from cgavit.detection import shapes as shapes_module  # noqa: E402
from cgavit.detection.checkpoint import CHECKPOINT_FORMAT  # noqa: E402
from cgavit.detection.models import build_detector  # noqa: E402
from cgavit.detection.engine import coco_metrics, lr_factor, param_groups, read_checkpoint, to_coco_results  # noqa: E402

SIZE = 128
SMALL_RCNN = dict(box_batch_size_per_image=32, rpn_batch_size_per_image=64, rpn_post_nms_top_n_train=200, box_detections_per_img=10)


pytestmark = pytest.mark.usefixtures("one_thread")  # detection tests run on one intra-op thread


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    train_dir, train_json = write_shapes_dataset(root, 2, SIZE, seed=0, split="train")
    val_dir, val_json = write_shapes_dataset(root, 3, SIZE, seed=1, split="val")
    return dict(root=root, train_images=str(train_dir), train_json=str(train_json), val_images=str(val_dir), val_json=str(val_json))


def _config(shapes, out, **kw):
    base = dict(
        train_json=shapes["train_json"], train_images=shapes["train_images"], output=str(out), model="retinanet",
        backbone="efficientvit_m0", freeze_bn=False, min_size=SIZE, max_size=SIZE, warmup_iters=0, lr=2e-4,
        lr_steps=(), batch_size=2, workers=0, log_every=1, device="cpu",
    )
    base.update(kw)
    return DetectionTrainConfig(**base)


def _epoch_rows(out):
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"]


# ----------------------------------------------------------------------------------- model / backbone
def _conv_out(n, times):
    for _ in range(times):
        n = (n - 1) // 2 + 1
    return n


@pytest.mark.parametrize("hw", [(333, 500), (64, 97), (32, 32)])
def test_pyramid_levels_at_any_size(hw):
    for build, names, finer in ((retinanet, ("p3", "p4", "p5", "p6", "p7"), 1), (maskrcnn, ("p2", "p3", "p4", "p5", "p6"), 2)):
        model = build("efficientvit_m0", num_classes=3).eval()
        fpn = model.backbone
        assert fpn.out_channels == 256 and fpn.level_names == names
        with torch.no_grad():
            feats = fpn(torch.randn(1, 3, *hw))
        assert tuple(feats) == names
        s16 = [_conv_out(n, 4) for n in hw]  # the backbone's stride-16 map
        expect = [[n * 2**k for n in s16] for k in range(finer, 0, -1)] + [s16, [_conv_out(n, 1) for n in s16], [_conv_out(n, 2) for n in s16]]
        if build is retinanet:
            expect.append([_conv_out(n, 3) for n in s16])
        for (name, f), want in zip(feats.items(), expect):
            assert f.shape == (1, 256, *want), name


def test_detectors_script_as_torchvisions_do(tmp_path):
    """torch.jit.script(retinanet(...)), which torchvision's own detectors take, failed ('Unknown type constructor
    OrderedDict' in the backbone, forward_intermediates' Python, an unannotated ImageList). The scripted backbone,
    saved and loaded, gives the eager one's levels, names and values; the scripted detectors run."""
    for build in (retinanet, maskrcnn):
        model = build("efficientvit_m0", num_classes=3, min_size=97, max_size=131, freeze_bn=False).eval()
        randomize_(model.backbone.body, 6)
        path = str(tmp_path / "fpn.pt")
        torch.jit.script(model.backbone).save(path)
        x = torch.randn(2, 3, 97, 131)
        with torch.no_grad():
            eager, scripted = model.backbone(x), torch.jit.load(path)(x)
            assert list(scripted) == list(eager) == list(model.backbone.level_names)
            for a, b in zip(eager.values(), scripted.values()):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            losses, detections = torch.jit.script(model)([torch.rand(3, 97, 131), torch.rand(3, 120, 61)])
        assert len(detections) == 2 and all(d["boxes"].shape[1:] == (4,) for d in detections)


def test_detectors_are_torchvision_models_with_7x7_windows_and_frozen_bn():
    rn = retinanet("efficientvit_m0", num_classes=5, min_size=150, max_size=200)
    mr = maskrcnn("efficientvit_m0", num_classes=5)
    assert isinstance(rn, RetinaNet) and isinstance(mr, MaskRCNN)
    for model in (rn, mr):
        body = model.backbone.body
        windows = [m.window for m in body.modules() if isinstance(m, CascadedGroupAttention)]
        assert windows and set(windows) == {7}
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in body.modules())
        assert any(isinstance(m, FrozenBatchNorm2d) for m in body.modules())
        assert isinstance(body.head, nn.Identity)
    # anchors: RetinaNet 4*stride*2^(i/3) x 3 ratios on strides 8..128; Mask R-CNN RPN 8*stride on 4..64
    assert [s[0] for s in rn.anchor_generator.sizes] == [32, 64, 128, 256, 512]
    assert rn.anchor_generator.num_anchors_per_location() == [9] * 5
    assert [s[0] for s in mr.rpn.anchor_generator.sizes] == [32, 64, 128, 256, 512]
    assert mr.roi_heads.box_roi_pool.featmap_names == ["p2", "p3", "p4", "p5"]
    # anchors sit at multiples of each level's stride whatever the padded size (here 160x224)
    rn.eval()
    images, _ = rn.transform([torch.rand(3, 150, 200)])
    assert tuple(images.tensors.shape[-2:]) == (160, 224)  # padded to a multiple of 32 only
    feats = list(rn.backbone(images.tensors).values())
    anchors = rn.anchor_generator(images, feats)[0]
    start = 0
    for stride, f in zip(rn.backbone.strides, feats):
        n = f.shape[-2] * f.shape[-1] * 9
        centres = (anchors[start:start + n, :2] + anchors[start:start + n, 2:]) / 2
        start += n
        assert torch.allclose(centres.unique(), torch.arange(0, max(f.shape[-2:]) * stride, stride).float()[: len(centres.unique())])
        assert centres.max() == (max(f.shape[-2:]) - 1) * stride


def test_timm_freeze_batch_norm_keeps_the_function_and_drops_the_parameters():
    """timm's ``freeze_batch_norm_2d``, which ``detection_body(freeze_bn=True)`` applies, on our network."""
    model = cgavit.create_model("efficientvit_m0", num_classes=0, img_size=128)
    randomize_(model, seed=3)
    model.eval()
    x = torch.randn(2, 3, 128, 96)
    with torch.no_grad():
        ref = model.forward_intermediates(x, intermediates_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    n_bn = sum(2 * m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    frozen = freeze_batch_norm_2d(model).train()  # train mode: frozen BN still uses the stored statistics
    with torch.no_grad():
        out = frozen.forward_intermediates(x, intermediates_only=True)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(out, ref))
    assert sum(p.numel() for p in frozen.parameters()) == n_params - n_bn


@pytest.mark.parametrize("freeze_bn", [True, False])
@pytest.mark.parametrize("trainable", [0, 2, 4])
def test_trainable_backbone_layers_freezes_the_leading_parts_and_their_batchnorm(freeze_bn, trainable):
    """torchvision's ``trainable_backbone_layers`` on cgavit's four parts (patch embedding, stages 1-3): the parts
    before the last ``trainable`` keep every parameter and BatchNorm statistic through a training step, with or
    without --train-bn; the others, the FPN and the head learn."""
    torch.manual_seed(0)
    model = retinanet("efficientvit_m0", num_classes=3, freeze_bn=freeze_bn, trainable_backbone_layers=trainable,
                      min_size=96, max_size=96)
    body = model.backbone.body
    parts = [body.patch_embed, *body.stages]
    frozen, trained = parts[:4 - trainable], parts[4 - trainable:]
    assert all(not p.requires_grad for part in frozen for p in part.parameters())
    assert all(p.requires_grad for part in trained for p in part.parameters())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for part in frozen for m in part.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for part in trained for m in part.modules()) == (not freeze_bn and trainable > 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-2)
    targets = [dict(boxes=torch.tensor([[10.0, 12.0, 60.0, 70.0]]), labels=torch.tensor([1]))] * 2
    sum(model.train()([torch.rand(3, 96, 96), torch.rand(3, 96, 96)], targets).values()).backward()
    optimizer.step()
    after = model.state_dict()
    for i, part in enumerate(parts):
        prefix = "backbone.body." + ("patch_embed." if i == 0 else f"stages.{i - 1}.")
        changed = [k for k in after if k.startswith(prefix) and not torch.equal(before[k], after[k])]
        assert (not changed) == (part in frozen), (i, changed[:3])
    assert not torch.equal(before["backbone.fpn.layer_blocks.0.0.weight"], after["backbone.fpn.layer_blocks.0.0.weight"])


def test_trainable_backbone_layers_is_checked_stored_and_rebuilt(shapes, tmp_path, capsys):
    """The option's bounds (0..4) are checked by the builders and ``detect train``; a run stores it, its
    ``model.pth`` is rebuilt with it, and a resume with another value is refused."""
    body = maskrcnn("efficientvit_m0", num_classes=3, trainable_backbone_layers=None).backbone.body  # torchvision's default
    assert all(p.requires_grad for p in body.parameters())
    for bad in (-1, 5, 2.0, True, "2"):
        with pytest.raises(ValueError, match=r"'trainable_backbone_layers' must be a whole number in 0\.\.4"):
            maskrcnn("efficientvit_m0", num_classes=3, trainable_backbone_layers=bad)
    argv = ["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
            "--backbone", "efficientvit_m0", "--train-bn", "--min-size", "96", "--max-size", "96", "--epochs", "1",
            "--warmup-iters", "0", "--device", "cpu", "--workers", "0", "--output", str(tmp_path / "run")]
    assert main([*argv, "--trainable-backbone-layers", "5"]) == 2
    assert "--trainable-backbone-layers must be a whole number in 0..4, got 5" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main([*argv, "--trainable-backbone-layers", "1"]) == 0
    model, config = load_detector(tmp_path / "run" / "model.pth")
    assert config["trainable_backbone_layers"] == 1
    assert [any(p.requires_grad for p in part.parameters()) for part in [model.backbone.body.patch_embed,
            *model.backbone.body.stages]] == [False, False, False, True]
    with pytest.raises(ValueError, match=r"holds another detector than this run asks for \(trainable_backbone_layers 1 there, 4 here\); they must match to resume"):
        train(_config(shapes, tmp_path / "run", epochs=2, resume="auto", min_size=96, max_size=96))


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
def test_imagenet_checkpoint_loads_into_the_detection_backbone(tmp_path, fmt):
    cls = cgavit.create_model("efficientvit_m0", num_classes=1000)  # built at 224: last-stage window 4
    randomize_(cls, seed=1)
    if fmt == "safetensors":
        path = save_weights(cls, tmp_path / "m0.safetensors")
    else:
        path = tmp_path / "m0.pth"
        torch.save({"model": cls.state_dict(), "epoch": 300}, path)
    body = detection_body("efficientvit_m0", pretrained=path)
    got, src = body.state_dict(), cls.state_dict()
    resized = []
    for key, value in src.items():
        if key.startswith("head") or key.endswith("num_batches_tracked"):
            assert key not in got
            continue
        if key.endswith("attention_biases") and value.shape != got[key].shape:
            resized.append(key)
            assert torch.allclose(got[key], resize_bias_table(value, 7))
            assert got[key].shape[1] == 49
        else:
            assert torch.equal(got[key], value), key
    assert resized and all(k.startswith("stages.2.") for k in resized)  # only the 4x4 last stage


def test_inference_at_800x1333_and_333x500():
    model = retinanet("efficientvit_m0", num_classes=4).eval()  # default resize: 800 / 1333
    with torch.no_grad():
        (out,) = model([torch.rand(3, 800, 1333)])
    assert set(out) == {"boxes", "scores", "labels"} and out["boxes"].shape[1] == 4
    model = maskrcnn("efficientvit_m0", num_classes=4, min_size=333, max_size=500, box_detections_per_img=10).eval()
    with torch.no_grad():
        (out,) = model([torch.rand(3, 333, 500)])  # processed at its own size (padded to 352x512)
    assert out["masks"].shape[1:] == (1, 333, 500) and len(out["masks"]) == len(out["boxes"])


# ------------------------------------------------------------------------------------------- recipe
def test_schedule_and_weight_decay_groups():
    milestones = [8 * 100, 11 * 100]
    assert lr_factor(0, 500, 0.001, milestones) == pytest.approx(0.001)
    assert lr_factor(250, 500, 0.001, milestones) == pytest.approx(0.5005)
    assert lr_factor(500, 500, 0.001, milestones) == 1.0
    assert lr_factor(799, 500, 0.001, milestones) == 1.0
    assert lr_factor(800, 500, 0.001, milestones) == pytest.approx(0.1)
    assert lr_factor(1100, 500, 0.001, milestones) == pytest.approx(0.01)
    model = retinanet("efficientvit_m0", num_classes=3)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    assert no_decay["weight_decay"] == 0 and decay["weight_decay"] == 0.05
    assert no_decay["params"] and all(names[id(p)].endswith("attention_biases") for p in no_decay["params"])


# -------------------------------------------------------------------------------------- data checks
def test_train_prints_the_loss_and_the_coco_scores_only():
    """RetinaNet's bbox_regression loss was printed among the bbox_* scores (its classification loss not)."""
    from cgavit.cli.detect import shown_metrics

    record = dict(type="epoch", epoch=1, lr=1e-4, loss=2.43621, bbox_regression=1.3, classification=1.1, bbox_AP=0.5, segm_AP50=0.25)
    assert shown_metrics(record) == {"loss": 2.4362, "bbox_AP": 0.5, "segm_AP50": 0.25}


def _bad_json(shapes, tmp_path, edit):
    data = json.loads(Path(shapes["train_json"]).read_text())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


def test_bad_annotations_are_named(shapes, tmp_path, capsys):
    def edit(d):
        anns = d["annotations"]
        anns[0]["image_id"] = 999  # no such image
        anns[1]["category_id"] = 42  # no such category
        d["images"].append(dict(id=50, file_name="gone.png", height=SIZE, width=SIZE))
        anns.append(dict(id=77, image_id=50, category_id=1, bbox=[1, 1, 5, 5], iscrowd=0, area=25, segmentation=[[1, 1, 6, 1, 6, 6]]))

    path = _bad_json(shapes, tmp_path, edit)
    a0, a1 = (a["id"] for a in json.loads(path.read_text())["annotations"][:2])
    with pytest.raises(ValueError) as err:
        check_coco(path, shapes["train_images"])
    text = str(err.value)
    assert f"annotation {a0} (image 999)" in text
    assert f"annotation {a1} (image" in text and "category_id 42" in text
    assert "image 50: gone.png" in text and "annotation 77 (image 50 gone.png)" in text
    code = main(["detect", "train", "--train-json", str(path), "--train-images", shapes["train_images"], "--output", str(tmp_path / "o")])
    assert code == 2
    assert "category_id 42" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_degenerate_boxes_skipped_with_warning_or_refused_with_strict(shapes, tmp_path, caplog):
    def edit(d):
        d["annotations"][0]["bbox"][2] = 0  # zero width
        d["annotations"][1]["bbox"] = [SIZE + 5, 3, 10, 10]  # outside the image

    path = _bad_json(shapes, tmp_path, edit)
    anns = json.loads(path.read_text())["annotations"]
    with caplog.at_level(logging.WARNING):
        check = check_coco(path, shapes["train_images"])
    assert len(check.dataset["annotations"]) == len(anns) - 2
    assert f"annotation {anns[0]['id']} " in caplog.text and f"annotation {anns[1]['id']} " in caplog.text
    assert "width or height <= 0" in caplog.text and "outside the" in caplog.text
    with pytest.raises(ValueError, match=f"annotation {anns[0]['id']} .*width or height <= 0"):
        check_coco(path, shapes["train_images"], strict=True)
    # Mask R-CNN needs masks: none at all is an error, a two-point polygon is degenerate
    missing = _bad_json(shapes, tmp_path, lambda d: d["annotations"][0].pop("segmentation"))
    with pytest.raises(ValueError, match=f"annotation {anns[0]['id']} .*no segmentation"):
        check_coco(missing, shapes["train_images"], require_masks=True)
    line = _bad_json(shapes, tmp_path, lambda d: d["annotations"][0].update(segmentation=[[1, 1, 9, 9]]))
    assert len(check_coco(line, shapes["train_images"], require_masks=True).skipped) == 1
    with pytest.raises(ValueError, match=f"annotation {anns[0]['id']} .*polygon 1 has 2 points"):
        check_coco(line, shapes["train_images"], require_masks=True, strict=True)


# --------------------------------------------------------------------------------------- evaluation
def test_coco_metrics_of_the_ground_truth_is_perfect(shapes):
    ds = CocoDetection(check_coco(shapes["val_json"], shapes["val_images"], require_masks=True), shapes["val_images"], masks=True)
    label_to_cat = [0] + [c for c, _ in ds.categories]
    exact, shifted = [[], []], [[], []]
    for i in range(len(ds)):
        _, t = ds[i]
        n = len(t["labels"])
        out = dict(boxes=t["boxes"], labels=t["labels"], scores=torch.linspace(1, 0.5, n), masks=t["masks"][:, None].float())
        for acc, o in ((exact, out), (shifted, {**out, "boxes": out["boxes"] + 6.0, "masks": out["masks"].roll(6, -1)})):
            b, s = to_coco_results(t["image_id"], o, label_to_cat)
            acc[0] += b
            acc[1] += s
    assert {r["category_id"] for r in exact[0]} <= {1, 3, 7}  # COCO ids, not contiguous labels
    for kind, k in (("bbox", 0), ("segm", 1)):
        good, table = coco_metrics(ds.coco, exact[k], kind)
        assert good["AP"] == pytest.approx(1.0) and good["AP50"] == pytest.approx(1.0), table
        bad, _ = coco_metrics(ds.coco, shifted[k], kind)
        assert bad["AP"] < 0.9 and set(bad) >= {"AP", "AP50", "AP75", "APs", "APm", "APl"}
    none, text = coco_metrics(ds.coco, [], "bbox")
    assert none["AP"] == 0 and "no detections" in text


def test_retinanets_background_detections_are_of_no_category_in_the_coco_results():
    # a dataset whose category ids are 0 and 5 (as many exported ones are): label 1 is category 0, label 0 RetinaNet's
    # background, whose detections were scored as category 0's before
    label_to_cat = [0, 0, 5]
    output = dict(boxes=torch.tensor([[0.0, 0, 4, 4], [1, 1, 6, 6], [2, 2, 9, 9]]), labels=torch.tensor([0, 1, 2]),
                  scores=torch.tensor([0.9, 0.8, 0.7]), masks=torch.ones(3, 1, 10, 10))
    bbox, segm = to_coco_results(3, output, label_to_cat)
    assert [r["category_id"] for r in bbox] == [0, 5] and [r["category_id"] for r in segm] == [0, 5]
    assert [r["score"] for r in bbox] == pytest.approx([0.8, 0.7]) and bbox[0]["bbox"] == [1.0, 1.0, 5.0, 5.0]


def test_draw_detections_leaves_out_retinanets_background():
    """draw_detections of a RetinaNet's output drew its label-0 detections, boxes named "background"."""
    image = torch.zeros(3, 40, 40, dtype=torch.uint8)
    output = dict(boxes=torch.tensor([[2.0, 2, 20, 20], [10, 10, 30, 30]]), labels=torch.tensor([0, 1]),
                  scores=torch.tensor([0.9, 0.8]))
    assert torch.equal(draw_detections(image, {k: v[:1] for k, v in output.items()}, ["background", "square"]), image)
    drawn = draw_detections(image, output, ["background", "square"])
    assert drawn[:, 2, 2].eq(0).all() and drawn[:, 10, 10].ne(0).any()  # only the square's box, from (10, 10)


def test_rle_helpers_round_trip():
    masks = torch.zeros(2, 12, 10, dtype=torch.uint8)
    masks[0, 2:5, 3:8] = 1
    masks[1, 6:12, 0:2] = 1
    rles = encode_masks(masks.numpy())
    assert all(isinstance(r["counts"], str) for r in rles)  # JSON-ready
    assert json.loads(json.dumps(rles)) == rles
    assert torch.equal(torch.from_numpy(decode_masks(rles)).permute(2, 0, 1), masks)
    assert rle_box_area(rles[0]) == ([3.0, 2.0, 5.0, 3.0], 15.0)
    square = segmentation_rle([[3, 2, 8, 2, 8, 5, 3, 5]], 12, 10)  # polygon -> RLE
    assert rle_box_area(square)[0] == [3.0, 2.0, 5.0, 3.0]
    assert segmentation_rle(rles[1], 12, 10) is rles[1]  # already compressed


def test_predict_checks_inputs_first(shapes, tmp_path):
    image = Path(shapes["val_images"]) / "val_00000.png"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        predict_images(tmp_path / "none.pth", [tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="looks like a file"):
        predict_images(tmp_path / "none.pth", [image, image], out=tmp_path / "one.png")
    with pytest.raises(CheckpointError):
        predict_images(tmp_path / "none.pth", [image], device="cpu")
    with pytest.raises(ValueError, match="give the evaluation data"):
        evaluate_checkpoint(tmp_path / "none.pth", "", shapes["val_images"])


@pytest.mark.parametrize("kind, settings", [
    ("retinanet", {}),  # its own score_thresh 0.05; untrained, it scores about 0.01 (its classifier's prior)
    ("maskrcnn", dict(box_score_thresh=0.5, rpn_post_nms_top_n_test=20)),  # untrained: about 1/4 (softmax of 4)
])
def test_predict_lists_every_detection_down_to_the_threshold_it_names(shapes, tmp_path, capsys, kind, settings):
    """`detect predict --score-threshold 0.01` said "0 detections >= 0.01": the detector had dropped every
    detection under its own score_thresh (0.05, or a --model-arg of training), a warning aside."""
    config = dict(kind=kind, backbone="efficientvit_m0", num_classes=4, categories=[[1, "square"], [3, "circle"], [7, "triangle"]],
                  freeze_bn=False, dials={}, min_size=64, max_size=64, model_kwargs=settings)
    torch.manual_seed(0)
    model = build_detector(config).eval()
    ckpt = save_torch(tmp_path / "model.pth", dict(format=CHECKPOINT_FORMAT, config=config, model=model.state_dict()))
    image = Path(shapes["val_images"]) / "val_00000.png"
    getattr(model, "roi_heads", model).score_thresh = -1.0  # every detection, whatever its score
    with torch.no_grad():
        output = model([pil_to_tensor(Image.open(image).convert("RGB")).float() / 255])[0]
    scores = output["scores"][output["labels"] > 0]  # RetinaNet's label 0 is the background's: never shown
    threshold = scores.median().item()  # one of the scores itself: "at least" includes it
    expected = int((scores >= threshold).sum())
    assert 0 < expected < len(scores) and scores.max() < (0.05 if kind == "retinanet" else 0.5)
    (pred,) = predict_images(ckpt, [image], tmp_path / "drawn", score_threshold=threshold, device="cpu")
    assert len(pred.scores) == expected and min(pred.scores) == threshold and pred.limit is None
    capsys.readouterr()
    run = ["detect", "predict", str(image), "--checkpoint", str(ckpt), "--device", "cpu", "--out", str(tmp_path / "o.png")]
    assert main([*run, "--score-threshold", repr(threshold)]) == 0
    assert f": {expected} detections >= {threshold} -> " in capsys.readouterr().out
    # a detector that returns at most 5 per image says so when it reaches its limit, naming the setting that sets it
    # (Mask R-CNN's was named detections_per_img, a setting it does not take)
    setting = "detections_per_img" if kind == "retinanet" else "box_detections_per_img"
    config["model_kwargs"] = {**settings, setting: 5}
    save_torch(ckpt, dict(format=CHECKPOINT_FORMAT, config=config, model=model.state_dict()))
    assert main([*run, "--score-threshold", "0"]) == 0
    assert f": 5 detections >= 0.0 (the detector's limit per image, {setting}: more may score as much) -> " in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- training
def test_training_lowers_the_loss_and_evaluates(shapes, tmp_path):
    out = tmp_path / "run"
    metrics = train(_config(shapes, out, epochs=8, hflip=0.0, val_json=shapes["val_json"], val_images=shapes["val_images"], eval_every=0))
    losses = [r["loss"] for r in _epoch_rows(out)]
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < 0.75 * losses[0], losses
    assert {"bbox_AP", "bbox_AP50", "bbox_AP75", "bbox_APs"} <= set(metrics)
    assert (out / "loss.png").stat().st_size > 0
    model, config = load_detector(out / "model.pth")
    assert config["categories"] == [[1, "square"], [3, "circle"], [7, "triangle"]] and config["num_classes"] == 4
    ds = CocoDetection(check_coco(shapes["val_json"], shapes["val_images"]), shapes["val_images"])
    again, _ = evaluate(model, ds, progress=False)
    assert again["bbox_AP"] == pytest.approx(metrics["bbox_AP"])
    # the returned record is the last epoch's, with its evaluation
    assert metrics["epoch"] == 8 and metrics["loss"] == pytest.approx(losses[-1])
    # the typed entry points behind `detect eval` and `detect predict`
    typed, summary = evaluate_checkpoint(out / "model.pth", shapes["val_json"], shapes["val_images"], workers=0, device="cpu")
    assert typed["bbox_AP"] == pytest.approx(metrics["bbox_AP"]) and summary.startswith("bbox")
    image = Path(shapes["val_images"]) / "val_00001.png"
    (pred,) = predict_images(out / "model.pth", [image], tmp_path / "drawn", score_threshold=0.0, device="cpu")
    assert pred.image == image and pred.drawn == tmp_path / "drawn" / "val_00001_pred.png" and pred.drawn.is_file()
    assert len(pred.names) == len(pred.scores) == len(pred.boxes) and set(pred.names) <= {"square", "circle", "triangle"}


def test_resume_continues_exactly(shapes, tmp_path):
    kw = dict(batch_size=1, lr_steps=(1,), warmup_iters=1, hflip=0.5)  # flips, warm-up and an lr step across the cut
    train(_config(shapes, tmp_path / "straight", epochs=2, **kw))
    train(_config(shapes, tmp_path / "cut", epochs=1, **kw))
    ckpt = read_checkpoint(tmp_path / "cut" / "checkpoint.pth")
    assert ckpt["epoch"] == 1 and ckpt["iteration"] == 2
    train(_config(shapes, tmp_path / "cut", epochs=2, resume="auto", **kw))
    a = read_checkpoint(tmp_path / "straight" / "checkpoint.pth")
    b = read_checkpoint(tmp_path / "cut" / "checkpoint.pth")
    assert a["iteration"] == b["iteration"] == 4
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [r["loss"] for r in _epoch_rows(tmp_path / "straight")] == [r["loss"] for r in _epoch_rows(tmp_path / "cut")]
    # an epoch's record gives the rate its last update used (it gave the next epoch's, after the step at epoch 1)
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    for epoch in (1, 2):
        last_step = [r for r in rows if r["type"] == "step" and r["epoch"] == epoch][-1]
        assert [r["lr"] for r in _epoch_rows(tmp_path / "straight") if r["epoch"] == epoch] == [last_step["lr"]]
    with pytest.raises(ValueError, match="must match to resume"):
        train(_config(shapes, tmp_path / "cut", epochs=3, resume="auto", backbone="efficientvit_m1"))
    # another batch size moved the lr steps mid-epoch and the iteration count, without a word
    with pytest.raises(ValueError, match=r"made 4 updates in 2 epochs \(2 per epoch\), and this run makes 1 .*--batch-size \(1\)"):
        train(_config(shapes, tmp_path / "cut", epochs=3, resume="auto", **{**kw, "batch_size": 2}))
    # a finished run resumed with no epoch left is left as it stands (model.pth was rewritten with a wrong epoch)
    model_file = (tmp_path / "cut" / "model.pth").read_bytes()
    assert train(_config(shapes, tmp_path / "cut", epochs=1, resume="auto", **kw)) == {}
    assert (tmp_path / "cut" / "model.pth").read_bytes() == model_file
    with pytest.raises(ValueError, match="leaves nothing to train; give a larger --epochs"):
        train(_config(shapes, tmp_path / "elsewhere", epochs=2, resume=str(tmp_path / "cut" / "checkpoint.pth"), **kw))
    assert not (tmp_path / "elsewhere").exists()
    # the rows an interrupted epoch left are replaced by the epoch trained again, not kept beside it
    metrics = tmp_path / "cut" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + json.dumps(dict(type="step", epoch=3, iter=5, lr=1.0, loss=9.0)) + "\n")
    train(_config(shapes, tmp_path / "cut", epochs=3, resume="auto", **kw))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iter"] for r in rows if r["type"] == "step"] == [1, 2, 3, 4, 5, 6] and 9.0 not in [r["loss"] for r in rows]


def test_a_finished_run_resumed_writes_a_model_pth_that_is_not_its_checkpoints(shapes, tmp_path, caplog):
    """A run resumed with more --epochs and stopped after its last checkpoint.pth, before model.pth (a kill, a full
    disk), kept the model.pth of the epochs before: resumed again, it was 'left as it stands', model.pth and
    checkpoint.pth disagreeing for good (only a missing model.pth was written again)."""
    kw = dict(min_size=64, max_size=64, freeze_bn=True, batch_size=1)
    out = tmp_path / "run"
    train(_config(shapes, out, epochs=1, **kw))
    earlier = (out / "model.pth").read_bytes()
    train(_config(shapes, out, epochs=2, resume="auto", **kw))
    for left in (earlier, earlier[:300]):  # the model.pth of epoch 1, or one whose write was cut short
        (out / "model.pth").write_bytes(left)
        caplog.clear()
        assert train(_config(shapes, out, epochs=2, resume="auto", **kw)) == {}
        model, ckpt = read_checkpoint(out / "model.pth"), read_checkpoint(out / "checkpoint.pth")
        assert model["epoch"] == ckpt["epoch"] == 2 and all(torch.equal(model["model"][k], v) for k, v in ckpt["model"].items())
        assert ("its model.pth holds epoch 1, written before: writing epoch 2's" if left is earlier
                else "writing the model.pth it stopped before") in caplog.text
    caplog.clear()
    assert train(_config(shapes, out, epochs=2, resume="auto", **kw)) == {}
    assert "is left as it stands" in caplog.text


def test_a_resume_writes_the_record_of_the_epoch_its_checkpoint_ended_where_the_run_stopped_before_it(shapes, tmp_path, caplog):
    """An epoch's checkpoint.pth is written before its evaluation and its metrics.jsonl row after: a run killed during
    the evaluation (or on a full disk at the row) resumed past that epoch with no record of it, for good."""
    kw = dict(min_size=64, max_size=64, freeze_bn=True, batch_size=1, val_json=shapes["val_json"],
              val_images=shapes["val_images"])
    out = tmp_path / "run"
    train(_config(shapes, out, epochs=1, **kw))
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["type"] for r in rows] == ["step", "step", "epoch"] and "bbox_AP" in rows[-1]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))  # what a kill during the evaluation leaves
    train(_config(shapes, out, epochs=2, resume="auto", **kw))
    assert f"{metrics} has no record of epoch 1" in caplog.text
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["type"], r["epoch"]) for r in again] == [("step", 1)] * 2 + [("epoch", 1)] + [("step", 2)] * 2 + [("epoch", 2)]
    assert again[2] == rows[2]  # its losses kept by the checkpoint, its evaluation made again on the same weights


def sigterm_after(step, n: int):
    """``step`` (the engine's ``_train_step``) wrapped to send this process a SIGTERM as its ``n``-th call returns, and
    the list of the wrapped calls' results (one per update made)."""
    made = []

    def signalled(*args):
        made.append(step(*args))
        if len(made) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return made[-1]

    return signalled, made


def test_a_signal_mid_epoch_saves_the_run_there_and_resume_goes_on_exactly(shapes, tmp_path, monkeypatch, capsys, caplog):
    """A Ctrl-C or SIGTERM (a job scheduler's) mid-epoch lost every update of the epoch, only the checkpoint of the
    epoch before kept (on COCO, hours of GPUs); `cgavit train` saves where it stopped. Now so does `detect train`,
    and --resume auto goes on from that update to the weights of a run never stopped."""
    kw = dict(epochs=1, batch_size=1, warmup_iters=1, hflip=0.5, freeze_bn=True, min_size=64, max_size=64)
    train(_config(shapes, tmp_path / "straight", **kw))  # two updates, flips and the warm-up across the cut
    from cgavit.detection import engine

    step = engine._train_step
    signalled, made = sigterm_after(step, 1)

    cut = tmp_path / "cut"
    argv = ["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"], "--backbone",
            "m0", "--min-size", "64", "--max-size", "64", "--warmup-iters", "1", "--lr", "2e-4",
            "--lr-steps", "--batch-size", "1", "--workers", "1", "--log-every", "1", "--device", "cpu", "--epochs", "1",
            "--output", str(cut)]  # a loader worker here, none straight: each image's flip is keyed, not streamed
    monkeypatch.setattr(engine, "_train_step", signalled)
    assert main(argv) == 128 + signal.SIGTERM and len(made) == 1  # stopped after the update in progress
    monkeypatch.setattr(engine, "_train_step", step)
    ckpt = read_checkpoint(cut / "checkpoint.pth")
    assert (ckpt["epoch"], ckpt["iteration"], ckpt["epoch_step"], ckpt["world_size"]) == (0, 1, 1, 1)
    assert "stopped after update 1 of epoch 1 (by SIGTERM)" in caplog.text and "terminated" in capsys.readouterr().err
    # its images are counted in batches of 1: another batch size would skip others
    assert main([*argv, "--resume", "auto", "--batch-size", "2"]) == 2
    assert "was stopped after update 1 of epoch 1, made by 1 process(es) x --batch-size 1" in capsys.readouterr().err
    (tmp_path / "damaged").mkdir()  # its record of the updates made is checked as any field of the file
    save_torch(tmp_path / "damaged" / "checkpoint.pth", {**ckpt, "partial": {**ckpt["partial"], "count": float("nan")}})
    assert main([*argv[:-1], str(tmp_path / "damaged"), "--resume", "auto"]) == 2
    assert "is damaged: it was saved after update 1 of an epoch" in capsys.readouterr().err
    assert main([*argv, "--resume", "auto"]) == 0
    assert "on a training set of" not in caplog.text  # the same images: nothing to say
    a, b = read_checkpoint(tmp_path / "straight" / "checkpoint.pth"), read_checkpoint(cut / "checkpoint.pth")
    assert a["iteration"] == b["iteration"] == 2 and b["epoch_step"] == 0
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    rows = [[{k: v for k, v in json.loads(line).items() if k != "time_s"} for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (tmp_path / "straight", cut)]
    assert [r["iter"] for r in rows[1]] == [1, 2, 2] and rows[0] == rows[1]  # steps 1 and 2, then the epoch


def test_a_run_stopped_mid_epoch_resumes_on_its_own_order_of_its_own_images(tmp_path, monkeypatch, capsys, caplog):
    """A mid-epoch resume skips the positions already trained on, in the order its --seed drew from its images:
    another seed skipped other images without a word (another batch size or number of processes was refused), and
    so did images added to or removed from the annotation file since the stop."""
    images, three = write_shapes_dataset(tmp_path / "d", 3, SIZE, seed=0, split="train")
    two = tmp_path / "two.json"
    coco = json.loads(three.read_text())
    two.write_text(json.dumps({**coco, "images": coco["images"][:2],
                               "annotations": [a for a in coco["annotations"] if a["image_id"] in {i["id"] for i in coco["images"][:2]}]}))
    from cgavit.detection import engine

    step = engine._train_step
    signalled, _ = sigterm_after(step, 1)

    argv = ["detect", "train", "--train-images", str(images), "--backbone", "m0", "--min-size", "64", "--max-size", "64",
            "--batch-size", "1", "--workers", "0", "--device", "cpu", "--epochs", "1", "--output", str(tmp_path / "run")]
    monkeypatch.setattr(engine, "_train_step", signalled)
    assert main([*argv, "--train-json", str(two)]) == 128 + signal.SIGTERM
    monkeypatch.setattr(engine, "_train_step", step)
    capsys.readouterr()
    assert main([*argv, "--train-json", str(two), "--resume", "auto", "--seed", "1"]) == 2
    assert ("was stopped after update 1 of epoch 1, of an order drawn with --seed 0: resume it with --seed 0, not 1"
            in capsys.readouterr().err)
    caplog.clear()
    assert main([*argv, "--train-json", str(three), "--resume", "auto"]) == 0
    assert (f"was stopped after update 1 of epoch 1 on a training set of 2 images; {three} now holds 3: the rest of that "
            "epoch is drawn from the new set's order") in caplog.text


def test_a_signal_after_the_last_update_stops_nothing(shapes, tmp_path, monkeypatch, capsys, caplog):
    """A SIGTERM during the run's last update (or its last evaluation) let the run end in full, model.pth and all, yet
    `detect train` then ended as stopped by it (exit 143, no summary): a job scheduler would requeue a finished run."""
    from cgavit.detection import engine

    step = engine._train_step
    signalled, made = sigterm_after(step, 2)  # the second and last update

    out = tmp_path / "run"
    monkeypatch.setattr(engine, "_train_step", signalled)
    assert main(["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
                 "--backbone", "m0", "--min-size", "64", "--max-size", "64", "--batch-size", "1", "--workers", "0",
                 "--device", "cpu", "--epochs", "1", "--output", str(out)]) == 0
    assert len(made) == 2 and (out / "model.pth").is_file() and read_checkpoint(out / "checkpoint.pth")["epoch"] == 1
    assert "model.pth" in capsys.readouterr().out and "continue with" not in caplog.text


def test_training_leaves_no_loader_worker_behind(shapes, tmp_path):
    """`detect train --workers N` (4 by default) never exited once it had finished: its persistent loader workers,
    which ignore SIGTERM so that the run's process alone stops the run, outlived the run, and Python's exit waited
    for them for ever (`cgavit train`'s are not kept between epochs either)."""
    train(_config(shapes, tmp_path / "run", epochs=1, workers=1, min_size=64, max_size=64, freeze_bn=True))
    assert not multiprocessing.active_children()


def test_maskrcnn_train_eval_predict_commands(shapes, tmp_path, capsys, caplog):
    out = tmp_path / "mr"
    args = ["detect", "train", "--model", "maskrcnn", "--backbone", "m0", "--train-bn", "--device", "cpu",
            "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
            "--val-json", shapes["val_json"], "--val-images", shapes["val_images"],
            "--min-size", str(SIZE), "--max-size", str(SIZE), "--epochs", "1", "--workers", "0", "--output", str(out)]
    args += [f"--model-arg={k}={v}" for k, v in SMALL_RCNN.items()]
    with caplog.at_level(logging.INFO, logger="cgavit.detection"):
        assert main(args) == 0
    # the epoch's COCO table is the log message's own text: passed as a value, the terminal printed it on one
    # line with its line breaks escaped ('bbox:\\n Average Precision ...')
    (table,) = [r for r in caplog.records if "COCO evaluation" in r.getMessage()]
    assert "\n Average Precision" in table.getMessage()
    assert not any(isinstance(a, str) and "\n" in a for a in table.args or ()), table.args
    printed = capsys.readouterr().out.strip().splitlines()
    said = next(line for line in reversed(printed) if not line.startswith("try:"))  # what it wrote, and only that
    # (it named a missing loss.png)
    named = [name for name in ("checkpoint.pth", "model.pth", "metrics.jsonl", "loss.png") if name in said.split(" in ")[0]]
    assert named == [name for name in ("checkpoint.pth", "model.pth", "metrics.jsonl", "loss.png") if (out / name).is_file()]
    assert ("loss.png" in named) != ("no loss.png" in said), said
    (row,) = _epoch_rows(out)
    assert {"loss_mask", "loss_objectness", "bbox_AP", "segm_AP", "segm_AP50"} <= set(row)
    capsys.readouterr()
    assert main(["detect", "eval", "--checkpoint", str(out / "model.pth"), "--val-json", shapes["val_json"],
                 "--val-images", shapes["val_images"], "--workers", "0", "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["segm_AP"] == pytest.approx(row["segm_AP"], abs=1e-4)
    image = Path(shapes["val_images"]) / "val_00000.png"
    dst = tmp_path / "pred.png"
    assert main(["detect", "predict", str(image), "--checkpoint", str(out / "checkpoint.pth"), "--out", str(dst),
                 "--score-threshold", "0", "--device", "cpu"]) == 0
    from torchvision.io import read_image

    drawn, original = read_image(str(dst)), read_image(str(image))
    assert drawn.shape == original.shape and not torch.equal(drawn, original)
    assert "detections >= 0.0" in capsys.readouterr().out
    assert main(["detect", "eval", "--checkpoint", str(shapes["train_json"]), "--val-json", shapes["val_json"],
                 "--val-images", shapes["val_images"]]) == 2


def test_torchrun_two_processes(shapes, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "cgavit",
           "detect", "train", "--backbone", "m0", "--train-bn", "--device", "cpu", "--batch-size", "1",
           "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
           "--val-json", shapes["val_json"], "--val-images", shapes["val_images"],
           "--min-size", str(SIZE), "--max-size", str(SIZE), "--epochs", "1", "--workers", "0", "--warmup-iters", "0",
           "--log-every", "1", "--output", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows] == ["step", "epoch"]  # 2 images / (2 ranks x 1): one step, written once
    assert "bbox_AP" in rows[-1] and read_checkpoint(out / "checkpoint.pth")["iteration"] == 1


def test_torchrun_a_checkpoint_rank_0_cannot_write_stops_every_rank_with_its_line(shapes, mount_tmpfs):
    """A full disk ended rank 0 with its line, and rank 1, gone on to its next collective, with gloo's "connection
    closed by peer" traceback (NCCL: a wait for the time-out)."""
    out = mount_tmpfs(size="1m") / "ddp"  # room for the records, not for checkpoint.pth
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "cgavit",
           "detect", "train", "--backbone", "m0", "--device", "cpu", "--batch-size", "1",
           "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
           "--min-size", str(SIZE), "--max-size", str(SIZE), "--epochs", "1", "--workers", "0", "--warmup-iters", "0",
           "--log-every", "1", "--output", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    line = f"cgavit detect: error: cannot write {out / 'checkpoint.pth'}: the disk is full"
    assert res.returncode != 0 and res.stderr.count(line) == 2, res.stderr[-3000:]  # each rank says it
    assert not any(text in res.stderr for text in ("[rank0]:", "[rank1]:", "by peer")), res.stderr[-3000:]
    assert not (out / "checkpoint.pth").exists()


def _torchrun_detect_train(shapes, out, *extra, script=None, env=None):
    """``cgavit detect train`` on the shapes (m0, 64 px, batch 1, no worker) under a 2-process torchrun (gloo), or the
    Python file ``script`` that runs ``cgavit`` with those arguments."""
    argv = ["detect", "train", "--backbone", "m0", "--device", "cpu", "--batch-size", "1", "--min-size", "64",
            "--max-size", "64", "--epochs", "1", "--workers", "0", "--warmup-iters", "0", "--log-every", "1",
            "--train-json", shapes["train_json"], "--train-images", shapes["train_images"], "--output", str(out), *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *([str(script)] if script else ["-m", "cgavit"]), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _no_rank_traceback(err):
    """Whether no rank died of a traceback (torchrun prefixes a rank's with ``[rankN]:``), such as gloo's "connection
    closed by peer" of a rank left in a collective that a failed rank never joined."""
    return not any(text in err for text in ("[rank0]:", "[rank1]:", "by peer"))


def test_torchrun_an_image_one_rank_cannot_read_stops_every_rank_with_its_line(shapes, tmp_path):
    """The rank that read the image stopped with its line; the other, in the update's gradient all-reduce (training)
    or the gathering of detections (evaluation), died of gloo's "connection closed by peer" traceback."""
    images = tmp_path / "train"
    shutil.copytree(shapes["train_images"], images)
    damaged = images / "train_00001.png"
    damaged.write_bytes(damaged.read_bytes()[:200])  # its header is whole: found only when decoded, by one rank
    out = tmp_path / "run"
    res = _torchrun_detect_train({**shapes, "train_images": str(images)}, out)
    line = f"cgavit detect: error: image 2: cannot read image {damaged}: image file is truncated"
    assert res.returncode != 0 and res.stderr.count(line) == 2, res.stderr[-3000:]  # each rank says it
    assert _no_rank_traceback(res.stderr), res.stderr[-3000:]
    assert not (out / "checkpoint.pth").exists()
    val = {**shapes, "train_json": shapes["val_json"], "train_images": shapes["val_images"]}  # 3 images to train on
    res = _torchrun_detect_train(val, out, "--val-json", shapes["train_json"], "--val-images", str(images))
    assert res.returncode != 0 and res.stderr.count(line) == 2, res.stderr[-3000:]
    assert "Epoch 1 was saved before its evaluation" in res.stderr and _no_rank_traceback(res.stderr), res.stderr[-3000:]


NAN_ON_RANK_1 = """
import math, os, sys
from torchvision.models.detection.retinanet import RetinaNet
from cgavit.cli import main
compute_loss = RetinaNet.compute_loss
if os.environ["RANK"] == "1":  # this rank's loss alone is not finite
    RetinaNet.compute_loss = lambda self, *args: {k: v * math.nan for k, v in compute_loss(self, *args).items()}
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_a_loss_that_is_not_finite_on_one_rank_stops_every_rank_with_its_line(shapes, tmp_path):
    """Rank 1 raised before its backward; rank 0 died in the gradient all-reduce with gloo's traceback."""
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(NAN_ON_RANK_1)
    res = _torchrun_detect_train(shapes, tmp_path / "run", script=script)
    line = "cgavit detect: error: the loss became nan at iteration 0 ({'classification': nan, 'bbox_regression': nan})"
    assert res.returncode != 0 and res.stderr.count(line) == 2, res.stderr[-3000:]
    assert _no_rank_traceback(res.stderr), res.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoint.pth").exists()


def test_torchrun_a_warning_is_said_once_by_rank_0(shapes, tmp_path):
    """Every rank checks the same annotation file and logged what it skipped: each warning came once per process."""
    coco = json.loads(Path(shapes["train_json"]).read_text())
    coco["annotations"].append({**coco["annotations"][0], "id": 999, "bbox": [5, 5, 0, 0]})
    degenerate = tmp_path / "degenerate.json"
    degenerate.write_text(json.dumps(coco))
    res = _torchrun_detect_train({**shapes, "train_json": str(degenerate)}, tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("skipping 1 degenerate entries") == 1, res.stderr[-3000:]
    assert res.stderr.count("training a random backbone with frozen BatchNorm") == 1, res.stderr[-3000:]


FULL_DISK_ON_RANK_0 = """
import errno, os, sys
from cgavit.cli import main
from cgavit.detection import engine
from cgavit.io import WriteError

def full(path, rows):
    raise WriteError(errno.ENOSPC, f"cannot write {path}: the disk is full")

if os.environ["RANK"] == "0":  # the only rank that writes
    engine.write_jsonl = full
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_a_resume_whose_records_rank_0_cannot_rewrite_stops_every_rank_with_its_line(shapes, tmp_path):
    """A resume drops the rows a killed run wrote after its checkpoint, on rank 0 alone, outside on_main: on a full
    disk rank 0 ended with its line and rank 1, waiting for rank 0's word on metrics.jsonl, with gloo's traceback."""
    out = tmp_path / "run"
    assert _torchrun_detect_train(shapes, out).returncode == 0
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + json.dumps(dict(type="step", epoch=2, iter=2, lr=1e-4, loss=1.0)) + "\n")
    script = tmp_path / "full_disk_on_rank_0.py"
    script.write_text(FULL_DISK_ON_RANK_0)
    res = _torchrun_detect_train(shapes, out, "--resume", "auto", "--epochs", "2", script=script)
    line = f"cgavit detect: error: cannot write {metrics}: the disk is full"
    assert res.returncode != 0 and res.stderr.count(line) == 2, res.stderr[-3000:]
    assert _no_rank_traceback(res.stderr), res.stderr[-3000:]
    assert read_checkpoint(out / "checkpoint.pth")["epoch"] == 1


def test_maskrcnn_roi_scales_do_not_depend_on_the_first_image():
    """torchvision's RoI poolers inferred each level's scale from the first batch they pooled: after an image whose
    resized height padding stretched past sqrt(2) (64x40 padded to 64x64), every scale was twice its value for good."""
    import copy

    torch.manual_seed(0)
    model = maskrcnn("efficientvit_m0", 3, min_size=64, max_size=64, **SMALL_RCNN).eval()
    other = copy.deepcopy(model)
    square = torch.rand(3, 64, 64)
    with torch.no_grad():
        alone = model([square])[0]
        other([torch.rand(3, 80, 128)])  # resized to 64x40, padded to 64x64
        after_strip = other([square])[0]
    for pool in (other.roi_heads.box_roi_pool, other.roi_heads.mask_roi_pool):
        assert pool.scales == [1 / s for s in (4, 8, 16, 32)]
    assert len(alone["boxes"]) and torch.equal(alone["boxes"], after_strip["boxes"])
    assert torch.equal(alone["masks"], after_strip["masks"])


def test_the_builders_refuse_a_class_count_or_size_the_detector_cannot_use():
    """retinanet(num_classes=0) and min_size=0 were built, and failed at the first image inside a convolution or the
    resize (RuntimeError: 'expected weight to be at least 1 at dimension 0'); num_classes=1, the background alone,
    trained a detector of nothing."""
    for build in (retinanet, maskrcnn):
        for classes in (0, 1, 2.0):
            with pytest.raises(ValueError, match=f"'num_classes' must be an integer in 2.*background.*got {classes}"):
                build("efficientvit_m0", classes)
        with pytest.raises(ValueError, match="'min_size' must be an integer in 32..4096 .*got 0"):
            build("efficientvit_m0", 3, min_size=0)
        with pytest.raises(ValueError, match="'max_size' must be an integer in 32..4096"):
            build("efficientvit_m0", 3, max_size=-1)
    assert retinanet("efficientvit_m0", 2, min_size=(64, 96), max_size=96).transform.min_size == (64, 96)  # torchvision's


def test_a_detector_setting_torchvision_does_not_take_is_refused(shapes, tmp_path, caplog, capsys):
    """torchvision hands names it does not know to its transform, which drops them: a misspelt --model-arg (or a Mask
    R-CNN name given to RetinaNet, as --help's examples were) trained without it, and was stored as if it had taken effect."""
    from cgavit.detection.models import build_detector

    with pytest.raises(ValueError, match="MaskRCNN takes no setting 'box_detections_per_image'; did you mean 'box_detections_per_img'"):
        maskrcnn("efficientvit_m0", 3, box_detections_per_image=5)
    with pytest.raises(ValueError, match="RetinaNet takes no setting 'rpn_batch_size_per_image'"):
        retinanet("efficientvit_m0", 3, rpn_batch_size_per_image=128)
    assert retinanet("efficientvit_m0", 3, detections_per_img=5, size_divisible=64).detections_per_img == 5
    assert maskrcnn("efficientvit_m0", 3, _skip_resize=True).transform._skip_resize  # the transform's **kwargs one
    with pytest.raises(ValueError, match="did you mean 'detections_per_img'"):
        _config(shapes, tmp_path / "run", epochs=1, model_kwargs={"box_detections_per_img": 5}).validate()
    with pytest.raises(ValueError, match="min_size is set by cgavit itself.*--min-size"):
        _config(shapes, tmp_path / "run", epochs=1, model_kwargs={"min_size": 5}).validate()
    assert main(["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
                 "--output", str(tmp_path / "run"), "--model-arg", "scor_thresh=0.9"]) == 2
    assert not (tmp_path / "run").exists()
    # values of the wrong kind trained a whole epoch, then failed at evaluation (text) or dropped detections (-1)
    for setting, says in (("detections_per_img=abc", "detections_per_img takes a whole number >= 1"),
                          ("detections_per_img=-1", "detections_per_img takes a whole number >= 1"),
                          ("score_thresh=0,5", "score_thresh takes a number in [0, 1]"),
                          ("image_mean=[0.5,0.5]", "image_mean takes a list of 3 numbers"),
                          ("head=1", "only Python can give")):
        assert main(["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
                     "--output", str(tmp_path / "run"), "--model-arg", setting]) == 2
        assert says in capsys.readouterr().err, setting
    assert not (tmp_path / "run").exists()
    # a file written before names were checked loads, without the setting that never took effect
    with caplog.at_level(logging.WARNING):
        model = build_detector(dict(kind="retinanet", backbone="efficientvit_m0", num_classes=3,
                                    model_kwargs={"scor_thresh": 0.9, "detections_per_img": 7}))
    assert model.detections_per_img == 7 and "left out the detector setting scor_thresh=0.9" in caplog.text


def test_progress_in_a_log_file_is_lines_not_bars(shapes, tmp_path, capsys, caplog):
    """Piped to a file, detect train wrote its tqdm bars' redraws there (a carriage return each, one long line per
    epoch); cgavit train's way is a bar on a terminal only, else a log line every --log-every updates."""
    with caplog.at_level(logging.INFO, logger="cgavit"):
        train(_config(shapes, tmp_path / "run", epochs=1, batch_size=1, val_json=shapes["val_json"],
                      val_images=shapes["val_images"]))
    err = capsys.readouterr().err
    assert "epoch 1/1:" not in err and "eval:" not in err and "\r" not in err, err[-2000:]
    assert "epoch 1/1 [1/2] loss" in caplog.text and "epoch 1/1 [2/2] loss" in caplog.text, caplog.text


def test_the_loss_figure_reads_in_plain_words_and_numbers(tmp_path, monkeypatch):
    """loss.png's axes were labelled 'lr' and ticked '2 x 10^0', '10^0', its total loss listed as 'loss' beside the
    losses it sums."""
    import matplotlib.pyplot as plt

    from cgavit.detection.engine import plot_losses

    rows = [dict(type="step", epoch=1, iter=i, lr=1e-4, loss=2.1 - i / 100, classification=1.1, bbox_regression=0.8)
            for i in range(2, 10, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    monkeypatch.undo()
    (fig,) = figures
    fig.canvas.draw()
    losses, rate = fig.axes
    assert rate.get_ylabel() == "learning rate" and "log scale" in losses.get_ylabel()
    assert sorted(t.get_text() for t in losses.get_legend().get_texts()) == ["bbox_regression", "classification", "total"]
    lo, hi = losses.get_ylim()
    ticks = [t.get_text() for t in losses.get_yticklabels() + losses.get_yticklabels(minor=True)
             if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert ticks and all(t.replace(".", "").isdigit() for t in ticks), ticks
    plt.close(fig)


def test_detect_train_says_how_to_use_the_model_it_wrote(shapes, tmp_path, capsys):
    """detect train named its files and stopped; the next commands (predict, and eval on the validation data given)
    are printed, and parse as written."""
    import shlex

    from cgavit.cli import build_parser

    out = tmp_path / "my run"
    assert main(["detect", "train", "--train-json", shapes["train_json"], "--train-images", shapes["train_images"],
                 "--val-json", shapes["val_json"], "--val-images", shapes["val_images"], "--backbone", "m0",
                 "--train-bn", "--min-size", "64", "--max-size", "64", "--warmup-iters", "0", "--lr-steps",
                 "--epochs", "1", "--workers", "0", "--device", "cpu", "--output", str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("try:")]
    predict, evaluate = (shlex.split(part) for part in line[len("try:"):].split("   or   "))
    assert predict[:4] == ["cgavit", "detect", "predict", "IMAGE"]
    assert build_parser().parse_args(predict[1:]).checkpoint == str(out / "model.pth")
    args = build_parser().parse_args(evaluate[1:])
    assert (args.detect_command, args.checkpoint, args.val_json) == ("eval", str(out / "model.pth"), shapes["val_json"])


def test_shapes_says_how_to_train_on_what_it_wrote(tmp_path, capsys):
    """``detect shapes`` named its files and stopped; training on them takes four paths and flags a newcomer has to
    find in the docs. The command it suggests must parse as written."""
    import shlex

    from cgavit.cli import build_parser

    out = tmp_path / "my shapes"
    assert main(["detect", "shapes", "--out", str(out), "--num-train", "1", "--num-val", "1", "--size", "48"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("try:")]
    argv = shlex.split(line[len("try:"):])
    assert argv[:3] == ["cgavit", "detect", "train"]
    args = build_parser().parse_args(argv[1:])
    assert (args.train_json, args.val_images) == (str(out / "train.json"), str(out / "val"))
    assert args.freeze_bn is False and (args.min_size, args.max_size) == (48, 48)  # --train-bn: a random backbone


def test_shapes_never_writes_over_a_users_files(tmp_path, capsys):
    """``detect shapes --out data`` replaced a user's own train.json without a word."""
    user = tmp_path / "data"
    user.mkdir()
    (user / "train.json").write_text('{"images": [], "annotations": [], "categories": [{"id": 1, "name": "mine"}]}')
    before = (user / "train.json").read_bytes()
    assert main(["detect", "shapes", "--out", str(user), "--num-train", "1", "--num-val", "1", "--size", "32"]) == 2
    assert "train.json exists and is not a shapes dataset's annotations" in capsys.readouterr().err
    assert (user / "train.json").read_bytes() == before and sorted(p.name for p in user.iterdir()) == ["train.json"]
    (tmp_path / "a-file").write_text("mine")  # a file for --out was a NotADirectoryError traceback
    assert main(["detect", "shapes", "--out", str(tmp_path / "a-file"), "--num-train", "1", "--num-val", "1", "--size", "32"]) == 2
    assert "a-file is a file, not a folder" in capsys.readouterr().err and (tmp_path / "a-file").read_text() == "mine"
    (user / "train.json").unlink()
    (user / "val").mkdir()
    (user / "val" / "photo.png").write_bytes(b"x")
    assert main(["detect", "shapes", "--out", str(user), "--num-train", "1", "--num-val", "1", "--size", "32"]) == 2
    assert sorted(p.name for p in user.iterdir()) == ["val"]
    # an earlier shapes dataset is written again, one stopped before its annotations too
    fresh = tmp_path / "shapes"
    for _ in range(2):
        assert main(["detect", "shapes", "--out", str(fresh), "--num-train", "1", "--num-val", "1", "--size", "32"]) == 0
    assert len(json.loads((fresh / "val.json").read_text())["images"]) == 1
    (fresh / "train.json").unlink()
    (fresh / "train" / ".train_00001.png.x1.tmp").write_bytes(b"")
    assert main(["detect", "shapes", "--out", str(fresh), "--num-train", "2", "--num-val", "1", "--size", "32"]) == 0


def test_shapes_refuses_a_bad_count_before_writing_either_split(tmp_path, capsys):
    """``--num-val -1`` was refused only after the training split was written, which was said as done."""
    out = tmp_path / "shapes"
    assert main(["detect", "shapes", "--out", str(out), "--num-train", "1", "--num-val", "-1", "--size", "32"]) == 2
    captured = capsys.readouterr()
    assert "must be in 0..100000, got -1" in captured.err and "train:" not in captured.out
    assert not out.exists()


def test_shapes_stopped_while_replacing_a_dataset_leaves_no_annotations_of_other_images(tmp_path, monkeypatch):
    """A second ``detect shapes`` (another seed) stopped midway left the first run's train.json describing the
    shapes of images it had already drawn again: boxes and masks of other pictures, silently."""
    write_shapes_dataset(tmp_path, num_images=3, size=48, seed=0)
    drawn = []

    def draw_then_stop(*args):
        if len(drawn) == 2:
            raise KeyboardInterrupt
        drawn.append(1)
        return draw(*args)

    draw = shapes_module.draw_shapes_image
    monkeypatch.setattr(shapes_module, "draw_shapes_image", draw_then_stop)
    with pytest.raises(KeyboardInterrupt):
        write_shapes_dataset(tmp_path, num_images=3, size=48, seed=1)
    assert not (tmp_path / "train.json").exists()
    monkeypatch.undo()
    write_shapes_dataset(tmp_path, num_images=3, size=48, seed=1)  # the next run writes it whole
    assert len(json.loads((tmp_path / "train.json").read_text())["images"]) == 3
