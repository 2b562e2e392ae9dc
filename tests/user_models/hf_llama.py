"""Hugging Face Llama from a small config, as ``from_pretrained`` gives it: rotary positions (cos/sin of
position_ids times inv_freq, rotated into the queries and keys), grouped-query attention (4 query heads over 2
key/value heads, repeated), RMSNorm, and ``use_cache`` on (its forward returns a DynamicCache beside the logits)."""

import torch
from hf_models import VOCAB, from_config
from transformers import LlamaConfig, LlamaForCausalLM

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")
# Small enough to export in seconds; 2 KV heads under 4 query heads is the grouped-query case.
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
MAX_POSITIONS = 256
EOS_ID, BOS_ID = 2, 1
# Llama's initial weights (std 0.02) give attention so flat that greedy tokens barely depend on positions: a prompt's
# later tokens moved 8 positions on kept the same 12 greedy tokens. Four times those weights, as sharp as trained
# ones, change them within 1 to 3 tokens, so a position counted wrong shows in the tokens.
WEIGHT_SCALE = 4.0


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=MAX_POSITIONS, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def build():
    model = from_config(LlamaForCausalLM, config(), "sdpa", seed=37)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:  # the projections and embeddings; the norms' scales stay 1
                weight.mul_(WEIGHT_SCALE)
    return model
