"""Small torch models written the way users write attention, exported as torch exports them, and the
checks the end-to-end fusion tests share.

Each model takes ``x`` [batch, seq, D_MODEL] and ``pad`` [batch, seq] (nonzero = real token) and builds its
mask from them in user code. Exports are cached: one export costs about a second.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import warnings
from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from mha_deploy.exporters.fusion import FusionReport, fuse_attention
from mha_deploy.model_report import all_nodes
from tests.exporters.fusion import hand_graphs as hg

D_MODEL, HEADS = 32, 4
# Tracing sizes: batch != seq, both >= 2, so that torch.export keeps both dynamic.
TRACE_BATCH, TRACE_SEQ = 2, 5
# Parity feeds: a length the export never saw.
BATCH, SEQ = 3, 7
# The fused graph against the plain one, both in ORT (fp32): same math in another order.
ATOL, RTOL = 1e-5, 1e-4


class UserAttention(nn.Module):
    """The reference attention: q/k/v/out projections, heads split with view + transpose, scores masked with
    ``masked_fill(mask == 0, -1e9)``; or ``F.scaled_dot_product_attention`` on the same heads."""

    def __init__(self, sdpa: dict | None = None):
        super().__init__()
        self.q_linear, self.k_linear, self.v_linear, self.out = (nn.Linear(D_MODEL, D_MODEL) for _ in range(4))
        self.sdpa = sdpa  # keyword arguments of F.scaled_dot_product_attention, None: the reference

    def forward(self, x, mask):
        b, s, _ = x.shape
        d_k = D_MODEL // HEADS
        q, k, v = (p(x).view(b, -1, HEADS, d_k).transpose(1, 2) for p in (self.q_linear, self.k_linear, self.v_linear))
        if self.sdpa is not None:
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.sdpa)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, -1e9)
            heads = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out(heads.transpose(1, 2).contiguous().view(b, s, -1))


class MaskedAttention(nn.Module):
    """``UserAttention`` over the mask ``build_mask(pad, seq_len)`` builds."""

    def __init__(self, build_mask: Callable, sdpa: dict | None = None):
        super().__init__()
        self.attention = UserAttention(sdpa)
        self.build_mask = build_mask

    def forward(self, x, pad):
        return self.attention(x, self.build_mask(pad, x.size(1)))


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)`` with torch's ``key_padding_mask`` (True = padded)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.causal = causal

    def forward(self, x, pad):
        s = x.size(1)
        future = torch.triu(torch.ones(s, s, dtype=torch.bool), 1) if self.causal else None
        return self.attention(x, x, x, key_padding_mask=~pad, attn_mask=future, need_weights=False)[0]


def tril(s: int) -> torch.Tensor:
    return torch.tril(torch.ones(s, s, dtype=torch.bool))


def exported(name: str, factory: Callable[[], nn.Module], pad_dtype: torch.dtype = torch.bool) -> onnx.ModelProto:
    """The plain ONNX graph of ``factory()`` (cached under ``name``), as ``torch.onnx.export(dynamo=True)`` at
    opset 23 writes it, batch and seq dynamic."""
    return module_and_export(name, factory, pad_dtype)[1]


@functools.cache
def module_and_export(
    name: str, factory: Callable[[], nn.Module], pad_dtype: torch.dtype = torch.bool
) -> tuple[nn.Module, onnx.ModelProto]:
    """``exported``, with the module it was exported from."""
    torch.manual_seed(0)
    module = factory().eval()
    x = torch.randn(TRACE_BATCH, TRACE_SEQ, D_MODEL)
    pad = torch.ones(TRACE_BATCH, TRACE_SEQ, dtype=pad_dtype)
    axes = {0: Dim("batch"), 1: Dim("seq")}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            module, (x, pad), dynamo=True, opset_version=23, dynamic_shapes=(axes, axes), input_names=["x", "pad"]
        )
    return module, program.model_proto


def feeds(model: onnx.ModelProto, side: str, pad_dtype=np.bool_, real_value=1) -> tuple[dict, np.ndarray]:
    """(feeds for ``model``'s inputs, the bool real-token rows) with padding on ``side``; real tokens of the
    pad input hold ``real_value`` (0.5: a float mask that a cast to an integer would truncate)."""
    real = hg.padding_sides(BATCH, SEQ, side, seed=1)
    values = {"x": hg.normal((BATCH, SEQ, D_MODEL), 2), "pad": np.where(real, real_value, 0).astype(pad_dtype)}
    return {i.name: values[i.name] for i in model.graph.input}, real


def fuse(model: onnx.ModelProto, target: str = "mha") -> tuple[onnx.ModelProto, FusionReport]:
    fused, report = fuse_attention(model, target)
    assert report.complete, report.summary()
    assert not [n for n in all_nodes(fused.graph) if n.op_type == "Softmax"], "an attention Softmax is left"
    return fused, report


def assert_parity(plain: onnx.ModelProto, fused: onnx.ModelProto, pad_dtype=np.bool_, real_value=1, every_row=False):
    """The fused graph equals the plain one in ORT on left and right padding: on real rows (every row when the
    mask does not depend on padding), the others finite."""
    for side in ("left", "right"):
        inputs, real = feeds(plain, side, pad_dtype, real_value)
        hg.assert_same_outputs(plain, fused, inputs, atol=ATOL, rtol=RTOL, rows=None if every_row else real)


def assert_parity_with_torch(module: nn.Module, fused: onnx.ModelProto, every_row=False):
    """The fused graph in ORT equals ``module`` in torch on left and right padding (real rows, or every row
    when the mask does not depend on padding). For torch's own attention, whose plain export ORT 1.31 CPU
    cannot run with a [batch, 1, 1, seq] mask ("inconsistent q_sequence_length"), this is the reference."""
    for side in ("left", "right"):
        inputs, real = feeds(fused, side)
        with torch.no_grad():
            args = [torch.from_numpy(inputs.get(name, np.ones((BATCH, SEQ), bool))) for name in ("x", "pad")]
            want = module(*args).numpy()
        (got,) = hg.run(fused, inputs).values()
        rows = np.ones_like(real) if every_row else real
        # Real rows only: with torch's -inf fill a padded query that sees no real key is NaN, in torch too.
        assert np.isfinite(got[rows]).all(), f"{int((~np.isfinite(got[rows])).sum())} elements are not finite"
        got, want = np.where(rows[..., None], got, 0), np.where(rows[..., None], want, 0)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
