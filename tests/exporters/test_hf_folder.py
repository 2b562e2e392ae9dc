"""``mha-deploy export --hf DIR``: folders as ``save_pretrained`` writes them (small configs, random weights, a tiny
tokenizer built here; nothing downloaded), each exported with ``--hf DIR`` and nothing else (``--kv-cache`` for the
generators): a BERT sequence classifier, a GPT-2 causal LM and BART. Every attention fused; the file equal to the
module in plain ONNX Runtime under Hugging Face's input names at shapes the export never saw; outputs named after
the model's output fields; the special ids recorded from the folder's configs; the tokenizer files and chat
template beside the file, where ``generate`` finds them with no flag. And export's three sources apart: ``--help``
lists each source's options in its own section, and a flag of another source is refused naming whose it is."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
ort = pytest.importorskip("onnxruntime")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.exporters.hf_folder import BesideFiles  # noqa: E402
from mha_deploy.exporters.own_model import named_outputs  # noqa: E402
from mha_deploy.model_report import read_metadata  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from tests.conftest import OWN_MODEL_ATOL, OWN_MODEL_RTOL, USER_MODELS  # noqa: E402

sys.path.insert(0, str(USER_MODELS))
import hf_sentence  # noqa: E402
from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB  # noqa: E402

sys.path.remove(str(USER_MODELS))

EOS_IDS, START_ID, BOS_ID = [2, 3], 2, 0
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
# Lengths the export never traced, probed or checked parity at (its traces: 3-17, its parity: 1-17, 41, 300).
UNSEEN_BATCH, UNSEEN_SEQ, UNSEEN_TARGET = 3, 23, 19


def _word_level(pad: str = f"w{PAD_ID}"):
    """A word-level tokenizer whose word ``w<i>`` is id i, but the pad id's word when ``pad`` spells it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    word_level = Tokenizer(WordLevel({(pad if i == PAD_ID else f"w{i}"): i for i in range(VOCAB)}, unk_token="w0"))
    word_level.pre_tokenizer = Whitespace()
    return word_level


def _tokenizer(folder, template_in_config: bool = False) -> None:
    """``_word_level`` saved as transformers saves a tokenizer: tokenizer.json, tokenizer_config.json, and the chat
    template (chat_template.jinja, or inside tokenizer_config.json)."""
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_level(), pad_token=f"w{PAD_ID}",
                                                eos_token=f"w{EOS_IDS[0]}")
    if not template_in_config:
        fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    if template_in_config:  # as older transformers saved it
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))


def _bert(folder):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN,
                                     max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID, num_labels=3)
    torch.manual_seed(41)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    _tokenizer(folder)


def _gpt2(folder):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=D_MODEL, n_layer=LAYERS, n_head=HEADS,
                                     n_positions=MAX_POSITIONS, bos_token_id=BOS_ID, eos_token_id=EOS_IDS[0])
    torch.manual_seed(42)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    # The generation config names more than the config does: it is the one read first.
    transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_IDS, pad_token_id=PAD_ID).save_pretrained(
        folder)
    _tokenizer(folder, template_in_config=True)


def _bart(folder):
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                     encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS,
                                     pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_IDS[0],
                                     decoder_start_token_id=START_ID)
    torch.manual_seed(43)
    transformers.BartForConditionalGeneration(config).save_pretrained(folder)
    _tokenizer(folder)


# sentence-transformers folders: 6's layout (the transformer at the root, pooling_mode) with mean pooling and
# Normalize; the layout before it (0_Transformer, pooling_mode_* flags) with every other mode, concatenated in its
# order.
SENTENCE_POOLING = {"sentence": ("mean",), "sentence-legacy": ("cls", "max", "mean_sqrt_len_tokens", "weightedmean",
                                                               "lasttoken")}


def _sentence_tokenizer():
    """``_word_level`` with its pad word spelt [PAD]: a special token is matched inside words ("w1" in "w17")."""
    return _word_level(pad="[PAD]")


def _sentence(folder):
    hf_sentence.save_folder(folder, _sentence_tokenizer(), SENTENCE_POOLING["sentence"], normalize=True)


def _sentence_legacy(folder):
    hf_sentence.save_folder(folder, _sentence_tokenizer(), SENTENCE_POOLING["sentence-legacy"], layout="legacy")


FAMILIES = {"bert": (_bert, []), "gpt2": (_gpt2, ["--kv-cache"]), "bart": (_bart, ["--kv-cache"]),
            "sentence": (_sentence, []), "sentence-legacy": (_sentence_legacy, [])}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family) -> (folder, file, CLI output)``: each family saved and exported once per module, with
    ``--hf DIR`` and nothing else (``--kv-cache`` for the generators)."""
    done = {}

    def export(family: str):
        if family not in done:
            save, flags = FAMILIES[family]
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            save(folder)
            path = tmp_path_factory.mktemp(f"onnx-{family}") / "model.onnx"
            result = CliRunner().invoke(main, ["export", "--hf", str(folder), *flags, "-o", str(path)])
            assert result.exit_code == 0, result.output
            done[family] = folder, path, result.output
        return done[family]

    return export


def _module(folder):
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()


def _ops(path) -> list[str]:
    import onnx

    return [node.op_type for node in all_nodes(onnx.load(str(path)).graph)]


def _right_padded(rng, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, seq] and their 0/1 attention mask, each row shorter than the last (the first whole)."""
    lengths = np.linspace(seq, max(seq // 3, 1), batch).astype(int)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(3, VOCAB, (batch, seq)), PAD_ID).astype(np.int64)
    return ids, mask


def _pair_record(path):
    """The encoder-decoder record a pair's decoder file holds (its generation ids)."""
    import onnx

    from mha_deploy.metadata import ENCODER_DECODER_KEY, EncoderDecoderRecord

    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return EncoderDecoderRecord.from_json(props[ENCODER_DECODER_KEY], str(path))


def _plain(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_a_bert_classifier_exports_fused_under_hugging_faces_names(exported):
    _, path, output = exported("bert")
    session = _plain(path)
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o.name for o in session.get_outputs()] == ["logits"]  # SequenceClassifierOutput's field
    # each attention one MultiHeadAttention (an If between two kernels of it where the fusion picks by length)
    assert f"{LAYERS} attention subgraph(s) found, {LAYERS} fused into com.microsoft.MultiHeadAttention" in output
    ops = _ops(path)
    assert ops.count("MultiHeadAttention") >= LAYERS and "Softmax" not in ops
    assert f"max length {MAX_POSITIONS} recorded" in output


def _tokenized(folder, lengths=(UNSEEN_SEQ, 9, 4), pairs: bool = True) -> dict[str, np.ndarray]:
    """What the folder's own tokenizer returns for texts of ``lengths`` words (sentence pairs: the second half of
    each text its second segment), padded on the right, as numpy: int64 ids, attention_mask, token_type_ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    rng = np.random.default_rng(0)
    texts = [[f"w{i}" for i in rng.integers(3, VOCAB, n)] for n in lengths]
    halves = ([" ".join(t[: len(t) // 2 or 1]) for t in texts], [" ".join(t[len(t) // 2 or 1:]) for t in texts])
    encoded = (tokenizer(*halves, padding=True, return_token_type_ids=True, return_tensors="np") if pairs
               else tokenizer([" ".join(t) for t in texts], padding=True, return_tensors="np"))
    return dict(encoded)


def test_a_bert_classifier_equals_the_module_in_plain_onnxruntime(exported):
    """The tokenizer's dict (int64 ids, 1/0 attention_mask, token_type_ids of a sentence pair), right-padded at a
    batch and length the export never saw, fed to plain ONNX Runtime unchanged: equal to the module."""
    folder, path, _ = exported("bert")
    feeds = _tokenized(folder)
    assert feeds["attention_mask"].dtype == np.int64 and feeds["token_type_ids"].any()
    session = _plain(path)
    assert {i.name: i.type for i in session.get_inputs()}["attention_mask"] == "tensor(int64)"
    (logits,) = session.run(["logits"], feeds)
    with torch.no_grad():
        want = _module(folder)(**{name: torch.from_numpy(value) for name, value in feeds.items()}).logits
    np.testing.assert_allclose(logits, want.numpy(), atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


def _bert_logits(folder, feeds: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return _module(folder)(**{name: torch.from_numpy(value) for name, value in feeds.items()}).logits.numpy()


@pytest.mark.parametrize("mask_dtype", [np.int64, np.bool_])
def test_a_bert_files_int64_mask_takes_a_bool_one_through_mha_session(exported, mask_dtype):
    """MHASession (and with it infer, serve and bench) takes the file's int64 1/0 mask, and a bool one as its earlier
    files took it, converted: the same logits either way, equal to the module."""
    from mha_deploy.runtime import MHASession

    folder, path, _ = exported("bert")
    feeds = _tokenized(folder)
    got = MHASession(path, provider="cpu").run({**feeds, "attention_mask": feeds["attention_mask"].astype(mask_dtype)})
    np.testing.assert_allclose(got["logits"], _bert_logits(folder, feeds), atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


def test_infer_runs_a_bert_file_with_its_int64_mask_over_jsonl_items(exported, tmp_path):
    """infer builds each batch's mask itself, in the file's dtype: every item's logits equal to the module's on that
    item alone."""
    folder, path, _ = exported("bert")
    feeds = _tokenized(folder)
    lengths = feeds["attention_mask"].sum(axis=1)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": f"t{row}", "input_ids": feeds["input_ids"][row, :n].tolist(),
                                         "token_type_ids": feeds["token_type_ids"][row, :n].tolist()}) + "\n"
                             for row, n in enumerate(lengths)))
    out = tmp_path / "logits.npz"
    result = CliRunner().invoke(main, ["infer", str(path), "--input", str(items), "--output", str(out),
                                       "--provider", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    written = np.load(out)
    for row, n in enumerate(lengths):
        alone = {name: value[row : row + 1, :n] for name, value in feeds.items()}
        np.testing.assert_allclose(written[f"t{row}.logits"], _bert_logits(folder, alone)[0], atol=OWN_MODEL_ATOL,
                                   rtol=OWN_MODEL_RTOL)


def test_serve_describes_a_bert_files_mask_as_int64_and_takes_bool_too(exported):
    """OIP: the metadata says INT64 (what Triton's config says too: TYPE_INT64), an INT64 mask is answered with the
    module's logits, and a BOOL one (a client of a bool-mask file) the same."""
    from mha_deploy.runtime import MHASession
    from mha_deploy.serving.http.app import create_app
    from tests.serving.helpers import app_on_loopback, connect, http_request

    folder, path, _ = exported("bert")
    feeds = _tokenized(folder)
    want = _bert_logits(folder, feeds)
    app = create_app(lambda: MHASession(path, provider="cpu"), model_name="bert")
    with app_on_loopback(app, timeout_s=60) as port:
        status, _, body = http_request(connect(port), "GET", "/v2/models/bert")
        assert status == 200
        assert {t["name"]: t["datatype"] for t in json.loads(body)["inputs"]}["attention_mask"] == "INT64"
        for datatype, mask in (("INT64", feeds["attention_mask"].tolist()),
                               ("BOOL", feeds["attention_mask"].astype(bool).tolist())):
            tensors = [{"name": name, "shape": list(value.shape), "datatype": "INT64", "data": value.tolist()}
                       for name, value in feeds.items() if name != "attention_mask"]
            tensors.append({"name": "attention_mask", "shape": list(feeds["attention_mask"].shape),
                            "datatype": datatype, "data": mask})
            status, _, body = http_request(connect(port), "POST", "/v2/models/bert/infer",
                                           json.dumps({"inputs": tensors}).encode(),
                                           {"Content-Type": "application/json"})
            assert status == 200, body
            (logits,) = [t for t in json.loads(body)["outputs"] if t["name"] == "logits"]
            got = np.array(logits["data"], np.float32).reshape(logits["shape"])
            np.testing.assert_allclose(got, want, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=datatype)


@pytest.mark.parametrize("family", SENTENCE_POOLING)
def test_a_sentence_transformers_folder_exports_its_pooled_vector_fused(exported, family):
    """One output, sentence-transformers' ``sentence_embedding`` [batch, d per pooling mode]; every attention fused
    (the pooling reads the mask too); no segment ids (one text per vector); encode's max_seq_length recorded."""
    _, path, output = exported(family)
    session = _plain(path)
    modes = SENTENCE_POOLING[family]
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    outputs = [(o.name, o.shape) for o in session.get_outputs()]
    assert outputs == [("sentence_embedding", ["batch", D_MODEL * len(modes)])]
    normalised = ", normalised" if family == "sentence" else ": inputs"
    assert f"BertModel with sentence-transformers' {' + '.join(modes)} pooling{normalised}" in output
    assert f"{LAYERS} attention subgraph(s) found, {LAYERS} fused into com.microsoft.MultiHeadAttention, 0 left " \
           "unfused" in output
    assert "Softmax" not in _ops(path)
    assert read_metadata(path).max_length == hf_sentence.MAX_SEQ_LENGTH
    assert {"tokenizer.json", "tokenizer_config.json"} <= {file.name for file in path.parent.iterdir()}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", SENTENCE_POOLING)
def test_a_sentence_transformers_folder_equals_its_encode(exported, family, side):
    """The file's vectors equal sentence-transformers' own on the folder at a batch and lengths the export never saw:
    ``encode`` of the texts (its tokenizer pads on the right), and its forward over the same ids padded on the left
    (where cls, lasttoken and weightedmean must find the first and last real tokens)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, path, _ = exported(family)
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    rng = np.random.default_rng(5)
    rows = [rng.integers(3, VOCAB, length) for length in (UNSEEN_SEQ, 4, 12)]
    mask = np.zeros((len(rows), UNSEEN_SEQ), bool)
    ids = np.full(mask.shape, PAD_ID, np.int64)
    for row, real in enumerate(rows):
        at = slice(0, len(real)) if side == "right" else slice(UNSEEN_SEQ - len(real), UNSEEN_SEQ)
        ids[row, at], mask[row, at] = real, True
    (got,) = _plain(path).run(["sentence_embedding"], {"input_ids": ids, "attention_mask": mask.astype(np.int64)})
    if side == "right":
        want = model.encode([" ".join(f"w{i}" for i in real) for real in rows], batch_size=len(rows))
    else:
        with torch.no_grad():
            features = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask.astype(np.int64))}
            want = model(features)["sentence_embedding"].numpy()
    np.testing.assert_allclose(got, want, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)
    if family == "sentence":  # its Normalize
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize(("change", "flags", "message"), [
    ("dense", [], "modules.json's module 2 is 'sentence_transformers.models.Dense'; --hf exports a "
                  "sentence-transformers folder of Transformer, Pooling and optionally Normalize"),
    ("pooling", [], "1_Pooling/config.json: pooling mode 'mean_of_squares' is not one of cls, max, mean"),
    (None, ["--kv-cache"], "a sentence-transformers folder is an encoder with its pooling, which generates nothing"),
])
def test_a_sentence_transformers_folder_the_file_cannot_follow_is_refused(tmp_path, change, flags, message):
    """A module the file would leave out (a Dense projection), a pooling it does not know, generation: refused
    naming it, nothing written."""
    folder = hf_sentence.save_folder(tmp_path / "st", pooling=("mean",))
    if change == "dense":
        modules = json.loads((folder / "modules.json").read_text())
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (folder / "modules.json").write_text(json.dumps(modules))
    elif change == "pooling":
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean_of_squares"}))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--hf", str(folder), *flags, "-o", str(out / "m.onnx")])
    assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    assert not out.exists()


def test_a_causal_lm_exports_its_cache_fused_with_the_folders_ids(exported):
    _, path, output = exported("gpt2")
    session = _plain(path)
    names = [i.name for i in session.get_inputs()]
    assert names[:2] == ["input_ids", "attention_mask"] and "position_ids" in names
    assert session.get_outputs()[0].name == "logits"
    assert f"{LAYERS} attention subgraph(s) found, {LAYERS} fused" in output and "cache layout ragged" in output
    ops = _ops(path)
    assert ops.count("GroupQueryAttention") >= LAYERS and "Softmax" not in ops
    recorded = read_metadata(path)
    # generation_config.json's ids (eos 2 and 3, pad 1), not config.json's (eos 2 only); no start id for a causal LM
    assert recorded.generation.eos_token_ids == EOS_IDS and recorded.generation.pad_token_id == PAD_ID
    assert recorded.generation.decoder_start_token_id is None
    assert recorded.max_length == MAX_POSITIONS


def test_a_causal_lms_prompt_call_equals_the_module_in_plain_onnxruntime(exported):
    """The first call (an empty cache) at an unseen length, right-padded: the default file's logits, each row's last
    real token's ([batch, 1, vocab]), equal the module's there."""
    folder, path, _ = exported("gpt2")
    session = _plain(path)
    ids, mask = _right_padded(np.random.default_rng(1), UNSEEN_BATCH, UNSEEN_SEQ)
    feeds = {"input_ids": ids, "attention_mask": mask,
             "position_ids": np.broadcast_to(np.arange(UNSEEN_SEQ), ids.shape).astype(np.int64)}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            feeds[spec.name] = np.zeros((UNSEEN_BATCH, spec.shape[1], 0, spec.shape[3]), np.float32)
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = _module(folder)(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    assert logits.shape[1] == 1
    last = mask.sum(axis=1) - 1  # right-padded: each row's last real column
    np.testing.assert_allclose(logits[:, 0], want.numpy()[np.arange(len(last)), last], atol=OWN_MODEL_ATOL,
                               rtol=OWN_MODEL_RTOL)


def test_generate_finds_the_tokenizer_beside_the_file_and_equals_transformers(exported, tmp_path):
    folder, path, _ = exported("gpt2")
    prompt = "w5 w9 w17 w33 w4"
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": prompt}) + "\n")
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(tmp_path / "prompts.jsonl"),
                                       "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "6",
                                       "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "tokenizer.json beside the model" in result.output
    (line,) = (tmp_path / "out.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert set(record["text"].split()) <= {f"w{i}" for i in record["output_ids"]}  # decoded by that tokenizer
    ids = torch.tensor([[int(word[1:]) for word in prompt.split()]])
    with torch.no_grad():  # transformers' greedy search, stopping at the folder's eos ids as generate does
        want = _module(folder).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert record["output_ids"] == want[0, ids.shape[1]:].tolist()


def test_an_encoder_decoder_exports_its_pair_fused_with_the_folders_ids(exported):
    _, path, output = exported("bart")
    encoder = path.with_name("model.encoder.onnx")
    assert "decoder 2 self- and 2 cross-attention(s), all fused" in output
    for file in (encoder, path):
        assert "Softmax" not in _ops(file)
    assert [i.name for i in _plain(encoder).get_inputs()] == ["input_ids", "attention_mask"]
    recorded = _pair_record(path).generation
    assert (recorded.eos_token_ids, recorded.pad_token_id, recorded.decoder_start_token_id) == (
        [EOS_IDS[0]], PAD_ID, START_ID)


def test_an_encoder_decoder_equals_the_module_in_plain_onnxruntime(exported):
    """The encoder's run and the decoder's first call (an empty self-attention cache, a whole target prompt) at
    unseen lengths, the source right-padded: the logits of every target position."""
    folder, path, _ = exported("bart")
    rng = np.random.default_rng(2)
    source, source_mask = _right_padded(rng, UNSEEN_BATCH, UNSEEN_SEQ)
    target = rng.integers(3, VOCAB, (UNSEEN_BATCH, UNSEEN_TARGET)).astype(np.int64)
    encoder = _plain(path.with_name("model.encoder.onnx"))
    # the source's mask as the tokenizer gives it (int64 1/0), to the encoder and to the decoder
    assert {i.name: i.type for i in encoder.get_inputs()}["attention_mask"] == "tensor(int64)"
    encoder_feeds = {"input_ids": source, "attention_mask": source_mask}
    cross = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, encoder_feeds), strict=True))
    decoder = _plain(path)
    feeds = {"input_ids": target, "attention_mask": np.ones_like(target), "encoder_attention_mask": encoder_feeds[
        "attention_mask"]}
    for spec in decoder.get_inputs():
        if spec.name.endswith(".encoder.key") or spec.name.endswith(".encoder.value"):
            feeds[spec.name] = cross[spec.name.replace("past_key_values.", "present.")]
        elif spec.name.startswith("past_key_values."):
            feeds[spec.name] = np.zeros((UNSEEN_BATCH, spec.shape[1], 0, spec.shape[3]), np.float32)
    logits = decoder.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = _module(folder)(input_ids=torch.from_numpy(source), attention_mask=torch.from_numpy(source_mask),
                               decoder_input_ids=torch.from_numpy(target)).logits
    np.testing.assert_allclose(logits, want.numpy(), atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


@pytest.mark.parametrize("family", ["bert", "gpt2", "bart"])
def test_the_tokenizer_files_and_chat_template_land_beside_the_file(exported, family):
    folder, path, _ = exported(family)
    beside = {file.name for file in path.parent.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= beside
    assert (path.parent / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # GPT-2's folder holds its template inside tokenizer_config.json (older transformers' way): written out.
    assert (path.parent / "chat_template.jinja").read_text() == TEMPLATE
    if family != "bert":  # save_pretrained writes a generation config for models that generate
        assert (path.parent / "generation_config.json").is_file()
    assert not [name for name in beside if name.startswith(".")]  # no temporary left


def test_generate_finds_an_encoder_decoders_tokenizer(exported, tmp_path):
    _, path, _ = exported("bart")
    (tmp_path / "src.jsonl").write_text(json.dumps({"id": 1, "prompt": "w7 w8 w9 w10"}) + "\n")
    result = CliRunner().invoke(main, ["generate", str(path), "--input", str(tmp_path / "src.jsonl"), "--output",
                                       str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "tokenizer.json beside the model" in result.output
    assert "text" in json.loads((tmp_path / "out.jsonl").read_text())


def test_the_output_names_are_a_model_outputs_field_names():
    """What names a cache-free --hf export's outputs (own_model.named_outputs on the ModelOutput): its fields, the
    None ones (loss, attentions) skipped."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=1,
                                     num_attention_heads=HEADS, intermediate_size=FFN)
    with torch.no_grad():
        result = transformers.BertModel(config).eval()(input_ids=torch.ones(2, 5, dtype=torch.int64))
    assert [name for name, _ in named_outputs(result)] == ["last_hidden_state", "pooler_output"]


def test_a_model_reading_an_input_without_a_role_is_refused_naming_it(tmp_path):
    """Wav2Vec2 reads raw waveforms (input_values), which no role feeds: refused before anything is written."""
    config = transformers.Wav2Vec2Config(hidden_size=D_MODEL, num_hidden_layers=1, num_attention_heads=HEADS,
                                         intermediate_size=FFN, conv_dim=(D_MODEL,), conv_stride=(5,),
                                         conv_kernel=(10,), num_conv_pos_embeddings=16)
    transformers.Wav2Vec2Model(config).save_pretrained(tmp_path / "wav2vec2")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path / "wav2vec2"), "-o", str(out / "w.onnx")])
    assert result.exit_code == 1
    assert "Wav2Vec2Model.forward reads input_values, which --hf cannot feed yet" in result.output
    assert not out.exists()


def test_a_folder_without_a_config_or_an_architecture_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path), "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 1 and "no config.json in it" in result.output
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path), "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 1 and "names no architecture" in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_files_beside_are_written_whole_or_not_at_all(tmp_path):
    """A file beside the model that cannot be written takes back the ones written before it."""
    (tmp_path / "folder").mkdir()
    beside = BesideFiles({"tokenizer.json": b"{}", "generation_config.json": b"{}"})
    (tmp_path / "out" / "generation_config.json").mkdir(parents=True)  # a directory in the way
    (tmp_path / "out" / "generation_config.json" / "x").write_text("")
    with pytest.raises(OSError):
        beside.write(tmp_path / "out", tmp_path / "folder")
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["generation_config.json"]


def test_export_help_shows_each_sources_options_apart():
    help_text = CliRunner().invoke(main, ["export", "--help"]).output
    sections = ["The built-in block (without --module or --hf):", "Your own module (--module):",
                "A Hugging Face folder (--hf):", "Your own module or a Hugging Face folder (--module, --hf):",
                "Every source:"]
    where = [help_text.index(title) for title in sections]
    assert where == sorted(where)
    for flag, section in (("--mask [", 0), ("--input NAME", 1), ("--hf DIR", 2), ("--eos-id", 3), ("--fuse [", 4)):
        at = help_text.index(f"  {flag}", where[0])
        assert where[section] < at and (section == len(where) - 1 or at < where[section + 1]), flag


@pytest.mark.parametrize(("args", "message"), [
    (["--hf", "DIR", "--input", "input_ids:tokens"],
     "--input is for --module (your own code); --hf exports the folder's model as it is: its inputs read from the "
     "model's forward"),
    (["--hf", "DIR", "--output-name", "x"], "--output-name is for --module (your own code); --hf"),
    (["--hf", "DIR", "--mask", "padding", "--heads", "2"], "--heads, --mask describe the built-in ones; --hf"),
    (["--hf", "DIR", "--checkpoint", "w.safetensors"], "--checkpoint is for the built-in block or --module; --hf"),
    (["--hf", "DIR", "--module", "m.py:build"], "--module and --hf are two sources of a model: give one"),
    (["--module", "m.py:build", "--mask", "padding"], "--mask describe the built-in ones; --module exports your"),
    (["--max-length", "5"], "--max-length is for --module or --hf (a model of your own); without --module or --hf"),
    (["--input", "x:tokens"], "--input is for --module (your own code); without --module or --hf"),
])
def test_a_flag_of_another_source_is_refused_naming_its_source(tmp_path, args, message):
    args = [str(tmp_path) if arg == "DIR" else arg for arg in args]
    result = CliRunner().invoke(main, ["export", *args, "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "m.onnx").exists()


def test_the_files_beside_a_model_are_found_unless_a_flag_names_others(tmp_path):
    """What generate (and serve) take with no --tokenizer / --chat-template: the files export --hf wrote beside."""
    from mha_deploy.runtime.beside_model import BesideModel

    model = tmp_path / "model.onnx"
    assert BesideModel.of(model).resolve(None, None, print) == (None, None)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    said = []
    found = BesideModel.of(model).resolve(None, None, said.append)
    assert found == (tmp_path / "tokenizer.json", tmp_path / "chat_template.jinja") and len(said) == 2
    said.clear()
    given = BesideModel.of(model).resolve(tmp_path / "other.json", None, said.append)
    assert given == (tmp_path / "other.json", tmp_path / "chat_template.jinja")
    assert said == [f"chat_template.jinja beside the model: {tmp_path / 'chat_template.jinja'} (--chat-template to "
                    "use another)"]


def test_the_id_flags_take_the_folders_ids_place_one_by_one():
    from mha_deploy.exporters.hf_folder import _merged
    from mha_deploy.metadata import GenerationIds

    folder = GenerationIds([2], 1, 0)
    assert _merged(folder, None) == folder and _merged(None, GenerationIds([5])) == GenerationIds([5])
    assert _merged(folder, GenerationIds([], None, 7)) == GenerationIds([2], 1, 7)
    assert _merged(folder, GenerationIds([5, 6])) == GenerationIds([5, 6], 1, 0)


def test_genai_is_refused_for_an_encoder_decoder_folder_before_it_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BartForConditionalGeneration"],
                                                      "is_encoder_decoder": True}))
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path), "--kv-cache", "--genai", "-o",
                                       str(tmp_path / "out" / "m.onnx")])
    assert result.exit_code == 2 and "this folder holds an encoder-decoder" in result.output
    assert not (tmp_path / "out").exists()
