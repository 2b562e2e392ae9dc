"""Hugging Face encoders (BERT, DistilBERT, RoBERTa) from small configs, used as they come: the model's own
forward, its own mask handling, its ModelOutput. One factory per model and attention implementation."""

from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB, from_config
from transformers import (
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    RobertaConfig,
    RobertaModel,
)

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")


def _bert(attn):
    config = BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID)
    return from_config(BertModel, config, attn, seed=11)


def _distilbert(attn):
    config = DistilBertConfig(vocab_size=VOCAB, dim=D_MODEL, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                              max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID)
    return from_config(DistilBertModel, config, attn, seed=12)


def _roberta(attn):
    # RoBERTa's positions count real tokens from padding_idx + 1: the table holds MAX_POSITIONS + 2 rows.
    config = RobertaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=PAD_ID)
    return from_config(RobertaModel, config, attn, seed=13)


def build_bert():
    return _bert("sdpa")


def build_bert_eager():
    return _bert("eager")


def build_distilbert():
    return _distilbert("sdpa")


def build_distilbert_eager():
    return _distilbert("eager")


def build_roberta():
    return _roberta("sdpa")


def build_roberta_eager():
    return _roberta("eager")
