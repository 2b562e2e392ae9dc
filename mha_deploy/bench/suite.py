"""One bench run: every backend of every mask mode at every shape, each row with its error against torch.

Per mask mode and shape, the inputs come from the one data loader
(``MaskMode.inputs``), the torch eager reference runs once on them in fp32 on
the CPU, and every backend's output is compared with it on real query rows
(``mha_deploy.compare``) before the backends are timed together in blocks.
Efficiency is against ORT's own MatMul rate on the same device, in the same run
(int8-dynamic rows: its int8 MatMulInteger rate).
Figures only: nothing here asserts a timing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from mha_deploy.bench.backends import (
    Backend,
    BackendFactory,
    default_backends,
    openvino_available,
    ort_file,
    torch_module,
)
from mha_deploy.bench.cases import DEFAULT_SHAPES, MaskMode
from mha_deploy.bench.gemm import GEMM_SIZES, peak_gemm_gflops
from mha_deploy.bench.memory import MemoryRow, measure_peak_rss
from mha_deploy.bench.target import CPU_FP32, BenchTarget
from mha_deploy.bench.timing import QuietGate, load_average, load_line, mha_flops, time_blocks
from mha_deploy.compare import compare_outputs
from mha_deploy.errors import OptionError
from mha_deploy.exporters.export import auto_fusion_target
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import DEFAULT_ATOL, DEFAULT_RTOL, torch_reference
from mha_deploy.exporters.precision import FP16_ATOL, FP16_RTOL
from mha_deploy.exporters.quantize import INT8_REL_ERR_BUDGET, REL_ERR_BUDGETS
from mha_deploy.inputs import real_rows
from mha_deploy.model_report import read_metadata
from mha_deploy.models import MultiHeadAttention
from mha_deploy.signature import Signature

# The row every "vs eager" ratio divides by, in the same mask mode and shape.
BASELINE = "torch eager"
# precision -> (atol, rtol, relative budget): the export's own parity test for models of that precision.
TOLERANCES = {
    "fp32": (DEFAULT_ATOL, DEFAULT_RTOL, None),
    "fp16": (FP16_ATOL, FP16_RTOL, None),
    "int8-dynamic": (DEFAULT_ATOL, DEFAULT_RTOL, INT8_REL_ERR_BUDGET),
    # A weight-only file given as MODEL (its GEMMs on int8 kernels too, but its efficiency is read against the fp32
    # MatMul rate: it replaces an fp32 row).
    **{kind: (DEFAULT_ATOL, DEFAULT_RTOL, REL_ERR_BUDGETS[kind]) for kind in ("int4", "int8")},
}


@dataclass
class BenchRow:
    mask: str  # the mask mode's label, e.g. "padding-25%"
    backend: str
    batch: int
    seq: int
    median_ms: float
    p90_ms: float
    gflops: float
    vs_torch_eager: float | None  # torch eager median / this median: > 1 is faster (None without that row)
    efficiency: float | None  # gflops / the run's ORT MatMul rate in the row's precision (None: not measured)
    # Against the torch eager reference (fp32, CPU) on the same inputs, over real query rows; None where the run
    # has no reference (a user's model benched without its module): an error never measured is not zero.
    max_abs_err: float | None
    rel_err: float | None  # ||output - reference|| / ||reference||
    # Whether the error is within what export-time parity accepts at this backend's precision (True when not
    # measured: nothing was found to differ).
    within_tolerance: bool


@dataclass
class BenchReport:
    d_model: int
    heads: int
    threads: int
    provider: str
    dtype: str
    gemm_gflops: float  # the best ORT MatMul rate of the run, on the bench's provider and dtype
    gemm_size: int  # ... reached at gemm_size³
    mask_modes: list[str] = field(default_factory=list)
    # ORT's int8 MatMulInteger rate (GOP/s) and size, the yardstick of int8-dynamic rows; measured when the run has one.
    int8_gemm_gops: float | None = None
    int8_gemm_size: int | None = None
    # mask mode label -> the backend that is what `mha-deploy export` (--fuse auto) writes for it.
    default_export: dict[str, str] = field(default_factory=dict)
    rows: list[BenchRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    # 1/5/15-minute load averages around the run: other processes on the same cores inflate every figure.
    load_before: list[float] | None = None
    load_after: list[float] | None = None
    quiet: str = ""  # what the QuietGate saw, when one held the timed blocks
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"d_model {self.d_model}, {self.heads} heads, {self.threads} threads, provider {self.provider}, "
            f"{self.dtype}; ORT {self.dtype} MatMul peak {self.gemm_gflops:.0f} GFLOP/s "
            f"(at {self.gemm_size}^3; efficiency = GFLOP/s / this)"
            + (f"; int8-dynamic rows: / ORT int8 MatMulInteger peak {self.int8_gemm_gops:.0f} GOP/s "
               f"(at {self.int8_gemm_size}^3)" if self.int8_gemm_gops else ""),
            "errors: output vs the torch eager reference (fp32, CPU) on the same inputs, real query rows; "
            "rel err = ||out - ref|| / ||ref||",
            *(f"note: {note}" for note in self.notes),
            f"{'mask':<14} {'shape':<9} {'backend':<22} {'median ms':>10} {'p90 ms':>9} {'GFLOP/s':>8} "
            f"{'vs eager':>8} {'effic.':>7} {'max abs err':>11} {'rel err':>9}  note",
        ]
        for r in self.rows:
            ratio = f"{r.vs_torch_eager:7.2f}x" if r.vs_torch_eager is not None else f"{'-':>8}"
            efficiency = f"{r.efficiency:7.0%}" if r.efficiency is not None else f"{'-':>7}"
            note = "" if r.within_tolerance else "DIFFERS from torch beyond parity tolerance"
            gflops = f"{r.gflops:8.0f}" if r.gflops == r.gflops else f"{'-':>8}"  # NaN: not known
            max_abs = f"{r.max_abs_err:11.1e}" if r.max_abs_err is not None else f"{'-':>11}"
            rel = f"{r.rel_err:9.1e}" if r.rel_err is not None else f"{'-':>9}"
            lines.append(
                f"{r.mask:<14} {f'{r.batch}x{r.seq}':<9} {r.backend:<22} {r.median_ms:10.2f} {r.p90_ms:9.2f} "
                f"{gflops} {ratio} {efficiency} {max_abs} {rel}  {note}".rstrip()
            )
        if self.memory:
            lines += ["", f"{'mask':<14} {'shape':<9} {'backend':<22} {'peak RSS MB':>11} {'run MB':>8} "
                          f"{'no-arena run MB':>16}"]
            by_key = {(m.mask, m.backend, m.batch, m.seq, m.arena): m for m in self.memory}
            for m in self.memory:
                if m.arena:
                    plain = by_key.get((m.mask, m.backend, m.batch, m.seq, False))
                    lines.append(
                        f"{m.mask:<14} {f'{m.batch}x{m.seq}':<9} {m.backend:<22} {m.peak_rss_mb:11.0f} "
                        f"{m.run_mb:8.0f} {plain.run_mb if plain else float('nan'):16.0f}"
                    )
        lines += ["", load_line(self.load_before, self.load_after, self.threads)]
        if self.quiet:
            lines.append(self.quiet)
        return "\n".join(lines)


def _tolerance(precision: str) -> dict:
    atol, rtol, rel_budget = TOLERANCES[precision]
    return {"atol": atol, "rtol": rtol, "rel_budget": rel_budget}


def bench_case(
    report: BenchReport, label: str, signature: Signature, backends: list[Backend], feeds: dict,
    expected: dict | None, batch: int, seq: int, budget_s: float, gate: QuietGate | None, flops: float | None,
) -> list[BenchRow]:
    """One mask mode at one shape: every backend's first output checked against ``expected`` (the reference's
    outputs on ``feeds``; None: no reference, no error), then every backend timed together. ``flops``: the
    work of one call (None when not known: no GFLOP/s, no efficiency)."""
    first = signature.output_names[0]
    real = real_rows(signature, feeds)
    runs = {backend.name: backend.prepare(feeds) for backend in backends}
    comparisons = {
        backend.name: compare_outputs(
            signature, {first: runs[backend.name]()}, expected, real, names=(first,),
            **_tolerance(backend.precision),
        )[0]
        for backend in backends
    } if expected is not None else {}
    timings = time_blocks(runs, budget_s, gate=gate)
    baseline = timings.get(BASELINE)
    rows = []
    for backend in backends:
        timing, comparison = timings[backend.name], comparisons.get(backend.name)
        gflops = flops / (timing.median_ms * 1e-3) / 1e9 if flops else float("nan")
        peak = report.int8_gemm_gops if backend.precision == "int8-dynamic" else report.gemm_gflops
        rows.append(BenchRow(
            label, backend.name, batch, seq, timing.median_ms, timing.p90_ms, gflops,
            baseline.median_ms / timing.median_ms if baseline else None, gflops / peak if flops and peak else None,
            comparison.max_abs_err if comparison else None, comparison.rel_err if comparison else None,
            comparison.passed if comparison else True,
        ))
    return rows


def measure_memory(
    report: BenchReport, mode: MaskMode, backends: Sequence[Backend], shapes, threads: int, provider: str = "cpu"
) -> None:
    """Peak RSS of each ORT backend of ``mode`` at each shape, on the mode's inputs, with ORT's CPU arena on and off."""
    for batch, seq in shapes:
        for backend in backends:
            if backend.path is not None:
                for arena in (True, False):
                    report.memory.append(measure_peak_rss(
                        backend.path, backend.name, batch, seq, threads, arena, provider, mode.padded_pct
                    ))


def _check_backends(signature: Signature, backends: list[Backend]) -> None:
    names = [backend.name for backend in backends]
    if len(set(names)) != len(names):
        raise OptionError(f"bench backends need distinct names, got {names}")
    for backend in backends:
        if backend.signature is not None and backend.signature != signature:
            raise OptionError(f"backend {backend.name!r} takes {backend.signature}, not the mode's {signature}")


def _file_backends(models: Sequence[str | Path], modes: Sequence[MaskMode], target: BenchTarget,
                   threads: int) -> list[Backend]:
    """One backend per ONNX file, each checked to match the signature of one of the modes."""
    files = [ort_file(path, target, threads, Path(path).name) for path in models]
    signatures = {mode.signature for mode in modes}
    for file in files:
        if file.signature in signatures:
            continue
        if file.signature == Signature("self", file.signature.mask):
            fix = f"add --mask {file.signature.mask}"
        else:
            fix = "the bench compares self-attention MHA files that return no weights"
        raise OptionError(
            f"{file.name} takes {file.signature}, which none of the mask modes "
            f"({', '.join(mode.label for mode in modes)}) benches: {fix}"
        )
    return files


def settings_from_file(
    path: str | Path, d_model: int | None = None, heads: int | None = None, modes: Sequence[MaskMode] | None = None
) -> tuple[int, int, tuple[MaskMode, ...]]:
    """d_model, heads and mask modes for a bench of the exported file at ``path``, read from its metadata.

    Given ones must agree with the file (``OptionError`` otherwise), so that no
    comparison model of another width is exported only to fail on the file's
    inputs; without ``modes``, the file's own mask mode.
    """
    from mha_deploy.model_report import read_metadata

    metadata = read_metadata(path)
    for flag, given, own in (("--d-model", d_model, metadata.d_model), ("--heads", heads, metadata.num_heads)):
        if given is not None and given != own:
            raise OptionError(f"{flag} {given} disagrees with {Path(path).name}, which has {own}: omit it")
    return metadata.d_model, metadata.num_heads, tuple(modes) if modes else (MaskMode(metadata.signature.mask),)


def run_bench(
    mha: MultiHeadAttention,
    modes: Sequence[MaskMode] = (MaskMode(),),
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    *,
    target: BenchTarget = CPU_FP32,
    threads: int = 2,
    budget_s: float = 2.0,
    backends: BackendFactory | None = None,
    models: Sequence[str | Path] = (),
    packed_qkv: bool = False,
    openvino: bool | None = None,
    memory_shapes: Sequence[tuple[int, int]] = (),
    gemm_sizes: Sequence[int] = GEMM_SIZES,
    gate: QuietGate | None = None,
    workdir: str | Path | None = None,
    on_row: Callable[[BenchRow], None] | None = None,
) -> BenchReport:
    """Time every backend of every mask mode at every shape; every row carries its error against torch eager.

    ``backends(signature)`` builds the compared backends of a signature (default:
    ``default_backends`` of ``mha`` on ``target``, exported into ``workdir``,
    a temporary directory by default). Each ONNX file of ``models`` joins the
    modes whose signature it has. ``budget_s`` is the timing budget per backend
    and shape; ``gate`` holds each timed block until the machine is quiet. ``openvino`` adds OpenVINO
    on the unfused graph (None: when it is installed).
    ``memory_shapes``: peak RSS of every ORT file at those shapes, in fresh processes.
    """
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="mha-bench-") as tmp:
        workdir = Path(workdir or tmp)
        if openvino is None:
            openvino = openvino_available()
        factory = backends or partial(
            default_backends, mha, target=target, threads=threads, workdir=workdir, packed_qkv=packed_qkv,
            openvino=openvino,
        )
        files = _file_backends(models, modes, target, threads)
        report = BenchReport(
            mha.d_model, mha.num_heads, threads, target.provider, target.dtype,
            *peak_gemm_gflops(threads, target, gemm_sizes), mask_modes=[mode.label for mode in modes],
            load_before=_load(), notes=[target.note] if target.note else [],
        )
        if backends is None:
            report.default_export = {mode.label: f"ORT {auto_fusion_target(mode.signature)}" for mode in modes}
            defaults = sorted({f"{mode.signature.mask}: {report.default_export[mode.label]}" for mode in modes})
            report.notes.append(f"the default export (--fuse auto) is, per mask mode, {'; '.join(defaults)}")
        if backends is None and target.dtype != "fp32":
            report.notes.append(f"torch eager runs in fp32 (its -1e9 mask fill overflows {target.dtype})")
        by_signature: dict[Signature, list[Backend]] = {}
        for mode in modes:
            signature = mode.signature
            if signature not in by_signature:
                by_signature[signature] = factory(signature) + [f for f in files if f.signature == signature]
                _check_backends(signature, by_signature[signature])
            if report.int8_gemm_gops is None and any(b.precision == "int8-dynamic" for b in by_signature[signature]):
                report.int8_gemm_gops, report.int8_gemm_size = peak_gemm_gflops(
                    threads, target, gemm_sizes, dtype="int8"
                )
            reference = attention_graph(mha, signature)
            for batch, seq in shapes:
                feeds = mode.inputs(report.d_model, batch, seq)
                expected = torch_reference(reference, signature, feeds)
                flops = mha_flops(batch, seq, report.d_model)
                for row in bench_case(report, mode.label, signature, by_signature[signature], feeds, expected,
                                       batch, seq, budget_s, gate, flops):
                    report.rows.append(row)
                    if on_row:
                        on_row(row)
        for mode in modes if memory_shapes else ():
            measure_memory(report, mode, by_signature[mode.signature], memory_shapes, threads, target.provider)
    report.load_after = _load()
    report.quiet = gate.summary() if gate is not None else ""
    return report


def run_model_bench(
    path: str | Path,
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    *,
    padded_pct: float = 0.0,
    module: torch.nn.Module | None = None,
    target: BenchTarget = CPU_FP32,
    threads: int = 2,
    budget_s: float = 2.0,
    gemm_sizes: Sequence[int] = GEMM_SIZES,
    gate: QuietGate | None = None,
    on_row: Callable[[BenchRow], None] | None = None,
) -> BenchReport:
    """A user's own model file (``export --module``) at each shape, every length axis ``seq`` long with the last
    ``padded_pct`` of it padded where a mask marks it; with ``module`` (the same model in torch), that module in
    torch eager too: the baseline of the ratios and the reference of the errors (first output, real rows).

    The rows carry no GFLOP/s (the model is the user's: its operation count is not known here); the run's ORT
    MatMul rate still says how fast this host is.
    """
    torch.set_num_threads(threads)
    file = ort_file(path, target, threads, f"ORT {Path(path).name}")
    session_metadata = read_metadata(path)
    signature = file.signature
    if signature.model != "custom":
        raise OptionError(f"{Path(path).name} is a built-in model: bench it with --mask (and MODEL) as usual")
    if padded_pct and not signature.padding_masks:
        raise OptionError(f"{Path(path).name} takes no padding mask: it cannot bench padded inputs")
    mode = MaskMode(signature.mask, padded_pct)
    report = BenchReport(
        session_metadata.d_model, session_metadata.num_heads, threads, target.provider, target.dtype,
        *peak_gemm_gflops(threads, target, gemm_sizes), mask_modes=[mode.label], load_before=_load(),
        notes=[f"your own model {Path(path).name}: inputs {', '.join(signature.input_names)}; GFLOP/s not known"],
    )
    backends = [file]
    if module is not None:
        backends.append(torch_module(module.eval(), signature, BASELINE))
    else:
        report.notes.append("no reference: errors are '-' (give the module, --module FILE.py:FACTORY, to compare "
                            "against it in torch)")
    for batch, seq in shapes:
        feeds = mode.inputs(session_metadata.d_model, batch, seq, signature=signature)
        # The module in torch is the reference (its first output), when given.
        expected = {signature.output_names[0]: backends[-1].prepare(feeds)()} if module is not None else None
        for row in bench_case(report, mode.label, signature, backends, feeds, expected, batch, seq, budget_s, gate,
                               flops=None):
            report.rows.append(row)
            if on_row:
                on_row(row)
    report.load_after = _load()
    report.quiet = gate.summary() if gate is not None else ""
    return report


def _load() -> list[float] | None:
    load = load_average()
    return list(load) if load is not None else None

