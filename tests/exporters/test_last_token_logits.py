"""A causal LM's ``export --kv-cache`` file with ``--logits auto`` (the default: last) or ``last``
(exporters.last_token_logits): the LM head runs on each row's last real token of the call only, counted from the
file; runtime.generation left- or right-padded and the serving engine give each prompt the greedy tokens
transformers' ``generate`` gives it alone (onnxruntime-genai, ``generate`` and ``serve`` on the same default file:
tests/exporters/test_llm_families.py); what needs every position's logits is refused naming ``--logits all``. The
ragged file is the family tests' default export of tests/user_models/hf_families.py's Llama; the holes layout is
the session's ``--logits all`` holes export of tests/user_models/causal_lm.py rewritten by the same pass."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import helper

from mha_deploy.cli import main
from mha_deploy.errors import InputError, ModelFileError
from mha_deploy.exporters.last_token_logits import PREFIX, logits_at_every_position, logits_at_last_token
from mha_deploy.model_report import read_metadata
from mha_deploy.runtime.generation import GenerationConfig, generate, prompt_batch
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from mha_deploy.serving.engine import GenerationEngine, GenerationRequest
from tests.conftest import HOLES_EVERY_POSITION, hf_family_kv_export, user_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

families = user_module("hf_families")
LENGTHS, PROMPTS, MAX_NEW = families.PROMPT_LENGTHS, families.PROMPTS, families.MAX_NEW


@pytest.fixture(scope="module")
def last_llama(tmp_path_factory):
    """(file, model): the family Llama's folder exported with ``--kv-cache`` and the defaults (``--logits auto``:
    last for a causal LM), the family tests' own export (tests/exporters/test_llm_families.py), once per run."""
    path, output = hf_family_kv_export(tmp_path_factory, "llama")
    assert "cache layout ragged" in output, output
    assert read_metadata(path).signature.last_token_outputs == ("logits",)
    return path, families.build("llama")


@pytest.fixture(scope="module")
def alone(last_llama):
    """transformers' greedy ``generate`` on each of ``PROMPTS`` alone (``MAX_NEW`` tokens, or up to the eos id)."""
    return families.greedy_alone(last_llama[1])


@pytest.fixture(scope="module")
def holes_pair(lm_cache):
    """(every position's file, the same rewritten by ``logits_at_last_token``): the session's holes export of
    causal_lm with ``--logits all`` (tests/exporters/test_own_kv_cache.py's), in memory."""
    model = onnx.load(str(lm_cache("causal_lm", *HOLES_EVERY_POSITION)[0]))
    return model, logits_at_last_token(model)


def _padded(padding: str, vocab: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of four lengths in one batch, padded on ``padding``'s side with the pad id (masked)."""
    rng = np.random.default_rng(seed)
    ids, mask = prompt_batch([rng.integers(3, vocab, n) for n in LENGTHS])
    ids = np.where(mask == 1, ids, families.PAD_ID)
    if padding == "right":
        order = np.argsort(mask == 0, axis=1, kind="stable")
        ids, mask = np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)
    return ids, mask


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("layout", ["ragged", "holes"])
def test_the_lm_head_runs_on_one_token_per_row(last_llama, holes_pair, layout):
    """The MatMul producing the logits reads [batch, 1, hidden] (its input made an output and run on a right-padded
    prompt batch of 4 x 12), the logits come back [batch, 1, vocab], and nothing else reads the gathered row. The
    Llama's final norm (SkipSimplifiedLayerNormalization, its residual sum unread) runs after the gather, on the
    gathered input and skip: one token per row too."""
    model = onnx.load(str(last_llama[0])) if layout == "ragged" else holes_pair[1]
    readers = [node for node in model.graph.node if {PREFIX + "hidden", PREFIX + "skip"} & set(node.input)]
    if layout == "ragged":
        assert [node.op_type for node in readers] == ["SkipSimplifiedLayerNormalization"]
        assert list(readers[0].input[:2]) == [PREFIX + "hidden", PREFIX + "skip"]
    heads = readers if readers[0].op_type == "MatMul" else \
        [node for node in model.graph.node if readers[0].output[0] in node.input]
    assert [node.op_type for node in heads] == ["MatMul"] and len(readers) == 1
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_empty_tensor_value_info(heads[0].input[0]))
    session = _session(probe)
    ids, mask = _padded("right", 50)
    feeds = {"input_ids": ids, "attention_mask": mask}
    for port in session.get_inputs():
        if port.name.startswith("past_key_values."):
            feeds[port.name] = np.zeros((len(ids), port.shape[1], 0, port.shape[3]), np.float32)
        elif port.name == "position_ids":
            feeds[port.name] = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    hidden, logits = session.run([heads[0].input[0], "logits"], feeds)
    assert hidden.shape[:2] == (len(ids), 1) and logits.shape[:2] == (len(ids), 1)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_last_token_file_gives_each_prompt_its_greedy_tokens_alone(last_llama, alone, padding):
    """The ragged file (prompts of four lengths in one batch, either side padded: the stepper moves a row's tokens
    to the front): each row's greedy tokens equal transformers' ``generate`` on its prompt alone (exact ids; the
    export checked the logits at atol 1e-5 scaled by each row's magnitude, rtol 1e-4, call by call)."""
    ids, mask = prompt_batch([np.array(prompt) for prompt in PROMPTS])
    ids = np.where(mask == 1, ids, families.PAD_ID)
    if padding == "right":
        order = np.argsort(mask == 0, axis=1, kind="stable")
        ids, mask = np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1)
    stepper = KVCacheStepper(last_llama[0])
    assert stepper.last_token_only
    out = generate(stepper, ids, mask, max_new_tokens=MAX_NEW)  # the eos id the file recorded
    assert [tokens.tolist() for tokens in out.tokens] == alone


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_holes_layout_file_rewritten_generates_what_every_positions_file_does(holes_pair, padding):
    """The holes layout (a padded prompt's columns stay in the cache as holes): the last real token of each row is
    read off the mask's last ``seq`` columns, on either side; greedy tokens of the batch equal the every-position
    file's (exact ids), and ``logits_at_every_position`` gives back the graph as it was."""
    every, last = holes_pair
    ids, mask = _padded(padding, 50)
    tokens = [generate(KVCacheStepper(_session(model), cache_layout="holes"), ids, mask, max_new_tokens=MAX_NEW,
                       eos_token_id=[]).tokens for model in (every, last)]
    assert [t.tolist() for t in tokens[1]] == [t.tolist() for t in tokens[0]]
    assert logits_at_every_position(last).graph.node == every.graph.node


def test_the_serving_engine_prefilling_in_chunks_gives_each_prompt_its_tokens_alone(last_llama, alone):
    """``serve``'s engine, its prefill cut into chunks of 5 tokens (the 12-token prompt's later chunks are several
    tokens after a past: ``extend``), the four prompts joining one ragged cache: each request's tokens equal
    transformers' greedy tokens for its prompt alone (exact ids)."""
    from tests.serving.test_generation_engine import served

    engine = GenerationEngine(KVCacheStepper(last_llama[0]), prefill_chunk=5)
    requests = [GenerationRequest(prompt, GenerationConfig(max_new_tokens=MAX_NEW)) for prompt in PROMPTS]
    assert served(engine, requests) == alone


def test_what_needs_every_position_is_refused_naming_logits_all(last_llama):
    """A prompt's own log probabilities (``every_position``; serve's ``echo`` with ``logprobs``) need every position's
    logits: the stepper and the serving engine refuse them, naming ``--logits all``; ``inspect`` and the metadata say
    the logits are the last token's."""
    path = last_llama[0]
    stepper = KVCacheStepper(path)
    with pytest.raises(ModelFileError, match="--logits all"):
        stepper.prefill(np.array([PROMPTS[0]]), np.ones((1, LENGTHS[0]), np.int64), every_position=True)
    engine = GenerationEngine(stepper)
    with pytest.raises(InputError, match="--logits all"):
        engine.submit(GenerationRequest(PROMPTS[0], GenerationConfig(max_new_tokens=2), logprobs=0,
                                        prompt_logprobs=True), lambda event: None)
    assert read_metadata(path).signature.last_token_outputs == ("logits",)
    shown = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert "logits             float32  [batch, 1, 256]" in shown and "last token logits: each row's last" in shown


def test_logits_is_a_kv_cache_decoders_flag(tmp_path):
    """``--logits`` without ``--kv-cache`` is refused before anything is exported; with the built-in block, as another
    source's flag."""
    refused = CliRunner().invoke(main, ["export", "--hf", str(tmp_path), "--logits", "last", "-o",
                                        str(tmp_path / "m.onnx")])
    assert refused.exit_code != 0 and "give --kv-cache" in refused.output, refused.output
    builtin = CliRunner().invoke(main, ["export", "--kv-cache", "--mask", "causal", "--logits", "last", "-o",
                                        str(tmp_path / "m.onnx")])
    assert builtin.exit_code != 0 and "--logits" in builtin.output, builtin.output


def _lm(tied_softcap: bool, also_read: bool = False) -> onnx.ModelProto:
    """A minimal LM graph: ids -> a token table's rows -> the LM head -> logits. ``tied_softcap``: the head's weight
    is the table through a Transpose (a tied head) and the logits soft-capped (tanh(x / 30) * 30, Gemma-2's);
    ``also_read``: another output reads the head's product at every position."""
    rng = np.random.default_rng(3)
    table = helper.make_tensor("table", onnx.TensorProto.FLOAT, [11, 8], rng.standard_normal(88).tolist())
    weight = helper.make_tensor("weight", onnx.TensorProto.FLOAT, [8, 11], rng.standard_normal(88).tolist())
    cap = helper.make_tensor("cap", onnx.TensorProto.FLOAT, [], [30.0])
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["hidden"])]
    if tied_softcap:
        nodes += [helper.make_node("Transpose", ["table"], ["tied"], perm=[1, 0]),
                  helper.make_node("MatMul", ["hidden", "tied"], ["product"]),
                  helper.make_node("Div", ["product", "cap"], ["scaled"]),
                  helper.make_node("Tanh", ["scaled"], ["capped"]),
                  helper.make_node("Mul", ["capped", "cap"], ["logits"])]
    else:
        nodes += [helper.make_node("MatMul", ["hidden", "weight"], ["product"]),
                  helper.make_node("Identity", ["product"], ["logits"])]
    outputs = [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", 11])]
    if also_read:
        nodes.append(helper.make_node("ReduceSum", ["product"], ["total"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, []))
    inputs = [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "total_seq"])]
    graph = helper.make_graph(nodes, "lm", inputs, outputs, [table, weight, cap])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("tied_softcap", [False, True], ids=["head", "tied-softcapped-head"])
def test_the_pass_reads_each_rows_last_real_token_off_the_mask(tied_softcap):
    """On a minimal graph (a tied head and Gemma-2's final soft-cap, or a plain head): the rewritten logits equal the
    whole graph's at each row's last 1 of the mask's last seq columns (exactly: the same ops on the same rows), for a
    left-padded, a right-padded, a full row and one after a past (the mask wider than the call)."""
    model = _lm(tied_softcap)
    every, last = _session(model), _session(logits_at_last_token(model))
    ids = np.array([[0, 0, 4, 5], [6, 7, 0, 0], [1, 2, 3, 9], [5, 5, 5, 5]])
    call = np.array([[0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    mask = np.concatenate([np.ones((4, 3), np.int64), call], axis=1)  # 3 cached tokens before this call's
    feeds = {"input_ids": ids, "attention_mask": mask}
    want = every.run(["logits"], feeds)[0][np.arange(4), [3, 1, 3, 2]][:, None]
    np.testing.assert_array_equal(last.run(["logits"], feeds)[0], want)


def test_the_pass_refuses_a_head_whose_product_is_read_elsewhere_naming_logits_all():
    """A value on the way from the head to the logits that another node reads at every position: gathering before
    the head would change what that node reads, so the pass refuses, naming --logits all."""
    from mha_deploy.errors import ExportError

    with pytest.raises(ExportError, match="--logits all"):
        logits_at_last_token(_lm(False, also_read=True))


def _lm_with_final_norm(residual_read: bool) -> onnx.ModelProto:
    """A minimal LM graph with a final SkipSimplifiedLayerNormalization before its head: the hidden states and the
    residual two token tables' rows ([batch, seq, 8], as value_info says); ``residual_read``: the norm's residual sum
    is also an output (read at every position)."""
    rng = np.random.default_rng(4)
    tables = [helper.make_tensor(name, onnx.TensorProto.FLOAT, [11, 8], rng.standard_normal(88).tolist())
              for name in ("table", "residual_table")]
    gamma = helper.make_tensor("gamma", onnx.TensorProto.FLOAT, [8], rng.standard_normal(8).tolist())
    weight = helper.make_tensor("weight", onnx.TensorProto.FLOAT, [8, 11], rng.standard_normal(88).tolist())
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["hidden"]),
             helper.make_node("Gather", ["residual_table", "input_ids"], ["residual"]),
             helper.make_node("SkipSimplifiedLayerNormalization", ["hidden", "residual", "gamma"],
                              ["normed", "", "", "sum"] if residual_read else ["normed"], domain="com.microsoft",
                              epsilon=1e-6),
             helper.make_node("MatMul", ["normed", "weight"], ["logits"])]
    outputs = [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", 11])]
    if residual_read:
        outputs.append(helper.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, ["batch", "seq", 8]))
    inputs = [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["batch", "total_seq"])]
    graph = helper.make_graph(nodes, "lm", inputs, outputs, [*tables, gamma, weight], value_info=[
        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["batch", "seq", 8])
        for name in ("hidden", "residual")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize("residual_read", [False, True], ids=["norm-after-gather", "residual-sum-read"])
def test_the_final_norm_runs_after_the_gather_unless_its_residual_sum_is_read(residual_read):
    """The final Skip norm's input and skip are gathered and the norm runs on one token per row; where its residual
    sum is read at every position (here: an output) the norm stays before the gather, that output [batch, seq, 8].
    Either way the logits equal the whole graph's at each row's last real token (atol 1e-6: a norm over one row is
    the same arithmetic as over many), and logits_at_every_position gives the graph back."""
    model = _lm_with_final_norm(residual_read)
    last = logits_at_last_token(model)
    norm = next(node for node in last.graph.node if node.op_type == "SkipSimplifiedLayerNormalization")
    gathered = [PREFIX + "hidden", PREFIX + "skip"]
    assert list(norm.input[:2]) == (["hidden", "residual"] if residual_read else gathered)
    ids = np.array([[0, 0, 4, 5], [6, 7, 0, 0], [1, 2, 3, 9]])
    mask = np.array([[0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    feeds = {"input_ids": ids, "attention_mask": mask}
    want = _session(model).run(None, feeds)
    got = _session(last).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0][np.arange(3), [3, 1, 3]][:, None], rtol=0, atol=1e-6)
    if residual_read:
        np.testing.assert_array_equal(got[1], want[1])
    undone = logits_at_every_position(last)
    assert [node.op_type for node in undone.graph.node] == [node.op_type for node in model.graph.node]
    np.testing.assert_array_equal(_session(undone).run(None, feeds)[0], want[0])
