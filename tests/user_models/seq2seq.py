"""An encoder-decoder (translation-style) over token ids: a ScaledDotProductAttention module, scale as
d_k ** 0.5, cross-attention over the encoder's memory, causal decoder self-attention."""

import torch
from torch import nn

INPUTS = ("src:tokens:src_seq", "src_mask:padding-mask:src_seq", "tgt:tokens:tgt_seq", "tgt_mask:padding-mask:tgt_seq")


class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_k, dropout=0.1):
        super().__init__()
        self.temperature = d_k ** 0.5
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = self.dropout(torch.softmax(attn, dim=-1))
        return torch.matmul(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head, self.d_k = n_head, d_model // n_head
        self.query_linear = nn.Linear(d_model, d_model)
        self.key_linear = nn.Linear(d_model, d_model)
        self.value_linear = nn.Linear(d_model, d_model)
        self.output_linear = nn.Linear(d_model, d_model)
        self.attention = ScaledDotProductAttention(self.d_k)

    def forward(self, q, k, v, mask=None):
        b, len_q, len_k = q.size(0), q.size(1), k.size(1)
        q = self.query_linear(q).view(b, len_q, self.n_head, self.d_k).transpose(1, 2)
        k = self.key_linear(k).view(b, len_k, self.n_head, self.d_k).transpose(1, 2)
        v = self.value_linear(v).view(b, len_k, self.n_head, self.d_k).transpose(1, 2)
        out, _ = self.attention(q, k, v, mask=mask)
        return self.output_linear(out.transpose(1, 2).contiguous().view(b, len_q, -1))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head)
        self.ffn = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = self.norm1(x + self.self_attn(x, x, x, mask))
        return self.norm2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_head)
        self.cross_attn = MultiHeadAttention(d_model, n_head)
        self.ffn = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.norm1(x + self.self_attn(x, x, x, tgt_mask))
        x = self.norm2(x + self.cross_attn(x, memory, memory, src_mask))
        return self.norm3(x + self.ffn(x))


class Transformer(nn.Module):
    def __init__(self, src_vocab=40, tgt_vocab=50, d_model=32, n_head=4, layers=2):
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, n_head) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(d_model, n_head) for _ in range(layers))
        self.generator = nn.Linear(d_model, tgt_vocab)

    def forward(self, src, src_mask, tgt, tgt_mask):
        src_mask = src_mask.unsqueeze(1).unsqueeze(2)  # [batch, 1, 1, src_len]
        t = tgt.size(1)
        tgt_mask = tgt_mask.unsqueeze(1).unsqueeze(2) & torch.tril(torch.ones(t, t, dtype=torch.bool))
        memory = self.src_embed(src)
        for layer in self.encoder:
            memory = layer(memory, src_mask)
        x = self.tgt_embed(tgt)
        for layer in self.decoder:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.generator(x)


def build():
    torch.manual_seed(2)
    return Transformer()


def build_bench():
    """The step benchmark's model (benchmarks/seq2seq_step.py): d_model 512, 8 heads, 6 + 6 layers, 8k vocabularies."""
    torch.manual_seed(3)
    return Transformer(src_vocab=8000, tgt_vocab=8000, d_model=512, n_head=8, layers=6)
