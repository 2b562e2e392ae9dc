"""``mha-deploy export --hf DIR --kv-cache`` and nothing else, for each causal-LM family the export claims
(tests/user_models/hf_families.py: tiny configs written with ``save_pretrained``): what the file fuses, counted from
the file itself, and that greedy generation gives every prompt of a mixed-length batch the tokens transformers'
``generate`` gives it alone, through each way the file is run: ``mha_deploy.runtime.generation`` (left- or
right-padded), ``mha-deploy generate`` over a JSONL dataset, ``mha-deploy serve`` answering concurrent requests of
OpenAI's client, and onnxruntime-genai (in .venv-genai) from the config ``mha-deploy genai-config`` writes with no
flags. One export per family per session."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from mha_deploy.bench.genai import genai_python, run_genai_greedy
from mha_deploy.cli import main
from mha_deploy.runtime.generation import generate, prompt_batch
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import hf_family_kv_export, user_module
from tests.serving.helpers import Server, completions_concurrent_and_together

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

families = user_module("hf_families")
LENGTHS, PROMPTS, MAX_NEW = families.PROMPT_LENGTHS, families.PROMPTS, families.MAX_NEW


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family) -> (file, CLI output, model)``: the family's folder exported once per run, and the model it
    was saved from."""
    cache = {}

    def export(family: str):
        if family not in cache:
            cache[family] = (*hf_family_kv_export(tmp_path_factory, family), families.build(family))
        return cache[family]

    return export


@pytest.fixture(scope="module")
def alone(exported):
    """``alone(family) -> [new tokens per prompt]``: transformers' greedy ``generate`` on each of ``PROMPTS`` alone,
    ``MAX_NEW`` new tokens or fewer where the folder's eos id comes (as the file recorded it: every path below ends
    a row there, its eos kept)."""
    cache = {}

    def tokens(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = families.greedy_alone(exported(family)[2])
        return cache[family]

    return tokens


def _attentions(path) -> list[dict[str, object]]:
    """Each GroupQueryAttention's attributes in graph order (layer order: the export keeps it)."""
    model = onnx.load(str(path), load_external_data=False)
    return [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node in model.graph.node
            if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"]


def _attention_inputs(path) -> list[list[str]]:
    model = onnx.load(str(path), load_external_data=False)
    return [list(node.input) for node in model.graph.node if node.op_type == "GroupQueryAttention"]


def _initializer_shapes(path, names: list[str]) -> list[list[int]]:
    model = onnx.load(str(path), load_external_data=False)
    found = {init.name: list(init.dims) for init in model.graph.initializer}
    return [found[name] for name in names]


def _head_dim(path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(value.type.tensor_type.shape.dim[3].dim_value for value in model.graph.input
                if value.name.startswith("past_key_values."))


def _cache_heads(path) -> set[int]:
    model = onnx.load(str(path), load_external_data=False)
    return {value.type.tensor_type.shape.dim[1].dim_value for value in model.graph.input
            if value.name.startswith("past_key_values.")}


@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_fuses_every_attention_into_group_query_attention_at_its_kv_heads(exported, family):
    """One GroupQueryAttention per layer with the config's KV heads (OPT: every head), the cache at those heads, the
    rotary inside the op (``do_rotary``) where the family has one, q/k/v packed where the module allows, a sliding
    layer's window as ``local_window_size`` (a global layer without one), Gemma-2's score cap as ``softcap``; no
    warning that an attention was left unfused. ``families.FUSED`` states each family's expectation."""
    path, output, _ = exported(family)
    want = families.FUSED[family]
    ops = _attentions(path)
    assert len(ops) == families.LAYERS, output
    assert [op["kv_num_heads"] for op in ops] == [want.kv_heads] * families.LAYERS
    assert [op["num_heads"] for op in ops] == [families.HEADS] * families.LAYERS
    assert _cache_heads(path) == {want.kv_heads}
    assert [op.get("local_window_size") for op in ops] == families.windows(family)
    # The rotary inside the op (fusion.rotary_gqa): every rotary family here rotates pairs (i, i + d/2), not
    # interleaved; the partial ones their heads' first rotary_dim dims only (the op's cos/sin caches [max length,
    # rotary_dim / 2], the rest of each head passed through). OPT's learned positions are added to the embeddings:
    # no rotary, and no cos/sin tables in the op.
    assert [op.get("do_rotary") for op in ops] == [1 if want.rotary else None] * families.LAYERS, output
    assert [op.get("rotary_interleaved") for op in ops] == [0 if want.rotary else None] * families.LAYERS
    tables = [[name for name in op_inputs[7:9] if name] for op_inputs in _attention_inputs(path)]  # cos/sin caches
    assert [len(names) for names in tables] == [2 if want.rotary else 0] * families.LAYERS
    if want.rotary:
        head_dim = _head_dim(path)
        widths = {tuple(shape) for shape in _initializer_shapes(path, [name for names in tables for name in names])}
        assert widths == {(families.MAX_POSITIONS, (want.rotary_dim or head_dim) // 2)}, widths
    # q/k/v as one projection into the op's packed query (fusion.qkv_packing), where no per-head q/k norm sits
    # between the projections and the op, and the module has three projections to pack (Phi-3 slices its one).
    assert [op_inputs[1:3] == ["", ""] for op_inputs in _attention_inputs(path)] == [want.packed] * families.LAYERS
    caps = [op.get("softcap") for op in ops]
    assert caps == [None if want.softcap is None else pytest.approx(want.softcap)] * families.LAYERS
    assert "cache layout ragged" in output and "left unfused, as exported" not in output, output


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_generates_each_prompts_greedy_tokens_alone(exported, alone, family, padding):
    """Prompts of four lengths in one batch, left- or right-padded: each row's greedy tokens (``MAX_NEW``, or up to
    the recorded eos id) equal transformers' ``generate`` on that prompt alone (exact token ids; the logits match
    within the export's own parity tolerance, atol 1e-5 scaled by each row's magnitude, rtol 1e-4)."""
    path = exported(family)[0]
    ids, mask = prompt_batch([np.array(prompt) for prompt in PROMPTS])
    ids = np.where(mask == 1, ids, families.PAD_ID)
    if padding == "right":
        order = np.argsort(mask == 0, axis=1, kind="stable")
        ids, mask = np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)
    out = generate(KVCacheStepper(path), ids, mask, max_new_tokens=MAX_NEW)  # the eos id the file recorded
    assert [tokens.tolist() for tokens in out.tokens] == alone(family)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_through_generate_over_a_dataset_mixes_lengths_in_one_batch(exported, alone, family, tmp_path):
    """``mha-deploy generate`` over a JSONL file of the four prompts, with no flag but the new tokens: the file takes
    position_ids, so the four lengths share one batch (left-padded), and each prompt's output ids equal
    transformers' greedy tokens alone (exact ids)."""
    path = exported(family)[0]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": n, "input_ids": p}) + "\n" for n, p in enumerate(PROMPTS)))
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(source), "--output",
                                       str(tmp_path / "out.jsonl"), "--max-new-tokens", str(MAX_NEW), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "4 prompts" in result.output and "1 batches" in result.output, result.output
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["output_ids"] for line in lines] == alone(family)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_served_to_concurrent_openai_requests_gives_each_prompt_its_tokens_alone(exported, alone, family,
                                                                                             tmp_path):
    """``mha-deploy serve`` of the file (no flag but the port, provider and threads the tests pin): the four prompts
    sent at once as four requests by OpenAI's client, continuous batching mixing their lengths in one cache, and
    then as one request of four prompts; every completion's token ids equal transformers' greedy tokens for its
    prompt alone (exact ids), ending at the recorded eos id where it comes."""
    pytest.importorskip("openai")
    path = exported(family)[0]
    server = Server(path, tmp_path / "server.log", "--threads", "1", "--name", family)
    try:
        server.wait_ready()
        assert "requests of any length share one cache" in server.log()
        concurrent, together = completions_concurrent_and_together(server, family, PROMPTS, MAX_NEW)
    finally:
        server.stop()
    assert concurrent == alone(family), server.log()
    assert together == alone(family)


@pytest.mark.skipif(genai_python() is None, reason="no .venv-genai: scripts/setup.sh installs onnxruntime-genai there")
@pytest.mark.parametrize("family", families.FAMILIES)
def test_each_family_in_onnxruntime_genai_from_the_config_written_with_no_flags(exported, alone, family):
    """``mha-deploy genai-config FILE`` with no flag: the context length and the eos, pad and bos ids come from the
    folder's config (max_position_embeddings, eos_token_id, pad_token_id, bos_token_id, as the export recorded them);
    onnxruntime-genai (its own environment, its own onnxruntime) then generates the four prompts as one batch,
    right-padded with the pad id as it pads, and each row's tokens equal transformers' greedy tokens alone (exact
    ids)."""
    path = exported(family)[0]
    result = CliRunner().invoke(main, ["genai-config", str(path)])
    assert result.exit_code == 0, result.output
    config = json.loads((path.parent / "genai_config.json").read_text())["model"]
    assert (config["context_length"], config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (
        families.MAX_POSITIONS, families.EOS_ID, families.PAD_ID, families.BOS_ID)
    # inspect shows the bos id beside the others; prompts stay as given (the generate and serve tests above)
    shown = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert f"eos {families.EOS_ID}, pad {families.PAD_ID}, bos {families.BOS_ID} (not added to prompts)" in shown
    width = max(LENGTHS)
    padded = [prompt + [families.PAD_ID] * (width - len(prompt)) for prompt in PROMPTS]
    rows = run_genai_greedy(path.parent, padded, width + MAX_NEW).new_tokens(width)
    for row, (theirs, want) in enumerate(zip(rows, alone(family), strict=True)):
        # A row that reaches the eos id (as test_genai.py reads onnxruntime-genai 0.18): its eos kept unless that step
        # ended the whole batch (the last step's tokens left out), then the pad id until the batch ends.
        ended = want[-1] == families.EOS_ID
        before_eos = want[:-1] if ended else want
        rest = theirs[len(before_eos):]
        assert theirs[:len(before_eos)] == before_eos and (
            rest[:1] in ([], [families.EOS_ID]) and set(rest[1:]) <= {families.PAD_ID} if ended else not rest), (
            f"row {row} ({LENGTHS[row]} tokens): onnxruntime-genai {theirs}, transformers {want}")
