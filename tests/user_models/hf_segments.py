"""BERT with its segment ids (token_type_ids, a 2-row table of their own) from a small config, as a sentence-pair
model takes them: ``BertModel``'s own forward and ModelOutput."""

from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB, from_config
from transformers import BertConfig, BertModel

SEGMENTS = 2  # BERT's type_vocab_size
INPUTS = ("input_ids:tokens", "attention_mask:padding-mask", "token_type_ids:segments")


def _config() -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID,
                      type_vocab_size=SEGMENTS, num_labels=3)


def build():
    return from_config(BertModel, _config(), "sdpa", seed=41)
