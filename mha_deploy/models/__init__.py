"""The torch side: the reference attention and checkpoint loading. Needs the ``export`` extra."""

from mha_deploy.models.attention import MASK_FILL_VALUE, MultiHeadAttention
from mha_deploy.models.checkpoint import load_checkpoint, read_state_dict, save_checkpoint, to_reference_state_dict
from mha_deploy.models.transformer import Decoder, DecoderLayer, Encoder, EncoderLayer

__all__ = [
    "MASK_FILL_VALUE",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "MultiHeadAttention",
    "load_checkpoint",
    "read_state_dict",
    "save_checkpoint",
    "to_reference_state_dict",
]
