"""Shared fixtures: exported models are cached for the whole session (an export costs 1-3 s)."""

from __future__ import annotations

import importlib.util

import pytest

from mha_deploy.metadata import ATTENTION_KINDS, MASK_MODES, Signature

TEST_D_MODEL, TEST_HEADS = 64, 4

# Every valid (attention, mask) pair: causal needs self-attention.
SIGNATURES = [
    Signature(attention, mask)
    for attention in ATTENTION_KINDS
    for mask in MASK_MODES
    if not (attention == "cross" and "causal" in mask)
]


def signature_id(signature: Signature) -> str:
    prefix = f"{signature.model}-" if signature.model != "mha" else f"{signature.attention}-"
    return prefix + signature.mask + ("-weights" if signature.return_weights else "") + (
        "-kv-cache" if signature.kv_cache else ""
    )


has_torch = importlib.util.find_spec("torch") is not None


# What users get: the default (auto: contrib MultiHeadAttention, or ONNX Attention when returning
# weights), the other fused target, and the plain graph.
USER_TARGETS = ("auto", "onnx", "none")


@pytest.fixture(scope="session")
def export_model(tmp_path_factory):
    """``export_model(signature, fuse) -> (path, reference torch module)``, exported once per argument pair.

    ``fuse`` defaults to "auto", what ``mha-deploy export`` writes unless told otherwise.
    """
    cache = {}

    def export(signature: Signature, fuse: str = "auto"):
        if (signature, fuse) not in cache:
            import torch

            from mha_deploy.exporters import export_mha
            from mha_deploy.exporters.graphs import attention_graph
            from mha_deploy.models import MultiHeadAttention

            torch.manual_seed(1234)
            mha = MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()
            path = tmp_path_factory.mktemp("models") / f"{signature_id(signature)}-{fuse}.onnx"
            export_mha(mha, path, signature, fuse=fuse)
            cache[signature, fuse] = (path, attention_graph(mha, signature))
        return cache[signature, fuse]

    return export


@pytest.fixture
def defective_export(monkeypatch):
    """Make every export produce a subtly wrong graph: the output projection's bias off by 1e-3.

    Far smaller than any mask or head-split bug, and larger than the default
    tolerance: what parity at export must refuse.
    """
    import onnx

    from mha_deploy.exporters import export as export_module

    real_export = export_module.export_onnx

    def export_with_defect(*args, **kwargs):
        model = real_export(*args, **kwargs)
        biases = [t for t in model.graph.initializer if "W_o" in t.name and t.name.endswith("bias")]
        assert biases, [t.name for t in model.graph.initializer]
        for tensor in biases:
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) + 1e-3, tensor.name))
        return model

    monkeypatch.setattr(export_module, "export_onnx", export_with_defect)
