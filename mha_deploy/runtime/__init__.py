"""Running an exported model with ONNX Runtime: ``MHASession``, providers, input validation. No torch."""

from mha_deploy.runtime.providers import PROVIDER_CHOICES
from mha_deploy.runtime.session import MHASession

__all__ = ["PROVIDER_CHOICES", "MHASession"]
