"""The one comparator: with atol per row (export-time parity), an element's absolute tolerance grows with the
magnitude of its output row, which is what fp32 rounding does; rows of magnitude below 1 keep the absolute atol."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.compare import compare_arrays, row_scale

ATOL, RTOL = 1e-5, 1e-4


def _logits(error: float) -> tuple[np.ndarray, np.ndarray]:
    """A row of logits in the hundreds with one near 0, and the same with ``error`` added to that one: the
    rounding of an exact fp32 export lands there as on any element of the row."""
    expected = np.array([[200.0, -150.0, 0.001, 75.0]], np.float32)
    actual = expected.copy()
    actual[0, 2] += error
    return actual, expected


@pytest.mark.parametrize(
    ("error", "per_row", "passed"),
    [
        (6e-5, False, False),  # absolute: 6e-5 > 1e-5 + 1e-4 * 0.001, an exact export refused
        (6e-5, True, True),  # per row: 6e-5 <= 1e-5 * 200
        (3e-3, True, False),  # 3e-3 > 1e-5 * 200: a real error
    ],
    ids=["rounding-absolute", "rounding-per-row", "real-error-per-row"],
)
def test_atol_per_row_scales_with_the_rows_magnitude(error, per_row, passed):
    actual, expected = _logits(error)
    comparison = compare_arrays("logits", actual, expected, ATOL, RTOL, atol_per_row=per_row)
    assert comparison.passed == passed
    # required_atol is in the tolerance's own units: per row, the error over the row's largest |value|.
    assert comparison.required_atol == pytest.approx((error - RTOL * 0.001) / (200.0 if per_row else 1.0), rel=1e-2)
    assert ("x row scale" in comparison.summary()) == per_row


@pytest.mark.parametrize(
    ("reference", "scale"),
    [
        ([[0.5, -0.25], [300.0, 1.0]], [[1.0], [300.0]]),  # at least 1: small rows keep the absolute atol
        ([[-40.0, 2.0]], [[40.0]]),  # magnitudes, whatever the sign
        ([3.0, 0.1], [3.0, 1.0]),  # a vector holds one value per item: each its own row
    ],
)
def test_row_scale_is_the_largest_magnitude_of_each_row_at_least_one(reference, scale):
    np.testing.assert_array_equal(row_scale(np.abs(np.array(reference))), np.array(scale))


def test_a_nan_reference_fails_instead_of_comparing_as_no_error():
    comparison = compare_arrays("out", np.zeros((1, 2)), np.array([[np.nan, 0.0]]), ATOL, RTOL, atol_per_row=True)
    assert comparison.finite and not comparison.reference_finite and not comparison.passed
    assert "the reference has non-finite values on real rows" in comparison.summary()
