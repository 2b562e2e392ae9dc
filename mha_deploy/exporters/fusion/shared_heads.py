"""A head-split ``Transpose`` that several attentions' MatMuls read -> one copy per MatMul.

Why this pass exists: upstream's SDPA fusion replaces an attention's nodes only
when nothing else reads them ("Matched nodes have other uses preventing
replacement"). When two attentions read the same keys and values (torch's
``nn.TransformerDecoder`` over a memory that is its own input, with layers cloned
from one, as built before training: the exporter's optimizer merges their equal
key/value projections), their head-split Transpose is shared and neither fuses.
A copy per reader costs one transpose of the keys per attention until fusion,
after which the fused ops read the projections without it.
"""

from __future__ import annotations

import onnx_ir as ir


def unshare_head_transposes(model: ir.Model) -> int:
    """Give each MatMul reading a shared Transpose its own copy; the number of copies made."""
    copies = 0
    for node in list(model.graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        uses = list(node.outputs[0].uses())
        if len(uses) < 2 or node.outputs[0].is_graph_output() or any(u.node.op_type != "MatMul" for u in uses):
            continue
        for use in uses[1:]:
            copy = ir.Node(
                node.domain, "Transpose", inputs=node.inputs, attributes=list(node.attributes.values()),
                name=f"{node.name}_copy{copies}",
            )
            copy.outputs[0].dtype, copy.outputs[0].shape = node.outputs[0].dtype, node.outputs[0].shape
            model.graph.insert_after(node, copy)
            use.node.replace_input_with(use.idx, copy.outputs[0])
            copies += 1
    return copies
