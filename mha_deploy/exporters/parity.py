"""torch reference vs ONNX Runtime on shapes the export never saw.

Parity is judged on real query positions only: a padded query row of the
reference is padding, never returned to users, and fused kernels may legally
compute something else there. Every position, padded or not, must be finite.
"""

from __future__ import annotations

import numpy as np
import torch

from mha_deploy.compare import Comparison, compare_outputs
from mha_deploy.inputs import PADDING_SIDES, InputCase, make_inputs, padding_mask, real_query_rows
from mha_deploy.metadata import ParityReport, Signature
from mha_deploy.runtime.session import MHASession

DEFAULT_ATOL, DEFAULT_RTOL = 1e-5, 1e-4
# The name parity has always used for a generated shape.
ParityCase = InputCase
__all__ = [
    "DEFAULT_ATOL", "DEFAULT_RTOL", "PADDING_SIDES", "ParityCase", "check_parity", "default_cases", "make_inputs",
    "padding_mask", "real_query_rows", "torch_reference",
]


# Different from the tracing sizes (2, 3, 5), with batch 1 / length 1, lengths
# that are not multiples of 8, one sequence >= 256, and both padding sides.
SELF_CASES = (
    ParityCase(1, 1, 1, "none"),
    ParityCase(3, 17, 17, "right"),
    ParityCase(4, 41, 41, "left"),
    ParityCase(2, 300, 300, "mixed"),
)
CROSS_CASES = (
    ParityCase(1, 1, 1, "none"),
    ParityCase(3, 17, 9, "right"),
    ParityCase(4, 6, 41, "left"),
    ParityCase(2, 259, 300, "mixed"),
)


def default_cases(signature: Signature) -> tuple[ParityCase, ...]:
    return SELF_CASES if len(signature.sequence_axes) == 1 else CROSS_CASES


def torch_reference(module: torch.nn.Module, signature: Signature, feeds: dict[str, np.ndarray]) -> dict:
    with torch.no_grad():
        result = module(*(torch.from_numpy(feeds[name]) for name in signature.input_names))
    result = result if isinstance(result, tuple) else (result,)
    return {name: tensor.float().numpy() for name, tensor in zip(signature.output_names, result, strict=True)}


def check_parity(
    module: torch.nn.Module,
    session: MHASession,
    cases: tuple[ParityCase, ...] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
    rel_budget: float | None = None,
) -> ParityReport:
    """Run ``module`` (torch, eager) and ``session`` (ORT) on each case and compare.

    Each real query position must satisfy ``|actual - ref| <= atol + rtol * |ref|``;
    with ``rel_budget`` (quantized models) the test is instead
    ``||actual - ref|| / ||ref|| <= rel_budget`` per output and shape.
    """
    signature = session.signature
    cases = cases or default_cases(signature)
    # The reference stays fp32: a half-precision model is judged against full precision.
    model_dtype = session.metadata.dtype
    comparisons: list[Comparison] = []
    failures: list[str] = []
    for index, case in enumerate(cases):
        feeds = make_inputs(signature, session.metadata.d_model, case, seed + index)
        expected = torch_reference(module, signature, feeds)
        actual = session.run({k: v.astype(model_dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()})
        rows = real_query_rows(signature, feeds)
        for comparison in compare_outputs(signature, actual, expected, rows, atol, rtol, rel_budget):
            comparisons.append(comparison)
            if not comparison.passed:
                failures.append(f"{case.label(signature)}: {comparison.summary()}")
    return ParityReport(
        passed=not failures,
        atol=atol,
        rtol=rtol,
        max_abs_err=max(c.max_abs_err for c in comparisons),
        required_atol=max(c.required_atol for c in comparisons),
        required_rtol=max(c.required_rtol for c in comparisons),
        shapes=[case.label(signature) for case in cases],
        failures=failures,
        rel_err=max(c.rel_err for c in comparisons),
        rel_budget=rel_budget,
    )
