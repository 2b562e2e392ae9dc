"""Encoders beyond BERT from their ``save_pretrained`` folders, each exported with ``export --hf DIR`` and nothing
else: DeBERTa-v2 (relative attention: c2p and p2c score terms, position buckets, shared attention keys), ModernBERT
(rotary; global layers and local sliding-window layers), CLIP (both towers) and ViT. Small configs, random weights,
nothing downloaded.

Each family: every attention fused (no Softmax left) and the fused ops as said (DeBERTa's c2p + p2c as the op's
attention_bias with its 1/sqrt(d * 3) scale; ModernBERT's global layers on the key padding input, its local
layers' two-sided window as a materialised attention_bias, which the export's report names: MultiHeadAttention
takes no window and GroupQueryAttention's local_window_size is causal only); the file equal to the module in plain
ONNX Runtime under Hugging Face's input names at a batch and length the export never saw (right-padded rows, masks
bool in the file), within OWN_MODEL_ATOL/RTOL (2e-5 absolute, 1e-4 relative: fp32, a different summation order).
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


def test_clips_cross_batch_logits_are_left_out_naming_how_to_compute_them(exported):
    _, path, output = exported("clip")
    model, _, _ = _fused(path)
    names = [o.name for o in model.graph.output]
    assert "text_embeds" in names and "image_embeds" in names
    assert "logits_per_image" not in names and "logits_per_text" not in names
    assert "logits_per_image, logits_per_text left out" in output


def _feeds(family, rng):
    """Hugging Face's input names -> values at the unseen size: right-padded ids (pad id at the padded positions,
    the first row whole), the mask bool, images random."""
    feeds = {}
    if family != "vit":
        lengths = rng.integers(2, UNSEEN_SEQ + 1, size=UNSEEN_BATCH)
        lengths[0] = UNSEEN_SEQ
        mask = np.arange(UNSEEN_SEQ)[None, :] < lengths[:, None]
        ids = rng.integers(3, VOCAB, size=(UNSEEN_BATCH, UNSEEN_SEQ))
        feeds["input_ids"] = np.where(mask, ids, PAD_ID).astype(np.int64)
        feeds["attention_mask"] = mask
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
    assert {i.name for i in session.get_inputs()} == set(feeds)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    with torch.no_grad():
        want = module(**{name: torch.from_numpy(value.astype(np.int64) if value.dtype == bool else value)
                         for name, value in feeds.items()})
    compared = {"deberta": ["logits"], "modernbert": ["last_hidden_state"], "clip": ["text_embeds", "image_embeds"],
                "vit": ["logits"]}[family]
    for name in compared:
        have, expected = got[name], want[name].numpy()
        if name == "last_hidden_state":  # the real tokens' rows: padded rows are padding
            real = feeds["attention_mask"]
            have, expected = have[real], expected[real]
        np.testing.assert_allclose(have, expected, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=name)
