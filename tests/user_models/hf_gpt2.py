"""Hugging Face GPT-2 from a small config: its Conv1D projections (addmm on a flattened view), its causal mask
folded with the padding mask, and forward(input_ids, past_key_values, attention_mask, ...) as it comes."""

from hf_models import D_MODEL, HEADS, LAYERS, MAX_POSITIONS, VOCAB, from_config
from transformers import GPT2Config, GPT2LMHeadModel

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")


def _gpt2(attn):
    config = GPT2Config(vocab_size=VOCAB, n_embd=D_MODEL, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    return from_config(GPT2LMHeadModel, config, attn, seed=21)


def build():
    return _gpt2("sdpa")


def build_eager():
    return _gpt2("eager")
