"""torch's own nn.Transformer (batch_first=True) as a translation model over token ids: key padding masks on
both sides, the target's causal mask from generate_square_subsequent_mask, tgt_is_causal set."""

import torch
from torch import nn

INPUTS = ("src:tokens:src_seq", "src_mask:padding-mask:src_seq", "tgt:tokens:tgt_seq", "tgt_mask:padding-mask:tgt_seq")


class Translator(nn.Module):
    def __init__(self, vocab=60, d_model=32, nhead=4, layers=2):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, nhead, layers, layers, dim_feedforward=64, dropout=0.1,
                                          batch_first=True)
        self.generator = nn.Linear(d_model, vocab)

    def forward(self, src, src_mask, tgt, tgt_mask):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        out = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=causal,
                               src_key_padding_mask=~src_mask, tgt_key_padding_mask=~tgt_mask,
                               memory_key_padding_mask=~src_mask, tgt_is_causal=True)
        return self.generator(out)


def build():
    torch.manual_seed(5)
    return Translator()
