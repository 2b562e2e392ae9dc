"""torch -> ONNX export with parity checks. Needs the ``export`` extra (torch, onnxscript)."""

from mha_deploy.exporters.export import ExportResult, export_builtin, export_mha, export_model, export_stack
from mha_deploy.exporters.optimize import optimize_model
from mha_deploy.exporters.own_model import InputDecl, load_factory
from mha_deploy.exporters.parity import ParityCase, check_parity

__all__ = [
    "ExportResult",
    "InputDecl",
    "ParityCase",
    "check_parity",
    "export_builtin",
    "export_mha",
    "export_model",
    "export_stack",
    "load_factory",
    "optimize_model",
]
