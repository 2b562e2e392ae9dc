"""What one rewrite of a ragged file's ``GroupQueryAttention`` ops did, op by op: the record every such pass returns
(``fusion.rotary_gqa``'s rotary moved into the op, ``fusion.qkv_packing``'s q/k/v on one projection,
``fusion.head_round_trip``'s output split and merged back removed).

Why one record: the export says each pass's refusals in one line alike, and, where the ragged file fails parity
with the passes applied, retries it without those that did something (``rotary_gqa.fuse_into_gqa_checked``), which
it can only do if every pass says the same things the same way: its name, how many attentions it looked at, how many
it rewrote, why each other one was left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass


@dataclass
class AttentionRewriteReport:
    """``rewrite`` (the pass, as a line names it) done on ``done`` of the ``attentions`` it looked at, and one
    ``"node: why"`` per attention it left as it was (a pass that has nothing to say, say a chain that is simply not
    there, refuses nothing)."""

    rewrite: str
    attentions: int = 0
    done: int = 0
    refused: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line, e.g. ``rotary in the op (do_rotary): 2 of 2 GroupQueryAttention``, with the first reason an
        attention was left as it was and how many more were."""
        line = f"{self.rewrite}: {self.done} of {self.attentions} GroupQueryAttention"
        if not self.refused:
            return line
        more = f" (and {len(self.refused) - 1} more)" if len(self.refused) > 1 else ""
        return f"{line}; left as it was: {self.refused[0]}{more}"


def rewritten(model: onnx.ModelProto, ir_model: ir.Model,
              report: AttentionRewriteReport) -> tuple[onnx.ModelProto, AttentionRewriteReport]:
    """What a pass returns: ``ir_model`` (``model`` as the pass changed it) with the nodes it left unread removed,
    sorted and serialized, and ``report``; ``model`` itself where the pass rewrote nothing."""
    if not report.done:
        return model, report
    RemoveUnusedNodesPass()(ir_model)
    ir_model.graph.sort()
    return ir.serde.serialize_model(ir_model), report
