"""Hugging Face models as their users build them: from a small config, random weights, nothing downloaded.
Not a --module file itself: hf_encoder.py, hf_gpt2.py and hf_seq2seq.py are, and build from here."""

import torch

VOCAB = 96
D_MODEL, HEADS, LAYERS, FFN = 32, 4, 2, 64
MAX_POSITIONS = 512
PAD_ID = 1


def from_config(cls, config, attn_implementation: str, seed: int):
    """cls built from config with the given attention implementation ("eager" or "sdpa"), in eval mode."""
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation)
    return model.eval()
