"""Hugging Face image encoders (ViT) from small configs, used as they come: pixel_values [batch, 3, 32, 32] in,
the model's own ModelOutput out. The image's sizes are read off the config (``pixel_values:image``)."""

from hf_models import D_MODEL, FFN, HEADS, LAYERS, from_config
from transformers import ViTConfig, ViTModel

IMAGE_SIZE, PATCH, CHANNELS = 32, 8, 3
INPUTS = ("pixel_values:image",)


def _config() -> ViTConfig:
    return ViTConfig(hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                     image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=CHANNELS)


def build():
    return from_config(ViTModel, _config(), "sdpa", seed=21)

