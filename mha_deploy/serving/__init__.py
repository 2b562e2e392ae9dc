"""Running exported models with ONNX Runtime. Imports neither torch nor the exporters."""

from mha_deploy.serving.providers import PROVIDER_CHOICES
from mha_deploy.serving.session import MHASession

__all__ = ["MHASession", "PROVIDER_CHOICES"]
