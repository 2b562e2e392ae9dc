"""Multilingual encoder-decoders from ``save_pretrained`` folders with their configs as they come (``use_cache`` on,
the forward returning an ``EncoderDecoderCache`` by default), exported with ``export --hf DIR --kv-cache`` and
nothing else, then generated from with ``mha-deploy generate``: M2M100 (its sinusoidal position table rebuilt in
the forward past ``max_position_embeddings``: a length guard, traced at that max length) with a forced first token
(the target language id its generation config names, recorded at export) and per-item decoder prompts; Whisper,
whose source is audio features (``input_features`` [batch, mel, frames], frames fixed) and whose decoder starts
from a prompt (start, language, task, no-timestamps ids). Greedy and beam search equal transformers' ``generate``
token for token, on sources of different lengths (features of different contents) batched together. MBart's
folder as it comes: the forward it is traced with returns no cache object."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from tests.conftest import USER_MODELS, exported_once  # noqa: E402

sys.path.insert(0, str(USER_MODELS))
from hf_models import D_MODEL, FFN, HEADS, LAYERS, PAD_ID, VOCAB  # noqa: E402

sys.path.remove(str(USER_MODELS))

BOS_ID, EOS_ID, START_ID = 0, 2, 2
FORCED_ID, OTHER_LANGUAGE = 50, 61  # the generation config's target language; another given with --forced-bos-id
MAX_POSITIONS = 64  # the sinusoidal table's length: its forward rebuilds it for a longer sequence
NEW_TOKENS = 7
# Sources of different lengths, batched together; some items start their decoder from a prompt of their own (the
# start id put in front where it is missing, as transformers puts it in front of decoder_input_ids).
SOURCES = {"a": [5, 9, 17, 33, 4, 70, 12], "b": [40, 8, 3], "c": [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
           "d": [88, 6, 44, 19], "e": [7, 7, 91, 15, 60]}
DECODER_PROMPTS = {"d": [OTHER_LANGUAGE], "e": [START_ID, 30, 31]}


def _config_kwargs() -> dict:
    return dict(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                decoder_start_token_id=START_ID, init_std=0.3)  # weights wide enough that the tokens vary


def _save(cls, config, folder) -> None:
    """``cls`` from ``config`` with random weights, saved as its users save it: the config's use_cache left on, the
    target language set as the forced first token of its generation config."""
    torch.manual_seed(47)
    model = cls(config)
    assert model.config.use_cache
    model.generation_config.forced_bos_token_id = FORCED_ID
    model.save_pretrained(folder)


def _exported(tmp_path_factory, name: str, save) -> tuple:
    """(folder, decoder file, export's output): ``save(folder)`` then ``export --hf folder --kv-cache``, once per
    test run (``exported_once``: the serving tests, tests/serving/test_seq2seq_requests.py, serve the same files)."""
    def write(root) -> dict:
        save(root / "hf")
        (root / "onnx").mkdir(exist_ok=True)
        result = CliRunner().invoke(main, ["export", "--hf", str(root / "hf"), "--kv-cache", "-o",
                                           str(root / "onnx" / "model.onnx")])
        assert result.exit_code == 0, result.output
        return {"output": result.output}

    root, record = exported_once(tmp_path_factory, ("hf_seq2seq_folders", name), write)
    return root / "hf", root / "onnx" / "model.onnx", record["output"]


def export_m2m100(tmp_path_factory) -> tuple:
    return _exported(tmp_path_factory, "m2m100", lambda folder: _save(
        transformers.M2M100ForConditionalGeneration, transformers.M2M100Config(**_config_kwargs()), folder))


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    """(folder, decoder file, export's output): M2M100 saved and exported once, with --hf DIR --kv-cache only."""
    return export_m2m100(tmp_path_factory)


def _module(folder):
    return transformers.M2M100ForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()


def _ops(path) -> list[str]:
    import onnx

    return [node.op_type for node in all_nodes(onnx.load(str(path)).graph)]


def test_m2m100_as_it_comes_exports_fused_with_its_max_length_and_forced_first_token(m2m100):
    _, path, output = m2m100
    assert f"max length {MAX_POSITIONS} recorded from the model's config (its max_position_embeddings" in output
    assert f"forced first token {FORCED_ID}" in output
    assert f"decoder {LAYERS} self- and {LAYERS} cross-attention(s), all fused" in output
    for file in (path.with_name("model.encoder.onnx"), path):
        ops = _ops(file)
        assert "Softmax" not in ops and ops.count("MultiHeadAttention") >= LAYERS
    import onnx

    from mha_deploy.metadata import ENCODER_DECODER_KEY, EncoderDecoderRecord

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    record = EncoderDecoderRecord.from_json(props[ENCODER_DECODER_KEY], str(path))
    assert record.max_length == MAX_POSITIONS
    assert (record.generation.decoder_start_token_id, record.generation.forced_bos_token_id) == (START_ID, FORCED_ID)


def _generate(path, tmp_path, *flags) -> dict:
    lines = [{"id": key, "input_ids": ids, **({"decoder_prompt": DECODER_PROMPTS[key]} if key in DECODER_PROMPTS
                                             else {})} for key, ids in SOURCES.items()]
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(tmp_path / "src.jsonl"), "--output",
                                       str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW_TOKENS),
                                       "--no-progress", *flags])
    assert result.exit_code == 0, result.output
    return {record["id"]: record["output_ids"] for record in map(json.loads,
                                                                 (tmp_path / "out.jsonl").read_text().splitlines())}


def _transformers(module, key: str, num_beams: int, forced: int) -> list[int]:
    """transformers' generate on the item alone: its source, its decoder prompt (the start id in front) or the
    forced first token, max new tokens and beams as given."""
    source = torch.tensor([SOURCES[key]])
    prompt = DECODER_PROMPTS.get(key, [])
    decoder = [START_ID, *prompt] if prompt[:1] != [START_ID] else prompt
    with torch.no_grad():
        out = module.generate(source, attention_mask=torch.ones_like(source),
                              decoder_input_ids=torch.tensor([decoder]), max_new_tokens=NEW_TOKENS,
                              num_beams=num_beams, do_sample=False, forced_bos_token_id=forced)
    return out[0, len(decoder):].tolist()


@pytest.mark.parametrize("num_beams", [1, 3])
def test_m2m100_generates_as_transformers_with_its_forced_first_token_and_decoder_prompts(m2m100, tmp_path,
                                                                                          num_beams):
    folder, path, _ = m2m100
    got = _generate(path, tmp_path, "--num-beams", str(num_beams), "--batch-size", "8")
    module = _module(folder)
    for key in SOURCES:
        assert got[key] == _transformers(module, key, num_beams, FORCED_ID), key
    # The recorded target language is the first token of every item without a decoder prompt, and no other's.
    assert {got[key][0] == FORCED_ID for key in SOURCES if key not in DECODER_PROMPTS} == {True}
    assert len({tuple(tokens) for tokens in got.values()}) > 1  # the sources matter: not one answer for all


def test_forced_bos_id_takes_the_recorded_ones_place(m2m100, tmp_path):
    folder, path, _ = m2m100
    got = _generate(path, tmp_path, "--forced-bos-id", str(OTHER_LANGUAGE))
    module = _module(folder)
    for key in SOURCES:
        assert got[key] == _transformers(module, key, 1, OTHER_LANGUAGE), key
        assert (got[key][0] == OTHER_LANGUAGE) or key in DECODER_PROMPTS


def test_mbart_as_it_comes_is_traced_without_its_cache_object(tmp_path):
    """MBart's folder keeps use_cache on (its forward then returns an EncoderDecoderCache, which is no tensor): the
    module --hf loads for the trace has its caches off, and returns none."""
    from mha_deploy.exporters.hf_folder import load_hf_model

    _save(transformers.MBartForConditionalGeneration, transformers.MBartConfig(**_config_kwargs()), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
    model = load_hf_model(tmp_path)
    ids = torch.tensor([[5, 6, 7, EOS_ID]])
    with torch.no_grad():
        out = model.module(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :2])
    assert out.past_key_values is None and out.logits.shape == (1, 2, VOCAB)
    assert model.generation_ids().forced_bos_token_id == FORCED_ID
    assert model.inputs == ("input_ids:tokens:src_seq", "attention_mask:padding-mask:src_seq",
                            "decoder_input_ids:tokens:tgt_seq", "decoder_attention_mask:padding-mask:tgt_seq")


# Whisper: features of MEL x 2*POSITIONS; its decoder prompt <|startoftranscript|><|lang|><|task|><|notimestamps|>.
MEL, POSITIONS, TARGET_POSITIONS, TRANSCRIPT = 8, 8, 32, 50
WHISPER_PROMPT = [TRANSCRIPT, 60, 70, 80]
# Its generation config's ids never generated (non-speech symbols) and never first (blank, end), as it saves them.
SUPPRESS, BEGIN_SUPPRESS = list(range(3, 40, 3)), [EOS_ID, 41, 42, 43]


def _save_whisper(folder) -> None:
    kwargs = {**_config_kwargs(), "decoder_start_token_id": TRANSCRIPT}
    del kwargs["max_position_embeddings"]
    config = transformers.WhisperConfig(num_mel_bins=MEL, max_source_positions=POSITIONS,
                                        max_target_positions=TARGET_POSITIONS, **kwargs)
    torch.manual_seed(48)
    model = transformers.WhisperForConditionalGeneration(config)
    assert model.config.use_cache
    model.generation_config.suppress_tokens, model.generation_config.begin_suppress_tokens = SUPPRESS, BEGIN_SUPPRESS
    model.save_pretrained(folder)


def export_whisper(tmp_path_factory) -> tuple:
    return _exported(tmp_path_factory, "whisper", _save_whisper)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(folder, decoder file, export's output): Whisper saved and exported once, with --hf DIR --kv-cache only."""
    return export_whisper(tmp_path_factory)


def _features(rows: int, seed: int = 5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, MEL, 2 * POSITIONS)) * 2).astype(np.float32)


def test_whisper_as_it_comes_exports_fused_on_its_audio_features(whisper):
    import onnxruntime as ort

    _, path, output = whisper
    assert f"decoder {LAYERS} self- and {LAYERS} cross-attention(s), all fused" in output
    # its decoder's table is sliced by length: the longest target is the config's max_target_positions
    assert f"max length {TARGET_POSITIONS} recorded from the model's config" in output
    encoder = path.with_name("model.encoder.onnx")
    for file in (encoder, path):
        ops = _ops(file)
        assert "Softmax" not in ops and ops.count("MultiHeadAttention") >= LAYERS
    plain = ort.InferenceSession(str(encoder), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape[1:]) for i in plain.get_inputs()] == [("input_features", [MEL, 2 * POSITIONS])]
    decoder = [i.name for i in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()]
    assert "encoder_attention_mask" not in decoder  # the features have no padding to mask
    assert f"{len(SUPPRESS)} suppressed id(s), {len(BEGIN_SUPPRESS)} never first" in output


def test_whisper_decoder_reads_the_cross_caches_as_they_are(whisper):
    """Each decoding step reads the encoder's cross keys/values in their [batch, heads, source, head_dim] layout
    (no Transpose of the whole source per layer and step) and makes no [batch, mel, frames] zeros for the features'
    batch: both were per-step copies of the source's size (1500 positions, 3000 frames at Whisper's sizes)."""
    import onnx

    _, path, _ = whisper
    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = {value.name for value in graph.input}
    cross = [node for node in graph.node if node.op_type == "MultiHeadAttention" and node.input[1] in inputs]
    assert len(cross) == LAYERS
    assert all(node.input[1].endswith(".encoder.key") and node.input[2].endswith(".encoder.value") for node in cross)
    # own_seq2seq_cache names the features' stand-in "<prefix>source_ids"; only their shape is made now
    assert not [node for node in graph.node if node.op_type == "ConstantOfShape" and "source_ids" in node.output[0]]


@pytest.mark.parametrize("num_beams", [1, 3])
def test_whisper_generates_as_transformers_from_features_and_decoder_prompts(whisper, num_beams):
    """Four items of different features in one call: two from the start id alone, two from Whisper's prompt; the
    recorded suppressed ids applied as transformers applies its generation config's."""
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    folder, path, _ = whisper
    features = _features(4)
    prompts = [None, WHISPER_PROMPT, None, WHISPER_PROMPT[1:]]  # the last one: the start id put in front
    got = generate(KVCacheStepper(path), features, max_new_tokens=NEW_TOKENS, num_beams=num_beams,
                   decoder_prompts=prompts)
    module = transformers.WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True).eval()
    for rows, decoder in (([0, 2], [TRANSCRIPT]), ([1, 3], WHISPER_PROMPT)):
        with torch.no_grad():  # transformers' generation loop (Whisper's own generate adds its timestamp logic)
            want = transformers.GenerationMixin.generate(
                module, torch.from_numpy(features[rows]), decoder_input_ids=torch.tensor([decoder] * 2),
                max_new_tokens=NEW_TOKENS, num_beams=num_beams, do_sample=False)
        for row, tokens in zip(rows, want[:, len(decoder):].tolist(), strict=True):
            assert got.tokens[row].tolist() == tokens, row
    assert len({tuple(tokens.tolist()) for tokens in got.tokens}) > 1
    assert not {token for tokens in got.tokens for token in tokens.tolist()} & set(SUPPRESS)


def test_generate_reads_whisper_features_items_and_names_a_bad_one(whisper, tmp_path):
    _, path, _ = whisper
    features = _features(2, seed=6)
    np.savez(tmp_path / "audio.npz", a=features[0], b=features[1],
             short=np.zeros((MEL, 2 * POSITIONS - 2), np.float32))
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(tmp_path / "audio.npz"), "--output",
                                       str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW_TOKENS),
                                       "--on-error", "skip", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (f"prompt 'short': input_features has frames {2 * POSITIONS - 2} (expected {2 * POSITIONS})"
            in " ".join(result.output.split()))
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [record["id"] for record in got] == ["a", "b"]
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    alone = generate(KVCacheStepper(path), features, max_new_tokens=NEW_TOKENS)
    assert [record["output_ids"] for record in got] == [tokens.tolist() for tokens in alone.tokens]
