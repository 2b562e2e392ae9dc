"""sdpa_from_attention: standard ``Attention`` over 4-D Q/K/V (torch's ``F.scaled_dot_product_attention``)
-> upstream's SDPA form, and from there the same fused ops as the reference attention."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha

from mha_deploy.exporters.fusion import fuse_attention
from mha_deploy.exporters.fusion.sdpa_from_attention import sdpa_from_attention_rules
from tests.exporters.fusion import hand_graphs as hg
from tests.exporters.fusion import user_models as um

BATCH, HEADS, SEQ, KV_LEN, HEAD_SIZE = 2, 2, 4, 6, 4


def _attention(mask="none", *, kv_len=SEQ, rank=4, past=False, **attributes) -> onnx.ModelProto:
    """Standard Attention over q [BATCH, HEADS, SEQ, HEAD_SIZE] and k/v [BATCH, HEADS, kv_len, HEAD_SIZE];
    ``mask``: "bool" [BATCH, 1, SEQ, kv_len] (True = attend), "float" [BATCH, 1, SEQ, kv_len] (added), "none"."""
    g = hg.Graph()
    shape = [BATCH, HEADS, SEQ, HEAD_SIZE] if rank == 4 else [BATCH, SEQ, HEADS * HEAD_SIZE]
    q = g.input("query", np.float32, shape)
    k = g.input("key", np.float32, [*shape[:-2], kv_len, shape[-1]] if rank == 4 else [BATCH, kv_len, shape[-1]])
    v = g.input("value", np.float32, [*shape[:-2], kv_len, shape[-1]] if rank == 4 else [BATCH, kv_len, shape[-1]])
    inputs = [q, k, v]
    if mask == "bool":
        # q axis explicit: ORT 1.31's CPU kernel rejects a 1 there.
        inputs.append(g.input("real", bool, [BATCH, 1, SEQ, kv_len]))
    elif mask == "float":
        inputs.append(g.input("bias", np.float32, [BATCH, 1, SEQ, kv_len]))
    if past:
        inputs += ["" if len(inputs) == 3 else None, g.input("past_key", np.float32, [BATCH, HEADS, 1, HEAD_SIZE])]
        inputs = [i for i in inputs if i is not None]
    if rank == 3:
        attributes.update(q_num_heads=HEADS, kv_num_heads=HEADS)
    g.output(g.op("Attention", *inputs, **attributes))
    return g.model()


def _feeds(model: onnx.ModelProto, kv_len: int) -> dict[str, np.ndarray]:
    real = hg.padding_feeds(BATCH, kv_len, seed=4)
    bias = np.where(np.random.default_rng(5).random((BATCH, 1, SEQ, kv_len)) < 0.3, -1e9, 0).astype(np.float32)
    bias[..., 0] = 0  # every query sees a key
    feeds = {
        "query": hg.normal((BATCH, HEADS, SEQ, HEAD_SIZE), 1),
        "key": hg.normal((BATCH, HEADS, kv_len, HEAD_SIZE), 2),
        "value": hg.normal((BATCH, HEADS, kv_len, HEAD_SIZE), 3),
        "real": np.broadcast_to(real[:, None, None, :], (BATCH, 1, SEQ, kv_len)).copy(),
        "bias": bias,
    }
    return {i.name: feeds[i.name] for i in model.graph.input}


@pytest.mark.parametrize(
    ("mask", "kv_len", "attributes"),
    [
        ("none", KV_LEN, {}),
        ("none", KV_LEN, {"scale": 0.3}),
        ("bool", KV_LEN, {}),
        ("float", KV_LEN, {}),
        ("none", SEQ, {"is_causal": 1}),
        ("bool", SEQ, {"is_causal": 1}),
        ("float", SEQ, {"is_causal": 1}),
    ],
    ids=["unmasked", "scaled", "bool-mask", "float-mask", "causal", "bool-mask-causal", "float-mask-causal"],
)
def test_attention_becomes_sdpa(mask, kv_len, attributes):
    model = _attention(mask, kv_len=kv_len, **attributes)
    rewritten, count = hg.rewrite(model, sdpa_from_attention_rules)
    assert count == 1
    assert "Attention" not in hg.op_types(rewritten)
    # The private SDPA op does not run in ORT: upstream's fallback makes it a MultiHeadAttention that does.
    runnable = ir.serde.deserialize_model(rewritten)
    assert replace_sdpa_by_mha(runnable) == 1
    hg.assert_same_outputs(model, ir.serde.serialize_model(runnable), _feeds(model, kv_len))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_attention(rank=3), "query is not 4-D", id="3d-already-fused"),
        pytest.param(_attention(softcap=30.0), "softcap", id="softcap"),
        pytest.param(_attention(past=True), "past state", id="past-key"),
        # The op's causal alignment for q_len != kv_len differs between runtimes.
        pytest.param(_attention(kv_len=KV_LEN, is_causal=1), "is_causal", id="causal-cross-lengths"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, sdpa_from_attention_rules)
    assert count == 0
    assert hg.op_types(rewritten) == hg.op_types(model)
    assert any(reason in why for why in hg.failed_checks(model, sdpa_from_attention_rules))


def test_unfused_attention_op_fails_the_fusion_naming_the_reason():
    _fused, report = fuse_attention(_attention(softcap=30.0), "mha")
    assert (report.found, report.fused, report.remaining) == (1, 0, 1) and not report.complete
    assert "softcap" in " ".join(report.unfused_reasons["sdpa_from_attention"])
    assert report.unfused_names == ["(unnamed) (Attention)"]
    assert "not fused: (unnamed) (Attention); 1 left unfused" in report.summary()
    assert "sdpa_from_attention: attribute softcap" in report.summary()


def test_torch_attention_left_unfused_is_named_after_torchs_op(monkeypatch):
    # With the rule out of the chain, torch's standard Attention stays as exported: the report names it.
    monkeypatch.setattr("mha_deploy.exporters.fusion.pipeline.fuse_sdpa_from_attention", lambda model: 0)
    name = "sdpa-padding"
    _, report = fuse_attention(um.exported(name, TORCH_ATTENTION[name][0]), "mha")
    assert (report.found, report.fused, report.remaining) == (1, 0, 1)
    assert report.unfused_names == ["node_scaled_dot_product_attention (Attention)"]


# --- torch's own attention, through torch's export and the whole chain ----------------------------

PADDING, CAUSAL, PADDING_CAUSAL, BIAS = (
    ("com.microsoft.MultiHeadAttention", {"key_padding_mask"}),
    ("com.microsoft.GroupQueryAttention", {"seqlens_k"}),
    ("com.microsoft.GroupQueryAttention", {"seqlens_k"}),
    ("com.microsoft.MultiHeadAttention", {"attention_bias"}),
)
FLASH = ("com.microsoft.MultiHeadAttention", set())


def _float_padding(pad, s):
    """torch's own additive form: 0 on real keys, -inf on padded ones."""
    return torch.zeros(pad.shape, dtype=torch.float32).masked_fill(~pad, float("-inf"))[:, None, None, :]


# id -> (module factory, expected op and mask inputs, whether the mask depends on padding)
TORCH_ATTENTION = {
    "sdpa-unmasked": (lambda: um.MaskedAttention(lambda pad, s: None, sdpa={}), FLASH, False),
    "sdpa-padding": (lambda: um.MaskedAttention(lambda pad, s: pad[:, None, None, :], sdpa={}), PADDING, True),
    "sdpa-padding-scaled": (
        lambda: um.MaskedAttention(lambda pad, s: pad[:, None, None, :], sdpa={"scale": 0.25}), PADDING, True
    ),
    "sdpa-float-padding": (lambda: um.MaskedAttention(_float_padding, sdpa={}), PADDING, True),
    "sdpa-is-causal": (lambda: um.MaskedAttention(lambda pad, s: None, sdpa={"is_causal": True}), CAUSAL, False),
    "sdpa-padding-and-tril": (
        lambda: um.MaskedAttention(lambda pad, s: pad[:, None, None, :] & um.tril(s), sdpa={}), PADDING_CAUSAL, True
    ),
    # nn.MultiheadAttention folds heads into the batch axis around its mask: not read, fused through the bias.
    "nn-multihead-attention": (lambda: um.TorchMHA(causal=False), BIAS, True),
    "nn-multihead-attention-causal": (lambda: um.TorchMHA(causal=True), BIAS, True),
}


@pytest.mark.parametrize("name", list(TORCH_ATTENTION))
def test_torch_attention_becomes_the_reference_patterns_fused_op(name):
    factory, (op_type, mask_inputs), padded = TORCH_ATTENTION[name]
    module, plain = um.module_and_export(name, factory)
    fused, report = um.fuse(plain)
    (op,) = report.ops
    assert (report.found, op.op_type, set(op.mask_inputs)) == (1, op_type, mask_inputs), op.describe()
    if name == "sdpa-padding-scaled":
        assert op.attributes["scale"] == pytest.approx(0.25)
    if op_type.endswith("GroupQueryAttention"):
        assert ("compacted" in op.kernel) == padded, op.kernel
    if name.startswith("sdpa"):
        # The reference pattern's path: upstream's mha took the head split (projection biases folded), and
        # short_sequence's branch is there as for the reference attention.
        assert report.rule_counts["mha"] == 1 and "up to 256 keys" in op.kernel, report.rule_counts
    assert bool(report.unrecognised_masks) == (mask_inputs == BIAS[1])
    assert ("mask not recognised" in report.summary()) == (mask_inputs == BIAS[1])
    um.assert_parity_with_torch(module, fused, every_row=not padded)


@pytest.mark.parametrize("name", ["sdpa-padding", "sdpa-padding-and-tril", "nn-multihead-attention"])
def test_torch_attention_on_the_onnx_target(name):
    factory, _, padded = TORCH_ATTENTION[name]
    module, plain = um.module_and_export(name, factory)
    fused, report = um.fuse(plain, "onnx")
    (op,) = report.ops
    assert op.op_type == "Attention" and bool(op.attributes.get("is_causal", 0)) == ("tril" in name)
    um.assert_parity_with_torch(module, fused, every_row=not padded)
