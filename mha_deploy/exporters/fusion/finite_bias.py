"""A contrib attention op's float ``attention_bias`` -> ``Max(attention_bias, finite fill)``.

Why this pass exists: a bias that ``native_mask`` could not read as key padding or causal
stays a float input, often with -inf where a key is hidden (torch's float masks,
``generate_square_subsequent_mask``, the reference form's masked_fill). On a query row whose
keys are all hidden (left padding under a causal mask), ORT 1.31's CPU
``com.microsoft.MultiHeadAttention`` then returns NaN (measured), which the next layer's keys
and values carry into real rows. Raised to ``finite_fill`` the row averages its values
instead; every row with a visible key is unchanged (its hidden keys' probabilities underflow
to 0 either way). One elementwise pass over the [batch, 1, q_len, kv_len] bias the kernel
reads anyway. A pass, not a pattern rule: the op may also return past/present state, and
only its bias input changes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mha_deploy.exporters.fusion.contrib_mha import ATTENTION_BIAS, optional_input
from mha_deploy.exporters.fusion.mask_analysis import finite_fill

# contrib ops whose input 5 is attention_bias
_OPS = {"MultiHeadAttention", "Attention"}
_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def _bounded(bias: ir.Value) -> bool:
    producer = bias.producer()
    return producer is not None and producer.op_type == "Max" and producer.domain == ""


def fuse_finite_bias(model: ir.Model) -> int:
    """Bound every contrib attention op's float attention_bias below in ``model``; the number of ops changed."""
    count = 0
    for node in list(model.graph.all_nodes()):
        if node.op_type not in _OPS or node.domain != "com.microsoft":
            continue
        bias = optional_input(node, ATTENTION_BIAS)
        if bias is None or bias.dtype not in _FLOATS or _bounded(bias):
            continue
        dtype = bias.dtype.numpy()
        lowest = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(finite_fill(-np.inf, dtype),
                                                                                     dtype)))])
        bounded = ir.Node("", "Max", [bias, lowest.outputs[0]])
        bounded.outputs[0].dtype, bounded.outputs[0].shape = bias.dtype, bias.shape
        node.graph.insert_before(node, [lowest, bounded])
        node.replace_input_with(ATTENTION_BIAS, bounded.outputs[0])
        count += 1
    return count
