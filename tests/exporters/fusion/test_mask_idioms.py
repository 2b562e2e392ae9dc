"""Every usual way of writing a padding and/or causal mask lands on the kernel the reference form gets.

Each idiom is a small torch module, exported by torch and fused: the op and kernel chosen are those of
the reference's ``masked_fill(mask == 0, -1e9)`` over the same mask (key padding -> MultiHeadAttention's
padding kernels, causal -> GroupQueryAttention, both -> GroupQueryAttention over compacted tokens), no
float mask is materialised, and the fused graph equals the module in torch on both padding sides.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.exporters.fusion import user_models as um
from tests.exporters.fusion.test_mask_analysis import CAUSAL, PADDING, PADDING_CAUSAL

D_K = um.D_MODEL // um.HEADS


def _subsequent_mask(s: int) -> torch.Tensor:
    """The Annotated Transformer's: [1, s, s], True where key <= query."""
    return torch.triu(torch.ones(1, s, s), diagonal=1).type(torch.uint8) == 0


def _index_grid(pad: torch.Tensor, s: int) -> torch.Tensor:
    """Hugging Face's mask functions: the padding input indexed at [batch_idx, kv_idx] and a predicate on query
    and key positions, over index grids broadcast to [batch, 1, q, kv]."""
    batch_idx = torch.arange(pad.size(0))[:, None, None, None]
    q_idx, kv_idx = torch.arange(s)[None, None, :, None], torch.arange(s)[None, None, None, :]
    return pad[batch_idx, kv_idx] & (kv_idx <= q_idx) & (kv_idx >= 0)


# shape -> (keep mask [.., q, kv] from (pad, seq_len), True = attend; what the mha target makes of it)
SHAPES = {
    "padding": (lambda pad, s: pad[:, None, None, :], PADDING),
    "padding-expanded": (lambda pad, s: pad[:, None, None, :].expand(pad.size(0), 1, s, s), PADDING),
    "padding-heads": (lambda pad, s: pad[:, None, None, :].expand(pad.size(0), um.HEADS, s, s), PADDING),
    "causal": (lambda pad, s: um.tril(s), CAUSAL),
    "padding-causal": (lambda pad, s: pad[:, None, None, :] & um.tril(s), PADDING_CAUSAL),
    "padding-causal-heads": (
        lambda pad, s: (pad[:, None, None, :] & um.tril(s)).expand(pad.size(0), um.HEADS, s, s), PADDING_CAUSAL,
    ),
    # tgt_mask = pad.unsqueeze(-2) & subsequent_mask(T), unsqueezed for the heads in the attention.
    "annotated-transformer": (lambda pad, s: (pad.unsqueeze(-2) & _subsequent_mask(s)).unsqueeze(1), PADDING_CAUSAL),
    "index-grid": (_index_grid, PADDING_CAUSAL),
}


def _masked_fill(scores, keep, fill):
    return scores.masked_fill(~keep, fill)


def _where(scores, keep, fill):
    return scores + torch.where(keep, 0.0, fill)


def _one_minus(scores, keep, fill):
    """Hugging Face's ``(1 - mask) * finfo.min``."""
    return scores + (1.0 - keep.to(scores.dtype)) * fill


# idiom -> how the scores are masked (None: F.scaled_dot_product_attention with the bool mask)
IDIOMS = {"masked_fill": _masked_fill, "where": _where, "one-minus": _one_minus, "sdpa-bool": None,
          "sdpa-bool-rows-unmasked": None}
FILLS = {"-inf": -math.inf, "finfo-min": torch.finfo(torch.float32).min, "-1e9": -1e9, "-1e4": -1e4}


class IdiomAttention(nn.Module):
    """q/k/v/out projections, heads split with view + transpose, the mask of ``shape`` applied as ``idiom``."""

    def __init__(self, idiom: str, fill: float, shape: str):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(um.D_MODEL, um.D_MODEL) for _ in range(4))
        self.idiom, self.fill, self.keep = idiom, fill, SHAPES[shape][0]

    def forward(self, x, pad):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, -1, um.HEADS, D_K).transpose(1, 2) for p in (self.q, self.k, self.v))
        keep = self.keep(pad, s)
        if self.idiom.startswith("sdpa"):
            if self.idiom == "sdpa-bool-rows-unmasked":
                # Hugging Face's sdpa masks: a row with no visible key attends to every key instead.
                keep = keep | ~keep.any(-1, keepdim=True)
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            scores = IDIOMS[self.idiom](q @ k.transpose(-2, -1) / math.sqrt(D_K), keep, self.fill)
            heads = torch.softmax(scores, dim=-1) @ v
        return self.out(heads.transpose(1, 2).contiguous().view(b, s, -1))


CASES = sorted(
    # Every idiom over every shape with Hugging Face's fill, and every fill over the hardest shape
    # ((1 - mask) * -inf is NaN where the mask is 1: nobody writes it).
    {(idiom, "finfo-min", shape) for idiom in IDIOMS for shape in SHAPES}
    | {(idiom, fill, "padding-causal") for idiom in IDIOMS if not idiom.startswith("sdpa") for fill in FILLS}
    - {("one-minus", "-inf", "padding-causal")}
)


@pytest.mark.parametrize(("idiom", "fill", "shape"), CASES, ids=["-".join(case) for case in CASES])
def test_idiom_gets_the_reference_forms_kernel(idiom, fill, shape):
    module, plain = um.module_and_export(
        f"idiom-{idiom}-{fill}-{shape}", lambda: IdiomAttention(idiom, FILLS[fill], shape)
    )
    fused, report = um.fuse(plain)
    op_type, mask_inputs, kernel = SHAPES[shape][1]
    (op,) = report.ops
    assert (op.op_type, set(op.mask_inputs)) == (op_type, mask_inputs), op.describe()
    assert kernel in op.kernel, op.describe()
    assert report.unrecognised_masks == [] and "materialised)" not in report.summary(), report.summary()
    um.assert_parity_with_torch(module, fused, every_row=SHAPES[shape][1] is CAUSAL)


def _sliding_window(pad: torch.Tensor, s: int) -> torch.Tensor:
    """Causal within a window of 2 keys: neither key padding nor causal."""
    q_idx, kv_idx = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return pad[:, None, None, :] & (kv_idx <= q_idx) & (kv_idx > q_idx - 2)


def test_a_mask_that_is_neither_stays_a_reported_bias():
    """A sliding window looks causal at short lengths: it must stay the op's attention_bias, reported as a window
    (its size a constant of the mask's arithmetic) kept materialised."""
    module, plain = um.module_and_export("idiom-sliding-window", lambda: _WindowAttention())
    fused, report = um.fuse(plain)
    (op,) = report.ops
    assert set(op.mask_inputs) == {"attention_bias"}, op.describe()
    assert "window or chunk mask" in op.kernel, op.describe()
    assert "1 with a window or chunk mask as attention_bias (materialised" in report.summary()
    um.assert_parity_with_torch(module, fused)


class _WindowAttention(IdiomAttention):
    def __init__(self):
        super().__init__("where", torch.finfo(torch.float32).min, "padding")
        self.keep = _sliding_window


class PositionBiasAttention(nn.Module):
    """T5's attention: no 1/sqrt(d) scale, a relative position bias [1, heads, q, kv] from a learned table
    added to the scores next to the (1 - mask) * finfo.min mask."""

    def __init__(self, shape: str):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(um.D_MODEL, um.D_MODEL, bias=False) for _ in range(4))
        self.relative = nn.Embedding(9, um.HEADS)
        self.keep = SHAPES[shape][0]

    def forward(self, x, pad):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, -1, um.HEADS, D_K).transpose(1, 2) for p in (self.q, self.k, self.v))
        distance = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).clamp(-4, 4) + 4
        position_bias = self.relative(distance).permute(2, 0, 1).unsqueeze(0)
        mask = (1.0 - self.keep(pad, s).to(x.dtype)) * torch.finfo(x.dtype).min
        scores = q @ k.transpose(-2, -1)
        scores += position_bias + mask
        heads = torch.softmax(scores.float(), dim=-1).type_as(scores) @ v
        return self.out(heads.transpose(1, 2).contiguous().view(b, s, -1))


@pytest.mark.parametrize(("shape", "causal"), [("padding", False), ("padding-causal", True)])
def test_position_bias_is_the_ops_bias_and_its_mask_the_ops_mask(shape, causal):
    module, plain = um.module_and_export(f"position-bias-{shape}", lambda: PositionBiasAttention(shape))
    fused, report = um.fuse(plain)
    (op,) = report.ops
    assert op.op_type == "com.microsoft.MultiHeadAttention", op.describe()
    assert set(op.mask_inputs) == {"key_padding_mask", "attention_bias"}, op.describe()
    assert op.attributes["scale"] == 1.0 and bool(op.attributes.get("unidirectional", 0)) == causal
    assert "position bias, additive attention_bias" in op.kernel, op.describe()
    assert report.unrecognised_masks == [] and "materialised)" not in report.summary(), report.summary()
    um.assert_parity_with_torch(module, fused)


def test_position_bias_is_kept_on_the_onnx_target():
    """Standard Attention has one additive attn_mask: the position bias goes with the mask, as the model adds it."""
    module, plain = um.module_and_export(
        "position-bias-padding-causal", lambda: PositionBiasAttention("padding-causal")
    )
    fused, report = um.fuse(plain, "onnx")
    (op,) = report.ops
    assert op.op_type == "Attention" and set(op.mask_inputs) == {"attn_mask"}, op.describe()
    um.assert_parity_with_torch(module, fused)
