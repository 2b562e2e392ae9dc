"""mask_analysis (not a rule: what native_mask and the onnx rules read a bias with).

Over-reading is the risk here: a bias taken for key padding or causal is dropped
in favour of the op's own mask input, so anything else must come back as None.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from mha_deploy.exporters.fusion.mask_analysis import analyse_bias, analyse_bias_for
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


def test_parts_must_fit_the_op():
    bias = _bias(lambda g: mask_bias(g, _padding_and_causal(g)))
    assert analyse_bias_for(bias, BATCH, SEQ, SEQ) is not None
    assert analyse_bias_for(bias, BATCH + 1, SEQ, SEQ) is None  # padding of another batch
    # Causal flags mean "key <= query" only when queries and keys are one sequence.
    assert analyse_bias_for(bias, BATCH, SEQ - 1, SEQ) is None
