"""Serving an exported model: the HTTP server (``http/``) and Triton model repositories (``triton``). No torch.

``MHASession`` and ``BatchRunner`` live in ``mha_deploy.runtime`` and ``mha_deploy.batch``;
they are re-exported here so that code written against earlier releases keeps working.
"""

from mha_deploy.batch import BatchRunner, RunStats
from mha_deploy.runtime import PROVIDER_CHOICES, MHASession

__all__ = ["PROVIDER_CHOICES", "BatchRunner", "MHASession", "RunStats"]
