"""Read the constant tensors a rule's check depends on (a fill, a scale, Unsqueeze axes).

Kept here, on public APIs only (``onnx_ir`` and ``onnxscript.optimizer``), so the
rules do not depend on onnxscript's private ``_ir_utils``, whose names may
change in any release.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.optimizer import basic_constant_propagation


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """``value``'s contents when it is an initializer or a ``Constant`` output, else None."""
    if value is None or value.is_graph_input():
        # An initializer that is also a graph input is only a default: callers may feed another value.
        return None
    if value.const_value is None and (producer := value.producer()) is not None:
        # A Constant's output only carries its tensor once propagated; the rewriter does that
        # per pass, but not for graphs read outside one (hand-built, or nodes a rule just added).
        basic_constant_propagation([producer])
    tensor = value.const_value
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except FileNotFoundError:  # external data that is not on disk
        return None


def scalar_constant(value: ir.Value | None) -> int | float | bool | None:
    """The element of a one-element constant (any rank), else None."""
    array = constant_array(value)
    return array.item() if array is not None and array.size == 1 else None
