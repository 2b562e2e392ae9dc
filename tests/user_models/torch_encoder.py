"""torch's own nn.TransformerEncoder (batch_first=True) over float features with a key padding mask."""

import torch
from torch import nn

INPUTS = ("x:sequence", "keep:padding-mask")


class Encoder(nn.Module):
    def __init__(self, d_model=32, nhead=4, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x, keep):
        return self.encoder(x, src_key_padding_mask=~keep)


def build():
    torch.manual_seed(4)
    return Encoder()
