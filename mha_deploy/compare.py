"""The one comparator: outputs against a reference, on real rows. numpy only.

Used by export-time parity, the bench (every row's error against torch), the
fp16 and int8 budgets, and the tests. Per output it reports max and mean
absolute and relative error, the relative error of the whole tensor, and the
smallest atol (at the given rtol) and rtol (at the given atol) that would have
passed, so a failure says how far off it was.

With ``atol_per_row`` (export-time parity's default) atol is in units of each
output row's magnitude: an element passes when ``|a - r| <= atol * s + rtol *
|r|``, ``s`` the largest ``|r|`` over its row (the last axis), at least 1.
fp32 rounding grows with the magnitudes a value is summed from, not with the
value itself: a logit near 0 in a row of logits in the hundreds carries the
row's rounding (docs/export.md, "The default tolerance").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.signature import Signature

# Below this |reference| a relative error says nothing (division by ~0).
_TINY = 1e-30


@dataclass
class Comparison:
    """One output compared with its reference (float64 statistics over its real rows)."""

    name: str
    atol: float
    rtol: float
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float  # max |a - r| / |r| over elements with |r| > 0
    mean_rel_err: float
    rel_err: float  # ||a - r|| / ||r||: the whole tensor's relative error
    required_atol: float  # smallest atol that passes at this rtol
    required_rtol: float  # smallest rtol that passes at this atol (inf if some |r| == 0 needs it)
    finite: bool  # every position (real or padding) is finite
    rel_budget: float | None = None  # when set, passing means rel_err <= rel_budget
    # Every compared reference element is finite: a NaN there compares as no error at all (NaN > x is False).
    reference_finite: bool = True
    # atol (and required_atol) in units of each row's magnitude: max |reference| over the last axis, at least 1.
    atol_per_row: bool = False
    # Logits outputs (``is_logits``): how many of the compared rows (last axis) there are, and in how many the
    # argmax is the reference's. Quantized models report the share (top-1 agreement) beside their error.
    top1_rows: int = 0
    top1_agree: int = 0

    @property
    def passed(self) -> bool:
        if not self.finite or not self.reference_finite:
            return False
        if self.rel_budget is not None:
            return self.rel_err <= self.rel_budget
        return self.required_atol <= self.atol

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        if not self.finite:
            return f"{self.name}: FAILED | non-finite values"
        if not self.reference_finite:
            return f"{self.name}: FAILED | the reference has non-finite values on real rows"
        if self.rel_budget is not None:
            return (
                f"{self.name}: {verdict} | relative error {self.rel_err:.3%} (budget {self.rel_budget:.1%}), "
                f"max abs err {self.max_abs_err:.3g}"
            )
        tolerance = tolerance_words(self.atol, self.rtol, self.atol_per_row)
        return (
            f"{self.name}: {verdict} | max abs err {self.max_abs_err:.3g}, mean {self.mean_abs_err:.3g}; "
            f"max rel err {self.max_rel_err:.3g} (tolerance {tolerance}; "
            f"would pass with atol >= {self.required_atol:.3g} or rtol >= {self.required_rtol:.3g})"
        )


def tolerance_words(atol: float, rtol: float, atol_per_row: bool) -> str:
    """``atol=1e-05 x row scale rtol=0.0001``: the tolerance as the comparison applied it."""
    return f"atol={atol:g}{' x row scale' if atol_per_row else ''} rtol={rtol:g}"


def is_logits(name: str) -> bool:
    """Whether output ``name`` holds scores whose argmax over the last axis is a prediction (a token, a class):
    named as transformers and Optimum name them (``logits``, ``start_logits``)."""
    return "logits" in name.lower()


def row_scale(reference: np.ndarray) -> np.ndarray:
    """|reference| [..., n] -> [..., 1]: the largest magnitude of each row (the last axis), at least 1. A vector
    holds one value per item (a per-item score, a per-token one on real rows): each is its own row."""
    if reference.ndim <= 1:
        return np.maximum(1.0, reference)
    return np.maximum(1.0, reference.max(axis=-1, keepdims=True))


def _row_axis(signature: Signature, name: str, rows: Mapping[str, np.ndarray]) -> str | None:
    """The axis along which output ``name``'s rows are real or padding: its first length axis that ``rows``
    covers (an attention's weights [batch, heads, q, kv]: q); None for an output without one (a custom model's
    per-item output: every row of it is real)."""
    return next((axis for axis in signature.tensors[name].axes[1:] if axis in rows), None)


def _rows_first(signature: Signature, name: str, array: np.ndarray, axis: str) -> np.ndarray:
    """Move the output's row ``axis`` next to batch, so that [batch, length] rows index it."""
    return np.moveaxis(np.asarray(array), signature.tensors[name].axes.index(axis), 1)


def compare_arrays(
    name: str,
    actual: np.ndarray,
    expected: np.ndarray,
    atol: float,
    rtol: float,
    rel_budget: float | None = None,
    atol_per_row: bool = False,
) -> Comparison:
    """Compare two arrays of the same shape (already restricted to the positions that matter); with
    ``atol_per_row``, atol counts in units of each row's magnitude (``row_scale``)."""
    finite = bool(np.isfinite(actual).all())
    actual64, expected64 = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual64.shape != expected64.shape:
        raise InputError(f"{name}: shape {actual64.shape} differs from the reference's {expected64.shape}")
    abs_err = np.abs(actual64 - expected64)
    reference = np.abs(expected64)
    reference_finite = bool(np.isfinite(expected64).all())
    if abs_err.size == 0:
        return Comparison(name, atol, rtol, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, finite, rel_budget,
                          atol_per_row=atol_per_row)
    top1_rows = top1_agree = 0
    if is_logits(name) and expected64.ndim >= 1 and expected64.shape[-1] > 1:
        top1_rows = expected64.size // expected64.shape[-1]
        top1_agree = int((actual64.argmax(axis=-1) == expected64.argmax(axis=-1)).sum())
    nonzero = reference > _TINY
    rel = abs_err[nonzero] / reference[nonzero]
    scale = row_scale(reference) if atol_per_row else 1.0
    excess = abs_err - atol * scale
    over = excess > 0
    if not over.any():
        required_rtol = 0.0
    elif (reference[over] <= _TINY).any():
        required_rtol = float("inf")
    else:
        required_rtol = float((excess[over] / reference[over]).max())
    return Comparison(
        name=name,
        atol=atol,
        rtol=rtol,
        max_abs_err=float(abs_err.max()),
        mean_abs_err=float(abs_err.mean()),
        max_rel_err=float(rel.max()) if rel.size else 0.0,
        mean_rel_err=float(rel.mean()) if rel.size else 0.0,
        rel_err=float(np.linalg.norm(abs_err) / max(float(np.linalg.norm(expected64)), _TINY)),
        required_atol=float(max(0.0, ((abs_err - rtol * reference) / scale).max())),
        required_rtol=required_rtol,
        finite=finite,
        rel_budget=rel_budget,
        reference_finite=reference_finite,
        atol_per_row=atol_per_row,
        top1_rows=top1_rows,
        top1_agree=top1_agree,
    )


def compare_outputs(
    signature: Signature,
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    rows: Mapping[str, np.ndarray] | np.ndarray | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    rel_budget: float | None = None,
    names: Iterable[str] | None = None,
    atol_per_row: bool = False,
) -> list[Comparison]:
    """Compare each output (default: every output of ``signature``) on its real rows: ``rows`` maps each length
    axis to its real positions, bool [batch, length] (``inputs.real_rows``), and an output is compared on the
    real positions of its own length axis (an encoder-decoder's encoder states by the source's mask, its logits
    by the target's); a bare array is the query axis's. ``atol_per_row`` as for ``compare_arrays`` (a row there
    is an output's last axis).

    Padded rows are never returned to users (a runner cuts each item's outputs to its real lengths), so only
    their finiteness is checked.
    """
    if rows is not None and not isinstance(rows, Mapping):
        rows = {signature.query_axis: rows}
    results = []
    for name in names or signature.output_names:
        got, want = np.asarray(actual[name]), np.asarray(expected[name])
        got_real, want_real = got, want
        axis = _row_axis(signature, name, rows) if rows is not None else None
        if axis is not None:
            real = rows[axis]
            got_real = _rows_first(signature, name, got, axis)[real]
            want_real = _rows_first(signature, name, want, axis)[real]
        comparison = compare_arrays(name, got_real, want_real, atol, rtol, rel_budget, atol_per_row)
        comparison.finite = bool(np.isfinite(got).all())
        results.append(comparison)
    return results
