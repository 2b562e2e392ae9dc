"""Running exported models with ONNX Runtime. Imports neither torch nor the exporters."""

from mha_deploy.serving.providers import PROVIDER_CHOICES
from mha_deploy.serving.runner import BatchRunner, RunStats
from mha_deploy.serving.session import MHASession

__all__ = ["PROVIDER_CHOICES", "BatchRunner", "MHASession", "RunStats"]
