"""Deploy fusion: same function with randomised BN statistics, no BatchNorm left, idempotent."""

import copy

import pytest
import torch
from torch import nn

import cgavit
from cgavit.layers import BNLinear, ConvBN, Residual
from cgavit.testing import randomize_, rel_err


def test_convbn_fold_including_grouped():
    for groups in (1, 4, 16):
        m = randomize_(ConvBN(16, 32, 3, 2, 1, groups=groups)).eval()
        x = torch.randn(2, 16, 9, 9)
        with torch.no_grad():
            assert rel_err(m.fuse()(x), m(x)) <= 1e-6


def test_bnlinear_fold():
    m = randomize_(BNLinear(24, 5)).eval()
    x = torch.randn(4, 24)
    with torch.no_grad():
        assert rel_err(m.fuse()(x), m(x)) <= 1e-6


@pytest.mark.parametrize("name", cgavit.list_models())
def test_fused_model_same_outputs_no_batchnorm(name):
    model = randomize_(cgavit.create_model(name, distillation=True), 1).eval()
    fused = cgavit.fuse(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    assert not any("attention_biases" in n for n, _ in fused.named_parameters())
    with torch.no_grad():
        for shape in [(2, 3, 224, 224), (1, 3, 161, 97)]:  # build size, and an odd size with padding
            x = torch.randn(shape)
            assert rel_err(fused(x), model(x)) <= 1e-5


def test_fuse_twice_and_original_untouched():
    model = randomize_(cgavit.create_model("efficientvit_m0", img_size=128)).eval()
    before = copy.deepcopy(model.state_dict())
    once = cgavit.fuse(model)
    twice = cgavit.fuse(once)
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        assert torch.equal(once(x), twice(x))
    assert once.state_dict().keys() == twice.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_fuse_after_grad_forward_in_eval_and_after_load_state_dict():
    model = randomize_(cgavit.create_model("efficientvit_m0", img_size=128)).eval()
    x = torch.randn(2, 3, 128, 128)
    model(x).sum().backward()  # grad-enabled forward in eval mode (timm's port cannot deepcopy after this)
    fused = cgavit.fuse(model)
    other = randomize_(cgavit.create_model("efficientvit_m0", img_size=128), 7).eval()
    model.load_state_dict(other.state_dict())  # new weights: nothing stale may survive
    refused = cgavit.fuse(model)
    with torch.no_grad():
        assert rel_err(refused(x), other(x)) <= 1e-5
        assert rel_err(fused(x), refused(x)) > 1e-2


def test_fused_small_maps_and_dials():
    # maps smaller than the window (built at 512: windows 7) and a non-paper dial set
    model = randomize_(cgavit.create_model("efficientvit_m0", img_size=512, cascade=False, ffn_per_side=2)).eval()
    fused = cgavit.fuse(model)
    with torch.no_grad():
        for shape in [(1, 3, 64, 96), (1, 3, 224, 224)]:
            x = torch.randn(shape)
            assert rel_err(fused(x), model(x)) <= 1e-5


def test_fuse_rejects_non_module():
    with pytest.raises(ValueError, match="nn.Module"):
        cgavit.fuse("efficientvit_m0")


SMALL = dict(embed_dim=(16, 24, 32), depth=(1, 1, 1), num_heads=(2, 2, 2))


def test_fuse_keeps_the_dtype_and_folds_16_bit_models_in_float32():
    """A bf16 fold rounded every step; float64 must stay exact (a first fix folded it in float32 too)."""
    torch.manual_seed(0)
    model = randomize_(cgavit.create_model("m0", num_classes=5, img_size=64, **SMALL)).eval()
    x = torch.randn(2, 3, 64, 64)
    wide = model.double()
    with torch.no_grad():
        assert cgavit.fuse(wide).head.weight.dtype == torch.float64
        assert rel_err(cgavit.fuse(wide)(x.double()), wide(x.double())) < 1e-12
        narrow = copy.deepcopy(wide).to(torch.bfloat16)
        fused = cgavit.fuse(narrow)
        assert fused.head.weight.dtype == torch.bfloat16
        expected = cgavit.fuse(copy.deepcopy(narrow).float()).to(torch.bfloat16)  # folded in float32, rounded once
        for (name, a), b in zip(fused.state_dict().items(), expected.state_dict().values()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.bfloat16), ("fp32", torch.float64), ("auto", torch.bfloat16)])
def test_optimize_takes_a_model_of_any_float_dtype(dtype, precision):
    """The fast paths take float32 images; optimize judged them on the model in its own dtype and failed."""
    model = randomize_(cgavit.create_model("m0", num_classes=5, img_size=64, **SMALL)).eval().to(dtype)
    backend = dict(backend="torch") if precision == "fp32" else {}
    result = cgavit.optimize(model, torch.randn(2, 3, 64, 64), precision, compile=False, **backend)
    assert result.rel_err is not None and result.rel_err < 0.05


def test_statistics_drawn_from_images_make_the_logits_depend_on_the_image():
    """With statistics drawn without regard to the activations' scale, a randomised network's logits hardly depend on
    its input (unrelated images' logits differed by ~1e-4, relative), so whole-model checks at 1e-5 barely saw a
    path computing on the wrong pixels. Drawn around each BatchNorm's input on ``images``, they do, and a fold still
    matches; the modules' modes are kept."""
    torch.manual_seed(0)
    images = torch.randn(4, 3, 64, 96)
    model = cgavit.create_model("m0", num_classes=5, img_size=64, **SMALL).train()
    randomize_(model, 2, images=images)
    assert all(m.training for m in model.modules())
    stem = model.patch_embed[0].bn  # the first BatchNorm: its statistics are near those of its input
    with torch.no_grad():
        seen = model.patch_embed[0].conv(images)
    assert torch.allclose(stem.running_mean, seen.mean((0, 2, 3)), atol=0.5 * float(seen.std()))
    ratio = stem.running_var / seen.var((0, 2, 3), unbiased=False)
    assert bool(((ratio >= 0.5) & (ratio <= 1.5)).all())
    model.eval()
    x, other = torch.randn(2, 3, 64, 96), torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        assert rel_err(model(other), model(x)) > 0.1
        assert rel_err(model(x.flip(3)), model(x)) > 0.1
        assert rel_err(cgavit.fuse(model)(x), model(x)) <= 1e-4


def test_a_fused_model_set_to_train_gives_its_eval_mode_logits():
    """A fused model kept the residuals' stochastic depth (the head's dropout was folded away): set to train, as a
    teacher inside a module being trained is, it dropped branches at random, and a distilled one gave a pair."""
    torch.manual_seed(0)
    model = randomize_(cgavit.create_model("m0", num_classes=4, img_size=64, distillation=True, drop_path_rate=0.3,
                                           **SMALL), 1).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        fused = cgavit.fuse(model).train()
        for _ in range(3):
            assert rel_err(fused(x), expected) <= 1e-5
    assert model.distilled_training and any(m.drop > 0 for m in model.modules() if isinstance(m, Residual))  # untouched
