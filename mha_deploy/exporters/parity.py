"""torch reference vs ONNX Runtime on shapes the export never saw.

Parity is judged on real query positions only: a padded query row of the
reference is padding, never returned to users, and fused kernels may legally
compute something else there. Every position, padded or not, must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mha_deploy.metadata import ParityReport, Signature
from mha_deploy.runtime.session import MHASession

DEFAULT_ATOL, DEFAULT_RTOL = 1e-5, 1e-4
PADDING_SIDES = ("none", "right", "left", "mixed")


@dataclass(frozen=True)
class ParityCase:
    batch: int
    q_len: int
    kv_len: int
    padding: str = "right"  # where padding goes when the model has a key_padding_mask

    def label(self, signature: Signature) -> str:
        one_sequence = signature.attention == "self"
        shape = f"{self.batch}x{self.q_len}" if one_sequence else f"{self.batch}x{self.q_len}x{self.kv_len}"
        return f"{shape}/{self.padding}" if signature.has_padding_mask and self.padding != "none" else shape


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
    return SELF_CASES if signature.attention == "self" else CROSS_CASES


def padding_mask(batch: int, kv_len: int, padding: str, rng: np.random.Generator) -> np.ndarray:
    """bool [batch, kv_len], True = real token; row 0 is always full length."""
    lengths = rng.integers(1, kv_len + 1, size=batch)
    lengths[0] = kv_len
    positions = np.arange(kv_len)[None, :]
    right = positions < lengths[:, None]
    left = positions >= (kv_len - lengths)[:, None]
    if padding == "none":
        return np.ones((batch, kv_len), dtype=bool)
    if padding == "right":
        return right
    if padding == "left":
        return left
    return np.where((np.arange(batch) % 2 == 0)[:, None], left, right)


def make_inputs(signature: Signature, d_model: int, case: ParityCase, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name in signature.sequence_inputs:
        length = case.q_len if name in ("x", "query") else case.kv_len
        feeds[name] = rng.standard_normal((case.batch, length, d_model), dtype=np.float32)
    for mask_name, sequence_name in signature.padding_masks.items():
        feeds[mask_name] = padding_mask(case.batch, feeds[sequence_name].shape[1], case.padding, rng)
    return feeds


def real_query_rows(signature: Signature, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """bool [batch, q_len]: the query positions whose outputs users read."""
    query = signature.sequence_inputs[0]  # x or query
    for mask_name, sequence_name in signature.padding_masks.items():
        if sequence_name == query:
            return feeds[mask_name]
    return np.ones(feeds[query].shape[:2], dtype=bool)


def torch_reference(module: torch.nn.Module, signature: Signature, feeds: dict[str, np.ndarray]) -> dict:
    with torch.no_grad():
        result = module(*(torch.from_numpy(feeds[name]) for name in signature.input_names))
    result = result if isinstance(result, tuple) else (result,)
    return {name: tensor.float().numpy() for name, tensor in zip(signature.output_names, result, strict=True)}


@dataclass
class _Errors:
    abs_err: np.ndarray
    reference: np.ndarray


def _compare(name, actual, expected, rows) -> tuple[_Errors, list[str]]:
    problems = []
    if not np.isfinite(actual).all():
        problems.append(f"{name} has non-finite values")
    if name == "attn_weights":  # [batch, heads, q, kv] -> rows on [batch, q]
        actual, expected = actual.transpose(0, 2, 1, 3), expected.transpose(0, 2, 1, 3)
    actual, expected = actual[rows].astype(np.float64), expected[rows].astype(np.float64)
    # (astype after indexing: a float16 model's outputs are compared in float64 too)
    return _Errors(np.abs(actual - expected), np.abs(expected)), problems


def _required_rtol(abs_err: np.ndarray, reference: np.ndarray, atol: float) -> float:
    excess = abs_err - atol
    over = excess > 0
    if not over.any():
        return 0.0
    with np.errstate(divide="ignore"):
        return float((excess[over] / reference[over]).max())


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
    errors: list[_Errors] = []
    failures: list[str] = []
    rel_errs: list[float] = [0.0]
    for index, case in enumerate(cases):
        feeds = make_inputs(signature, session.metadata.d_model, case, seed + index)
        expected = torch_reference(module, signature, feeds)
        # The reference stays fp32: a half-precision model is judged against full precision.
        model_dtype = np.dtype(session.metadata.dtype)
        actual = session.run({k: v.astype(model_dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()})
        rows = real_query_rows(signature, feeds)
        for name in signature.output_names:
            err, problems = _compare(name, actual[name], expected[name], rows)
            errors.append(err)
            failures += [f"{case.label(signature)}: {p}" for p in problems]
            rel_errs.append(float(np.linalg.norm(err.abs_err) / max(np.linalg.norm(err.reference), 1e-30)))
            if rel_budget is not None:
                if rel_errs[-1] > rel_budget:
                    failures.append(f"{case.label(signature)}: {name} relative error {rel_errs[-1]:.3%}")
            elif not np.all(err.abs_err <= atol + rtol * err.reference):
                failures.append(f"{case.label(signature)}: {name} max abs err {err.abs_err.max():.3g}")
    abs_err = np.concatenate([e.abs_err.ravel() for e in errors])
    reference = np.concatenate([e.reference.ravel() for e in errors])
    return ParityReport(
        passed=not failures,
        atol=atol,
        rtol=rtol,
        max_abs_err=float(abs_err.max()),
        required_atol=float(max(0.0, (abs_err - rtol * reference).max())),
        required_rtol=_required_rtol(abs_err, reference, atol),
        shapes=[case.label(signature) for case in cases],
        failures=failures,
        rel_err=max(rel_errs),
        rel_budget=rel_budget,
    )
