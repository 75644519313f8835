"""The fused Triton CGA kernel against the plain fused attention.

Without CUDA the kernels run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set here
before Triton is imported); with CUDA the same tests run natively on the GPU. Shapes stay small: the
interpreter is slow.
"""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cgavit import kernels  # noqa: E402
from cgavit.attention import LocalWindowAttention  # noqa: E402
from cgavit.deploy import fuse  # noqa: E402
from cgavit.model import EfficientViT  # noqa: E402
from cgavit.testing import full_fp32, randomize_, rel_err  # noqa: E402
from cgavit.variants import EfficientViTConfig  # noqa: E402

if not kernels.triton_available():
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)
module = kernels.load()
from cgavit.kernels import cga  # noqa: E402  (imported by load())
if not cga.interpreted() and not torch.cuda.is_available():
    pytest.skip("Triton was imported without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)
DEVICE = "cpu" if cga.interpreted() else "cuda"


@pytest.fixture(autouse=True)
def _ieee_references():
    """On a GPU the references' cuDNN convolutions run in TF32 by torch's default (~1e-3 relative), against which the
    kernel's IEEE float32 products could not meet 1e-5: every test here runs with TF32 off (no effect on the CPU)."""
    with full_fp32():
        yield

# (dim, heads, key_dim, value_dim, window, (H, W), cascade, group_split, kernels, batch)
CASES = {
    "one-head-full-window": (16, 1, 16, None, 7, (7, 7), True, True, [5], 1),
    "ws7-partial-9x11": (32, 4, 16, None, 7, (9, 11), True, True, [5, 5, 5, 5], 2),
    "ws7-small-5x5-mixed-kernels": (24, 3, 8, None, 7, (5, 5), True, True, [7, 5, 3], 1),
    "ws7-small-nonsquare-2x7": (16, 2, 16, None, 7, (2, 7), True, True, [5, 5], 1),
    "ws4-tiny-3x2": (16, 2, 8, None, 4, (3, 2), True, True, [3, 3], 1),
    "ws4-8-heads-narrow-keys": (32, 8, 4, None, 4, (8, 8), True, True, [3] * 8, 1),
    "ws4-no-cascade-wide-values": (24, 2, 16, 20, 4, (6, 9), False, True, [5, 3], 1),
    "ws4-no-group-split": (20, 4, 12, 8, 4, (4, 7), False, False, [1, 3, 5, 3], 1),
    "ws5-odd-window": (16, 2, 16, None, 5, (11, 6), True, True, [3, 3], 1),
    "many-channels-chunked": (80, 2, 16, 16, 4, (4, 4), False, False, [3, 3], 1),
    "wide-heads-chunked-values": (80, 2, 16, None, 4, (4, 4), True, True, [3, 3], 1),  # 40-wide heads
}


def _attention(dim, heads, key_dim, value_dim, window, cascade, group_split, kernels_, seed=0):
    lwa = LocalWindowAttention(
        dim, window, key_dim=key_dim, num_heads=heads, value_dim=value_dim, kernels=kernels_,
        cascade=cascade, group_split=group_split,
    )
    return fuse(randomize_(lwa, seed)).to(DEVICE)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_fused_attention(case):
    dim, heads, kd, vd, ws, (h, w), cascade, split, ks, batch = CASES[case]
    fused = _attention(dim, heads, kd, vd, ws, cascade, split, ks)
    x = torch.randn(batch, dim, h, w, device=DEVICE)
    with torch.no_grad():
        assert rel_err(module.TritonWindowAttention(fused)(x), fused(x)) <= 1e-5


@pytest.mark.parametrize("case", ["ws7-partial-9x11", "ws4-no-group-split"])
def test_kernel_without_fused_projection(case):
    dim, heads, kd, vd, ws, (h, w), cascade, split, ks, batch = CASES[case]
    fused = _attention(dim, heads, kd, vd, ws, cascade, split, ks, seed=1)
    x = torch.randn(1, dim, h, w, device=DEVICE)
    with torch.no_grad():
        assert rel_err(module.TritonWindowAttention(fused, project=False)(x), fused(x)) <= 1e-5


def test_channels_last_in_and_out():
    fused = _attention(32, 2, 16, None, 4, True, True, [3, 3])
    x = torch.randn(2, 32, 5, 6, device=DEVICE).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = module.TritonWindowAttention(fused)(x)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(out, fused(x)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_fp32(dtype):
    if dtype == torch.bfloat16 and cga.interpreted():
        pytest.skip("Triton's interpreter multiplies bfloat16 matrices wrongly (raw bits); GPU only")
    fused = _attention(32, 4, 16, None, 7, True, True, [5] * 4)
    x = torch.randn(1, 32, 9, 8, device=DEVICE)
    triton_attn = module.TritonWindowAttention(fused)
    with torch.no_grad():
        assert rel_err(triton_attn(x.to(dtype)).float(), fused(x)) <= (2e-3 if dtype == torch.float16 else 1e-2)


def _small_model(img_size, input_hw):
    """Fused, with statistics drawn around its BatchNorms' inputs at ``input_hw``: its logits depend on the image,
    so a kernel that attends the wrong tokens shows (with default-scale statistics they hardly do)."""
    cfg = EfficientViTConfig(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2))
    model = EfficientViT(cfg, num_classes=10, img_size=img_size)
    return fuse(randomize_(model, 3, images=torch.randn(4, 3, *input_hw))).to(DEVICE)


@pytest.mark.parametrize(
    "img_size, input_hw, batch",
    [(64, (64, 64), 2), ((64, 96), (64, 96), 1)],  # the second pads its stage-1 and stage-2 maps
    ids=["square", "non-square-padded"],
)
def test_whole_model_with_triton_attention(img_size, input_hw, batch):
    fused = _small_model(img_size, input_hw)
    fast = module.swap_triton_modules(copy.deepcopy(fused))
    assert not any(isinstance(m, LocalWindowAttention) for m in fast.modules())
    x = torch.randn(batch, 3, *input_hw, device=DEVICE)
    with torch.no_grad():
        assert rel_err(fast(x), fused(x)) <= 1e-5


def test_a_triton_path_cast_to_float64_says_to_cast_it_back():
    """OptimizedModel.double() casts its input to float64 too: the kernel's refusal named only the input's dtype,
    which the caller had given as float32."""
    import cgavit

    model = randomize_(EfficientViT(EfficientViTConfig((16, 32, 48), (1, 1, 1), (2, 2, 2), kernels=(3, 3)),
                                    num_classes=3, img_size=32)).eval().to(DEVICE)
    x = torch.randn(1, 3, 32, 32, device=DEVICE)
    fast = cgavit.optimize(model, x, backend="triton", compile=False).double()
    with pytest.raises(ValueError, match=r"got torch.float64: cast .*with \.float\(\)"):
        fast(x)


def test_unfused_attention_is_refused():
    lwa = LocalWindowAttention(16, 4, num_heads=2)
    with pytest.raises(ValueError, match="fuse"):
        module.TritonWindowAttention(lwa)
    with pytest.raises(ValueError, match="fuse"):
        module.swap_triton_modules(torch.nn.Sequential(lwa))


def test_a_partly_fused_model_is_refused_before_anything_is_swapped():
    """As swap_fast_modules: the error leaves the caller's model as it was, not half swapped."""
    fused = _attention(16, 2, 16, None, 4, True, True, [3, 3])
    model = torch.nn.Sequential(fused, LocalWindowAttention(16, 4, num_heads=2))
    with pytest.raises(ValueError, match="fuse"):
        module.swap_triton_modules(model)
    assert model[0] is fused


def test_bad_inputs_say_what_to_do():
    attn = module.TritonWindowAttention(_attention(16, 2, 16, None, 4, True, True, [3, 3]))
    with pytest.raises(ValueError, match=r"\(B, 16, H, W\)"):
        attn(torch.randn(1, 8, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        attn(torch.randn(1, 16, 4, 4, device=DEVICE).double())
    with pytest.raises(ValueError, match="no backward"):
        attn(torch.randn(1, 16, 4, 4, device=DEVICE, requires_grad=True))
    with pytest.raises(ValueError, match="17x17 windows"):
        cga.cga_forward(torch.randn(1, 16, 17, 17, device=DEVICE), dataclasses.replace(attn.layout, window=17),
                        attn.weights())


def test_windows_over_16_are_refused_when_built_not_at_the_first_call():
    """A 17x17 window was accepted by TritonWindowAttention and swap_triton_modules and refused only when run (by
    optimize, inside its build), saying to 'use the plain fused attention'; swap_triton_modules could leave a model
    half swapped. Now both refuse it first, naming the attention and what to run instead."""
    with pytest.raises(ValueError, match=r"this attention attends 17x17 windows .*backend='torch'"):
        module.TritonWindowAttention(_attention(16, 2, 16, None, 17, True, True, [3, 3]))
    small = _attention(16, 2, 16, None, 4, True, True, [3, 3])
    model = torch.nn.Sequential(small, _attention(16, 2, 16, None, 17, True, True, [3, 3]))
    with pytest.raises(ValueError, match=r"^1 attends 17x17 windows"):
        module.swap_triton_modules(model)
    assert model[0] is small
    assert isinstance(module.swap_triton_modules(torch.nn.Sequential(_attention(16, 2, 16, None, 16, True, True, [3])))[0],
                      module.TritonWindowAttention)


def test_weights_that_do_not_fit_the_layout_are_refused_not_read_past():
    """The kernel reads its weights by the layout's sizes: weights of other shapes (or a layout that does not
    describe them) would be read out of bounds, giving garbage or a GPU fault, so cga_forward refuses them."""
    attn = module.TritonWindowAttention(_attention(16, 2, 16, None, 4, True, True, [3, 3]))
    x, layout, weights = torch.randn(1, 16, 4, 4, device=DEVICE), attn.layout, attn.weights()
    cut = weights._replace(bias_full=weights.bias_full[:, :4, :4].contiguous())
    with pytest.raises(ValueError, match=r"bias_full.*\(2, 16, 16\)"):
        cga.cga_forward(x, layout, cut)
    with pytest.raises(ValueError, match=r"dw_weight.*\(2, 25, 16\)"):
        cga.cga_forward(x, dataclasses.replace(layout, kernel=5), weights)
    with pytest.raises(ValueError, match="qkv_weight"):
        cga.cga_forward(x, dataclasses.replace(layout, key_dim=8), weights)
    with pytest.raises(ValueError, match=r"\['qkv_bias'\] must be floating point"):
        cga.cga_forward(x, layout, weights._replace(qkv_bias=weights.qkv_bias.long()))
    with pytest.raises(TypeError, match="CgaLayout"):
        cga.cga_forward(x, dataclasses.astuple(layout), weights)
    with pytest.raises(ValueError, match="odd"):
        dataclasses.replace(layout, kernel=4)
    with pytest.raises(ValueError, match="divisible"):
        cga.CgaLayout(18, 4, 16, 4, 7, 3, False, True)
    with pytest.raises(ValueError, match="compiled for float32, float16 or bfloat16, got torch.float64"):
        cga.kernel_constants(layout, 4, 4, torch.float64, True)  # compile_kernel's first step: a KeyError before


def test_layout_and_weights_are_typed():
    attn = module.TritonWindowAttention(_attention(24, 3, 8, None, 7, True, True, [7, 5, 3]))
    assert attn.layout == cga.CgaLayout(24, 3, 8, 8, 7, 7, True, True)
    assert attn.layout.in_per_head == 8
    weights = attn.weights()
    assert isinstance(weights, cga.CgaWeights)
    assert weights.qkv_weight.shape == (3, 2 * 8 + 8, 8)
    assert weights.dw_weight.shape == (3, 7 * 7, 8)
    assert weights.bias_full.shape == (3, 49, 49)
    assert weights.proj_weight.shape == (24, 24)
    assert cga.window_grid(attn.layout, 5, 3) == (5, 3)
    assert cga.window_grid(attn.layout, 5, 9) == (7, 7)


COMPILE_CHECK = textwrap.dedent(
    """
    import torch
    from cgavit.kernels import cga
    cga.compile_kernel(cga.CgaLayout(32, 2, 16, 16, 7, 5, True, True), 9, 9, torch.float16, True, arch=90)
    cga.compile_kernel(cga.CgaLayout(24, 3, 8, 12, 4, 3, False, False), 6, 6, torch.float32, False, arch=80)
    """
)


@pytest.mark.skipif(not cga.interpreted(), reason="on a GPU every test above compiles the kernel")
def test_kernel_compiles_for_gpus_without_one():
    """The interpreter never runs Triton's compiler: compile for Hopper and Ampere (no GPU needed)."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_optimize_triton_backend_end_to_end():
    """``cgavit.optimize(backend="triton")`` on a small model: the kernels in place of every window
    attention, checked against the plain model (fp32; inductor is skipped in the interpreter)."""
    import cgavit

    cfg = EfficientViTConfig((16, 32, 48), (1, 1, 1), (2, 2, 2), kernels=(3, 3))
    model = randomize_(EfficientViT(cfg, num_classes=5, img_size=64), images=torch.randn(4, 3, 64, 80)).eval().to(DEVICE)
    x = torch.randn(2, 3, 64, 80, device=DEVICE)
    fast = cgavit.optimize(model, x, precision="fp32", backend="triton", compile=False)
    assert fast.rel_err is not None and fast.rel_err <= 1e-5
    swapped = [m for m in fast.modules() if isinstance(m, module.TritonWindowAttention)]
    assert len(swapped) == 3
    with torch.no_grad():
        assert rel_err(fast(x), fuse(model)(x)) <= 1e-5
