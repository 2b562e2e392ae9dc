"""mha-deploy: ship the reference multi-head attention with ONNX Runtime.

``mha_deploy.models`` (torch reference) -> ``mha_deploy.exporters`` (ONNX file)
-> ``mha_deploy.serving`` (ONNX Runtime, no torch). Importing this package
imports none of them.
"""

__version__ = "0.1.0"
