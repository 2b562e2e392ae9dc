"""Causal contrib MHA -> ``com.microsoft.GroupQueryAttention`` (kv_num_heads = num_heads), padding compacted.

Why this rule exists: ORT's CPU ``MultiHeadAttention`` with ``unidirectional=1``
falls back to a kernel that computes and stores every [batch, heads, q, kv]
score, masked half included. ``GroupQueryAttention`` is always causal and, since
ORT 1.31, runs a tiled flash kernel on CPU that skips the key blocks above the
diagonal and never holds the [q, kv] matrix (MLAS ``flashattn_gqa.cpp``).
Measured at (1,4096), d_model 512, 8 heads, 2 threads: GQA 137 ms against 276
for MHA unidirectional and 181 for MHA's mask-free flash path; equal to MHA
unidirectional within 7e-7. With ``kv_num_heads == num_heads`` it is plain
multi-head attention. Its inputs differ: no projection ``bias`` (of the one
``mha_bias`` folded in, the query's is added back, the key's dropped and the
value's added to the output, as in ``short_sequence``), ``seqlens_k`` (real length - 1
per batch row, int32 [batch]) and ``total_sequence_length`` (int32 scalar).
GQA needs head_size to be a multiple of 8.

Padding: ``seqlens_k`` can only say "the first n keys are real" (right padding),
while the contract allows left and mixed padding. An attention has no positions:
under a causal mask a real query's output depends only on the real keys at or
before it, in their order. So the real tokens of each row are moved to the
front in order (padding after them, in order; ``compaction.real_first``) and
moved back after the op, which is exact for every real query, whatever the
padding side. This needs the padding mask to mark the queries' positions too
(self-attention: q_len is kv_len, one sequence, which the causal flag already
implies here), as the export's contract has it; a padded query row's output is then finite but not the
reference's (it sees the real keys of its row and no padding), as the parity
contract allows. ``seqlens_k`` = max(count - 1, 0): GQA rejects -1, and a row
without any real token only has to stay finite. The compacted tokens are cut to
the longest row's count before the op (the positions after it are padding in
every row; their outputs are zeros), so a padded batch's GQA runs over its real
length; and the whole compaction sits under ``If(any token padded)``: batch 1 and
equal-length buckets run GQA on the tokens as they are, without the four
gathers (measured at 8x128: 8.3 vs 8.9 ms for the whole block, and at 1x4096
with a quarter padded 109 vs 132 ms, in one run of ``mha-deploy bench --mask
padding-causal,padding-causal-25%`` with the previous export as the extra file).

Kernel by size: ORT 1.31's CPU GQA has two paths for one op. Asked for
``present_key``/``present_value`` it runs the tiled flash kernel; without them it
computes and stores the [batch, heads, q, kv] probabilities, which is about twice
as fast on short sequences and slower on long ones. GQA op alone, d_model 512,
8 heads, 2 threads, fp32, medians of interleaved blocks (materialising vs tiled,
ms): (8,128) 2.6 vs 5.2, (32,64) 5.0 vs 8.0, (1,1024) 9.8 vs 20.1, (2,1024)
21.3 vs 41.5, (4,1024) 47 vs 85, (1,2048) 44 vs 53, (2,2048) 87 vs 105,
(1,3072) 95 vs 100, (1,4096) 179 vs 144; the materialising run adds about 1.1x
the score bytes to the process's peak (77 MB at (2,1024), 289 MB at (2,2048),
1.1 GB at (2,4096) against 70 MB tiled). So the op goes under an ``If`` on
``batch * heads * seq * seq * itemsize <= MATERIALISE_MAX_BYTES``: then GQA
without presents, else GQA with them. Both run the same op on the same inputs,
so the output is the same either way. The gain per byte is not a function of
the bytes alone: 128 MB is (4,1024), 1.8x faster materialised, and (1,2048),
1.2x. 64 MB admits only shapes that measured at least 1.9x faster, and bounds
what a run can add to about 75 MB.

CUDA: ORT 1.31 registers GroupQueryAttention for float16 and bfloat16 only on
the CUDA provider (the kernels the installed libonnxruntime_providers_cuda.so
instantiates), so an fp32 model runs this op on the CPU provider there.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._context import TapeBuilder

from mha_deploy.exporters.fusion.compaction import any_padded, cut, gather_rows, int64, longest, real_first
from mha_deploy.exporters.fusion.contrib_mha import (
    ATTENTION_BIAS,
    BIAS,
    KEY_PADDING_MASK,
    ContribMHARule,
    has_inputs_from,
    move_bias_out,
    optional_input,
)
from mha_deploy.exporters.fusion.mask_analysis import dims_match
from mha_deploy.exporters.fusion.op_branches import op_branch, score_bytes, tag_kernel, tape_branch

# GQA's CPU and CUDA kernels both reject other head sizes.
HEAD_SIZE_MULTIPLE = 8
_GQA_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
# Largest [batch, heads, seq, seq] score tensor for which GQA runs its materialising path (module docstring).
MATERIALISE_MAX_BYTES = 64 * 2**20


class CausalGQA(ContribMHARule):
    def __init__(self, materialise_max_bytes: int = MATERIALISE_MAX_BYTES) -> None:
        super().__init__()
        self.materialise_max_bytes = materialise_max_bytes

    def check(self, context, query, key, value, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        if not node.attributes.get_int("unidirectional", 0):
            return result.fail("the op is not causal", node)
        if len(node.outputs) != 1:
            return result.fail("the op also returns past/present state", node)
        if has_inputs_from(node, ATTENTION_BIAS):
            return result.fail("the op has an attention_bias or past state", node)
        for value_ in (query, key, value):
            if value_ is None or value_.shape is None or value_.shape.rank() != 3:
                return result.fail("query/key/value must be 3-D [batch, seq, hidden]", node)
        batch, q_len, hidden = query.shape
        # Causal over one sequence: "key <= query" needs query i and key i to be the same position.
        if not (dims_match(key, [batch, q_len, hidden]) and dims_match(value, [batch, q_len, hidden])):
            return result.fail("key/value are not [batch, q_len, hidden] like the query (not self-attention)", key)
        num_heads = node.attributes.get_int("num_heads", 0)
        if not isinstance(hidden, int) or num_heads <= 0 or hidden % num_heads:
            return result.fail("hidden size unknown or not divisible by num_heads", query)
        if (hidden // num_heads) % HEAD_SIZE_MULTIPLE:
            return result.fail(f"head size {hidden // num_heads} is not a multiple of {HEAD_SIZE_MULTIPLE}", query)
        if query.dtype not in _GQA_DTYPES:
            return result.fail(f"GroupQueryAttention takes float32/float16, not {query.dtype}", query)
        bias = optional_input(node, BIAS)
        if bias is not None and not dims_match(bias, [3 * hidden]):
            return result.fail("bias is not [3 * hidden]", bias)
        mask = optional_input(node, KEY_PADDING_MASK)
        if mask is not None and not dims_match(mask, [batch, q_len]):
            return result.fail("key_padding_mask is not [batch, seq]", mask)
        return result

    def rewrite(self, op, query, key, value, attention, **_):
        node = attention.producer()
        num_heads = node.attributes.get_int("num_heads")
        attributes = {"num_heads": num_heads, "kv_num_heads": num_heads}
        if (scale := node.attributes.get_float("scale", None)) is not None:
            attributes["scale"] = scale
        q, k, v = query, key, value
        value_bias = None
        if (bias := optional_input(node, BIAS)) is not None:
            q, value_bias = move_bias_out(op, query, bias)
        base = attention.name or "attention"
        mask = optional_input(node, KEY_PADDING_MASK)
        kernel = gqa_kernel(compacted=mask is not None, max_bytes=self.materialise_max_bytes)
        if mask is None:
            output = tag_kernel(self._gqa(op, q, k, v, _full_length(op, q), attributes, attention, base), kernel)
        else:
            # Nothing padded (batch 1, equal-length buckets): GQA on the tokens as they are, no gathers.
            full = TapeBuilder()
            full_output = self._gqa(full, q, k, v, _full_length(full, q), attributes, attention, f"{base}_full")
            output = op.If(
                any_padded(op, mask),
                then_branch=self._compacted(q, k, v, mask, attributes, attention, f"{base}_compacted"),
                else_branch=tape_branch(full, full_output, attention, f"{base}_full"),
            )
            tag_kernel(output, kernel)
        return output if value_bias is None else op.Add(output, value_bias)

    def _compacted(self, q, k, v, mask, attributes, attention: ir.Value, name: str) -> ir.Graph:
        """The padded case: real tokens first, cut to the longest row's count, GQA, and back in place; the
        positions past the cut (padding in every row) get zeros."""
        op = TapeBuilder()
        compaction = real_first(op, mask)
        # Made for CUDA (no materialising): no cut, and total_sequence_length from the mask's Shape. On an H200
        # (ORT 1.31) the cut's length, computed from the mask's values on the device, reached CUDA's GQA as "Flash
        # total sequence length must be positive and fit int32" (it is >= 1); GQA reads that input on the host,
        # and a Shape is computed there. Padded positions then stay in the op, masked by seqlens_k.
        length = longest(op, compaction) if self.materialise_max_bytes else op.Squeeze(op.Shape(mask, start=1, end=2))
        src = cut(op, compaction.src, length)
        q, k, v = (gather_rows(op, x, src) for x in (q, k, v))
        # seqlens_k = max(count - 1, 0): GQA rejects -1, and a row without any real token only has to stay finite.
        last = op.Max(op.Sub(op.Squeeze(compaction.count, int64(op, [1])), int64(op, 1)), int64(op, 0))
        seqlens, total = op.Cast(last, to=ir.DataType.INT32), op.Cast(length, to=ir.DataType.INT32)
        compact = self._gqa(op, q, k, v, (seqlens, total), attributes, attention, name, cut_shape=True)
        # [batch, length, hidden] -> [batch, seq, hidden]: zero rows after the cut, then every token in place
        beyond = op.Sub(op.Shape(mask, start=1, end=2), op.Unsqueeze(length, int64(op, [0])))
        zero = int64(op, [0])
        pads = op.Concat(zero, zero, zero, zero, beyond, zero, axis=0)
        output = gather_rows(op, op.Pad(compact, pads), compaction.dest)
        return tape_branch(op, output, attention, name)

    def _gqa(self, op, q, k, v, lengths, attributes, attention: ir.Value, name: str, cut_shape=False) -> ir.Value:
        """If(scores small) GQA materialising them, else GQA tiled: the present_key/present_value outputs,
        unused, are what makes ORT 1.31's CPU kernel take its flash path (module docstring). ``lengths`` is
        GQA's (seqlens_k, total_sequence_length). With ``materialise_max_bytes`` 0, GQA tiled alone: ORT's CUDA
        kernel (1.31) refuses a GQA without present_key/present_value ("required unless borrowing a non-quantized
        KV cache"), so files made for CUDA (fp16) never take the materialising path, a CPU speed-up."""
        seqlens, total = lengths
        inputs = [q, k, v, None, None, seqlens, total]
        # The cut output's length is the longest row's, not the model's seq.
        known = cut_shape and attention.shape is not None and attention.shape.rank() == 3
        shape = ir.Shape([attention.shape[0], None, attention.shape[2]]) if known else None

        def gqa(kind: str, outputs: int) -> ir.Graph:
            return op_branch(
                "com.microsoft", "GroupQueryAttention", inputs, attributes, f"{name}_{kind}", attention, outputs, shape
            )

        max_bytes = self.materialise_max_bytes
        if not max_bytes:
            output = op.GroupQueryAttention(*inputs, _domain="com.microsoft", _outputs=3, **attributes)[0]
            output.dtype, output.shape = attention.dtype, shape if shape is not None else attention.shape
            return output
        # the check made sure the dtype is known
        scores = score_bytes(op, q, k, attributes["num_heads"], attention.dtype.itemsize)
        small = op.LessOrEqual(scores, int64(op, max_bytes))
        return op.If(small, then_branch=gqa("gqa_materialised", 1), else_branch=gqa("gqa_tiled", 3))


def gqa_kernel(compacted: bool, max_bytes: int) -> str:
    """What this rule's If runs on ORT's CPU provider: GQA materialising scores up to ``max_bytes``, tiled beyond;
    ``compacted`` when a padding mask's padded tokens are moved out first."""
    compaction = ", padded tokens compacted out: any padding side" if compacted else ""
    if not max_bytes:
        return f"GroupQueryAttention (causal{compaction}; tiled)"
    return f"GroupQueryAttention (causal{compaction}; scores materialised up to {max_bytes / 2**20:g} MB, tiled beyond)"


def _full_length(op, query: ir.Value) -> tuple[ir.Value, ir.Value]:
    """GQA's (seqlens_k, total_sequence_length) when every row is full length: seq - 1 each, and seq."""
    seq = op.Shape(query, start=1, end=2)
    seqlens = op.Cast(op.Expand(op.Sub(seq, int64(op, 1)), op.Shape(query, start=0, end=1)), to=ir.DataType.INT32)
    return seqlens, op.Cast(op.Squeeze(seq), to=ir.DataType.INT32)


def causal_gqa_rules_with(materialise_max_bytes: int) -> pattern.RewriteRuleSet:
    """The rule, with GQA materialising scores of up to ``materialise_max_bytes`` (tests cross it on small shapes)."""
    return pattern.RewriteRuleSet([CausalGQA.rule(materialise_max_bytes)])


causal_gqa_rules = causal_gqa_rules_with(MATERIALISE_MAX_BYTES)


def fuse_causal_gqa(model: ir.Model, materialise: bool = True) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites. ``materialise`` False: GQA tiled only, the
    form ORT's CUDA provider runs (fp16 exports)."""
    return (causal_gqa_rules if materialise else causal_gqa_rules_with(0)).apply_to_model(model)
