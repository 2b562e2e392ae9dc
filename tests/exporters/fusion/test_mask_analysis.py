"""mask_analysis (not a rule: what native_mask and the onnx rules read a bias with).

Over-reading is the risk here: a bias taken for key padding or causal is dropped
in favour of the op's own mask input, so anything else must come back as None.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from mha_deploy.exporters.fusion.mask_analysis import analyse_bias, analyse_bias_for
from tests.exporters.fusion import user_models as um
from tests.exporters.fusion.hand_graphs import FILL, Graph, causal_mask, key_padding_mask, mask_bias, positions

BATCH, SEQ = 2, 4


def _bias(build) -> ir.Value:
    """The value ``build(g)`` returns, in the IR the rules see."""
    g = Graph()
    g.output(build(g))
    model = ir.serde.deserialize_model(g.model())
    return model.graph.outputs[0]


def _padding(g):
    return key_padding_mask(g, BATCH, SEQ)


def _padding_and_causal(g):
    return g.op("And", _padding(g), causal_mask(g, SEQ))


@pytest.mark.parametrize(
    ("build", "padding", "causal"),
    [
        (lambda g: mask_bias(g, _padding(g)), True, False),
        (lambda g: mask_bias(g, _padding(g), expand_to=[BATCH, 1, SEQ, SEQ]), True, False),
        (lambda g: mask_bias(g, causal_mask(g, SEQ)), False, True),
        (lambda g: mask_bias(g, _padding_and_causal(g)), True, True),
        (lambda g: mask_bias(g, g.op("Cast", _padding_and_causal(g), to=onnx.TensorProto.BOOL)), True, True),
    ],
    ids=["padding", "padding-expanded", "causal", "padding-and-causal", "cast-to-bool"],
)
def test_recognised(build, padding, causal):
    parts = analyse_bias(_bias(build))
    assert parts is not None
    assert parts.fill == FILL
    assert (parts.key_padding is not None, parts.causal) == (padding, causal)
    if padding:
        assert parts.key_padding.name == "key_padding_mask"


def _where(g, mask, fill=FILL, other=0.0, compare_to=0):
    masked = g.op("Equal", g.op("Cast", mask, to=onnx.TensorProto.INT64), g.const(compare_to, np.int64))
    return g.op("Where", masked, g.const(fill), g.const(other))


def _unsqueeze(g, axes):
    g.input("key_padding_mask", bool, [BATCH, SEQ])
    return g.op("Unsqueeze", "key_padding_mask", g.const(axes, np.int64))


def _upper_triangular(g):
    """``q_pos[:, None] <= kv_pos[None, :]``: key >= query, the future instead of the past."""
    both = positions(g, SEQ)
    q = g.op("Unsqueeze", both, g.const([1], np.int64))
    return g.op("LessOrEqual", q, g.op("Unsqueeze", both, g.const([0], np.int64)))


def _two_ranges(g):
    return causal_mask(g, SEQ, kv_positions=positions(g, SEQ))


def _two_paddings(g):
    first = key_padding_mask(g, BATCH, SEQ, name="first")
    return g.op("And", first, key_padding_mask(g, BATCH, SEQ, name="second"))


@pytest.mark.parametrize(
    "build",
    [
        # 1 where kept instead of 0: the bias also moves the visible scores.
        pytest.param(lambda g: _where(g, _padding(g), other=1.0), id="kept-is-one"),
        # Equal(mask, 1) selects the real tokens: the inverse mask.
        pytest.param(lambda g: _where(g, _padding(g), compare_to=1), id="inverse-mask"),
        # [batch, 1, kv_len, 1]: masks queries, not keys.
        pytest.param(lambda g: _where(g, _unsqueeze(g, [1, 3])), id="wrong-unsqueeze"),
        pytest.param(lambda g: mask_bias(g, _upper_triangular(g)), id="upper-triangular"),
        # Key and query positions from two Ranges need not index one sequence.
        pytest.param(lambda g: mask_bias(g, _two_ranges(g)), id="two-ranges"),
        pytest.param(lambda g: mask_bias(g, _two_paddings(g)), id="two-padding-masks"),
        pytest.param(lambda g: mask_bias(g, g.input("mask", bool, [BATCH, 1, SEQ, SEQ])), id="dense-mask"),
        pytest.param(lambda g: g.input("bias", np.float32, [BATCH, 1, SEQ, SEQ]), id="float-input"),
    ],
)
def test_not_recognised(build):
    assert analyse_bias(_bias(build)) is None


# --- the algebra on hand-built masks ------------------------------------------------------------


def _ones(g, dtype=bool):
    """``torch.ones(SEQ, SEQ)`` as torch exports it: Expand of a scalar one."""
    return g.op("Expand", g.const(1, dtype), g.const([SEQ, SEQ], np.int64))


def _triangle(g, upper: int, k: int | None = 0, dtype=bool):
    inputs = [_ones(g, dtype)] + ([g.const(k, np.int64)] if k is not None else [])
    return g.op("Trilu", *inputs, upper=upper)


def _bias_where(g, condition, fill_when_true: bool):
    """``Where(condition, FILL, 0)`` (condition blocks) or ``Where(condition, 0, FILL)`` (condition keeps)."""
    fill, zero = g.const(FILL), g.const(0.0)
    return g.op("Where", condition, *((fill, zero) if fill_when_true else (zero, fill)))


def _float_mask_bias(g, mask):
    """``masked_fill(mask == 0, FILL)`` of a float mask, as a bias."""
    return _bias_where(g, g.op("Equal", mask, g.const(0.0)), True)


def _padding_view(g):
    """``pad.view(BATCH, 1, 1, SEQ)``: a Reshape that only inserts 1s."""
    g.input("key_padding_mask", bool, [BATCH, SEQ])
    return g.op("Reshape", "key_padding_mask", g.const([BATCH, 1, 1, SEQ], np.int64))


def _padded_flags(g):
    """torch's key_padding_mask, True = padded, as [BATCH, 1, 1, SEQ]."""
    g.input("is_padded", bool, [BATCH, SEQ])
    return g.op("Unsqueeze", "is_padded", g.const([1, 2], np.int64))


# id -> (bias builder, key padding input name or None, nonzero marks real, causal)
ALGEBRA = {
    "view": (lambda g: mask_bias(g, _padding_view(g)), "key_padding_mask", True, False),
    "tril": (lambda g: mask_bias(g, _triangle(g, upper=0)), None, True, True),
    # A float mask is compared with 0.0 as it is (torch casts only bool masks before `== 0`).
    "tril-float-default-diagonal": (lambda g: _float_mask_bias(g, _triangle(g, 0, None, np.float32)), None, True, True),
    "triu-1-equal-0": (
        lambda g: mask_bias(g, g.op("Equal", _triangle(g, 1, 1, np.float32), g.const(0.0))), None, True, True
    ),
    "not-triu-1": (lambda g: mask_bias(g, g.op("Not", _triangle(g, 1, 1))), None, True, True),
    "padding-times-tril": (
        lambda g: _float_mask_bias(
            g, g.op("Mul", g.op("Cast", _padding(g), to=onnx.TensorProto.FLOAT), _triangle(g, 0, 0, np.float32))
        ),
        "key_padding_mask", True, True,
    ),
    # torch's own additive masks: Where(blocked, -inf, zeros_like), summed.
    "where-not-padding": (lambda g: _bias_where(g, g.op("Not", _padding(g)), True), "key_padding_mask", True, False),
    "where-keep": (lambda g: _bias_where(g, g.op("And", _padding(g), _triangle(g, 0)), False), "key_padding_mask", True,
                   True),
    "padded-flags": (lambda g: _bias_where(g, _padded_flags(g), True), "is_padded", False, False),
    "sum-of-biases": (
        lambda g: g.op("Add", _bias_where(g, _padded_flags(g), True), _bias_where(g, _triangle(g, 1, 1), True)),
        "is_padded", False, True,
    ),
    "or-of-blocked": (
        lambda g: _bias_where(g, g.op("Or", _padded_flags(g), _triangle(g, 1, 1)), True), "is_padded", False, True
    ),
}


@pytest.mark.parametrize("name", list(ALGEBRA))
def test_algebra_recognises(name):
    build, padding, marks_real, causal = ALGEBRA[name]
    parts = analyse_bias_for(_bias(build), BATCH, SEQ, SEQ)
    assert parts is not None
    assert (parts.key_padding.name if parts.key_padding is not None else None) == padding
    assert (parts.padding_marks_real, parts.causal) == (marks_real, causal)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda g: mask_bias(g, _triangle(g, 0, 1)), id="tril-diagonal-1"),
        pytest.param(lambda g: mask_bias(g, _triangle(g, 0, -1)), id="tril-diagonal-minus-1"),
        # triu(., 1) kept (no == 0, no ~): attends to the future.
        pytest.param(lambda g: mask_bias(g, _triangle(g, 1, 1)), id="triu-without-equal-0"),
        pytest.param(lambda g: mask_bias(g, g.op("Not", _triangle(g, 1, 0))), id="not-triu-0"),
        # A triangle of a mask that is not all ones is not causal.
        pytest.param(
            lambda g: mask_bias(g, g.op("Trilu", g.input("dense", bool, [SEQ, SEQ]), upper=0)), id="tril-of-an-input"
        ),
        # Or of keep masks attends where either does; And of blocked masks masks where both do.
        pytest.param(lambda g: mask_bias(g, g.op("Or", _padding(g), _triangle(g, 0))), id="or-of-keep"),
        pytest.param(
            lambda g: _bias_where(g, g.op("And", _padded_flags(g), _triangle(g, 1, 1)), True), id="and-of-blocked"
        ),
        # A float mask cast to an integer type: 0.5 would become 0.
        pytest.param(
            lambda g: mask_bias(
                g,
                g.op(
                    "Cast",
                    g.op("Unsqueeze", g.input("soft", np.float32, [BATCH, SEQ]), g.const([1, 2], np.int64)),
                    to=onnx.TensorProto.INT64,
                ),
            ),
            id="float-cast-to-int",
        ),
        # A fill that does not mask.
        pytest.param(lambda g: mask_bias(g, _padding(g), fill=-1.0), id="fill-not-masking"),
        pytest.param(
            lambda g: g.op("Add", _bias_where(g, _padded_flags(g), True), _bias_where(g, _padded_flags(g), True)),
            id="two-padding-biases",
        ),
    ],
)
def test_algebra_does_not_recognise(build):
    assert analyse_bias(_bias(build)) is None


def test_parts_must_fit_the_op():
    bias = _bias(lambda g: mask_bias(g, _padding_and_causal(g)))
    assert analyse_bias_for(bias, BATCH, SEQ, SEQ) is not None
    assert analyse_bias_for(bias, BATCH + 1, SEQ, SEQ) is None  # padding of another batch
    # A padding mask of another sequence (e.g. the queries' in cross-attention over a memory).
    assert analyse_bias_for(_bias(lambda g: mask_bias(g, _padding(g))), BATCH, SEQ, SEQ + 1) is None
    # Causal flags mean "key <= query" only when queries and keys are one sequence.
    assert analyse_bias_for(bias, BATCH, SEQ - 1, SEQ) is None


# --- masks as users build them, through torch's export and the whole chain -----------------------

# What the mha target makes of each mask: (op type, mask inputs, a word its kernel must contain).
PADDING = ("com.microsoft.MultiHeadAttention", {"key_padding_mask"}, "flash when no key is padded")
CAUSAL = ("com.microsoft.GroupQueryAttention", {"seqlens_k"}, "causal;")
PADDING_CAUSAL = ("com.microsoft.GroupQueryAttention", {"seqlens_k"}, "padded tokens compacted out")
BIAS = ("com.microsoft.MultiHeadAttention", {"attention_bias"}, "mask not recognised")

# id -> (mask from (pad, seq_len), pad input dtype, expected). The pad input is nonzero on real tokens.
# (``pad[:, None, None, :]`` exports as the unsqueezes do; tril's other diagonals are in the algebra tests.)
USER_MASKS = {
    "unsqueeze": (lambda pad, s: pad.unsqueeze(1).unsqueeze(2), torch.bool, PADDING),
    "view": (lambda pad, s: pad.view(pad.size(0), 1, 1, s), torch.bool, PADDING),
    "int-input": (lambda pad, s: pad[:, None, None, :], torch.int64, PADDING),
    "float-input": (lambda pad, s: pad[:, None, None, :], torch.float32, PADDING),
    "tril": (lambda pad, s: um.tril(s), torch.bool, CAUSAL),
    "tril-float": (lambda pad, s: torch.tril(torch.ones(s, s)), torch.bool, CAUSAL),
    "tril-4d": (lambda pad, s: um.tril(s).unsqueeze(0).unsqueeze(0), torch.bool, CAUSAL),
    "triu-equal-0": (lambda pad, s: torch.triu(torch.ones(s, s), diagonal=1) == 0, torch.bool, CAUSAL),
    "not-triu": (lambda pad, s: ~torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1), torch.bool, CAUSAL),
    "padding-and-tril": (lambda pad, s: pad[:, None, None, :] & um.tril(s), torch.bool, PADDING_CAUSAL),
    "padding-times-tril": (
        lambda pad, s: pad.unsqueeze(1).unsqueeze(2).float() * torch.tril(torch.ones(s, s)), torch.bool,
        PADDING_CAUSAL,
    ),
    "padding-and-tril-4d": (lambda pad, s: pad[:, None, None, :] & um.tril(s)[None, None], torch.bool, PADDING_CAUSAL),
    # An integer & is BitwiseAnd: 2 & 1 == 0, so it is not "both nonzero".
    "int-padding-and-tril": (lambda pad, s: pad[:, None, None, :] & um.tril(s), torch.int64, BIAS),
    # [batch, 1, seq, 1]: masks queries, not keys.
    "wrong-axes": (lambda pad, s: pad.unsqueeze(1).unsqueeze(3), torch.bool, BIAS),
    # triu(., 1) as the mask keeps the future: causal only as `== 0` or `~`.
    "triu-without-equal-0": (lambda pad, s: torch.triu(torch.ones(s, s, dtype=torch.bool), 1), torch.bool, BIAS),
    "tril-diagonal-1": (lambda pad, s: torch.tril(torch.ones(s, s, dtype=torch.bool), 1), torch.bool, BIAS),
}


def _user_model(name: str) -> onnx.ModelProto:
    build, pad_dtype, _ = USER_MASKS[name]
    return um.exported(name, lambda: um.MaskedAttention(build), pad_dtype)


@pytest.mark.parametrize("name", list(USER_MASKS))
def test_user_mask_becomes_the_ops_native_mask(name):
    _, pad_dtype, (op_type, mask_inputs, kernel) = USER_MASKS[name]
    plain = _user_model(name)
    fused, report = um.fuse(plain)
    (op,) = report.ops
    assert (op.op_type, set(op.mask_inputs)) == (op_type, mask_inputs), op.describe()
    assert kernel in op.kernel, op.describe()
    assert report.unrecognised_masks == ([op.name] if kernel == BIAS[2] else [])
    padded = kernel != CAUSAL[2]
    # float-input: real tokens hold 0.5, which a cast to an integer type would read as padding.
    real_value = 0.5 if pad_dtype == torch.float32 else 1
    um.assert_parity(plain, fused, NUMPY[pad_dtype], real_value, every_row=not padded)


NUMPY = {torch.bool: np.bool_, torch.int64: np.int64, torch.float32: np.float32}


@pytest.mark.parametrize("name", ["padding-and-tril", "padding-times-tril", "view", "wrong-axes"])
def test_user_mask_on_the_onnx_target(name):
    plain = _user_model(name)
    fused, report = um.fuse(plain, "onnx")
    (op,) = report.ops
    assert op.op_type == "Attention"
    assert bool(op.attributes.get("is_causal", 0)) == ("tril" in name)
    um.assert_parity(plain, fused)
