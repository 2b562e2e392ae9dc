"""A causal language model on torch's own nn.TransformerDecoder (batch_first=True, no cross-attention input of its
own: the memory is the sequence itself, as GPT-style tutorials on nn.TransformerDecoder write it), with a bool
causal mask and a key padding mask."""

import torch
from torch import nn

INPUTS = ("tokens:tokens", "mask:padding-mask")


class DecoderLM(nn.Module):
    def __init__(self, vocab=70, d_model=32, nhead=4, layers=2, max_len=512):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)
        layer = nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, tokens, mask):
        t = tokens.size(1)
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), diagonal=1)  # True = hidden
        out = self.decoder(x, x, tgt_mask=causal, memory_mask=causal, tgt_key_padding_mask=~mask,
                           memory_key_padding_mask=~mask, tgt_is_causal=True)
        return self.lm_head(out)


def build():
    torch.manual_seed(6)
    return DecoderLM()
