"""Whisper's encoder from a small config, as ``WhisperModel(...).get_encoder()`` returns it: input_features
[batch, mel, frames] in (frames exactly 2 x max_source_positions, which its forward requires), its
BaseModelOutput out. The sizes are read off the config (``input_features:audio``)."""

from hf_models import D_MODEL, FFN, HEADS, LAYERS, VOCAB, from_config
from transformers import WhisperConfig, WhisperModel

MEL, POSITIONS = 8, 16  # frames = 2 x POSITIONS
INPUTS = ("input_features:audio",)


def _whisper(attn):
    config = WhisperConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=LAYERS, decoder_layers=LAYERS,
                           encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, num_mel_bins=MEL, max_source_positions=POSITIONS,
                           max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=0)
    return from_config(WhisperModel, config, attn, seed=31).get_encoder()


def build():
    return _whisper("sdpa")
