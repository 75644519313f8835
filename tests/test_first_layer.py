"""The first convolution's weights rounded with GPTQ (cgavit.deploy.first_layer), and OpenVINO's builds with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cgavit.deploy import Int8Options
from cgavit.deploy.first_layer import gptq_convolution, gptq_round
from cgavit.deploy.openvino import openvino_available

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _images(n: int, size: int = 24, seed: int = 0) -> torch.Tensor:
    """``n`` random smooth 8-bit images (neighbouring pixels move together, as in photographs), normalised."""
    g = torch.Generator().manual_seed(seed)
    raw = F.interpolate(torch.rand(n, 3, size // 4, size // 4, generator=g), size=(size, size), mode="bilinear")
    return (torch.round(raw * 255) / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _quantiser(low: float, high: float):
    """An asymmetric 8-bit input quantiser over [low, high], as the runtimes' (NNCF's FakeQuantize)."""
    step = (high - low) / 255
    return lambda x: torch.clamp(torch.round((x - low) / step), 0, 255) * step + low


def test_gptq_rounding_moves_the_outputs_less_than_rounding_to_nearest():
    """On smooth patches each output's rounding errors add up; GPTQ moves each error where the patches' covariance
    says it matters least."""
    cols = F.unfold(_images(32), 3, stride=2).transpose(1, 2).reshape(-1, 27).double()
    w = torch.randn(16, 27, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    centred = cols - cols.mean(0)
    q, step = gptq_round(w, centred.T @ centred / len(cols), 127)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    torch.testing.assert_close(step, w.abs().amax(1) / 127)
    moved = lambda ints: float(((centred @ (w - ints.double() * step[:, None]).T) ** 2).mean())  # noqa: E731
    assert moved(q) < 0.5 * moved(torch.round(w / step[:, None]))
    q7, step7 = gptq_round(w, centred.T @ centred / len(cols), 63)
    assert q7.abs().max() <= 63 and torch.allclose(step7, w.abs().amax(1) / 63)


def test_gptq_convolution_computes_the_layer_with_no_mean_error():
    """The int8 form (the input through the quantiser, int8 weights times their steps, the new bias) gives fp32's
    output up to rounding, with no mean error left on the calibration images, and closer than rounding to nearest."""
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(8, 3, 3, 3, generator=g), torch.randn(8, generator=g)
    calibration = [_images(16, seed=3), _images(16, seed=4)]
    x = torch.cat(calibration)
    quantise = _quantiser(float(x.min()), float(x.max()))
    layer = gptq_convolution(weight, bias, calibration, quantise, (2, 2), (1, 1, 1, 1))
    assert layer.weights.dtype == torch.int8 and layer.weights.shape == weight.shape
    exact = F.conv2d(x, weight, bias, stride=2, padding=1)
    got = F.conv2d(quantise(x), layer.weights.float() * layer.scale.view(-1, 1, 1, 1), layer.bias, stride=2, padding=1)
    assert (got - exact).mean((0, 2, 3)).abs().max() < 1e-4
    nearest = torch.round(weight / layer.scale.view(-1, 1, 1, 1)) * layer.scale.view(-1, 1, 1, 1)
    plain = F.conv2d(quantise(x), nearest, bias, stride=2, padding=1)
    assert float(((got - exact) ** 2).mean()) < 0.7 * float(((plain - exact) ** 2).mean())
    with pytest.raises(ValueError, match="calibration batch"):
        gptq_convolution(weight, bias, [], quantise, (2, 2), (1, 1, 1, 1))


@pytest.fixture
def digits_builders(trained_digits):
    """The trained digits model's OpenVINO int8 builders on 32 images: NNCF's rounding everywhere, and GPTQ's for
    the first convolution."""
    if not openvino_available():
        pytest.skip("needs cgavit[openvino]")
    from cgavit.deploy.openvino import OpenVinoInt8Builder

    calibration = trained_digits.calibration(32)
    return [OpenVinoInt8Builder(trained_digits.model, (48, 48), calibration, Int8Options(reduce_range=True, gptq_first_layer=g))
            for g in (False, True)]


def test_openvino_rounds_the_first_layer_with_gptq(trained_digits, digits_builders):
    """Alone in int8, the first convolution with GPTQ's weights moves the logits less than with NNCF's; kept float it
    is fp32's again; its weights stay 7-bit int8 where asked."""
    from cgavit.deploy.openvino import OpenVinoModule

    plain, gptq = digits_builders
    assert plain.gptq_layer is None and gptq.gptq_layer == "patch_embed.conv1"
    x = trained_digits.images[:64]
    fp32 = OpenVinoModule(plain.float_model, 1)(x)
    others = [layer for layer in plain.layers if layer != "patch_embed.conv1"]
    error = {b: float((OpenVinoModule(b.build(others), 1, "int8")(x) - fp32).abs().mean()) for b in (plain, gptq)}
    assert 0 < error[gptq] < 0.8 * error[plain]
    torch.testing.assert_close(OpenVinoModule(gptq.build(list(gptq.layers)), 1, "int8")(x), fp32, rtol=1e-4, atol=1e-4)
    first = next(op for op in gptq.build([]).get_ordered_ops() if op.get_friendly_name() == gptq.layers["patch_embed.conv1"])
    ints = first.input_value(1).get_node().input_value(0).get_node().input_value(0).get_node().get_data()
    assert ints.dtype.name == "int8" and abs(ints).max() <= 63
    float_first = gptq.build(["patch_embed.conv1"])  # a first convolution NNCF's graph no longer quantises: left so
    from cgavit.deploy.openvino import gptq_first_layer

    again = float_first.clone()
    assert not gptq_first_layer(again, gptq.float_model, gptq.layers["patch_embed.conv1"], [x])
    torch.testing.assert_close(OpenVinoModule(again, 1, "int8")(x), OpenVinoModule(float_first, 1, "int8")(x))
