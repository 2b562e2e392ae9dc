"""fp16 models: weights, activations and I/O in half precision, for the CUDA provider."""

from __future__ import annotations

import onnx

# Re-exported (the "as" marks it so): defined in metadata, without onnx, so that the CLI can list it.
from mha_deploy.metadata import DTYPES as DTYPES

# fp16 vs the torch fp32 reference, d_model 512: max abs err 7.3e-4 on outputs
# of magnitude ~1.5 (inputs, weights and outputs are each rounded to fp16, unit
# roundoff 4.9e-4). 5e-3 leaves ~7x headroom for wider models while a wrong
# mask or head split (errors ~1e-1) still fails.
FP16_ATOL = FP16_RTOL = 5e-3


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float tensor, input and output to fp16; the bool mask input stays bool.

    ORT's converter clamps constants to fp16's range, so the reference's -1e9
    fill becomes -65504: still exp() == 0 for masked keys, and a row with no
    visible key stays finite instead of becoming -inf - -inf = NaN.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=False)
    converted.ir_version = min(converted.ir_version, model.ir_version)
    return converted
