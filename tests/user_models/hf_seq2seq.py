"""Hugging Face encoder-decoders (BART, Marian, T5) from small configs, used as they come. T5 has no
1/sqrt(d) scale and adds a relative position bias to its scores."""

from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB, from_config
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
)

INPUTS = (
    "input_ids:tokens:src_seq",
    "attention_mask:padding-mask:src_seq",
    "decoder_input_ids:tokens:tgt_seq",
    "decoder_attention_mask:padding-mask:tgt_seq",
)


def _bart(attn):
    config = BartConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                        decoder_ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, use_cache=False)
    return from_config(BartForConditionalGeneration, config, attn, seed=31)


def _marian(attn):
    config = MarianConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                          encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                          decoder_ffn_dim=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID,
                          eos_token_id=0, decoder_start_token_id=PAD_ID, use_cache=False)
    return from_config(MarianMTModel, config, attn, seed=32)


def _t5(attn):
    config = T5Config(vocab_size=VOCAB, d_model=D_MODEL, d_kv=D_MODEL // HEADS, d_ff=FFN, num_layers=LAYERS,
                      num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                      relative_attention_max_distance=32, pad_token_id=PAD_ID, eos_token_id=0,
                      decoder_start_token_id=PAD_ID, use_cache=False)
    return from_config(T5ForConditionalGeneration, config, attn, seed=33)


def build_bart():
    return _bart("sdpa")


def build_bart_eager():
    return _bart("eager")


def build_marian():
    return _marian("sdpa")


def build_marian_eager():
    return _marian("eager")


def build_t5():
    return _t5("sdpa")


def build_t5_eager():
    return _t5("eager")
