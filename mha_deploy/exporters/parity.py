"""torch reference vs ONNX Runtime on shapes the export never saw.

Parity is judged on real positions only, each output along its own length
axis by that axis's padding masks (an encoder-decoder's logits by the target's
mask, its encoder states by the source's): a padded row of the reference is
padding, never returned to users, and fused kernels or token packing may
legally compute something else there. Every position, padded or not, must be
finite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from mha_deploy.compare import Comparison, compare_outputs
from mha_deploy.errors import ExportError, MHADeployError, ParityError, first_line
from mha_deploy.exporters.reference_form import without_fast_path
from mha_deploy.inputs import (
    PADDING_SIDES,
    InputCase,
    cast_floats,
    make_inputs,
    padding_mask,
    real_query_rows,
    real_rows,
)
from mha_deploy.metadata import ParityReport, Signature
from mha_deploy.runtime.session import MHASession
from mha_deploy.runtime.validation import inert_padding

DEFAULT_ATOL, DEFAULT_RTOL = 1e-5, 1e-4
# What parity compares with, besides a torch module: any function of the feeds (fp32 floats, bool masks, int64
# ids) to the outputs by name, e.g. a graph exported elsewhere run in ORT (exporters.optimize).
Reference = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
# The name parity has always used for a generated shape.
ParityCase = InputCase
__all__ = [
    "CACHE_CASES",
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "PADDING_SIDES",
    "CacheCase",
    "ParityCase",
    "Reference",
    "check_cache_parity",
    "check_parity",
    "decode_in_calls",
    "default_cases",
    "full_sequence_inputs",
    "make_inputs",
    "padding_mask",
    "real_query_rows",
    "real_rows",
    "torch_reference",
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


@dataclass(frozen=True)
class CacheCase:
    """A KV-cache model's decoding to check: a prefill of ``prefill`` tokens (padded on ``padding``'s side
    when the model has a mask), ``steps`` one-token calls, then one call of ``chunk`` tokens. A decoder
    stack attends to ``memory`` tokens too (padded on the same side)."""

    batch: int
    prefill: int
    steps: int
    chunk: int
    padding: str = "right"
    memory: int = 11

    @property
    def calls(self) -> tuple[int, ...]:
        return (self.prefill, *(1,) * self.steps, self.chunk)

    def label(self, signature: Signature) -> str:
        shape = f"{self.batch}x({self.prefill}+{self.steps}x1+{self.chunk})"
        if signature.model == "decoder":
            shape += f"x{self.memory}"
        return f"{shape}/{self.padding}" if signature.has_padding_mask and self.padding != "none" else shape


# Batch 1 with a one-token prefill, both padding sides and a mix, a prefill >= 256; memory of 1 and >= 256.
CACHE_CASES = (
    CacheCase(1, 1, 3, 2, "none", memory=1),
    CacheCase(3, 17, 3, 4, "right"),
    CacheCase(4, 9, 2, 3, "left", memory=6),
    CacheCase(2, 260, 2, 5, "mixed", memory=257),
)


def full_sequence_inputs(signature: Signature, d_model: int, case: CacheCase, seed: int) -> dict[str, np.ndarray]:
    """The whole sequence a ``case`` decodes, as the cache-free ``signature`` takes it: x [batch, total, d_model]
    (+ key_padding_mask, padded only within the prefill: every later token is real; a decoder's memory
    and its mask padded on the case's side)."""
    total = sum(case.calls)
    feeds = make_inputs(signature, d_model, InputCase(case.batch, total, case.memory, case.padding), seed)
    rng = np.random.default_rng(seed + 1)
    query_mask = signature.mask_of(signature.query_input)
    if query_mask is not None:
        feeds[query_mask][:] = True
        feeds[query_mask][:, : case.prefill] = padding_mask(case.batch, case.prefill, case.padding, rng)
    return feeds


def decode_in_calls(session: MHASession, feeds: dict[str, np.ndarray], calls: tuple[int, ...]) -> np.ndarray:
    """Run a KV-cache ``session`` over the whole sequence ``feeds`` in calls of ``calls`` tokens, each fed the
    previous call's present outputs (every cache empty on the first call; a decoder's memory and its mask
    whole on every call); the outputs of every call, concatenated along the sequence."""
    signature = session.signature
    query = signature.query_input
    x = feeds[query]
    d_k = session.metadata.d_model // session.metadata.num_heads
    empty = np.zeros((x.shape[0], session.metadata.num_heads, 0, d_k), x.dtype)
    past = dict.fromkeys(signature.cache_pairs, empty)
    query_mask = signature.mask_of(query)
    whole = {name: array for name, array in feeds.items() if name not in (query, query_mask)}
    outputs, start = [], 0
    for length in calls:
        end = start + length
        masks = {query_mask: feeds[query_mask][:, :end]} if query_mask is not None else {}
        result = session.run({**whole, query: x[:, start:end], **past, **masks})
        outputs.append(result["output"])
        past = {name: result[present] for name, present in signature.cache_pairs.items()}
        start = end
    return np.concatenate(outputs, axis=1)


def check_cache_parity(
    reference: torch.nn.Module,
    session: MHASession,
    cases: tuple[CacheCase, ...] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
    rel_budget: float | None = None,
) -> ParityReport:
    """A KV-cache ``session`` decoding each case call by call against ``reference``: one causal forward of
    the whole sequence in torch (the cache-free module of the same mask mode), on every real position."""
    signature = session.signature.cache_free
    model_dtype = session.metadata.dtype

    def runs():
        for index, case in enumerate(cases or CACHE_CASES):
            if not signature.has_padding_mask:
                case = replace(case, padding="none")
            feeds = full_sequence_inputs(signature, session.metadata.d_model, case, seed + index)
            actual = {"output": decode_in_calls(session, cast_floats(feeds, model_dtype), case.calls)}
            yield case.label(signature), feeds, actual

    return _judge(reference, signature, runs(), atol, rtol, rel_budget)


def _judge(
    reference: torch.nn.Module | Reference,
    signature: Signature,
    runs: Iterable[tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]],
    atol: float,
    rtol: float,
    rel_budget: float | None,
) -> ParityReport:
    """Each run (label, fp32 feeds, ORT's outputs) against ``reference`` (a torch module run eagerly in fp32, or
    a ``Reference`` function) on the same feeds, each output on the real rows of its own length axis; one report
    over every output and run: the worst error of each kind."""
    comparisons: list[Comparison] = []
    failures: list[str] = []
    labels: list[str] = []
    module = isinstance(reference, torch.nn.Module)
    for label, feeds, actual in runs:
        labels.append(label)
        # The reference stays fp32: a half-precision model is judged against full precision.
        try:
            expected = torch_reference(reference, signature, feeds) if module else reference(feeds)
        except Exception as exc:  # the user's module or graph: any error type
            raise ExportError(
                f"parity at {label}: {'the module itself fails in torch' if module else 'the reference fails'} "
                f"({type(exc).__name__}: {first_line(exc)}); if it "
                "takes at most N tokens (a position table), give --max-length N"
            ) from exc
        compared = compare_outputs(signature, actual, expected, real_rows(signature, feeds), atol, rtol, rel_budget,
                                   atol_per_row=True)
        if module and not all(c.finite and c.reference_finite for c in compared):
            _refuse_nan_attention(reference, signature, feeds, label)
        for comparison in compared:
            comparisons.append(comparison)
            if not comparison.passed:
                failures.append(f"{label}: {comparison.summary()}")
    return parity_report(comparisons, labels, failures, atol, rtol, rel_budget=rel_budget)


def parity_report(comparisons: list, labels: list[str], failures: list[str], atol: float, rtol: float,
                  **settings) -> ParityReport:
    """The report of a parity run: the worst of its comparisons, the shapes it ran, what failed. Whether atol
    counted in row scales is read off the comparisons, so the report cannot claim a tolerance they did not apply.
    Under a relative budget (quantized models) it also reports the top-1 agreement of the logits outputs over
    every compared row, which fp32 parity does not need."""
    rows = sum(c.top1_rows for c in comparisons)
    if settings.get("rel_budget") is not None and rows:
        settings = {**settings, "top1_agreement": sum(c.top1_agree for c in comparisons) / rows, "top1_rows": rows}
    return ParityReport(
        atol_per_row=all(c.atol_per_row for c in comparisons),
        passed=not failures,
        atol=atol,
        rtol=rtol,
        max_abs_err=max(c.max_abs_err for c in comparisons),
        required_atol=max(c.required_atol for c in comparisons),
        required_rtol=max(c.required_rtol for c in comparisons),
        shapes=labels,
        failures=failures,
        rel_err=max(c.rel_err for c in comparisons),
        **settings,
    )


def _refuse_nan_attention(module: torch.nn.Module, signature: Signature, feeds: dict[str, np.ndarray],
                          label: str) -> None:
    """Raise, in one line, when torch itself turns finite inputs into NaN at ``label`` (the NaN in the ONNX
    graph, or in the reference's real rows, is then the module's own): typically a hand-written softmax over a
    query row whose keys are all masked with -inf, which left padding under a causal mask makes."""
    source = nan_source(module, signature, feeds)
    if source is None:
        return
    raise ParityError(
        f"parity at {label}: {source} gives NaN in torch itself, the ONNX graph computes the same; an "
        "attention's softmax over a query row whose keys are all masked with -inf does (left padding under a "
        "causal mask makes such rows, and the next layer's keys and values carry the NaN to real rows): fill "
        "masked scores with a finite value (torch.finfo(dtype).min) or call F.scaled_dot_product_attention "
        "(nn.MultiheadAttention: need_weights=False), which gives 0 there"
    )


def _finite(value) -> bool:
    """Every floating-point tensor in ``value`` (nested tuples, lists, dicts) is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    return True


def nan_source(module: torch.nn.Module, signature: Signature, feeds: dict[str, np.ndarray]) -> str | None:
    """The submodule of ``module`` whose forward first turns finite inputs into a non-finite output on
    ``feeds``, as ``name (Class)`` (named within the user's module, not the export's wrapper around it); None
    when torch's outputs are finite."""
    user = getattr(module, "module", None)
    user = user if isinstance(user, torch.nn.Module) else module
    names = {layer: name for name, layer in user.named_modules()}
    found: list[torch.nn.Module] = []

    def watch(layer, args, kwargs, output):
        if not found and _finite((args, kwargs)) and not _finite(output):
            found.append(layer)

    handles = [layer.register_forward_hook(watch, with_kwargs=True) for layer in names]
    try:
        torch_reference(module, signature, feeds)
    finally:
        for handle in handles:
            handle.remove()
    if not found:
        return None
    name = names[found[0]]
    return f"{name or 'the module'} ({type(found[0]).__name__})"


def default_cases(signature: Signature) -> tuple[ParityCase, ...]:
    # A model with no length axis (images, audio) varies in its batch only: the self-attention cases' batches.
    return SELF_CASES if len(signature.sequence_axes) <= 1 else CROSS_CASES


def torch_reference(module: torch.nn.Module, signature: Signature, feeds: dict[str, np.ndarray]) -> dict:
    with torch.no_grad(), without_fast_path():
        result = module(*(torch.from_numpy(feeds[name]) for name in signature.input_names))
    result = result if isinstance(result, tuple) else (result,)
    return {name: tensor.float().numpy() for name, tensor in zip(signature.output_names, result, strict=True)}


def check_parity(
    module: torch.nn.Module | Reference,
    session: MHASession,
    cases: tuple[ParityCase, ...] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    seed: int = 0,
    rel_budget: float | None = None,
) -> ParityReport:
    """Run ``module`` (torch, eager; or a ``Reference`` function) and ``session`` (ORT) on each case and compare.

    Each real position (``real_rows``) must satisfy ``|actual - ref| <= atol * s + rtol * |ref|``, ``s`` the largest
    ``|ref|`` of its output row, at least 1 (``compare.row_scale``);
    with ``rel_budget`` (quantized models) the test is instead
    ``||actual - ref|| / ||ref|| <= rel_budget`` per output and shape.
    """
    signature = session.signature
    model_dtype = session.metadata.dtype

    def runs():
        for index, case in enumerate(cases or default_cases(signature)):
            # As the session hands them to ORT (padding zeroed), for the reference too: a model that reads its
            # padding (a pooling that ignores the mask) is judged on what it is given.
            feeds = inert_padding(signature, make_inputs(signature, session.metadata.d_model, case, seed + index))
            try:
                outputs = session.run(cast_floats(feeds, model_dtype))
            except MHADeployError:
                raise
            except Exception as exc:  # ORT's own types: the graph cannot run at this shape
                raise ExportError(f"parity at {case.label(signature)}: ONNX Runtime cannot run the graph: "
                                  f"{first_line(exc)}") from exc
            yield case.label(signature), feeds, outputs

    return _judge(module, signature, runs(), atol, rtol, rel_budget)
