"""The contract between an exported ONNX file and everything that runs it.

This module is imported by both sides of the file boundary (exporters write the
metadata, serving reads it), so it must stay free of torch and onnx imports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from mha_deploy.compare import tolerance_words
from mha_deploy.errors import ModelFileError, SignatureError

# The I/O contract lives in its own module; re-exported here, where it was first defined.
from mha_deploy.signature import (
    ATTENTION_KINDS,
    FIXED_SHAPE_ROLES,
    MASK_MODES,
    MODEL_KINDS,
    PADDING_MASK,
    SEGMENTS,
    Signature,
)

__all__ = [
    "ATTENTION_KINDS", "CACHE_HOLES", "CACHE_LAYOUTS", "CACHE_LAYOUT_AUTO", "CACHE_LAYOUT_CHOICES", "CACHE_RAGGED",
    "DTYPES", "DTYPE_CHOICES", "ENCODER_DECODER_KEY", "FUSE_CHOICES", "MASK_MODES", "MAX_OPSET",
    "METADATA_KEY", "MIN_OPSET", "MODEL_KINDS", "ON_ERROR_CHOICES", "PROVIDER_CHOICES", "QUANTIZE_CHOICES",
    "QUANT_METHODS", "TRITON_KINDS", "EncoderDecoderRecord", "EvalRecord", "GenerationIds", "ModelMetadata",
    "ParityReport", "Signature", "WeightOnlyRecord",
]

METADATA_KEY = "mha_deploy"
# Bumped when the meaning of a recorded field changes: the newest format this version reads. Files are
# written in the oldest format that holds them, 1, except a custom model's (declared tensors; 2), a model
# with a max length (3), a parity report whose atol is per row (4), a generation section (5), how a KV-cache
# model's positions work (6), a KV-cache model's cache layout (7), weight-only quantization with its measured
# quality (8), inputs of the roles segments, image or audio (9) and a weight-only file's quantized embedding tables
# or its quality on text (10), which earlier mha-deploy cannot read: it then says to upgrade.
METADATA_FORMAT = 13
_CUSTOM_FORMAT = 2
_MAX_LENGTH_FORMAT = 3
_ROW_ATOL_FORMAT = 4
_GENERATION_FORMAT = 5
_POSITIONS_FORMAT = 6
_CACHE_LAYOUT_FORMAT = 7
_WEIGHT_ONLY_FORMAT = 8
_INPUT_ROLES_FORMAT = 9
_QUANTIZED_TEXT_FORMAT = 10
# A decoder-only model's bos id: an older reader would refuse the unknown field as unreadable, not as newer.
_BOS_FORMAT = 11
# A causal LM's logits at each row's last token only (--logits last, role LAST_TOKEN): an older reader would take
# [batch, 1, vocab] for every position's.
_LAST_TOKEN_FORMAT = 12
# An output spanning the batch (CLIP's logits_per_image [batch, batch]), or an int64 padding mask on a file without a
# cache (export --hf): an older reader would cut the first into items, and feed its load check's bool masks to the
# second.
_BATCH_OUTPUTS_FORMAT = 13
# How a KV-cache model over token ids numbers its tokens (ModelMetadata.positions): from its position_ids input
# (each row its own), not at all (a row's logits do not depend on padding before it), or by column of the padded
# batch (rows of different lengths do not get what they get alone).
POSITIONS_INPUT, POSITIONS_NONE, POSITIONS_PADDED_WIDTH = "input", "none", "padded-width"
POSITIONS_KINDS = (POSITIONS_INPUT, POSITIONS_NONE, POSITIONS_PADDED_WIDTH)
POSITIONS_WORDS = {
    POSITIONS_INPUT: "each row's from position_ids: prompts of any length share a batch exactly",
    POSITIONS_NONE: "padding before a row does not change it: prompts of any length share a batch exactly",
    POSITIONS_PADDED_WIDTH: "counted over the padded batch's columns: only prompts of one length share a batch "
                            "exactly (export with --position-ids where the module's are an arange into a table)",
}
# How a user's KV-cache LM keeps its cache (ModelMetadata.cache_layout). "ragged": each attention is contrib
# GroupQueryAttention reading and writing the cache in place; rows are right-padded, row r's first n_r mask entries
# are 1 and its cache is contiguous from position 0 (exporters.fusion.ragged_cache has the file contract). "holes":
# each attention's present is past ++ this call's keys/values (a copy of the cache per step), rows may be padded on
# either side and padded positions stay in the cache as holes the mask hides. None (earlier files): holes.
CACHE_RAGGED, CACHE_HOLES = "ragged", "holes"
CACHE_LAYOUTS = (CACHE_RAGGED, CACHE_HOLES)
# What an export of a user's causal LM with --kv-cache asks for: ragged where the file allows it (else holes, with
# the reason in its warnings), or one of the two (ragged refused with the reason when it cannot be).
CACHE_LAYOUT_AUTO = "auto"
CACHE_LAYOUT_CHOICES = (CACHE_LAYOUT_AUTO, CACHE_RAGGED, CACHE_HOLES)
CACHE_LAYOUT_WORDS = {
    CACHE_RAGGED: "GroupQueryAttention updates the cache in place; prompts right-padded, each row's cache "
                  "contiguous from position 0",
    CACHE_HOLES: "each step returns past ++ new keys/values (a copy); padding on either side stays in the cache "
                 "as masked holes",
}

# The choices the exporter, the runtime and serving accept, defined here (no torch, no
# onnxruntime) so that the CLI lists them without importing either; the modules that
# check them re-export them.
FUSE_CHOICES = ("auto", "mha", "onnx", "none")
# int4 / int8: weight-only, every MatMul with a constant weight as contrib MatMulNBits (block-wise scales, the CPU's
# int8 kernels at accuracy_level 4); int8-dynamic: onnxruntime.quantization's dynamic int8 (weights per tensor,
# activations quantized per call), the projections of encoders. Files before format 8 called int8-dynamic "int8".
QUANTIZE_CHOICES = ("none", "int4", "int8", "int8-dynamic")
WEIGHT_ONLY_BITS = {"int4": 4, "int8": 8}
INT8_DYNAMIC = "int8-dynamic"
# How weight-only scales are chosen: round to nearest (ORT's default quantizer), HQQ's half-quadratic fit of
# scale and zero point (no calibration data either), or GPTQ (ORT's copy of Intel Neural Compressor's; int4, with
# calibration prompts: each layer's rounding corrected against the activations those prompts give).
QUANT_METHODS = ("rtn", "hqq", "gptq")
# dtype option -> element type of the model's float tensors (recorded as ModelMetadata.dtype).
DTYPES = {"fp32": "float32", "fp16": "float16"}
DTYPE_CHOICES = tuple(DTYPES)
# torch's ONNX exporter needs opset >= 18; 23, the default, is the newest this project exports and checks.
MIN_OPSET, MAX_OPSET = 18, 23
PROVIDER_CHOICES = ("auto", "cpu", "cuda")
ON_ERROR_CHOICES = ("stop", "skip")
# Triton instance kind -> its config.pbtxt spelling.
TRITON_KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}


@dataclass
class ParityReport:
    """What the export-time comparison of ONNX Runtime against torch measured."""

    passed: bool
    atol: float
    rtol: float
    max_abs_err: float
    # Smallest atol that would have passed at the given rtol, and vice versa.
    required_atol: float
    required_rtol: float
    shapes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # Largest ||actual - reference|| / ||reference|| over real query rows, per output and shape.
    rel_err: float = 0.0
    # When set (quantized models), parity means rel_err <= rel_budget instead of the atol/rtol test.
    rel_budget: float | None = None
    # atol (and required_atol) in units of each output row's magnitude (compare.row_scale); files from before
    # it hold absolute ones.
    atol_per_row: bool = False
    # Quantized models with logits outputs: the share of real rows whose argmax over the last axis is the
    # reference's, over ``top1_rows`` rows of every shape (compare.Comparison.top1_agree); None: not measured.
    top1_agreement: float | None = None
    top1_rows: int | None = None

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        if self.rel_budget is not None:
            over = (f": {self.rel_err / self.rel_budget:.1f}x the budget" if self.rel_budget and
                    self.rel_err > self.rel_budget else "")
            top1 = (f", top-1 agreement {self.top1_agreement:.1%} over {self.top1_rows} rows"
                    if self.top1_agreement is not None else "")
            return (
                f"parity {verdict} over {len(self.shapes)} shapes ({', '.join(self.shapes)}): "
                f"relative error {self.rel_err:.3%} (budget {self.rel_budget:.1%}{over}), "
                f"max abs err {self.max_abs_err:.3g}{top1}"
            )
        tolerance = tolerance_words(self.atol, self.rtol, self.atol_per_row)
        return (
            f"parity {verdict} over {len(self.shapes)} shapes ({', '.join(self.shapes)}): "
            f"max abs err {self.max_abs_err:.3g} (tolerance {tolerance}; "
            f"would pass with atol >= {self.required_atol:.3g} at this rtol, "
            f"or rtol >= {self.required_rtol:.3g} at this atol)"
        )


@dataclass
class GenerationIds:
    """The token ids a generator needs and the file alone cannot say, recorded at export (``--eos-id``,
    ``--pad-id``, ``--start-id``) so that generation needs none of them: ``eos_token_ids`` end a row (none: every
    row runs to its token budget), ``pad_token_id`` fills prompts and finished rows (onnxruntime-genai finds a
    prompt's padding by it), ``decoder_start_token_id`` is the first token an encoder-decoder's decoder reads,
    ``forced_bos_token_id`` the token an encoder-decoder's first generated token is forced to by default (a Hugging
    Face generation config's: M2M100's and MBart-50's target language; ``generate --forced-bos-id`` overrides it);
    ``suppress_tokens`` and ``begin_suppress_tokens`` ids generation never picks (first), a generation config's
    (Whisper's); ``bos_token_id`` a decoder-only model's beginning-of-sequence id (its config's), kept for
    onnxruntime-genai's config only: a causal LM's prompt is the tokens given (the tokenizer adds any bos), so
    nothing that batches or generates reads it, unlike ``decoder_start_token_id``."""

    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    forced_bos_token_id: int | None = None
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self):
        self.eos_token_ids = list(self.eos_token_ids)
        self.suppress_tokens, self.begin_suppress_tokens = list(self.suppress_tokens), list(self.begin_suppress_tokens)

    def to_dict(self) -> dict:
        """As recorded: the forced first id only when set, so that a file without one stays readable by earlier
        mha-deploy."""
        raw = asdict(self)
        for name in ("forced_bos_token_id", "suppress_tokens", "begin_suppress_tokens", "bos_token_id"):
            if raw[name] in (None, []):
                del raw[name]
        return raw

    @property
    def ids(self) -> dict[str, int]:
        """Every recorded id by what it is, e.g. {"eos id": 2, "pad id": 0} (eos ids numbered when several)."""
        eos = self.eos_token_ids
        named = {("eos id" if len(eos) == 1 else f"eos id #{i + 1}"): token for i, token in enumerate(eos)}
        for name, token in (("pad id", self.pad_token_id), ("start id", self.decoder_start_token_id),
                            ("forced first id", self.forced_bos_token_id), ("bos id", self.bos_token_id)):
            if token is not None:
                named[name] = token
        return named

    def check(self, vocab: int | None, source: str = "generation ids") -> None:
        """Every id an integer in [0, vocab) (vocab None: not checked against a size); ``SignatureError`` naming
        the first that is not."""
        for name, token in self.ids.items():
            if type(token) is not int or token < 0:
                raise SignatureError(f"{source}: {name} is {token!r}, not a non-negative integer token id")
            if vocab is not None and token >= vocab:
                raise SignatureError(
                    f"{source}: {name} is {token}, past the model's vocabulary of {vocab} ids (0 to {vocab - 1}): "
                    "was it taken from another model's tokenizer?"
                )
        for name in ("suppress_tokens", "begin_suppress_tokens"):  # ids past the vocabulary are ignored, as there
            bad = [token for token in getattr(self, name) if type(token) is not int or token < 0]
            if bad:
                raise SignatureError(f"{source}: {name} holds {bad[0]!r}, not a non-negative integer token id")

    def describe(self) -> str:
        parts = [f"eos {', '.join(map(str, self.eos_token_ids))}" if self.eos_token_ids else "no eos"]
        if self.pad_token_id is not None:
            parts.append(f"pad {self.pad_token_id}")
        if self.decoder_start_token_id is not None:
            parts.append(f"decoder start {self.decoder_start_token_id}")
        if self.forced_bos_token_id is not None:
            parts.append(f"forced first token {self.forced_bos_token_id}")
        if self.bos_token_id is not None:
            parts.append(f"bos {self.bos_token_id} (not added to prompts)")
        if self.suppress_tokens or self.begin_suppress_tokens:
            parts.append(f"{len(self.suppress_tokens)} suppressed id(s), {len(self.begin_suppress_tokens)} never first")
        return ", ".join(parts)


@dataclass
class WeightOnlyRecord:
    """How a weight-only quantized file (``--quantize int4|int8``) was written, as its graph states it:
    ``matmuls`` contrib MatMulNBits of ``bits`` bits in blocks of ``block_size`` along K, ``symmetric`` (no zero
    points) or not, scales chosen by ``method`` (QUANT_METHODS), ``accuracy_level`` the op's (4: the CPU's int8
    kernels; 0: unset); ``fp32_matmuls`` MatMuls with a constant weight left in fp32 (the LM head under
    ``--keep-head-fp32``); ``head_fp32`` whether that was asked."""

    bits: int
    block_size: int
    symmetric: bool
    method: str
    accuracy_level: int
    matmuls: int
    fp32_matmuls: int = 0
    head_fp32: bool = False
    # --quantize-embeddings: token embedding tables as contrib GatherBlockQuantized (4-bit, blocks of block_size
    # along the hidden axis, round to nearest whatever ``method``). Written only when set (format 10).
    embeddings: int = 0
    # --eval-data: the quantized file against the fp32 module on the user's text. Written only when set (format 10).
    evaluation: EvalRecord | None = None

    def describe(self) -> str:
        kept = f"; {self.fp32_matmuls} MatMul(s) with a constant weight kept fp32" if self.fp32_matmuls else ""
        head = " (the LM head, --keep-head-fp32)" if self.head_fp32 and self.fp32_matmuls else ""
        tables = (f"; {self.embeddings} embedding table(s) as 4-bit GatherBlockQuantized (rtn)"
                  if self.embeddings else "")
        return (f"{self.matmuls} MatMulNBits, {self.bits}-bit {'symmetric' if self.symmetric else 'asymmetric'} "
                f"blocks of {self.block_size}, {self.method}, accuracy_level {self.accuracy_level}{kept}{head}"
                f"{tables}")

    def to_dict(self) -> dict:
        """As JSON holds it: the fields added in format 10 only when set, so that other files stay readable by
        mha-deploy that predates them."""
        raw = asdict(self)
        if not self.embeddings:
            del raw["embeddings"]
        if self.evaluation is None:
            del raw["evaluation"]
        return raw

    @property
    def format(self) -> int:
        """The oldest metadata format that holds this record."""
        return _QUANTIZED_TEXT_FORMAT if self.embeddings or self.evaluation is not None else _WEIGHT_ONLY_FORMAT

    @classmethod
    def from_dict(cls, raw: dict) -> WeightOnlyRecord:
        raw = dict(raw)
        if raw.get("evaluation") is not None:
            raw["evaluation"] = EvalRecord(**raw["evaluation"])
        return cls(**raw)


@dataclass(frozen=True)
class EvalRecord:
    """A weight-only file against the fp32 module on the user's text (``export --eval-data``): ``perplexity`` of
    the file and ``perplexity_fp32`` of the module over ``scored`` next tokens of ``prompts`` prompts read from
    ``source``; greedy decoding of ``new_tokens`` tokens from each prompt by both, ``greedy_agreement`` the mean share
    of them before the first token that differs, ``greedy_identical`` the prompts whose tokens are all equal.
    ``ratio_budget``: the perplexity ratio past which the export refused the file."""

    source: str
    prompts: int
    scored: int
    perplexity: float
    perplexity_fp32: float
    new_tokens: int
    greedy_agreement: float
    greedy_identical: int
    ratio_budget: float

    @property
    def ratio(self) -> float:
        return self.perplexity / self.perplexity_fp32

    def describe(self) -> str:
        return (f"on {self.source} ({self.prompts} prompts, {self.scored} tokens scored): perplexity "
                f"{self.perplexity:.4g} against fp32's {self.perplexity_fp32:.4g} ({self.ratio:.3f}x, budget "
                f"{self.ratio_budget:g}x); greedy {self.new_tokens} new tokens: {self.greedy_agreement:.1%} equal "
                f"before the first difference, {self.greedy_identical} of {self.prompts} prompts identical")


# An encoder-decoder exported with --kv-cache is two files (exporters.own_seq2seq_cache); each records under this
# key which part it is, and the decoder the name of its encoder beside it. Kept apart from METADATA_KEY: the pair's
# I/O is Optimum's encoder-decoder convention, which a custom Signature does not describe.
ENCODER_DECODER_KEY = "mha_deploy.encoder_decoder"


@dataclass
class EncoderDecoderRecord:
    """One file of an encoder-decoder pair: ``part`` "encoder" or "decoder"; ``companion`` the other file's name
    (in the same folder); the ids generation needs; the attentions found, fused with ``fusion``; the per-step
    parity the export checked (a summary line); and the longest sequence the module takes."""

    part: str
    companion: str
    generation: GenerationIds | None = None
    fusion: str = "none"
    attentions: dict[str, int] = field(default_factory=dict)
    parity: str = ""
    # The longest source or target the module takes (a position table's size, --max-length); None: no limit.
    max_length: int | None = None
    # --quantize (QUANTIZE_CHOICES) of both files; weight-only: how the decoder's weights were (the encoder's
    # alike). Written only when set, so that an fp32 pair stays readable by earlier mha-deploy.
    quantization: str = "none"
    weight_only: WeightOnlyRecord | None = None

    def to_dict(self) -> dict:
        raw = asdict(self)
        if self.generation is not None:
            raw["generation"] = self.generation.to_dict()
        if self.quantization == "none":
            del raw["quantization"], raw["weight_only"]
        elif self.weight_only is not None:
            raw["weight_only"] = self.weight_only.to_dict()
        return raw

    @classmethod
    def from_json(cls, text: str, source: str = "model") -> EncoderDecoderRecord:
        try:
            raw = json.loads(text)
            if raw.get("weight_only") is not None:
                raw["weight_only"] = WeightOnlyRecord.from_dict(raw["weight_only"])
            if raw.get("generation") is not None:
                raw["generation"] = GenerationIds(**raw["generation"])
            record = cls(**raw)
        except (ValueError, TypeError) as exc:
            raise ModelFileError(f"{source}: unreadable {ENCODER_DECODER_KEY} metadata ({exc})") from exc
        if record.part not in ("encoder", "decoder") or not record.companion:
            raise ModelFileError(f"{source}: {ENCODER_DECODER_KEY} metadata names no part or companion")
        return record


@dataclass
class ModelMetadata:
    """Everything a session needs to know about an exported model."""

    # A user's own model (signature.model "custom") may hold attentions of several widths: num_heads is then the
    # most heads one of them splits into (it sizes the largest score tensor an item needs), as the written graph
    # states it, and d_model the widest attention's width (the inputs' where the graph does not say).
    d_model: int
    num_heads: int
    signature: Signature
    dtype: str = "float32"
    opset: int = 23
    fusion: str = "none"
    quantization: str = "none"
    # Stacks: how many layers, and the feed-forward width.
    layers: int = 1
    d_ff: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    parity: ParityReport | None = None
    format: int = 1
    # The longest sequence the model takes on any length axis (a position table's size, --max-length); None:
    # no limit recorded. The validator refuses a longer one before ONNX Runtime indexes past the table.
    max_length: int | None = None
    # A generator's token ids (eos, pad, decoder start) recorded at export; None: none recorded.
    generation: GenerationIds | None = None
    # A user's KV-cache LM: how its positions work (POSITIONS_KINDS), so that a scheduler knows whether rows of
    # different lengths can share a batch exactly; None: not recorded (other models, earlier files).
    positions: str | None = None
    # A user's KV-cache LM: how its cache is laid out and updated (CACHE_LAYOUTS); None: holes (other models,
    # earlier files).
    cache_layout: str | None = None
    # --quantize int4 / int8 (weight-only): how the weights were quantized; None otherwise. A file that records
    # quantization "int8" without it is from before int4 (format < 8): the dynamic path, read as "int8-dynamic".
    weight_only: WeightOnlyRecord | None = None

    @property
    def fixed_sizes(self) -> dict[str, int]:
        """The sizes of the named fixed axes (``signature.FIXED_AXES``); a custom model's are ints in its axes."""
        heads = max(self.num_heads, 1)
        return {"d_model": self.d_model, "heads": heads, "d_k": self.d_model // heads}

    def to_json(self) -> str:
        raw = asdict(self)
        if not self.signature.kv_cache:
            # Written only when set, so that files without a cache stay readable by earlier mha-deploy.
            del raw["signature"]["kv_cache"]
            del raw["signature"]["layers"]
        if self.signature.model != "custom":
            for name in ("custom_inputs", "custom_outputs", "custom_paddable"):
                del raw["signature"][name]
        else:
            raw["format"] = max(self.format, _CUSTOM_FORMAT)
            if any(spec.role in (SEGMENTS, *FIXED_SHAPE_ROLES) for spec in self.signature.custom_inputs):
                raw["format"] = max(raw["format"], _INPUT_ROLES_FORMAT)
            if self.signature.last_token_outputs:
                raw["format"] = max(raw["format"], _LAST_TOKEN_FORMAT)
            if self.signature.batch_outputs or (not self.signature.kv_cache and any(
                    spec.role == PADDING_MASK and spec.dtype != "bool" for spec in self.signature.custom_inputs)):
                raw["format"] = max(raw["format"], _BATCH_OUTPUTS_FORMAT)
        if self.max_length is None:
            del raw["max_length"]
        else:
            raw["format"] = max(raw["format"], _MAX_LENGTH_FORMAT)
        if self.generation is None:
            del raw["generation"]
        else:
            raw["generation"] = self.generation.to_dict()
            raw["format"] = max(raw["format"], _GENERATION_FORMAT)
            if self.generation.bos_token_id is not None:
                raw["format"] = max(raw["format"], _BOS_FORMAT)
        if self.positions is None:
            del raw["positions"]
        else:
            raw["format"] = max(raw["format"], _POSITIONS_FORMAT)
        if self.cache_layout is None:
            del raw["cache_layout"]
        else:
            raw["format"] = max(raw["format"], _CACHE_LAYOUT_FORMAT)
        if self.weight_only is None:
            del raw["weight_only"]
        else:
            raw["weight_only"] = self.weight_only.to_dict()
            raw["format"] = max(raw["format"], self.weight_only.format)
        if raw["parity"] is not None:
            if raw["parity"]["atol_per_row"]:
                raw["format"] = max(raw["format"], _ROW_ATOL_FORMAT)
            else:
                del raw["parity"]["atol_per_row"]
            if raw["parity"]["top1_agreement"] is None:
                del raw["parity"]["top1_agreement"], raw["parity"]["top1_rows"]
            else:
                raw["format"] = max(raw["format"], _WEIGHT_ONLY_FORMAT)
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "model") -> ModelMetadata:
        try:
            raw = json.loads(text)
            raw["signature"] = Signature(**raw["signature"])
            if raw.get("parity") is not None:
                raw["parity"] = ParityReport(**raw["parity"])
            if raw.get("generation") is not None:
                raw["generation"] = GenerationIds(**raw["generation"])
            if raw.get("weight_only") is not None:
                raw["weight_only"] = WeightOnlyRecord.from_dict(raw["weight_only"])
            elif raw.get("quantization") == "int8":
                raw["quantization"] = INT8_DYNAMIC  # the only int8 there was before weight-only int8
            metadata = cls(**raw)
        except (ValueError, TypeError, KeyError, SignatureError) as exc:
            raise ModelFileError(f"{source}: unreadable mha-deploy metadata ({exc})") from exc
        # JSON keeps "64" a string: a field of the wrong type would fail far from here, naming no file.
        for name in ("d_model", "num_heads", "opset", "layers", "format"):
            value = getattr(metadata, name)
            if type(value) is not int or value < 1:
                raise ModelFileError(f"{source}: mha-deploy metadata {name} is {value!r}, not a positive integer")
        if metadata.max_length is not None and (type(metadata.max_length) is not int or metadata.max_length < 1):
            raise ModelFileError(
                f"{source}: mha-deploy metadata max_length is {metadata.max_length!r}, not a positive integer"
            )
        if metadata.generation is not None:
            try:
                metadata.generation.check(None, f"{source}: mha-deploy metadata generation")
            except SignatureError as exc:
                raise ModelFileError(str(exc)) from exc
        if metadata.positions is not None and metadata.positions not in POSITIONS_KINDS:
            raise ModelFileError(f"{source}: mha-deploy metadata positions is {metadata.positions!r}, not one of "
                                 f"{', '.join(POSITIONS_KINDS)}")
        if metadata.cache_layout is not None and metadata.cache_layout not in CACHE_LAYOUTS:
            raise ModelFileError(f"{source}: mha-deploy metadata cache_layout is {metadata.cache_layout!r}, not one of "
                                 f"{', '.join(CACHE_LAYOUTS)}")
        if metadata.signature.layers not in (1, metadata.layers):
            raise ModelFileError(
                f"{source}: its metadata says {metadata.layers} layers, its cache layout {metadata.signature.layers}"
            )
        if metadata.format > METADATA_FORMAT:
            raise ModelFileError(
                f"{source}: metadata format {metadata.format} is newer than this mha-deploy "
                f"understands ({METADATA_FORMAT}); upgrade mha-deploy"
            )
        if metadata.quantization not in QUANTIZE_CHOICES:
            raise ModelFileError(f"{source}: mha-deploy metadata quantization is {metadata.quantization!r}, not one of "
                                 f"{', '.join(QUANTIZE_CHOICES)}")
        if (metadata.quantization in WEIGHT_ONLY_BITS) != (metadata.weight_only is not None):
            raise ModelFileError(f"{source}: mha-deploy metadata quantization {metadata.quantization} "
                                 f"{'lacks' if metadata.weight_only is None else 'contradicts'} its weight-only record")
        return metadata

    @classmethod
    def from_props(cls, props: dict[str, str], source: str = "model") -> ModelMetadata:
        if METADATA_KEY not in props:
            raise ModelFileError(
                f"{source}: no mha-deploy metadata in this ONNX file; export it with `mha-deploy export`"
            )
        return cls.from_json(props[METADATA_KEY], source)
