"""Cascaded group attention against the design notes' equations, written out by hand."""

import pytest
import torch

from cgavit.attention import CascadedGroupAttention, LocalWindowAttention, relative_bias_index
from cgavit.testing import randomize_


def _reference(attn: CascadedGroupAttention, x: torch.Tensor) -> torch.Tensor:
    """Design notes, chapter 5, in plain tensor algebra, using the module's (eval-mode) weights."""
    B, C, H, W = x.shape
    h = attn.num_heads
    groups = x.chunk(h, 1) if attn.group_split else [x] * h
    offsets = relative_bias_index(H, W, attn.window)
    prev, outs = None, []
    for j in range(h):
        xj = groups[j] if prev is None or not attn.cascade else groups[j] + prev
        y = attn.qkvs[j](xj)
        q, k, v = y.split([attn.key_dim, attn.key_dim, attn.value_dim], 1)
        q = attn.dws[j](q)
        q, k, v = (t.reshape(B, t.shape[1], H * W) for t in (q, k, v))
        scores = torch.einsum("bdn,bdm->bnm", q, k) / attn.key_dim**0.5
        scores = scores + attn.attention_biases[j][offsets]
        a = scores.softmax(-1)
        prev = torch.einsum("bnm,bdm->bdn", a, v).reshape(B, attn.value_dim, H, W)
        outs.append(prev)
    return attn.proj(torch.cat(outs, 1))


@pytest.mark.parametrize("cascade, groups", [(True, True), (False, True), (False, False)])
def test_matches_hand_written_equations(cascade, groups):
    attn = randomize_(CascadedGroupAttention(32, key_dim=8, num_heads=4, window=5, kernels=[3, 5, 3, 1],
                                             cascade=cascade, group_split=groups)).eval()
    x = torch.randn(2, 32, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _reference(attn, x), rtol=1e-5, atol=1e-5)
        # a map smaller than the window uses the biases of the offsets it has
        y = torch.randn(2, 32, 3, 4)
        torch.testing.assert_close(attn(y), _reference(attn, y), rtol=1e-5, atol=1e-5)


def test_bias_index_matches_official_enumeration():
    # the official code numbers offsets in the order it first meets them over all point pairs
    r = 4
    points = [(i, j) for i in range(r) for j in range(r)]
    seen, idxs = {}, []
    for p in points:
        for q in points:
            off = (abs(p[0] - q[0]), abs(p[1] - q[1]))
            seen.setdefault(off, len(seen))
            idxs.append(seen[off])
    assert torch.equal(relative_bias_index(r, r, r), torch.tensor(idxs).view(r * r, r * r))


def test_head_attention_maps_are_softmax_rows():
    attn = randomize_(CascadedGroupAttention(24, key_dim=4, num_heads=3, window=3)).eval()
    with torch.no_grad():
        maps = attn.head_attention_maps(torch.randn(2, 24, 2, 3))
    assert len(maps) == 3 and maps[0].shape == (2, 6, 6)
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 6))


def test_window_partition_equals_per_window_attention():
    lwa = randomize_(LocalWindowAttention(16, window=4, key_dim=4, num_heads=2)).eval()
    x = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        out = lwa(x)
        tl = lwa.attn(x[:, :, :4, :4])
        br = lwa.attn(x[:, :, 4:, 4:])
    torch.testing.assert_close(out[:, :, :4, :4], tl)
    torch.testing.assert_close(out[:, :, 4:, 4:], br)


def test_padding_crops_back():
    lwa = randomize_(LocalWindowAttention(16, window=4, key_dim=4, num_heads=2)).eval()
    with torch.no_grad():
        assert lwa(torch.randn(1, 16, 5, 9)).shape == (1, 16, 5, 9)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("train", [True, False])
def test_gradients_exact_at_batch_one(batch, train):
    # torch 2.14.1's BatchNorm2d backward is wrong for a batch of 1 when the incoming gradient is
    # channels-last-strided, which is what q's depthwise Conv-BN receives from the score matmul
    attn = randomize_(CascadedGroupAttention(8, key_dim=2, num_heads=2, window=3)).double().train(train)
    x = torch.randn(batch, 8, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attn, (x,), eps=1e-6, atol=1e-5)


def test_a_map_wider_than_the_window_is_refused_not_given_another_offsets_bias():
    """At 5x9 with window 7, offset (0, +7) read table entry 7, the bias of offset (+1, 0); 8x8 was an IndexError."""
    attn = CascadedGroupAttention(16, key_dim=4, num_heads=2, window=7).eval()
    for module in (attn, attn.fuse()):
        for h, w in ((5, 9), (8, 8)):
            with pytest.raises(ValueError, match=f"a {h}x{w} map is larger than this attention's 7x7 window"):
                module(torch.randn(1, 16, h, w))
        assert module(torch.randn(1, 16, 5, 7)).shape == (1, 16, 5, 7)
