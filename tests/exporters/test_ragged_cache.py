"""The ragged KV-cache layout of a user's causal LM (exporters.fusion.ragged_cache): what the default --kv-cache
export writes, its greedy tokens driven by plain numpy calls under the layout's contract, and where the export
keeps the holes layout instead, saying why."""

import re

import pytest

pytest.importorskip("torch")

import numpy as np
import onnx
import onnxruntime as ort
import torch
from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.errors import ExportError
from mha_deploy.exporters import export_model
from mha_deploy.exporters.fusion import ragged_cache
from mha_deploy.exporters.fusion.ragged_cache import RaggedRefused, to_ragged_cache
from mha_deploy.metadata import CACHE_RAGGED, POSITIONS_INPUT, POSITIONS_NONE, POSITIONS_PADDED_WIDTH
from mha_deploy.runtime import MHASession
from tests.conftest import USER_MODELS, user_module

HOLES = ("--cache-layout", "holes")


def assert_ragged_file(path, layers: int) -> None:
    """Every attention of the file at ``path`` GroupQueryAttention writing its present outputs, no
    MultiHeadAttention, and no Concat growing a cache input (the copy per step the layout removes)."""
    graph = onnx.load(str(path)).graph
    ops = [node.op_type for node in graph.node]
    assert ops.count("GroupQueryAttention") == layers and "MultiHeadAttention" not in ops
    past = {value.name for value in graph.input if value.name.startswith("past_key_values.")}
    assert len(past) == 2 * layers
    assert not [node.name for node in graph.node if node.op_type == "Concat" and past & set(node.input)]
    written = {name for node in graph.node if node.op_type == "GroupQueryAttention" for name in node.output[1:]}
    assert written == {value.name for value in graph.output if value.name.startswith("present.")}


@pytest.mark.parametrize(("name", "positions"), [("causal_lm", POSITIONS_NONE), ("tutorial_gpt", POSITIONS_INPUT)])
def test_the_default_cache_export_is_ragged(lm_cache, name, positions):
    """No positions (TinyLM) or positions by arange into a table (the tutorial GPT, given position_ids by default):
    GroupQueryAttention over the cache in place, recorded, said. torch's and GPT-2's decoders:
    test_own_kv_cache.test_torch_hugging_face_and_tutorial_decoders_get_a_narrowed_fused_cache."""
    path, output = lm_cache(name)
    metadata = MHASession(path, provider="cpu").metadata
    assert metadata.cache_layout == CACHE_RAGGED and metadata.positions == positions
    assert_ragged_file(path, metadata.layers)
    assert "cache layout ragged" in output and "warning" not in output


def ragged_greedy(path, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
    """Greedy tokens [batch, new_tokens] of the ragged file at ``path``, driven by plain ONNX Runtime calls as the
    layout's contract says: the prompts right-padded in one first call, then one token per row at its own
    position, each call's present fed back as the next call's past."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {value.name: value for value in session.get_inputs()}
    outputs = [value.name for value in session.get_outputs()]
    batch, lengths = len(prompts), np.array([len(prompt) for prompt in prompts])
    ids = np.zeros((batch, lengths.max()), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(lengths.max()), ids.shape)
    past = {name: np.zeros((batch, value.shape[1], 0, value.shape[3]), np.float32)
            for name, value in inputs.items() if name.startswith("past_key_values.")}
    last, tokens = lengths - 1, []
    for _ in range(new_tokens):
        feeds = {"input_ids": ids, "attention_mask": (np.arange(lengths.max()) < lengths[:, None]).astype(np.int64),
                 **past}
        if "position_ids" in inputs:
            feeds["position_ids"] = np.ascontiguousarray(positions, np.int64)
        result = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        logits = result["logits"]  # the default file's: each row's last real token's only, [batch, 1, vocab]
        token = (logits[:, 0] if logits.shape[1] == 1 else logits[np.arange(batch), last]).argmax(-1)
        tokens.append(token)
        past = {name: result[name.replace("past_key_values", "present")] for name in past}
        ids, positions, last = token[:, None].astype(np.int64), lengths[:, None], np.zeros(batch, np.int64)
        lengths = lengths + 1
    return np.stack(tokens, axis=1)


@pytest.mark.parametrize("name", ["causal_lm", "tutorial_gpt"])
def test_ragged_greedy_tokens_equal_the_modules_greedy_loop(lm_cache, name):
    """Prompts of different lengths in one batch: each row's tokens are those of the module's whole forward run
    on that prompt alone for every new token."""
    path, _ = lm_cache(name)
    module = user_module(name).build().eval()
    vocab = module.tok.num_embeddings
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, vocab, length).tolist() for length in (5, 2, 9, 1)]
    generated = ragged_greedy(path, prompts, 12)
    for row, prompt in enumerate(prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                tokens = torch.tensor([ids])
                ids.append(int(module(tokens, torch.ones_like(tokens, dtype=torch.bool))[0, -1].argmax()))
        assert generated[row].tolist() == ids[len(prompt):], f"row {row}"


def test_a_grouped_query_rotary_decoder_is_ragged_with_its_cache_at_the_kv_heads(lm_cache):
    """The tiny Hugging Face Llama (4 query heads over 2 KV heads repeated by repeat_kv, rotary) with the defaults:
    each attention GroupQueryAttention with kv_num_heads 2 writing the cache in place, the cache in and out at the
    2 KV heads (never repeated), and the runtime's buffers sized from the file's own cache inputs. Its greedy tokens
    against transformers' generate on a mixed-length batch, left- and right-padded: tests/runtime/test_generation.py
    (test_a_rotary_decoders_mixed_length_batch_gives_each_prompt_its_greedy_tokens_alone) and the serving engine's
    (test_a_rotary_decoders_requests_of_any_length_share_the_loop_each_equal_to_transformers_alone), same file."""
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    llama = user_module("hf_llama")
    path, output = lm_cache("hf_llama")
    assert "holes cache layout" not in output and "cache layout ragged" in output
    assert_ragged_file(path, llama.LAYERS)
    graph = onnx.load(str(path)).graph
    attentions = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    for node in attentions:
        attributes = {attribute.name: attribute.i for attribute in node.attribute}
        assert (attributes["num_heads"], attributes["kv_num_heads"]) == (llama.HEADS, llama.KV_HEADS)
        assert "local_window_size" not in attributes  # Llama: causal over the whole past
    caches = [value for value in (*graph.input, *graph.output)
              if value.name.startswith(("past_key_values.", "present."))]
    assert len(caches) == 4 * llama.LAYERS
    head_dim = llama.HIDDEN // llama.HEADS
    assert {tuple(d.dim_value for d in value.type.tensor_type.shape.dim[1::2]) for value in caches} == {
        (llama.KV_HEADS, head_dim)}
    session = MHASession(path, provider="cpu")
    assert session.metadata.cache_layout == CACHE_RAGGED and session.metadata.num_heads == llama.HEADS
    stepper = KVCacheStepper(path)
    stepper.prefill(np.array([[5, 6, 7], [8, 9, 0]]), np.array([[1, 1, 1], [1, 1, 0]]))
    assert stepper.ragged and {buffer.shape[1] for buffer in stepper.buffers.values()} == {llama.KV_HEADS}


def test_group_query_attentions_local_window_size_is_the_keys_a_query_sees():
    """What the ragged rewrite writes a sliding window of w keys as (ONNX Runtime 1.31 CPU, pinned here): with
    local_window_size w, the query at position p sees keys p - w + 1 .. p, in a prompt and in a one-token step after
    it. A window read off a module's mask is only exact if this holds."""
    from onnx import TensorProto, helper

    heads, kv_heads, head_dim, length, window = 2, 1, 8, 40, 5
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, local_window_size=window)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", "s", size])
              for name, size in (("q", heads * head_dim), ("k", head_dim), ("v", head_dim))]
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", kv_heads, "p", head_dim])
               for name in ("past_k", "past_v")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output]
    model = helper.make_model(helper.make_graph([node], "window", inputs, outputs), ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, length, size)).astype(np.float32)
               for size in (heads * head_dim, head_dim, head_dim))
    positions = np.arange(length)
    shown = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - window)
    expected = np.empty((length, heads * head_dim))
    for head in range(heads):
        scores = q[0, :, head * head_dim:(head + 1) * head_dim] @ k[0].T / np.sqrt(head_dim)
        scores = np.where(shown, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        expected[:, head * head_dim:(head + 1) * head_dim] = (weights / weights.sum(axis=1, keepdims=True)) @ v[0]
    empty = np.zeros((1, kv_heads, 0, head_dim), np.float32)

    def call(start, end, past_k, past_v):
        return session.run(None, {"q": q[:, start:end], "k": k[:, start:end], "v": v[:, start:end], "past_k": past_k,
                                  "past_v": past_v, "seqlens_k": np.array([end - 1], np.int32),
                                  "total": np.array(end, np.int32)})

    np.testing.assert_allclose(call(0, length, empty, empty)[0][0], expected, atol=1e-5)
    _, past_k, past_v = call(0, length - 1, empty, empty)
    np.testing.assert_allclose(call(length - 1, length, past_k, past_v)[0][0, 0], expected[-1], atol=1e-5)


class SlidingWindowLM(torch.nn.Module):
    """TinyLM whose attentions see only the last ``window`` positions (or, ``chunked``, only the positions of their
    own chunk of ``window``, as chunked attention does): its mask is built from the padding mask and shapes alone, as
    a causal one is."""

    def __init__(self, window: int = 3, chunked: bool = False):
        super().__init__()
        self.lm, self.window, self.chunked = user_module("causal_lm").build(), window, chunked

    def forward(self, tokens, mask):
        t = tokens.size(1)
        ones = torch.ones(t, t, dtype=torch.bool, device=tokens.device)
        if self.chunked:
            chunk = torch.arange(t, device=tokens.device) // self.window
            band = torch.tril(ones) & (chunk[:, None] == chunk[None, :])
        else:
            band = torch.tril(ones) & torch.triu(ones, diagonal=1 - self.window)
        x = self.lm.tok(tokens)
        for layer in self.lm.layers:
            x = layer(x, mask.unsqueeze(1).unsqueeze(2) & band)
        return self.lm.lm_head(x)


WINDOW_EXPORT = {"inputs": ["tokens:tokens", "mask:padding-mask"], "kv_cache": True}


@pytest.mark.parametrize(("window", "chunked", "max_length"), [(3, False, None), (300, True, 512)],
                         ids=["window-by-columns", "chunks-past-the-parity-lengths"])
def test_a_mask_the_op_cannot_take_keeps_the_holes_layout_saying_where_it_differs(tmp_path, monkeypatch, window,
                                                                                  chunked, max_length):
    """A window of 3 counted over the padded batch's columns: the positions probe sees a hole change which keys a
    row's window holds (positions "padded-width"). Chunks of 300, wider than every call per-step parity decodes (262
    tokens): the mask probe, run up to the max length (4096 when none is known), reads a window of 300 off the first
    chunk and finds the key the next chunk hides where that window shows it."""
    export = {**WINDOW_EXPORT, "max_length": max_length}
    result = export_model(SlidingWindowLM(window, chunked), tmp_path / "lm.onnx", **export)
    assert result.metadata.cache_layout is None and result.parity.passed
    if not chunked:
        why = "positions padded-width: the module counts them over the padded batch's columns"
        assert result.metadata.positions == POSITIONS_PADDED_WIDTH
        assert f"--kv-cache: holes cache layout, not ragged ({why}" in " ".join(result.warnings), result.warnings
    else:
        why = r"the mask of attention 0 hides key \d+ from query"
        probed = rf"--kv-cache: holes cache layout, not ragged \({why} \d+ .*where a sliding window of 300 keys"
        assert [w for w in result.warnings if re.match(probed, w) and "the mask probe)" in w], result.warnings
    assert "MultiHeadAttention" in {node.op_type for node in onnx.load(str(result.path)).graph.node}
    with pytest.raises(ExportError, match=rf"--cache-layout ragged: {why}"):
        export_model(SlidingWindowLM(window, chunked), tmp_path / "forced.onnx", cache_layout="ragged", **export)
    assert not (tmp_path / "forced.onnx").exists()
    if chunked:  # what the probe is for: per-step parity alone would have written a wrong ragged file
        monkeypatch.setattr(ragged_cache, "check_masks_are_causal", lambda *args: None)
        unprobed = export_model(SlidingWindowLM(window, chunked), tmp_path / "unprobed.onnx", cache_layout="ragged",
                                **export)
        assert unprobed.metadata.cache_layout == CACHE_RAGGED and unprobed.parity.passed


def test_a_sliding_window_is_read_off_the_mask_into_the_ops_local_window_size(tmp_path):
    """A window of 300 keys (wider than per-step parity decodes): the mask probe reads it, each attention is
    GroupQueryAttention with local_window_size 300, and greedy tokens past the window (a prompt of 305 beside one of
    20, right-padded, each row at its own positions) equal the module's whole forward on each prompt alone."""
    module = SlidingWindowLM(300)
    result = export_model(module, tmp_path / "lm.onnx", max_length=512, **WINDOW_EXPORT)
    assert result.metadata.cache_layout == CACHE_RAGGED, result.warnings
    assert_ragged_file(result.path, result.metadata.layers)
    windows = {attribute.i for node in onnx.load(str(result.path)).graph.node
               if node.op_type == "GroupQueryAttention" for attribute in node.attribute
               if attribute.name == "local_window_size"}
    assert windows == {300}
    rng = np.random.default_rng(30)
    prompts = [rng.integers(0, module.lm.tok.num_embeddings, length).tolist() for length in (305, 20)]
    generated = ragged_greedy(result.path, prompts, 3)
    module.eval()
    for row, prompt in enumerate(prompts):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(3):
                tokens = torch.tensor([ids])
                ids.append(int(module(tokens, torch.ones_like(tokens, dtype=torch.bool))[0, -1].argmax()))
        assert generated[row].tolist() == ids[len(prompt):], f"row {row}"


def _bias_reads_the_ids(graph, attention):
    graph.node.extend([
        onnx.helper.make_node("Cast", ["input_ids"], ["ids_as_float"], to=onnx.TensorProto.FLOAT),
        onnx.helper.make_node("Add", [attention.input[5], "ids_as_float"], ["bias_with_ids"]),
    ])
    attention.input[5] = "bias_with_ids"


def _bias_plus_a_position_bias(graph, attention):
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    graph.node.append(onnx.helper.make_node("Add", [attention.input[5], "half"], ["bias_plus_half"]))
    graph.value_info.append(onnx.helper.make_tensor_value_info("bias_plus_half", onnx.TensorProto.FLOAT, None))
    attention.input[5] = "bias_plus_half"


def _grown_cache_read_elsewhere(graph, attention):
    graph.node.append(onnx.helper.make_node("ReduceSum", [attention.input[1]], ["cache_sum"]))
    graph.output.append(onnx.ValueInfoProto(name="cache_sum"))


def _keys_not_from_a_cache(graph, attention):
    attention.input[1] = attention.input[2]  # the values' Concat read twice: no longer one present per Concat


@pytest.mark.parametrize(("change", "reason"), [
    # a mask hiding some token, say: not a key-padding mask the row lengths can replace
    (_bias_reads_the_ids, "its mask reads input_ids, not only the attention mask and shapes"),
    # built from constants, so structurally a mask; the probe reads a value GroupQueryAttention would drop
    (_bias_plus_a_position_bias, r"the mask of attention 0 adds 0.5 to a score, neither 0 nor a masking fill"),
    # another reader would see the cache GroupQueryAttention no longer builds
    (_grown_cache_read_elsewhere, "its grown cache is read by more than the op and one present output"),
    (_keys_not_from_a_cache, "its grown cache is read by more than the op and one present output"),
])
def test_the_rewrite_refuses_what_it_cannot_prove(lm_cache, change, reason):
    """The structural half of the proof and the mask probe, on the holes file with one thing changed: the rewrite
    refuses, saying why, and leaves the model as it was; unchanged, the same file is rewritten."""
    path, _ = lm_cache("causal_lm", *HOLES)
    model = onnx.load(str(path))
    assert "GroupQueryAttention" in {node.op_type for node in to_ragged_cache(model).graph.node}
    attention = next(node for node in model.graph.node if node.op_type == "MultiHeadAttention")
    change(model.graph, attention)
    with pytest.raises(RaggedRefused, match=reason):
        to_ragged_cache(model)
    assert "GroupQueryAttention" not in {node.op_type for node in model.graph.node}


def _export(name: str, path, *flags: str):
    inputs = [arg for spec in user_module(name).INPUTS for arg in ("--input", spec)]
    return CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / name}.py:build", *inputs, "--kv-cache",
                                     *flags, "-o", str(path)])


def test_without_position_ids_a_padded_width_model_keeps_holes_and_says_why(lm_cache, tmp_path):
    path, output = lm_cache("tutorial_gpt", "--no-position-ids")
    metadata = MHASession(path, provider="cpu").metadata
    assert metadata.positions == POSITIONS_PADDED_WIDTH and metadata.cache_layout is None
    assert "warning: --kv-cache: holes cache layout, not ragged (positions padded-width" in output
    assert "position_ids" not in {value.name for value in onnx.load(str(path)).graph.input}
    refused = _export("tutorial_gpt", tmp_path / "lm.onnx", "--no-position-ids", "--cache-layout", "ragged")
    assert refused.exit_code != 0 and "--cache-layout ragged: positions padded-width" in refused.output
    assert not (tmp_path / "lm.onnx").exists()


def test_a_rotary_pass_that_breaks_parity_costs_the_file_that_pass_not_the_ragged_layout(tmp_path, monkeypatch):
    """The tiny Llama exported with fusion.rotary_gqa's cos/sin tables made one position late (a deliberately broken
    pass, nothing in it refuses): per-step parity (the export's tolerance) fails with the rotary in the op, so the
    file is written ragged without it (the module's own rotary ops around GroupQueryAttention, no do_rotary, q/k/v
    not packed since they are rotated outside), its parity passed, and one warning line names the pass left out."""
    from mha_deploy.exporters.fusion import rotary_gqa

    read = rotary_gqa._Tables.read
    monkeypatch.setattr(rotary_gqa._Tables, "read",
                        lambda self, rotated: tuple(np.roll(table, 1, axis=0) for table in read(self, rotated)))
    llama = user_module("hf_llama")
    path = tmp_path / "lm.onnx"
    result = _export("hf_llama", path)
    assert result.exit_code == 0, result.output
    left_out = [line for line in result.output.splitlines() if "ragged layout without" in line]
    assert len(left_out) == 1 and left_out[0].startswith(
        "warning: --kv-cache: ragged layout without rotary in the op (do_rotary): the file failed parity with it ("
    ), result.output
    assert left_out[0].endswith("; nor q/k/v packed into one MatMul, which then applied to no attention")
    assert "holes cache layout" not in result.output and "cache layout ragged" in result.output
    session = MHASession(path, provider="cpu")
    assert session.metadata.cache_layout == CACHE_RAGGED and session.metadata.parity.passed
    assert_ragged_file(path, llama.LAYERS)
    graph = onnx.load(str(path)).graph
    attentions = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert all({a.name: a.i for a in node.attribute}.get("do_rotary", 0) == 0 for node in attentions)
    assert all(list(node.input[1:3]) != ["", ""] for node in attentions)
    assert {"Cos", "Sin"} <= {node.op_type for node in graph.node}


def test_cache_layout_holes_keeps_past_plus_new(lm_cache):
    path, output = lm_cache("causal_lm", *HOLES)
    graph = onnx.load(str(path)).graph
    ops = [node.op_type for node in graph.node]
    assert "GroupQueryAttention" not in ops and ops.count("MultiHeadAttention") == 2
    assert MHASession(path, provider="cpu").metadata.cache_layout is None and "warning" not in output


@pytest.mark.parametrize(("flags", "message"), [
    (("--cache-layout", "ragged"), "--cache-layout is how a KV-cache decoder keeps its cache: give --kv-cache"),
    (("--cache-layout", "paged"), "'paged' is not one of 'auto', 'ragged', 'holes'"),
])
def test_cache_layout_flag_errors(tmp_path, flags, message):
    inputs = [arg for spec in user_module("causal_lm").INPUTS for arg in ("--input", spec)]
    result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'causal_lm'}.py:build", *inputs, *flags,
                                       "-o", str(tmp_path / "lm.onnx")])
    assert result.exit_code == 2 and message in result.output, result.output


def test_an_encoder_decoder_refuses_a_ragged_cache_before_tracing(tmp_path):
    module = user_module("seq2seq")
    with pytest.raises(ExportError, match="--cache-layout ragged: an encoder-decoder's decoder keeps the holes"):
        export_model(module.build(), tmp_path / "mt.onnx", module.INPUTS, kv_cache=True, cache_layout="ragged")
