"""An encoder over float features (e.g. 20 filterbank channels per frame): a linear front end, the -inf
fill, the scale as torch.sqrt of a tensor, and dropout that eval turns off; one vector per frame out."""

import torch
from torch import nn

INPUTS = ("features:sequence:frames:20", "frame_mask:padding-mask:frames")


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.2)

    def forward(self, x, mask):
        b, n, d = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32))
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        weights = self.attn_drop(scores.softmax(dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class FeatureEncoder(nn.Module):
    def __init__(self, in_features=20, dim=32, heads=4, depth=2):
        super().__init__()
        self.frontend = nn.Linear(in_features, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "attn": Attention(dim, heads)}) for _ in range(depth)
        )
        self.out = nn.LayerNorm(dim)

    def forward(self, features, frame_mask):
        x = self.frontend(features)
        for layer in self.layers:
            x = x + layer["attn"](layer["norm"](x), frame_mask)
        return self.out(x)


def build():
    torch.manual_seed(3)
    return FeatureEncoder()
