"""The one comparator: with atol per row (export-time parity), an element's absolute tolerance grows with the
magnitude of its output row, which is what fp32 rounding does; rows of magnitude below 1 keep the absolute atol.
Each output is compared on the real rows of its own length axis: an encoder-decoder's encoder states by the
source's mask, its logits by the target's."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.compare import compare_arrays, compare_outputs, row_scale
from mha_deploy.inputs import real_rows
from mha_deploy.signature import Signature, TensorSpec

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


# An encoder-decoder as a user declares it: source and target, each with its mask; logits along the target,
# encoder states along the source, a pooled vector per item.
SEQ2SEQ = Signature.custom(
    (TensorSpec("src", "tokens", "int64", ("batch", "src_seq"), vocab=9),
     TensorSpec("src_mask", "padding_mask", "bool", ("batch", "src_seq"), marks="src"),
     TensorSpec("tgt", "tokens", "int64", ("batch", "tgt_seq"), vocab=9),
     TensorSpec("tgt_mask", "padding_mask", "bool", ("batch", "tgt_seq"), marks="tgt")),
    (TensorSpec("logits", "output", "model", ("batch", "tgt_seq", 3)),
     TensorSpec("states", "output", "model", ("batch", "src_seq", 3)),
     TensorSpec("pooled", "output", "model", ("batch", 3))),
    ("src_seq", "tgt_seq"),
)


@pytest.mark.parametrize(
    ("output", "where", "passed"),
    [
        ("states", (1, 4), True),  # source position 4 of item 1 is padding: not compared
        ("states", (1, 1), False),  # a real source row
        ("states", (0, 4), False),  # item 0's source is 5 long: position 4 is real there
        ("logits", (1, 2), True),  # target position 2 of item 1 is padding (its source is real there)
        ("logits", (1, 1), False),
        ("pooled", (1, 0), False),  # one row per item: every row real
    ],
)
def test_each_output_is_compared_on_the_real_rows_of_its_own_axis(output, where, passed):
    feeds = {"src": np.zeros((2, 5), np.int64), "tgt": np.zeros((2, 3), np.int64),
             "src_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool),
             "tgt_mask": np.array([[1, 1, 1], [1, 1, 0]], bool)}
    rng = np.random.default_rng(0)
    expected = {"logits": rng.standard_normal((2, 3, 3)), "states": rng.standard_normal((2, 5, 3)),
                "pooled": rng.standard_normal((2, 3))}
    actual = {name: value.copy() for name, value in expected.items()}
    actual[output][where] += 1.0  # an error far over the tolerance, in one row
    rows = real_rows(SEQ2SEQ, feeds)
    assert sorted(rows) == ["src_seq", "tgt_seq"]
    comparisons = {c.name: c for c in compare_outputs(SEQ2SEQ, actual, expected, rows, ATOL, RTOL)}
    assert comparisons[output].passed == passed, comparisons[output].summary()
    assert all(c.passed for name, c in comparisons.items() if name != output)
    # a padded row is still held to being finite
    actual[output][where] = np.nan
    (nan,) = compare_outputs(SEQ2SEQ, actual, expected, rows, ATOL, RTOL, names=[output])
    assert not nan.finite and not nan.passed
