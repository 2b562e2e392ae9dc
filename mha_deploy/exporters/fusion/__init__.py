"""Graph passes that fuse each reference-MHA subgraph into one attention op.

One module per own rewrite rule (each says why upstream's
``onnxscript.rewriter.ort_fusions`` needs it); ``pipeline`` composes them with
the upstream fusions and says why an attention stayed unfused. ``mask_analysis``
(with ``mask_probe``, which runs a mask it cannot read by its ops) and
``constant_values`` are what the rules read the graph with; ``op_branches``
builds the If branches of the rules that choose between two copies of an op.
"""

from mha_deploy.exporters.fusion.pipeline import FUSION_TARGETS, FusedOp, FusionReport, fuse_attention

__all__ = ["FUSION_TARGETS", "FusedOp", "FusionReport", "fuse_attention"]
