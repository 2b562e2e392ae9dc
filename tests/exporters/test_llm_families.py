"""``mha-deploy export --hf DIR --kv-cache`` and nothing else, for each causal-LM family the export claims
(tests/user_models/hf_families.py: tiny configs written with ``save_pretrained``): what the file fuses, counted from
the file itself, and that greedy generation through ``mha_deploy.runtime.generation`` gives every prompt of a
mixed-length batch, left- or right-padded, the tokens transformers' ``generate`` gives it alone. One export per
family per session."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from mha_deploy.runtime.generation import generate, prompt_batch
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import user_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

families = user_module("hf_families")
MAX_NEW = 8
# Prompts around and past the sliding window (8 keys): a window's edge moves within each row's generation.
LENGTHS = [3, 12, 1, 7]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family) -> (file, CLI output, model)``: the family's folder exported once per session."""
    from click.testing import CliRunner

    from mha_deploy.cli import main

    cache = {}

    def export(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = families.save(family, folder / "hf")
            path = folder / "model.onnx"
            result = CliRunner().invoke(main, ["export", "--hf", str(folder / "hf"), "--kv-cache", "-o", str(path)])
            assert result.exit_code == 0, result.output
            cache[family] = path, result.output, model
        return cache[family]

    return export


def _attentions(path) -> list[dict[str, object]]:
    """Each GroupQueryAttention's attributes in graph order (layer order: the export keeps it)."""
    model = onnx.load(str(path), load_external_data=False)
    return [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node in model.graph.node
            if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"]


def _attention_inputs(path) -> list[list[str]]:
    model = onnx.load(str(path), load_external_data=False)
    return [list(node.input) for node in model.graph.node if node.op_type == "GroupQueryAttention"]


def _cache_heads(path) -> set[int]:
    model = onnx.load(str(path), load_external_data=False)
    return {value.type.tensor_type.shape.dim[1].dim_value for value in model.graph.input
            if value.name.startswith("past_key_values.")}


@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_fuses_every_attention_into_group_query_attention_at_its_kv_heads(exported, family):
    """One GroupQueryAttention per layer with the config's KV heads, the cache at those heads, the rotary inside the
    op (``do_rotary``), q/k/v packed where the module allows, a sliding layer's window as ``local_window_size`` (a
    global layer without one), Gemma-2's score cap as ``softcap``; no warning that an attention was left unfused."""
    path, output, _ = exported(family)
    ops = _attentions(path)
    assert len(ops) == families.LAYERS, output
    assert [op["kv_num_heads"] for op in ops] == [families.KV_HEADS] * families.LAYERS
    assert [op["num_heads"] for op in ops] == [families.HEADS] * families.LAYERS
    assert _cache_heads(path) == {families.KV_HEADS}
    assert [op.get("local_window_size") for op in ops] == families.windows(family)
    # The rotary inside the op (fusion.rotary_gqa): every family here rotates whole heads, not interleaved.
    assert [op.get("do_rotary") for op in ops] == [1] * families.LAYERS, output
    # q/k/v as one projection into the op's packed query (fusion.qkv_packing), where no per-head q/k norm sits
    # between the projections and the op, and the module has three projections to pack (Phi-3 slices its one).
    packed = family not in {"qwen3", "gemma3", "phi3"}
    assert [op_inputs[1:3] == ["", ""] for op_inputs in _attention_inputs(path)] == [packed] * families.LAYERS
    caps = [op.get("softcap") for op in ops]
    assert caps == ([pytest.approx(families.SOFTCAP)] * families.LAYERS if family == "gemma2" else [None] * 2)
    assert "cache layout ragged" in output and "left unfused, as exported" not in output, output


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_generates_each_prompts_greedy_tokens_alone(exported, family, padding):
    """Prompts of four lengths in one batch, left- or right-padded: each row's first ``MAX_NEW`` greedy tokens equal
    transformers' ``generate`` on that prompt alone (exact token ids; the logits match within the export's own
    parity tolerance, atol 1e-5 scaled by each row's magnitude, rtol 1e-4)."""
    path, _, model = exported(family)
    rng = np.random.default_rng(37)
    ids, mask = prompt_batch([rng.integers(3, families.VOCAB, n) for n in LENGTHS])
    ids = np.where(mask == 1, ids, families.PAD_ID)
    if padding == "right":
        order = np.argsort(mask == 0, axis=1, kind="stable")
        ids, mask = np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)
    out = generate(KVCacheStepper(path), ids, mask, max_new_tokens=MAX_NEW, eos_token_id=[])
    # No end id on either side: every row runs its MAX_NEW tokens.
    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=families.PAD_ID)
    for row, tokens in enumerate(out.tokens):
        prompt = torch.from_numpy(ids[row][mask[row] == 1][None])
        with torch.no_grad():
            alone = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
        assert len(tokens) == MAX_NEW
        assert tokens.tolist() == alone[0, prompt.shape[1]:].tolist(), f"row {row} ({LENGTHS[row]} tokens)"
