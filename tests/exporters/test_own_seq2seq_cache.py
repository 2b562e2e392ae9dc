"""A KV-cache export of a user's encoder-decoder written with no cache code (``exporters.own_seq2seq_cache``): two
files (the encoder beside the decoder), checked call by call at export; generation from them against a greedy loop
over the module in torch (the tutorial form) and against transformers' ``generate`` (BART from a config)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mha_deploy.cli import main
from mha_deploy.errors import ModelFileError, ParityError
from mha_deploy.exporters import export_model
from mha_deploy.metadata import ENCODER_DECODER_KEY, GenerationIds
from mha_deploy.runtime.generation import generate
from mha_deploy.runtime.kv_stepper import KVCacheStepper
from tests.conftest import user_module
from tests.runtime.test_generation import (
    MAX_NEW,
    PAD,
    SEARCHES,
    CountingStepper,
    Seq2SeqRecomputeStepper,
    end_ids,
    prompts,
)

torch = pytest.importorskip("torch")

START = 1  # the tutorial model's decoder start id: any id of its target vocabulary
LONG = 64


@pytest.fixture(scope="session")
def tutorial_pair(tmp_path_factory, shared_trace):
    """The tutorial encoder-decoder exported with --kv-cache, its start id recorded; and its full forward."""
    module = user_module("seq2seq")
    path = tmp_path_factory.mktemp("own-seq2seq") / "mt.onnx"
    with shared_trace("seq2seq", "build"):  # the trace its other exports start from (conftest.traces_shared)
        result = export_model(module.build(), path, module.INPUTS, kv_cache=True,
                              generation=GenerationIds([], None, START))
    model = module.build().eval()

    def logits_of(source, mask, target):
        return model(source, mask.bool(), target, torch.ones_like(target, dtype=torch.bool))

    return result, logits_of


def test_two_files_each_naming_the_other(tutorial_pair):
    result, _ = tutorial_pair
    assert result.encoder_path == result.path.with_name("mt.encoder.onnx")
    records = {}
    for path in (result.path, result.encoder_path):
        props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
        records[path.name] = json.loads(props[ENCODER_DECODER_KEY])
    assert records["mt.onnx"]["part"] == "decoder" and records["mt.onnx"]["companion"] == "mt.encoder.onnx"
    assert records["mt.encoder.onnx"]["part"] == "encoder" and records["mt.encoder.onnx"]["companion"] == "mt.onnx"
    assert records["mt.onnx"]["generation"]["decoder_start_token_id"] == START
    # every attention fused: 2 encoder self-attentions; 2 decoder self- and 2 cross-attentions
    assert result.fusion.target == "mha" and result.fusion.attentions == (2, 2, 2)
    decoder_ops = [node.op_type for node in onnx.load(str(result.path)).graph.node]
    assert "Softmax" not in decoder_ops
    # the decoder holds no encoder layer: its cross keys/values are inputs
    names = {value.name for value in onnx.load(str(result.path)).graph.input}
    assert {"past_key_values.0.encoder.key", "encoder_attention_mask", "input_ids", "attention_mask"} <= names
    assert result.parity.passed and any("call" in s or "prompt" in s for s in result.parity.shapes)


def test_tutorial_greedy_equals_the_torch_loop(tutorial_pair):
    result, logits_of = tutorial_pair
    ids, mask = prompts([7, 3, 5], 40, seed=3)
    eos = end_ids(generate(Seq2SeqRecomputeStepper(logits_of, START), ids, mask, max_new_tokens=LONG).tokens)
    torch_stepper = Seq2SeqRecomputeStepper(logits_of, START)
    expected = generate(torch_stepper, ids, mask, max_new_tokens=LONG, eos_token_id=eos)
    stepper = KVCacheStepper(result.path)  # finds its encoder and start id
    assert stepper.encoder is not None and stepper.decoder_start_token_id == START
    counting = CountingStepper(stepper)
    out = generate(counting, ids, mask, max_new_tokens=LONG, eos_token_id=eos)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in expected.tokens]
    assert len({len(t) for t in out.tokens}) == 3  # the rows finished at different steps
    assert counting.rows_per_call == torch_stepper.rows_per_call
    unended = generate(KVCacheStepper(result.path), ids, mask, max_new_tokens=LONG).tokens
    reference = generate(Seq2SeqRecomputeStepper(logits_of, START), ids, mask, max_new_tokens=LONG).tokens
    assert [len(t) for t in unended] == [LONG] * 3
    assert [t.tolist() for t in unended] == [t.tolist() for t in reference]


def test_generate_command_finds_the_encoder(tutorial_pair, tmp_path):
    result, logits_of = tutorial_pair
    ids, mask = prompts([4, 6], 40, seed=8)
    sources = [row[m == 1].tolist() for row, m in zip(ids, mask, strict=True)]
    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps({"id": i, "input_ids": s}) + "\n" for i, s in enumerate(sources)))
    out = tmp_path / "out.jsonl"
    run = CliRunner().invoke(main, ["generate", str(result.path), "--input", str(source), "--output", str(out),
                                   "--max-new-tokens", "9"])
    assert run.exit_code == 0, run.output
    got = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    for tokens, row in zip(got, sources, strict=True):
        alone = generate(Seq2SeqRecomputeStepper(logits_of, START), np.array([row]), np.ones((1, len(row)), np.int64),
                         max_new_tokens=9).tokens[0]
        assert tokens == alone.tolist()


def test_a_failed_parity_writes_neither_file(shared_trace, tmp_path):
    module = user_module("seq2seq")
    path = tmp_path / "mt.onnx"
    with shared_trace("seq2seq", "build"), pytest.raises(ParityError, match=r"call \d+ of \d+.*nothing written"):
        export_model(module.build(), path, module.INPUTS, kv_cache=True, atol=0.0, rtol=0.0, fuse="none")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- Hugging Face encoder-decoders from configs ----------------------------------------------------------------


@pytest.fixture(scope="session")
def bart_pair(tmp_path_factory):
    """BART (weights scaled as tests/runtime's, for logits that are not near-uniform), exported with --kv-cache."""
    module = user_module("hf_seq2seq")
    model = module.build_bart()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(5.0)
    path = tmp_path_factory.mktemp("own-bart") / "bart.onnx"
    result = export_model(model, path, module.INPUTS, kv_cache=True,
                          generation=GenerationIds([], PAD, model.config.decoder_start_token_id))
    return result, model


@pytest.mark.parametrize("ends", [False, True], ids=["no-eos", "eos"])
@pytest.mark.parametrize("search", ["greedy", "beams"])
def test_bart_equals_transformers_generate(bart_pair, search, ends):
    result, model = bart_pair
    ids, mask = prompts([5, 2, 7], model.config.vocab_size, seed=4)
    eos = end_ids(generate(KVCacheStepper(result.path), ids, mask, max_new_tokens=MAX_NEW).tokens) if ends else None
    with torch.no_grad():  # BART's config forces its eos id at the last step: not a rule this loop has
        expected = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                  do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=eos,
                                  forced_eos_token_id=None, **SEARCHES[search])
    expected = expected[:, 1:].numpy()  # transformers returns the start id first
    out = generate(KVCacheStepper(result.path), ids, mask, max_new_tokens=MAX_NEW, pad_token_id=PAD,
                   eos_token_id=eos, **SEARCHES[search])
    np.testing.assert_array_equal(out.padded(expected.shape[1]), expected)


@pytest.mark.parametrize("factory", ["build_marian", "build_t5"])
def test_hf_encoder_decoders_pass_per_step_parity(shared_trace, tmp_path, factory):
    module = user_module("hf_seq2seq")
    path = tmp_path / "mt.onnx"
    with shared_trace("hf_seq2seq", factory):  # the trace the model's other exports start from
        result = export_model(getattr(module, factory)(), path, module.INPUTS, kv_cache=True)
    assert result.parity.passed and result.fusion.target == "mha"
    encoder_self, decoder_self, cross = result.fusion.attentions
    assert encoder_self == decoder_self == cross == 2
    assert path.is_file() and result.encoder_path.is_file()


def test_inspect_names_each_file_part_and_companion(tutorial_pair):
    result, _ = tutorial_pair
    for path, words in ((result.path, "the decoder of a pair exported with --kv-cache; its encoder: mt.encoder.onnx"),
                        (result.encoder_path, "the encoder of a pair exported with --kv-cache; its decoder: mt.onnx")):
        run = CliRunner().invoke(main, ["inspect", str(path)])
        assert run.exit_code == 0, run.output
        assert words in run.output and "2 encoder self, 2 decoder self, 2 cross (fusion mha)" in run.output


def test_the_encoder_given_as_the_model_is_refused_naming_the_decoder(tutorial_pair):
    result, _ = tutorial_pair
    with pytest.raises(ModelFileError, match=r"give its decoder, .*mt\.onnx"):
        KVCacheStepper(result.encoder_path)


def test_genai_is_refused_for_an_encoder_decoder_before_exporting(tmp_path):
    module = "tests/user_models/seq2seq.py:build"
    args = ["export", "--module", module, *(arg for spec in user_module("seq2seq").INPUTS for arg in ("--input", spec)),
            "--kv-cache", "--genai", "-o", str(tmp_path / "mt.onnx")]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 2 and "decoder-only" in run.output
    assert list(tmp_path.iterdir()) == []


def test_the_position_table_bounds_the_source_generate_takes(bart_pair):
    from mha_deploy.batch.generation import Prompt, prompt_limits

    result, model = bart_pair
    assert result.max_length == model.config.max_position_embeddings
    limits = prompt_limits(KVCacheStepper(result.path))
    assert limits.max_length == model.config.max_position_embeddings and not limits.with_new_tokens
    assert limits.vocab == model.config.vocab_size
    too_long = Prompt(0, np.ones(limits.max_length + 1, np.int64))
    assert "exceed" in limits.problem(too_long, max_new_tokens=4)
    short = Prompt(1, np.ones(3, np.int64))
    assert limits.problem(short, max_new_tokens=limits.max_length) is None
    assert "decoder takes at most 512 target tokens" in limits.problem(short, max_new_tokens=limits.max_length + 1)


def test_an_int8_pair_quantizes_both_files_and_records_its_quality(shared_trace, tmp_path):
    """--kv-cache --quantize int8 on the tutorial encoder-decoder: the encoder's and the decoder's MatMuls as
    MatMulNBits, each call's logits within int8's budget of the module's (top-1 agreement recorded), both files
    saying so; generate runs the pair as it runs the fp32 one."""
    module = user_module("seq2seq")
    path = tmp_path / "mt.onnx"
    with shared_trace("seq2seq", "build"):
        result = export_model(module.build(), path, module.INPUTS, kv_cache=True, quantize="int8",
                              generation=GenerationIds([], None, START))
    assert result.parity.passed and 0 < result.parity.rel_err <= 0.05 and result.parity.top1_agreement > 0.9
    for file in (result.path, result.encoder_path):
        assert any(node.op_type == "MatMulNBits" for node in onnx.load(file).graph.node), file
        record = json.loads({p.key: p.value for p in onnx.load(file).metadata_props}[ENCODER_DECODER_KEY])
        assert record["quantization"] == "int8" and record["weight_only"]["bits"] == 8
    out = generate(KVCacheStepper(path), [[5, 9, 2], [3, 4, 8, 8, 1]], max_new_tokens=4)
    assert [len(t) for t in out.tokens] == [4, 4]
