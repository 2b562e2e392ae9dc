"""A query row with no visible key (left padding under a causal mask): torch's own attention gives 0 there, the
export gives what torch gives, and no NaN reaches a real row on any fusion target; a user's softmax that gives
NaN there is named in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from mha_deploy.errors import ParityError  # noqa: E402
from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.exporters.reference_form import (  # noqa: E402
    in_reference_form,
    reference_attention,
    without_fast_path,
)
from mha_deploy.inputs import padding_mask  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import user_module  # noqa: E402

D_MODEL, HEADS = 32, 4
INPUTS = ("x:sequence", "pad:padding-mask")


def _tril(s: int) -> torch.Tensor:
    return torch.tril(torch.ones(s, s, dtype=torch.bool))


class _Layer(nn.Module):
    """One causal self-attention over padded keys, written as ``kind`` says, with a residual."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind.startswith("nn-multihead"):
            self.attention = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        else:
            self.qkv, self.out = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x, pad):
        b, s, _ = x.shape
        visible = pad[:, None, None, :] & _tril(s)  # [batch, 1, q, kv], True = attend
        if self.kind == "sdpa-window":  # a mask no rule reads as padding or causal: a float bias on the op
            visible = visible & ~_tril(s).tril(-3)
        if self.kind.startswith("nn-multihead"):
            need_weights = self.kind.endswith("need-weights")
            return x + self.attention(x, x, x, key_padding_mask=~pad, attn_mask=~_tril(s),
                                      need_weights=need_weights)[0]
        # Heads split as the tutorial form does (view(batch, -1, heads, d_k)).
        q, k, v = (t.view(b, -1, HEADS, D_MODEL // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.kind in ("sdpa-bool", "sdpa-window"):
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        elif self.kind == "sdpa-float":
            additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        else:  # "softmax-inf": a hand-written softmax over a -inf fill
            scores = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~visible, float("-inf"))
            heads = torch.softmax(scores, dim=-1) @ v
        return x + self.out(heads.transpose(1, 2).reshape(b, s, D_MODEL))


class TwoLayers(nn.Module):
    """Two layers, so that a NaN in a padded row of the first reaches real rows of the second."""

    def __init__(self, kind: str):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(kind) for _ in range(2))

    def forward(self, x, pad):
        for layer in self.layers:
            x = layer(x, pad)
        return x


def _build(kind: str) -> nn.Module:
    torch.manual_seed(3)
    return TwoLayers(kind).eval()


def _left_padded(batch=3, seq=9, seed=0):
    rng = np.random.default_rng(seed)
    pad = padding_mask(batch, seq, "left", rng)
    pad[0, :4] = False  # at least one row with padded queries that see no real key
    return {"x": rng.standard_normal((batch, seq, D_MODEL)).astype(np.float32), "pad": pad}


def _torch(module, feeds):
    with torch.no_grad(), without_fast_path():
        return module(*(torch.from_numpy(feeds[name]) for name in ("x", "pad"))).numpy()


# What torch 2.13 gives on a query row with no visible key, measured: 0 through F.scaled_dot_product_attention
# (bool or -inf float mask) and nn.MultiheadAttention(need_weights=False), NaN with need_weights=True and under
# its fast path (eval, no_grad, bool masks), whatever need_weights.
@pytest.mark.parametrize(("kind", "zeros"), [("sdpa-bool", True), ("sdpa-float", True),
                                             ("nn-multihead", True), ("nn-multihead-need-weights", False)])
def test_reference_form_gives_what_torch_gives_on_a_row_with_no_visible_key(kind, zeros):
    layer = _build(kind).layers[0]
    feeds = _left_padded()
    x, pad = torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["pad"])
    rewritten, _ = in_reference_form(layer)
    with torch.no_grad(), without_fast_path():
        want = layer(x, pad) - x
        with reference_attention():
            got = rewritten(x, pad) - x
    hidden = ~pad[0, :4]
    assert hidden.all()
    if zeros:
        # The attention gives 0 there, so the layer adds its output projection's bias alone.
        out_bias = layer.attention.out_proj.bias if kind.startswith("nn") else layer.out.bias
        torch.testing.assert_close(want[0, :4], out_bias.expand(4, -1), atol=1e-6, rtol=0)
    else:
        assert torch.isnan(want[0, :4]).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_torch_fast_path_gives_nan_where_the_reference_semantics_give_zero():
    # Why parity runs the module with the fast path off: under no_grad in eval, nn.MultiheadAttention with
    # bool masks takes _native_multi_head_attention, NaN on such a row.
    layer = _build("nn-multihead").layers[0]
    feeds = _left_padded()
    x, pad = torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["pad"])
    with torch.no_grad():
        fast = layer(x, pad)
        with without_fast_path():
            math_path = layer(x, pad)
    assert torch.isnan(fast[0, :4]).all() and torch.isfinite(math_path).all()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}

    def export(kind: str, fuse: str):
        if (kind, fuse) not in cache:
            path = tmp_path_factory.mktemp("rows") / f"{kind}-{fuse}.onnx"
            module = user_module("torch_decoder").build().eval() if kind == "nn-transformer-decoder" else _build(kind)
            inputs = user_module("torch_decoder").INPUTS if kind == "nn-transformer-decoder" else INPUTS
            cache[kind, fuse] = module, export_model(module, path, inputs, fuse=fuse)
        return cache[kind, fuse]

    return export


# (model, --fuse, the kernel its attentions take, "" for the unfused graph). nn.MultiheadAttention's reference
# form (two masked_fills: key padding, then the causal attn_mask) fuses onto the causal kernel like the tutorial's.
TARGETS = [
    ("sdpa-bool", "auto", "GroupQueryAttention (causal, padded tokens compacted out"),
    ("sdpa-bool", "onnx", "Attention (ONNX standard: causal, attn_mask)"),
    ("sdpa-bool", "none", ""),
    ("sdpa-float", "auto", "GroupQueryAttention (causal, padded tokens compacted out"),
    ("sdpa-float", "onnx", "Attention (ONNX standard: causal, attn_mask)"),
    ("sdpa-window", "auto", "MultiHeadAttention (mask not recognised, additive attention_bias"),
    ("sdpa-window", "onnx", "Attention (ONNX standard: attn_mask)"),
    ("nn-multihead", "auto", "GroupQueryAttention (causal, padded tokens compacted out"),
    ("nn-multihead", "none", ""),
    ("nn-transformer-decoder", "auto", "GroupQueryAttention (causal, padded tokens compacted out"),
]


@pytest.mark.parametrize(("kind", "fuse", "kernel"), TARGETS)
def test_no_nan_reaches_a_real_row_on_any_target(exported, kind, fuse, kernel):
    module, result = exported(kind, fuse)
    assert result.parity.passed
    assert {op.kernel[: len(kernel)] for op in result.fusion.ops} == ({kernel} if kernel else set())
    session = MHASession(result.path, provider="cpu")
    if kind == "nn-transformer-decoder":
        rng = np.random.default_rng(1)
        feeds = {"tokens": rng.integers(0, 70, (3, 9)), "mask": _left_padded()["pad"]}
        with torch.no_grad(), without_fast_path():
            want = module(torch.from_numpy(feeds["tokens"]), torch.from_numpy(feeds["mask"])).numpy()
        real = feeds["mask"]
    else:
        feeds = _left_padded()
        want, real = _torch(module, feeds), feeds["pad"]
    (got,) = session.run(feeds).values()
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} elements are not finite"
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=1e-4)


# --fuse auto tries the fused graph, then the unfused one: the line comes from the last.
@pytest.mark.parametrize("kind", ["softmax-inf", "nn-multihead-need-weights"])
def test_a_softmax_that_gives_nan_in_torch_is_named_in_one_line(tmp_path, kind):
    with pytest.raises(ParityError) as raised:
        export_model(_build(kind), tmp_path / "m.onnx", INPUTS)
    message = str(raised.value)
    assert "\n" not in message and "non-finite values" not in message
    assert "layers.0" in message and "gives NaN in torch itself" in message, message
    assert not (tmp_path / "m.onnx").exists()
