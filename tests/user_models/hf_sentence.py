"""A sentence-embedding model as sentence-transformers builds one: Hugging Face BERT from a small config, its last
hidden state mean-pooled over the attention mask, one vector per item ([batch, d_model]). Served on /v1/embeddings."""

import torch
from hf_models import D_MODEL, FFN, HEADS, LAYERS, MAX_POSITIONS, PAD_ID, VOCAB, from_config
from transformers import BertConfig, BertModel

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")


class MeanPooled(torch.nn.Module):
    """The encoder's token states averaged over the real tokens (sentence-transformers' mean pooling)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(states.dtype)  # [batch, seq, 1]
        return (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # [batch, d_model]


def build():
    config = BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD_ID)
    return MeanPooled(from_config(BertModel, config, "sdpa", seed=17)).eval()
