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
    return f"{signature.attention}-{signature.mask}" + ("-weights" if signature.return_weights else "")


has_torch = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="session")
def export_model(tmp_path_factory):
    """``export_model(signature, fuse) -> (path, reference torch module)``, exported once per argument pair."""
    cache = {}

    def export(signature: Signature, fuse: str = "none"):
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
