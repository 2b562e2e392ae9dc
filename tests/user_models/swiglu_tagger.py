"""A token tagger over ids, LLaMA-style blocks: RMSNorm written out, bias-free projections, a SwiGLU
feed-forward, the -inf fill, one label distribution per token. Its attentions' output projections read the
fused attention straight away (no bias between them)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

INPUTS = ("ids:tokens", "mask:padding-mask")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        out = torch.matmul(F.softmax(scores.float(), dim=-1), v)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x, mask):
        h = x + self.attention(self.attention_norm(x), mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Tagger(nn.Module):
    def __init__(self, vocab_size=50, dim=32, n_heads=4, n_layers=2, n_tags=5):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, n_tags, bias=False)

    def forward(self, ids, mask):
        h = self.tok_embeddings(ids)
        keep = mask[:, None, None, :]
        for layer in self.layers:
            h = layer(h, keep)
        return self.output(self.norm(h)).log_softmax(dim=-1)


def build():
    torch.manual_seed(0)
    return Tagger()
