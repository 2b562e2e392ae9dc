"""A KV-cache export of a user's causal LM written with no cache code (exporters.own_kv_cache): the file's
interface, step-by-step decoding against the module's own full forward, and what is refused."""

import pytest

pytest.importorskip("torch")

from dataclasses import replace

import numpy as np
import onnx
import torch
from click.testing import CliRunner
from torch import nn

from mha_deploy.cli import main
from mha_deploy.errors import ExportError, OptionError, ParityError
from mha_deploy.exporters import export_model
from mha_deploy.exporters.parity import CacheCase
from mha_deploy.metadata import GenerationIds
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.runtime import MHASession
from tests.conftest import HOLES_EVERY_POSITION, OWN_MODEL_ATOL, OWN_MODEL_RTOL, USER_MODELS, user_module
from tests.exporters.test_ragged_cache import assert_ragged_file

# The layout these tests drive call by call with padding on either side (the default is ragged where the file
# allows it: tests/exporters/test_ragged_cache.py), with logits at every position of a call, each checked.
HOLES = HOLES_EVERY_POSITION


def test_the_file_takes_and_returns_a_cache_per_attention_in_optimums_names(lm_cache):
    path, _ = lm_cache("causal_lm")
    session = MHASession(path, provider="cpu")
    signature = session.signature
    assert signature.kv_cache and signature.layers == 2
    caches = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert signature.input_names == ("input_ids", "attention_mask", *caches)
    assert signature.output_names == ("logits", *(name.replace("past_key_values", "present") for name in caches))
    assert signature.cache_pairs == {name: name.replace("past_key_values", "present") for name in caches}
    # [batch, heads, past_seq, head_dim]: TinyLM's d_model 32 over 4 heads
    assert signature.tensors["past_key_values.1.value"].axes == ("batch", 4, "past_seq", 8)
    assert signature.tensors["present.0.key"].axes == ("batch", 4, "total_seq", 8)
    assert signature.tensors["attention_mask"].dtype == "int64"
    graph_inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}
    assert graph_inputs["attention_mask"] == onnx.TensorProto.INT64  # as onnxruntime-genai feeds it
    # TinyLM has no positions: padding before a row does not move its logits, so any rows may share a batch.
    assert session.metadata.positions == "none"


def test_every_attention_is_fused_as_in_a_cache_free_export(lm_cache):
    path, output = lm_cache("causal_lm")
    ops = [node.op_type for node in all_nodes(onnx.load(str(path)).graph)]
    assert "Softmax" not in ops
    # Queries of this call's tokens over keys of every call: the mask, cut to those rows, is the op's bias.
    assert "2 fused into com.microsoft.MultiHeadAttention" in output
    assert "each step runs the whole sequence" not in output


def test_a_step_applies_weights_to_its_new_tokens_only(lm_cache):
    """Every MatMul of the file, run on a 2-token step after 13 cached tokens, has rows for the 2 new tokens
    and none for the 15 of the whole sequence (TinyLM's dims are 8, 32, 50 and 128); the LM head's, the default
    file's last, has the one row of the call's last token. The call's token ids reach the embedding as given:
    no filler as long as the past is built before them to be cut off again (a decode step's six small ops)."""
    path, _ = lm_cache("causal_lm")
    model = onnx.load(str(path))
    assert not [node.op_type for node in model.graph.node if node.op_type == "ConstantOfShape"]
    matmuls = [node.output[0] for node in model.graph.node if node.op_type in ("MatMul", "Gemm")]
    assert matmuls
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in matmuls)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = {i.name: np.zeros((1, 4, 13, 8), np.float32) for i in session.get_inputs() if i.name.startswith("past")}
    feeds = {"input_ids": np.array([[3, 4]]), "attention_mask": np.ones((1, 15), np.int64), **past}
    shapes = dict(zip(matmuls, (a.shape for a in session.run(matmuls, feeds)), strict=True))
    head = shapes.pop(matmuls[-1])
    assert head == (1, 1, 50), head
    assert all(15 not in shape and 2 in shape for shape in shapes.values()), shapes


def _decode(session, ids, mask, calls, positions=None):
    """Logits of each call of ``calls`` tokens, fed the previous call's present outputs (and ``positions``'
    columns of the call as position_ids, when given)."""
    signature = session.signature
    past = {name: np.zeros((ids.shape[0], *signature.tensors[name].axes[1:2], 0,
                            signature.tensors[name].axes[3]), np.float32) for name in signature.cache_pairs}
    start, logits = 0, []
    for length in calls:
        end = start + length
        given = {} if positions is None else {"position_ids": positions[:, start:end]}
        result = session.run({"input_ids": ids[:, start:end], "attention_mask": mask[:, :end], **given, **past})
        logits.append((start, end, result["logits"]))
        past = {name: result[present] for name, present in signature.cache_pairs.items()}
        start = end
    return logits, past


@pytest.mark.parametrize("padding", ["right", "left"])
def test_each_step_equals_the_modules_full_forward(lm_cache, padding):
    """A padded prompt, one-token steps, then several tokens at once: every call's logits on real rows equal
    the module's one forward over the whole sequence (right padding leaves holes the steps grow past)."""
    path, _ = lm_cache("causal_lm", *HOLES)
    session = MHASession(path, provider="cpu")
    module = user_module("causal_lm").build().eval()
    rng = np.random.default_rng(3)
    calls = (6, 1, 1, 4, 2)
    ids = rng.integers(0, 50, (3, sum(calls)))
    mask = np.ones(ids.shape, bool)
    for row, length in enumerate((6, 3, 1)):  # the prompt's real tokens, on the other side from the padding
        prompt = np.arange(calls[0]) >= calls[0] - length if padding == "left" else np.arange(calls[0]) < length
        mask[row, : calls[0]] = prompt
    with torch.no_grad():
        expected = module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    logits, cache = _decode(session, ids, mask.astype(np.int64), calls)
    for start, end, got in logits:
        real = mask[:, start:end]
        np.testing.assert_allclose(got[real], expected[:, start:end][real], atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL,
                                   err_msg=f"{padding} padding, tokens {start}:{end}")
    # The cache grown call by call is the cache of one call over the whole sequence, on real positions.
    _, whole = _decode(session, ids, mask.astype(np.int64), (sum(calls),))
    for name, array in cache.items():
        np.testing.assert_allclose(np.moveaxis(array, 2, 1)[mask], np.moveaxis(whole[name], 2, 1)[mask],
                                   atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=name)


@pytest.mark.parametrize(("flags", "sides"), [(HOLES, ("/left", "/right")), ((), ("/right",))])
def test_export_records_per_step_parity(lm_cache, flags, sides):
    """Holes: prompts padded on each side; ragged: right-padded prompts, and several tokens after a past at batch 1
    (the only batch ONNX Runtime's GroupQueryAttention takes them at)."""
    path, _ = lm_cache("causal_lm", *flags)
    metadata = MHASession(path, provider="cpu").metadata
    assert metadata.parity.passed
    assert all(any(side in shape for shape in metadata.parity.shapes) for side in sides), metadata.parity.shapes
    if not flags:
        assert metadata.cache_layout == "ragged"
        assert not any("/left" in shape for shape in metadata.parity.shapes)
        assert any(shape.startswith("1x(") and not shape.endswith("+0)") for shape in metadata.parity.shapes)


@pytest.mark.parametrize(("name", "factory"), [("torch_decoder", "build"), ("hf_gpt2", "build"),
                                               ("hf_gpt2", "build_eager"), ("tutorial_gpt", "build")])
def test_torch_hugging_face_and_tutorial_decoders_get_a_narrowed_fused_cache(shared_trace, tmp_path, name, factory):
    """Learned positions by arange (tutorial, torch, GPT-2), GPT-2's flattened Conv1D rows, torch's nested
    masked_fills: each step narrowed to its new tokens, every attention fused, parity per step; by default the
    file takes position_ids and its cache is ragged."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    module = user_module(name)
    with shared_trace(name, factory):  # the trace the model's other exports start from (conftest.traces_shared)
        result = export_model(getattr(module, factory)(), tmp_path / "lm.onnx", module.INPUTS, kv_cache=True)
    assert result.parity.passed
    # GPT-2's config names its eos and bos (0 in this small one): the file records the eos for generate and
    # onnxruntime-genai, the bos for onnxruntime-genai only (prompts stay as given)
    from_config = ["eos 0, bos 0 (not added to prompts) recorded from the module's config (--eos-id, --pad-id, "
                   "--start-id to record others)"]
    assert result.warnings == (from_config if name.startswith("hf_") else []), result.warnings
    assert result.metadata.generation == (GenerationIds([0], bos_token_id=0) if name.startswith("hf_") else None)
    layers = 4 if name == "torch_decoder" else 2  # nn.TransformerDecoder: self- and cross-attention per layer
    assert MHASession(result.path, provider="cpu").signature.layers == layers
    assert result.fusion.fused == layers and result.fusion.complete
    # positions by arange into a table: taken from position_ids (each row its own), which the ragged layout needs
    assert result.metadata.positions == "input"
    assert result.metadata.cache_layout == "ragged"
    assert_ragged_file(result.path, layers)


def test_per_row_positions_give_each_left_padded_row_what_it_gets_alone(shared_trace, tmp_path):
    """--position-ids: the tutorial GPT's learned positions come from the input, so with each row's count of real
    tokens as its positions (what KVCacheStepper and onnxruntime-genai feed), every row of a left-padded batch
    decodes, call by call, to the logits it gets alone."""
    path = tmp_path / "lm.onnx"
    inputs = [arg for spec in user_module("tutorial_gpt").INPUTS for arg in ("--input", spec)]
    with shared_trace("tutorial_gpt", "build"):
        result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'tutorial_gpt'}.py:build", *inputs,
                                           "--kv-cache", "--position-ids", *HOLES, "-o", str(path)])
    assert result.exit_code == 0, result.output
    session = MHASession(path, provider="cpu")
    assert session.signature.input_names[:3] == ("input_ids", "position_ids", "attention_mask")
    assert session.metadata.positions == "input"
    rng = np.random.default_rng(5)
    calls, lengths = (6, 1, 1, 3), (6, 3, 1)
    ids = rng.integers(0, 60, (len(lengths), sum(calls)))
    mask = np.ones(ids.shape, np.int64)
    for row, length in enumerate(lengths):
        mask[row, : calls[0] - length] = 0  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    batched, _ = _decode(session, ids, mask, calls, positions)
    for row, length in enumerate(lengths):
        real = mask[row] == 1
        alone_calls = (length, *calls[1:])
        alone, _ = _decode(session, ids[row:row + 1, real], np.ones((1, real.sum()), np.int64), alone_calls,
                           np.arange(real.sum())[None])
        got = np.concatenate([logits[row][mask[row, start:end] == 1] for start, end, logits in batched])
        want = np.concatenate([logits[0] for _, _, logits in alone])
        np.testing.assert_allclose(got, want, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=f"row {row}")


class GatedLM(nn.Module):
    """A causal attention, then a gated unit whose halves are cut along the features (``x[..., :d]``: Slice ops
    on another axis than the positions): still a row per position, so a step stays narrowed."""

    def __init__(self, vocab=20, d_model=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d_model)
        self.attn = nn.MultiheadAttention(d_model, 2, batch_first=True)
        self.gate = nn.Linear(d_model, 2 * d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, mask):
        x = self.embed(ids)
        t, d = ids.size(1), x.size(-1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        y, _ = self.attn(x, x, x, attn_mask=causal, key_padding_mask=~mask, need_weights=False)
        h = self.gate(y)
        return self.head(h[..., :d] * torch.sigmoid(h[..., d:]))


def test_cuts_along_the_features_keep_a_step_narrowed(tmp_path):
    result = export_model(GatedLM(), tmp_path / "lm.onnx", ["ids:tokens", "mask:padding-mask"], kv_cache=True,
                          parity_cases=(CacheCase(2, 4, 1, 2, "left"),))
    assert result.parity.passed
    assert not result.warnings, result.warnings


class CausalThen(nn.Module):
    """A causal attention over embedded ids, then ``after`` on its output, then a head over the vocabulary."""

    def __init__(self, vocab=20, d_model=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d_model)
        self.attn = nn.MultiheadAttention(d_model, 2, batch_first=True)
        self.head = nn.Linear(d_model, vocab)

    def after(self, y):
        raise NotImplementedError

    def forward(self, ids, mask):
        x = self.embed(ids)
        t = ids.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        y, _ = self.attn(x, x, x, attn_mask=causal, key_padding_mask=~mask, need_weights=False)
        return self.head(self.after(y))


class FeatureCumsum(CausalThen):
    """A cumulative sum over the features after the attention (per position, but an op the narrowing does not
    know): the cache still works, each step over the whole sequence."""

    def after(self, y):
        return torch.cumsum(y, dim=-1)


def test_an_op_narrowing_cannot_prove_keeps_the_whole_sequence_and_says_which(tmp_path):
    result = export_model(FeatureCumsum(), tmp_path / "lm.onnx", ["ids:tokens", "mask:padding-mask"], kv_cache=True,
                          parity_cases=(CacheCase(2, 4, 1, 2, "left"),))
    assert result.parity.passed
    assert [w for w in result.warnings if "each step runs the whole sequence's forward (CumSum" in w], result.warnings
    # Its logits are a cumsum over the features of the projection's product: no LM head to run on the last token
    # alone, so the default keeps every position and says why.
    assert [w for w in result.warnings if "logits at every position" in w and "no LM head" in w], result.warnings


class MeanCentred(CausalThen):
    """Each position minus the sequence's mean after the attention: one position reads every other one outside
    the attention, so no KV cache can reproduce it."""

    def after(self, y):
        return y - y.mean(dim=1, keepdim=True)


def test_a_module_no_cache_can_reproduce_is_refused_naming_the_call(tmp_path):
    target = tmp_path / "lm.onnx"
    with pytest.raises(ParityError, match=r"call \d of \d .*nothing written"):
        export_model(MeanCentred(), target, ["ids:tokens", "mask:padding-mask"], kv_cache=True,
                     parity_cases=(CacheCase(2, 4, 1, 2, "none"),), fuse="none")
    assert list(tmp_path.iterdir()) == []


class SingleHead(nn.Module):
    """One head over [batch, seq, d] with no head axis: keys the cache pass cannot lay out per head."""

    def __init__(self, vocab=20, d_model=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, mask):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        t = ids.size(1)
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool)) & mask[:, None, :]
        scores = (q @ k.transpose(1, 2)).masked_fill(~keep, -1e9)
        return self.head(torch.softmax(scores, dim=-1) @ v)


def test_attention_the_pass_cannot_lay_out_is_refused_not_cached_wrongly(tmp_path):
    with pytest.raises(ExportError, match=r"0 of 1 attention\(s\) found where a cache can be attached.*silently wrong"):
        export_model(SingleHead(), tmp_path / "lm.onnx", ["ids:tokens", "mask:padding-mask"], kv_cache=True)
    assert list(tmp_path.iterdir()) == []


class Unmasked(nn.Module):
    def __init__(self, vocab=20, d_model=16):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, d_model), nn.Linear(d_model, vocab)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_cache_needs_token_ids_and_their_mask(tmp_path):
    with pytest.raises(ExportError, match="declare its ids and their padding mask"):
        export_model(Unmasked(), tmp_path / "lm.onnx", ["ids:tokens"], kv_cache=True)


def test_half_caches_are_not_offered_yet(tmp_path):
    with pytest.raises(ExportError, match="fp32 for now"):
        export_model(user_module("causal_lm").build(), tmp_path / "lm.onnx", user_module("causal_lm").INPUTS,
                     kv_cache=True, dtype="fp16")


def test_inspect_describes_the_cache_per_attention(lm_cache):
    path, _ = lm_cache("causal_lm")
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "past_key_values.{i}.key/.value -> present.{i}.key/.value (i < 2, one per attention)" in result.output
    assert "encoder_key" not in result.output
    assert "cache layout ragged: GroupQueryAttention updates the cache in place" in result.output


def test_the_float_sequence_decoder_refuses_a_token_lm(lm_cache):
    path, _ = lm_cache("causal_lm")
    with pytest.raises(OptionError, match=r"run it with session\.run on input_ids"):
        MHASession(path, provider="cpu").decoder()


def test_the_generation_loop_drives_the_file_to_the_modules_greedy_tokens(lm_cache):
    """runtime.generation over the file (prompts of different lengths, left-padded in one batch) gives the
    tokens of a greedy loop that runs the module's whole forward on each prompt alone for every new token."""
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    path, _ = lm_cache("causal_lm", *HOLES)
    module = user_module("causal_lm").build().eval()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 50, length).tolist() for length in (5, 2, 9)]
    generated = generate(KVCacheStepper(path), prompts, max_new_tokens=24).tokens
    for prompt, tokens in zip(prompts, generated, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                row = torch.tensor([ids])
                ids.append(int(module(row, torch.ones_like(row, dtype=torch.bool))[0, -1].argmax()))
        assert tokens.tolist() == ids[len(prompt):]


# --- A rotary decoder as from_pretrained gives it (tests/user_models/hf_llama.py) ------------------------------


@pytest.fixture(scope="module")
def llama(lm_cache):
    """The tiny Llama exported with `export --module hf_llama.py:build --kv-cache` and nothing else."""
    pytest.importorskip("transformers")
    return lm_cache("hf_llama")


def test_a_rotary_decoder_exports_with_the_defaults_and_takes_each_rows_positions(llama):
    """use_cache on (its forward returns a DynamicCache) and the default opset (at which torch writes an ONNX
    RotaryEmbedding ONNX Runtime rejects at batch > 1): the export turns the one off and picks opset 22, a line
    each; the rotary's positions come from position_ids, and per-step parity ran rows of 3 different lengths."""
    path, output = llama
    assert "LlamaForCausalLM.forward called with use_cache=False" in output
    assert "opset 22, not 23" in output
    model = onnx.load(str(path))
    assert {o.domain: o.version for o in model.opset_import}[""] == 22
    assert "RotaryEmbedding" not in {node.op_type for node in all_nodes(model.graph)}
    session = MHASession(path, provider="cpu")
    assert session.signature.input_names[:2] == ("input_ids", "position_ids")
    assert session.metadata.positions == "input" and session.metadata.opset == 22
    # What onnxruntime-genai's config needs, from the module's config: its context and its eos
    assert "max length 256 recorded from the module's config (max_position_embeddings" in output
    assert session.metadata.max_length == 256 and session.metadata.generation.eos_token_ids == [2]
    from mha_deploy.runtime.genai_config import genai_config

    genai = genai_config(session.metadata, path.name)["model"]  # `genai-config` with no --max-length
    assert (genai["context_length"], genai["eos_token_id"], genai["bos_token_id"]) == (256, 2, 1)  # bos: its config's
    # its cache at the 2 KV heads under 4 query heads (GroupQueryAttention's kv_num_heads): genai allocates by them
    decoder = genai["decoder"]
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["head_size"]) == (4, 2, 16)
    assert session.signature.tensors["past_key_values.0.key"].axes[1] == 2
    assert session.metadata.parity.passed and any(shape.startswith("3x") for shape in session.metadata.parity.shapes)


def _positions_from_columns(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its position_ids input replaced by what the module counts without one: the padded batch's
    column indices of this call's tokens (Range(past, total), one row for every row)."""
    from onnx import helper

    columns = onnx.ModelProto()
    columns.CopyFrom(model)
    graph = columns.graph
    kept = [value for value in graph.input if value.name != "position_ids"]
    graph.ClearField("input")
    graph.input.extend(kept)
    zero = helper.make_tensor("axis0", onnx.TensorProto.INT64, [1], [0])
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["columns.ids_shape"]),
        helper.make_node("Shape", ["input_ids"], ["columns.seq"], start=1, end=2),
        helper.make_node("Shape", ["attention_mask"], ["columns.total"], start=1, end=2),
        helper.make_node("Sub", ["columns.total", "columns.seq"], ["columns.past"]),
        helper.make_node("Constant", [], ["columns.axis0"], value=zero),
        helper.make_node("Squeeze", ["columns.past", "columns.axis0"], ["columns.start"]),
        helper.make_node("Squeeze", ["columns.total", "columns.axis0"], ["columns.end"]),
        helper.make_node("Constant", [], ["columns.one"], value=helper.make_tensor("one", onnx.TensorProto.INT64,
                                                                                      [], [1])),
        helper.make_node("Range", ["columns.start", "columns.end", "columns.one"], ["columns.range"]),
        helper.make_node("Unsqueeze", ["columns.range", "columns.axis0"], ["columns.row"]),
        helper.make_node("Expand", ["columns.row", "columns.ids_shape"], ["position_ids"]),
    ]
    existing = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(nodes + existing)
    return columns


def test_the_positions_probe_sees_a_rotary_models_holes(lm_cache):
    """The holes file (the layout the probe runs on: a ragged file takes right padding only) given each row's own
    positions is padding-proof ("input"). Counting them over the padded batch's columns instead, as the module does
    without position_ids, a right-padded prompt's next token sits past a hole: rotary sees the farther distance, so
    the probe must record "padded-width". (Padding before a row alone shifts every position by the same amount, which
    rotary cannot see: the probe of earlier versions recorded "none".) Its cache is at the 2 KV heads as the ragged
    file's is: the repeat reads past ++ new, the cache never holds a head twice."""
    from mha_deploy.exporters.own_kv_cache import positions_kind

    path, _ = lm_cache("hf_llama", *HOLES)
    model = onnx.load(str(path))
    caches = [value for value in model.graph.input if value.name.startswith("past_key_values.")]
    assert {value.type.tensor_type.shape.dim[1].dim_value for value in caches} == {2}
    # each MultiHeadAttention reads the repeated cache as it is ([batch, heads, total, d_k], fusion.cache_heads), not
    # through a Transpose and Reshape of it per layer and step
    producers = {output: node for node in model.graph.node for output in node.output}
    attentions = [node for node in model.graph.node if node.op_type == "MultiHeadAttention"]
    assert len(attentions) == 2
    for node in attentions:
        for name in node.input[1:3]:
            assert producers[name].op_type == "Reshape" and producers[producers[name].input[0]].op_type == "Expand"
    signature = MHASession(path, provider="cpu").signature
    assert positions_kind(model, signature) == "input"
    own_positions = replace(signature, custom_inputs=tuple(spec for spec in signature.custom_inputs
                                                           if spec.name != "position_ids"))
    assert positions_kind(_positions_from_columns(model), own_positions) == "padded-width"
