"""torch -> ONNX export with parity checks. Needs the ``export`` extra (torch, onnxscript)."""

from mha_deploy.exporters.export import ExportResult, export_mha, export_stack
from mha_deploy.exporters.parity import ParityCase, check_parity

__all__ = ["ExportResult", "ParityCase", "check_parity", "export_mha", "export_stack"]
