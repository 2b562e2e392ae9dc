"""Encoders beyond BERT from their ``save_pretrained`` folders, each exported with ``export --hf DIR`` and nothing
else: DeBERTa-v2 (relative attention: c2p and p2c score terms, position buckets, shared attention keys), ModernBERT
(rotary; global layers and local sliding-window layers), CLIP (both towers) and ViT. Small configs, random weights,
nothing downloaded.

Each family: every attention fused (no Softmax left) and the fused ops as said (DeBERTa's c2p + p2c as the op's
attention_bias with its 1/sqrt(d * 3) scale; ModernBERT's global layers on the key padding input, its local
layers' two-sided window as a materialised attention_bias, which the export's report names: MultiHeadAttention
takes no window and GroupQueryAttention's local_window_size is causal only); the file equal to the module in plain
ONNX Runtime under Hugging Face's input names at a batch and length the export never saw (right-padded rows, the
attention_mask int64 1/0 as a tokenizer returns it; CLIP's logits_per_image and logits_per_text [batch, batch]
too), within OWN_MODEL_ATOL/RTOL (2e-5 absolute, 1e-4 relative: fp32, a different summation order).
One export per family per module."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.model_report import attention_ops  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from tests.conftest import OWN_MODEL_ATOL, OWN_MODEL_RTOL, USER_MODELS  # noqa: E402

sys.path.insert(0, str(USER_MODELS))
from hf_models import D_MODEL, FFN, HEADS, LAYERS, VOCAB  # noqa: E402

sys.path.remove(str(USER_MODELS))

# A batch and a length the export never traced, probed or checked parity at (3-17, 41, 300, the max length).
UNSEEN_BATCH, UNSEEN_SEQ = 5, 23
IMAGE_SIZE, PATCH = 32, 8
WINDOW = 8  # ModernBERT's local layers: each token sees 4 on either side
PAD_ID = 1


def _deberta():
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=128, relative_attention=True, position_buckets=16,
        pos_att_type=["p2c", "c2p"], share_att_key=True, max_relative_positions=-1, pad_token_id=0,
        type_vocab_size=0, num_labels=3)
    return transformers.DebertaV2ForSequenceClassification, config


def _modernbert():
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=WINDOW,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
    return transformers.ModernBertModel, config


def _clip():
    tower = {"hidden_size": D_MODEL, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "intermediate_size": FFN, "projection_dim": 16}
    config = transformers.CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": 77, "pad_token_id": PAD_ID,
                     "bos_token_id": 0, "eos_token_id": 2},
        vision_config={**tower, "image_size": IMAGE_SIZE, "patch_size": PATCH}, projection_dim=16)
    return transformers.CLIPModel, config


def _vit():
    config = transformers.ViTConfig(hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    intermediate_size=FFN, image_size=IMAGE_SIZE, patch_size=PATCH, num_labels=5)
    return transformers.ViTForImageClassification, config


FAMILIES = {"deberta": _deberta, "modernbert": _modernbert, "clip": _clip, "vit": _vit}
# Attentions per family: CLIP has a text and a vision tower.
ATTENTIONS = {"deberta": LAYERS, "modernbert": LAYERS, "clip": 2 * LAYERS, "vit": LAYERS}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(family) -> (folder, file, CLI output)``: saved and exported once per module."""
    done = {}

    def export(family: str):
        if family not in done:
            folder = tmp_path_factory.mktemp(family)
            cls, config = FAMILIES[family]()
            torch.manual_seed(7)
            cls._from_config(config).eval().save_pretrained(folder)
            path = folder.parent / f"{family}.onnx"
            result = CliRunner().invoke(main, ["export", "--hf", str(folder), "-o", str(path)])
            assert result.exit_code == 0, result.output
            done[family] = (folder, path, result.output)
        return done[family]

    return export


def _fused(path):
    import onnx

    model = onnx.load(str(path))
    ops = [node.op_type for node in all_nodes(model.graph)]
    return model, ops, attention_ops(list(model.graph.node), {t.name: t for t in model.graph.initializer})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_attention_is_fused(exported, family):
    _, path, output = exported(family)
    count = ATTENTIONS[family]
    # CLIP's causal text tower takes GroupQueryAttention, the rest MultiHeadAttention.
    assert f"{count} attention subgraph(s) found, {count} fused into com.microsoft." in output
    assert "0 left unfused" in output and "not fused:" not in output
    assert "mask not recognised" not in output and "fusion not used" not in output
    _, ops, infos = _fused(path)
    assert "Softmax" not in ops
    assert len(infos) == count


def test_debertas_relative_terms_are_the_ops_bias_with_its_scale(exported):
    """c2p + p2c: [batch, heads, q, kv] added to the scores, the op's attention_bias; scores scaled by
    1/sqrt(head_dim * 3) (c2p and p2c both on)."""
    _, path, _ = exported("deberta")
    _, _, infos = _fused(path)
    for info in infos:
        assert "attention_bias" in info.inputs and "relative score terms with the mask" in info.kernel
        assert info.attributes["scale"] == pytest.approx(1 / np.sqrt(D_MODEL // HEADS * 3), rel=1e-6)


def test_modernberts_global_layer_takes_key_padding_and_its_local_window_is_named(exported):
    _, path, output = exported("modernbert")
    _, _, infos = _fused(path)
    windows = [info for info in infos if "window or chunk mask" in info.kernel]
    assert len(windows) == LAYERS // 2, [info.kernel for info in infos]  # global_attn_every_n_layers 2
    assert all("key_padding_mask" in info.inputs for info in infos if info not in windows)
    assert f"{LAYERS // 2} with a window or chunk mask as attention_bias (materialised: MultiHeadAttention takes " \
           "no window, GroupQueryAttention's is causal only)" in output
    assert "opset 22, not 23" in output  # the rotary written as plain ops


def test_a_mask_free_encoder_takes_the_flash_kernel(exported):
    """ViT's all-True mask (built over the patches) masks nothing: no mask input is left on its ops."""
    _, path, _ = exported("vit")
    _, _, infos = _fused(path)
    assert all(info.kernel == "MultiHeadAttention (flash)" for info in infos)


def test_vits_context_reaches_its_output_projection_without_a_copy(exported):
    """ViT merges the heads with a permute, a view and a permute back: two Transposes a layer that ORT cannot
    cancel across the view. The chain drops them (fusion.head_round_trip): each op's output is what its output
    projection reads; the module parity test below checks the file."""
    _, path, _ = exported("vit")
    model, _, _ = _fused(path)
    readers = {name: node for node in model.graph.node for name in node.input}
    attentions = [node for node in model.graph.node if node.op_type == "MultiHeadAttention"]
    assert len(attentions) == LAYERS
    assert all(readers[node.output[0]].op_type == "MatMul" for node in attentions)


def test_clips_cross_batch_logits_are_outputs_spanning_the_batch(exported):
    """logits_per_image and logits_per_text are the file's, [batch, batch] in its metadata (the batch on a later
    axis: ``TensorSpec.spans_batch``), beside the per-item embeddings; inspect says which span the batch, in its
    text and its --json."""
    import json

    from mha_deploy.model_report import SPANS_BATCH_WORDS, read_metadata

    _, path, output = exported("clip")
    signature = read_metadata(path).signature
    assert signature.batch_outputs == ("logits_per_image", "logits_per_text")
    assert signature.tensors["logits_per_image"].axes == ("batch", "batch")
    assert {"text_embeds", "image_embeds"} <= {spec.name for spec in signature.item_outputs}
    assert "left out" not in output
    shown = CliRunner().invoke(main, ["inspect", str(path)])
    assert shown.exit_code == 0, shown.output
    lines = {line.split()[1]: line for line in shown.output.splitlines() if line.startswith("  output ")}
    assert {"text_embeds", "image_embeds", *signature.batch_outputs} <= set(lines)
    for name, line in lines.items():
        assert line.endswith(f"  {SPANS_BATCH_WORDS}") == (name in signature.batch_outputs), line
    assert "spans the batch: each item against every item of its call" in SPANS_BATCH_WORDS
    shown = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert [t["name"] for t in report["outputs"] if t["spans_batch"]] == ["logits_per_image", "logits_per_text"]
    assert len(report["outputs"]) == len(lines) > 2


def _feeds(family, rng):
    """Hugging Face's input names -> values at the unseen size: right-padded ids (pad id at the padded positions,
    the first row whole), the mask int64 1/0 as a tokenizer returns it, images random."""
    feeds = {}
    if family != "vit":
        lengths = rng.integers(2, UNSEEN_SEQ + 1, size=UNSEEN_BATCH)
        lengths[0] = UNSEEN_SEQ
        mask = np.arange(UNSEEN_SEQ)[None, :] < lengths[:, None]
        ids = rng.integers(3, VOCAB, size=(UNSEEN_BATCH, UNSEEN_SEQ))
        feeds["input_ids"] = np.where(mask, ids, PAD_ID).astype(np.int64)
        feeds["attention_mask"] = mask.astype(np.int64)
    if family in ("clip", "vit"):
        feeds["pixel_values"] = rng.standard_normal((UNSEEN_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_equals_the_module_in_plain_onnxruntime(exported, family):
    folder, path, _ = exported(family)
    cls, _ = FAMILIES[family]()
    module = cls.from_pretrained(folder).eval()
    feeds = _feeds(family, np.random.default_rng(3))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert {i.name: i.type for i in session.get_inputs()} == {
        name: "tensor(float)" if value.dtype == np.float32 else "tensor(int64)" for name, value in feeds.items()}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    with torch.no_grad():
        want = module(**{name: torch.from_numpy(value) for name, value in feeds.items()})
    compared = {"deberta": ["logits"], "modernbert": ["last_hidden_state"],
                "clip": ["text_embeds", "image_embeds", "logits_per_image", "logits_per_text"],
                "vit": ["logits"]}[family]
    for name in compared:
        have, expected = got[name], want[name].numpy()
        if name == "last_hidden_state":  # the real tokens' rows: padded rows are padding
            real = feeds["attention_mask"] == 1
            have, expected = have[real], expected[real]
        np.testing.assert_allclose(have, expected, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=name)


# --- CLIP's logits spanning the batch through infer, serve and Triton --------------------------------------------


def _clip_batch(rng, batch: int) -> dict[str, np.ndarray]:
    """A tokenizer's right-padded ids and int64 mask (rows of different lengths) and images, ``batch`` of each."""
    lengths = rng.integers(2, UNSEEN_SEQ + 1, size=batch)
    mask = (np.arange(UNSEEN_SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(3, VOCAB, size=mask.shape), PAD_ID).astype(np.int64)
    pixels = rng.standard_normal((batch, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def _clip_module(folder, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    module = transformers.CLIPModel.from_pretrained(folder).eval()
    with torch.no_grad():
        result = module(**{name: torch.from_numpy(value) for name, value in feeds.items()})
    return {name: result[name].numpy() for name in ("logits_per_image", "logits_per_text", "text_embeds")}


def test_serve_answers_clips_logits_for_each_requests_own_batch(exported):
    """Two clients' requests (batches of 2 and 3) arriving within one batching window: each gets logits_per_image
    [its batch, its batch] equal to the module's on its own batch, never a batch merged with the other's (which
    the server would otherwise form: 300 ms window)."""
    import concurrent.futures
    import json

    from mha_deploy.batching import BatchingConfig
    from mha_deploy.runtime import MHASession
    from mha_deploy.serving.http.app import create_app
    from tests.serving.helpers import app_on_loopback, connect, http_request

    folder, path, _ = exported("clip")
    rng = np.random.default_rng(11)
    batches = [_clip_batch(rng, 2), _clip_batch(rng, 3)]
    app = create_app(lambda: MHASession(path, provider="cpu"), BatchingConfig(max_wait_ms=300), model_name="clip")

    def post(port, feeds):
        tensors = [{"name": name, "shape": list(value.shape), "datatype": "FP32" if value.dtype == np.float32
                    else "INT64", "data": value.ravel().tolist()} for name, value in feeds.items()]
        status, _, body = http_request(connect(port), "POST", "/v2/models/clip/infer",
                                       json.dumps({"inputs": tensors}).encode(), {"Content-Type": "application/json"})
        assert status == 200, body
        return {t["name"]: np.array(t["data"], np.float32).reshape(t["shape"]) for t in json.loads(body)["outputs"]}

    with app_on_loopback(app, timeout_s=60) as port, concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda feeds: post(port, feeds), batches))
    for feeds, got in zip(batches, answers, strict=True):
        want = _clip_module(folder, feeds)
        batch = len(feeds["input_ids"])
        assert got["logits_per_image"].shape == (batch, batch)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=name)


def _infer_clip_items(path, tmp_path, *flags: str):
    """(the feeds, the output, the CliRunner result) of ``infer`` over three CLIP items (an npz), with ``flags``."""
    feeds = _clip_batch(np.random.default_rng(12), 3)
    lengths = feeds["attention_mask"].sum(axis=1)
    items = tmp_path / "items.npz"
    # npz keys as infer reads them: the ids under the item's id, its image under <id>.pixel_values
    np.savez(items, **{key: value for row, n in enumerate(lengths)
                       for key, value in ((f"i{row}", feeds["input_ids"][row, :n]),
                                          (f"i{row}.pixel_values", feeds["pixel_values"][row]))})
    out = tmp_path / "out.npz"
    result = CliRunner().invoke(main, ["infer", str(path), "--input", str(items), "--output", str(out),
                                       "--provider", "cpu", "--no-progress", *flags])
    return feeds, out, result


def test_infer_writes_clips_per_item_outputs_and_says_it_leaves_the_logits_out(exported, tmp_path):
    """infer batches items as it chooses, so an item's row of logits_per_image would depend on its batch-mates: it
    writes each item's embeddings (equal to the module's on the item alone) and names the outputs it leaves out."""
    folder, path, _ = exported("clip")
    feeds, out, result = _infer_clip_items(path, tmp_path)
    lengths = feeds["attention_mask"].sum(axis=1)
    assert result.exit_code == 0, result.output
    assert "logits_per_image, logits_per_text not written: each spans the whole batch" in result.output
    written = np.load(out)
    assert not [key for key in written.files if "logits_per" in key]
    for row, n in enumerate(lengths):
        alone = {name: value[row : row + 1, :n] if value.ndim == 2 else value[row : row + 1]
                 for name, value in feeds.items()}
        np.testing.assert_allclose(written[f"i{row}.text_embeds"], _clip_module(folder, alone)["text_embeds"][0],
                                   atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


def test_infer_on_ray_says_it_leaves_clips_logits_out_too(exported, tmp_path, monkeypatch):
    """``--engine ray`` reads the model on its driver before any actor (``run_dataset_on_ray``) and names the
    outputs it leaves out as the local engine does. Run here on an output the local engine finished, whose shards
    are all done: the engine's own code runs, its plan leaves nothing for an actor, and no Ray starts (ray.init is
    refused, to keep it so)."""
    ray = pytest.importorskip("ray")
    _, path, _ = exported("clip")
    _, _, local = _infer_clip_items(path, tmp_path)
    assert local.exit_code == 0, local.output

    def no_cluster(*args, **kwargs):
        raise AssertionError("a rerun with every shard done starts no Ray")

    monkeypatch.setattr(ray, "init", no_cluster)
    _, _, again = _infer_clip_items(path, tmp_path, "--engine", "ray")
    assert again.exit_code == 0, again.output
    assert "nothing to do" in again.stdout, again.output
    assert "note: logits_per_image, logits_per_text not written: each spans the whole batch" in again.stderr


def test_clips_triton_config_does_not_batch_requests_and_takes_an_int64_mask(exported):
    """Triton's dynamic batcher would concatenate requests along the batch and hand each its rows of
    logits_per_image: the config turns batching off (max_batch_size 0, the batch axis in dims) and says why."""
    import onnx

    from mha_deploy.model_report import read_metadata
    from mha_deploy.serving.triton import TritonConfig, config_pbtxt

    _, path, _ = exported("clip")
    text = config_pbtxt(onnx.load(str(path)), read_metadata(path), TritonConfig(), "clip")
    assert "max_batch_size: 0" in text and "dynamic_batching" not in text
    assert "logits_per_image, logits_per_text span the request's whole batch" in text
    assert 'name: "attention_mask"\n    data_type: TYPE_INT64\n    dims: [ -1, -1 ]' in text
    assert 'name: "logits_per_image"\n    data_type: TYPE_FP32\n    dims: [ -1, -1 ]' in text
