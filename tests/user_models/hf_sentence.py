"""A sentence-embedding model as sentence-transformers builds one: Hugging Face BERT from a small config, its last
hidden state mean-pooled over the attention mask, one vector per item ([batch, d_model]). Served on /v1/embeddings.

``build`` is the model as a module (``export --module``); ``save_folder`` writes the same weights as the folder
``SentenceTransformer.save`` writes (``export --hf``), without sentence-transformers: modules.json, the transformer's
config and weights (at the root, as sentence-transformers 6 saves it, or in ``0_Transformer`` with the pooling
flags of its early versions), ``1_Pooling/config.json``, ``2_Normalize`` when asked, sentence_bert_config.json."""

import json
from pathlib import Path

import torch
from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB, from_config
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")
MAX_SEQ_LENGTH = 128  # sentence_bert_config.json's: encode truncates there (below the 512 positions)
# sentence-transformers' class paths: before 6 (sentence_transformers.models.*) and 6's own
TYPES = {"legacy": {"Transformer": "sentence_transformers.models.Transformer",
                    "Pooling": "sentence_transformers.models.Pooling",
                    "Normalize": "sentence_transformers.models.Normalize"},
         "6": {"Transformer": "sentence_transformers.base.modules.transformer.Transformer",
               "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
               "Normalize": "sentence_transformers.base.modules.normalize.Normalize"}}
LEGACY_FLAGS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
                "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}


class MeanPooled(torch.nn.Module):
    """The encoder's token states averaged over the real tokens (sentence-transformers' mean pooling)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(states.dtype)  # [batch, seq, 1]
        return (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # [batch, d_model]


def build():
    config = BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID)
    return MeanPooled(from_config(BertModel, config, "sdpa", seed=17)).eval()


def save_folder(folder, tokenizer=None, pooling=("mean",), normalize=False, layout="6"):
    """``build()``'s encoder saved as a sentence-transformers folder in ``folder``, with ``pooling`` (modes, in the
    order they are concatenated), ``normalize`` and ``layout`` ("6": the transformer at the root and
    ``pooling_mode``; "legacy": the transformer in 0_Transformer and ``pooling_mode_*`` flags), and ``tokenizer`` (a
    ``tokenizers.Tokenizer``) saved beside the transformer as transformers saves one."""
    folder = Path(folder)
    types = TYPES[layout]
    transformer = folder / ("0_Transformer" if layout == "legacy" else "")
    build().encoder.save_pretrained(transformer)
    if tokenizer is not None:
        pad = tokenizer.id_to_token(PAD_ID)  # the config's pad id: encode pads a batch with it
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad).save_pretrained(transformer)
    _write(transformer / "sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    modules = [{"idx": 0, "name": "0", "path": transformer.name if layout == "legacy" else "",
                "type": types["Transformer"]},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": types["Pooling"]}]
    if layout == "legacy":
        config = {"word_embedding_dimension": D_MODEL, **{flag: mode in pooling for mode, flag in LEGACY_FLAGS.items()}}
    else:
        config = {"embedding_dimension": D_MODEL, "pooling_mode": pooling[0] if len(pooling) == 1 else list(pooling),
                  "include_prompt": True}
    _write(folder / "1_Pooling" / "config.json", config)
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": types["Normalize"]})
        (folder / "2_Normalize").mkdir()  # sentence-transformers before 6 wrote it empty
    _write(folder / "modules.json", modules)
    return folder


def _write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))
