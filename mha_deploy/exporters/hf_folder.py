"""``export_hf_folder``: a Hugging Face model folder, as ``save_pretrained`` writes it, -> a checked ONNX file.

The folder says everything ``--module`` makes the user say: ``config.json``'s ``architectures`` names the
transformers class (and with it the task: ``BertForSequenceClassification``, ``GPT2LMHeadModel``, ...), its
weights load into it, and the inputs are the forward's parameters under Hugging Face's names, each with the role
and length axis ``HF_INPUTS`` gives it. The outputs keep the model's output field names (``logits``,
``last_hidden_state``, ``pooler_output``: ``own_model.named_outputs`` names a ``ModelOutput``'s tensors by their
keys; CLIP's ``logits_per_image`` [batch, batch] among them, an output spanning the call's batch:
``TensorSpec.spans_batch``). The ``attention_mask`` is int64 1/0, as a tokenizer gives it (``HF_MASK_DTYPE``).
With ``kv_cache`` the special ids come from ``generation_config.json`` and the config, recorded as
``--eos-id``, ``--pad-id`` and ``--start-id`` would record them. The tokenizer, its chat template and the generation
and preprocessor configs are copied beside the file (``beside_model``), so that ``generate`` and ``serve`` find
them there. Nothing is downloaded: the folder is read with ``local_files_only``.

A sentence-transformers folder (``modules.json``: a transformer, its pooling, optionally Normalize) is exported as
one model, the transformer with its pooling after it: one output, ``sentence_embedding`` [batch, d], what
``SentenceTransformer.encode`` returns (``sentence_folder``), its max length the folder's ``max_seq_length``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from mha_deploy.atomic import atomic_path, same_file
from mha_deploy.errors import ExportError
from mha_deploy.exporters.sentence_folder import SentenceFolder, sentence_module
from mha_deploy.metadata import CACHE_LAYOUT_AUTO, GenerationIds
from mha_deploy.runtime.beside_model import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# What lands beside the exported file when the folder has it: what a tokenizer, a chat template, a generator and an
# image or audio preprocessor read (the chat template also when tokenizer_config.json holds it: ``_chat_template``).
COPIED_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", GENERATION_CONFIG_FILE,
                "preprocessor_config.json")

# A length axis of an encoder or a decoder-only model; an encoder-decoder has two, its source's and its target's.
SEQ, SOURCE, TARGET = "seq", "src_seq", "tgt_seq"


@dataclass(frozen=True)
class HFInput:
    """How a forward parameter of Hugging Face's name is fed: its role (``own_model.ROLES``), and whether it is on
    the decoder's side of an encoder-decoder (its target axis; else the source's, or ``seq`` in a model with one)."""

    role: str
    target: bool = False

    def axis(self, encoder_decoder: bool) -> str:
        if not encoder_decoder or self.role in ("image", "audio"):  # no length axis: SEQ writes none
            return SEQ
        return TARGET if self.target else SOURCE


# Hugging Face's input names -> how the file takes them: the one table. A name whose role own_model.ROLES takes
# becomes an input of the file wherever the forward has that parameter; the others are left at their defaults,
# unless the model reads nothing without them (its main input: ``refuse_unfed``). A new role is one line here,
# e.g. "token_type_ids": HFInput("segments").
HF_INPUTS: dict[str, HFInput] = {
    "input_ids": HFInput("tokens"),
    "attention_mask": HFInput("padding-mask"),
    "decoder_input_ids": HFInput("tokens", target=True),
    "decoder_attention_mask": HFInput("padding-mask", target=True),
    "token_type_ids": HFInput("segments"),
    "pixel_values": HFInput("image"),
    "input_features": HFInput("audio"),
}
# What the file's attention_mask takes: int64 1/0, as a Hugging Face tokenizer returns it (return_tensors="np"),
# so that its output feeds a plain onnxruntime session as it is (Optimum's files take the same). A --kv-cache
# causal LM's mask is int64 already; an encoder-decoder's --kv-cache pair keeps its own (``own_seq2seq_cache``).
HF_MASK_DTYPE = "int64"


def forward_like(wrapper, module):
    """``wrapper`` (a module over ``module`` whose forward takes ``**inputs``) declared with ``module``'s forward
    parameters and class name: the export feeds a forward the parameters its signature names, and names the
    model by its class."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    cls = type(wrapper)
    cls.forward.__signature__ = inspect.Signature([self_parameter, *parameters])
    cls.__name__ = cls.__qualname__ = type(module).__name__
    return wrapper


@dataclass
class HFModel:
    """A folder's model, loaded for export: the module (eval, fp32, caches off) and the inputs to declare."""

    module: object  # a transformers PreTrainedModel (or a module over it: sentence_module)
    architecture: str
    inputs: tuple[str, ...]  # NAME:ROLE[:AXIS], as ``--input`` takes them
    encoder_decoder: bool
    source: Path  # the folder of its config, weights and tokenizer files
    sentence: SentenceFolder | None = None  # a sentence-transformers folder's pipeline

    def generation_ids(self) -> GenerationIds | None:
        """The eos, pad and (an encoder-decoder's) decoder start ids of the folder's generation config, else of its
        config, and an encoder-decoder's forced first token (``forced_bos_token_id``: M2M100's and MBart-50's
        target language) and the ids its generation config suppresses (Whisper's), or a causal LM's bos id (for
        onnxruntime-genai's config); None when it names none."""
        from mha_deploy.exporters.export import config_bos_id

        sources = [getattr(self.module, "generation_config", None), self.module.config]

        def first(name: str) -> list[int]:
            return next((ids for source in sources if (ids := _token_ids(getattr(source, name, None)))), [])

        eos, pad = first("eos_token_id"), first("pad_token_id")
        # A causal LM starts from its prompt: its bos id is the tokenizer's business, not the generator's.
        start = first("decoder_start_token_id") if self.encoder_decoder else []
        forced = first("forced_bos_token_id") if self.encoder_decoder else []
        # ... and is kept apart from a start id, which would make the library's prompt batches start from it.
        bos = None if self.encoder_decoder else config_bos_id(sources)
        # Whisper's: ids its generation never picks (first); only a generation config names them.
        config = sources[0] if self.encoder_decoder else None
        suppress, begin = (_token_ids(getattr(config, name, None)) for name in ("suppress_tokens",
                                                                                "begin_suppress_tokens"))
        if not (eos or pad or start or forced or suppress or begin) and bos is None:
            return None
        return GenerationIds(eos, pad[0] if pad else None, start[0] if start else None,
                             forced[0] if forced else None, suppress, begin, bos_token_id=bos)

    def context_length(self) -> int | None:
        """The config's ``max_position_embeddings``: the longest sequence the model takes, where no position table
        states it (M2M100's sinusoidal table, rebuilt in its forward past that length); else an encoder-decoder's
        ``max_target_positions`` (Whisper: its source is features of a fixed size, its decoder's table is sliced by
        length, which no probe reads as a table)."""
        config = self.module.config
        for name in ("max_position_embeddings", *(("max_target_positions",) if self.encoder_decoder else ())):
            value = getattr(config, name, None)
            if type(value) is int and value > 0:
                return value
        return None


def _token_ids(value) -> list[int]:
    values = value if isinstance(value, list | tuple) else [value]
    return [v for v in values if type(v) is int and v >= 0]


def read_config(folder: Path) -> dict:
    """``config.json`` of ``folder``, with the ``ExportError`` that says what is missing when it is not a folder
    ``save_pretrained`` wrote."""
    if not folder.is_dir():
        raise ExportError(f"--hf {folder}: {'not a folder' if folder.exists() else 'no such folder'} (give the "
                          "folder save_pretrained wrote: config.json, the weights, the tokenizer files)")
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"--hf {folder}: no {CONFIG_FILE} in it (give the folder save_pretrained wrote)") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"--hf {folder}: {CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise ExportError(f"--hf {folder}: {CONFIG_FILE} is not a JSON object")
    return config


def model_class(folder: Path, config: dict):
    """The transformers class ``config.json``'s ``architectures`` names (its first)."""
    import transformers

    architectures = config.get("architectures") or []
    if not architectures or not isinstance(architectures[0], str):
        raise ExportError(f"--hf {folder}: {CONFIG_FILE} names no architecture (\"architectures\": [...]), so the "
                          "model class is unknown; save the model with save_pretrained from its task class "
                          "(e.g. BertForSequenceClassification), or export it with --module")
    name = architectures[0]
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise ExportError(f"--hf {folder}: transformers {transformers.__version__} has no model class {name} "
                          "(the config's architectures): a newer transformers, or --module with your own code")
    return cls


def load_hf_model(folder: str | os.PathLike) -> HFModel:
    """The model of ``folder`` (eval, fp32, sdpa attention where the class has it, caches off) and the inputs its
    forward takes under ``HF_INPUTS``' names; an ``ExportError`` naming what the folder lacks otherwise."""
    import torch

    folder = Path(folder)
    sentence = SentenceFolder.read(folder)
    source = sentence.transformer if sentence is not None else folder
    config = read_config(source)
    # sentence-transformers loads its transformer with AutoModel (the base model, whatever architectures says)
    cls = _auto_model() if sentence is not None else model_class(source, config)
    with _quiet_transformers():
        try:
            module = _from_pretrained(cls, source, torch.float32)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ExportError(f"--hf {folder}: {cls.__name__}.from_pretrained failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    module = module.float().eval()
    # The export traces a forward without a cache object (a KV-cache export adds its own to the graph); the
    # config save_pretrained wrote keeps use_cache on, the forward's default.
    for cfg in (module.config, getattr(module.config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    encoder_decoder = bool(getattr(module.config, "is_encoder_decoder", False))
    inputs = forward_inputs(module, encoder_decoder)
    if sentence is not None:
        return _sentence_model(folder, sentence, module, inputs, encoder_decoder)
    return HFModel(module, cls.__name__, inputs, encoder_decoder, source)


def _auto_model():
    import transformers

    return transformers.AutoModel


def _sentence_model(folder: Path, sentence: SentenceFolder, encoder, inputs: tuple[str, ...],
                    encoder_decoder: bool) -> HFModel:
    """The transformer of a sentence-transformers folder with its pooling after it; refused where the pooling
    has no mask to read or the transformer is not an encoder."""
    name = type(encoder).__name__
    if encoder_decoder:
        raise ExportError(f"--hf {folder}: its transformer is an encoder-decoder ({name}), of which "
                          "sentence-transformers runs the encoder alone: not exported by --hf yet; export it with "
                          "--module (the encoder and its pooling)")
    if not any(spec.split(":")[1] == "padding-mask" for spec in inputs):
        raise ExportError(f"--hf {folder}: {name}.forward takes no attention_mask, over which the pooling "
                          "averages: export it with --module")
    # One text per vector, as encode takes them: segment ids all 0, the forward's default, so the file takes none
    # (and infer and /v1/embeddings need none).
    inputs = tuple(spec for spec in inputs if spec.split(":")[1] != "segments")
    module = forward_like(sentence_module(encoder, sentence), encoder)
    return HFModel(module, f"{name} with sentence-transformers' {sentence.describe()}", inputs, encoder_decoder,
                   sentence.transformer, sentence)


def _from_pretrained(cls, folder: Path, dtype):
    """``cls.from_pretrained`` of the local folder, with sdpa attention unless the class does not offer it."""
    common = {"local_files_only": True, "dtype": dtype}
    try:
        return cls.from_pretrained(folder, attn_implementation="sdpa", **common)
    except ValueError as exc:
        # transformers names it "sdpa" or spells it out (DeBERTa-v2: "... through
        # torch.nn.functional.scaled_dot_product_attention yet").
        if not any(name in str(exc).lower() for name in ("sdpa", "scaled_dot_product_attention")):
            raise
        return cls.from_pretrained(folder, **common)  # its own attention: eager, the fusion's other spelling


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars (writing, loading weights) off while the folder loads."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def forward_inputs(module, encoder_decoder: bool) -> tuple[str, ...]:
    """``NAME:ROLE[:AXIS]`` for each forward parameter ``HF_INPUTS`` names with a role the export takes, in the
    forward's order; refused naming it when the model's main input (or an encoder-decoder's decoder ids) is not
    among them."""
    from mha_deploy.exporters.own_model import ROLES

    parameters = list(inspect.signature(module.forward).parameters)
    needed = [getattr(module, "main_input_name", "input_ids")]
    if encoder_decoder:
        needed.append("decoder_input_ids")
    takes = f"{type(module).__name__}.forward"
    for name in needed:
        known = HF_INPUTS.get(name)
        if known is None or known.role not in ROLES:
            fed = [n for n, spec in HF_INPUTS.items() if spec.role in ROLES]
            raise ExportError(f"{takes} reads {name}, which --hf cannot feed yet (it feeds {', '.join(fed)}): "
                              f"export it with --module, declaring {name} with --input")
        if name not in parameters:
            raise ExportError(f"{takes} has no parameter {name} (its main input): export it with --module")
    fed = {name: HF_INPUTS[name] for name in parameters if name in HF_INPUTS and HF_INPUTS[name].role in ROLES}
    # Segment ids where the config gives them a table of more than one row (BERT's type_vocab_size 2): GPT-2's
    # forward takes token_type_ids into its word table, RoBERTa's table has one row (Optimum feeds neither).
    segments = getattr(getattr(module, "config", None), "type_vocab_size", None)
    if not (type(segments) is int and segments > 1):
        fed = {name: spec for name, spec in fed.items() if spec.role != "segments"}
    # A mask marks ids on its axis: ViT's and Whisper's forwards take an attention_mask they never read.
    token_axes = {spec.axis(encoder_decoder) for spec in fed.values() if spec.role == "tokens"}
    return tuple(f"{name}:{spec.role}" + (f":{axis}" if (axis := spec.axis(encoder_decoder)) != SEQ else "")
                 for name, spec in fed.items()  # others left at their defaults (position_ids: the model's own)
                 if spec.role != "padding-mask" or spec.axis(encoder_decoder) in token_axes)


@dataclass(frozen=True)
class BesideFiles:
    """The folder's files that go beside the exported model: file name -> bytes."""

    files: dict[str, bytes]

    @classmethod
    def read(cls, folder: Path) -> BesideFiles:
        files = {}
        for name in COPIED_FILES:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                files[name] = (folder / name).read_bytes()
        if (template := _chat_template(folder, files.get(TOKENIZER_CONFIG_FILE))) is not None:
            files[CHAT_TEMPLATE_FILE] = template.encode("utf-8")
        return cls(files)

    def write(self, folder: Path, source: Path) -> list[Path]:
        """Each file written atomically into ``folder``; a file that is the one in ``source`` (an export into the
        model's own folder) is left as it is. On failure the ones written are removed again and the error raised."""
        written: list[Path] = []
        try:
            for name, data in self.files.items():
                path = folder / name
                if path.exists() and same_file(path, source / name):
                    continue
                with atomic_path(path) as tmp:
                    tmp.write_bytes(data)
                written.append(path)
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            raise
        return written


def _chat_template(folder: Path, tokenizer_config: bytes | None) -> str | None:
    """The chat template: ``chat_template.jinja`` (transformers 5's save), else the one ``tokenizer_config.json``
    holds (a string, or the ``default`` of named templates)."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if tokenizer_config is None:
        return None
    try:
        template = json.loads(tokenizer_config).get("chat_template")
    except (ValueError, AttributeError):
        return None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def export_hf_folder(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    kv_cache: bool = False,
    generation: GenerationIds | None = None,
    max_length: int | None = None,
    position_ids: bool | None = None,
    cache_layout: str = CACHE_LAYOUT_AUTO,
    **options,
):
    """Export the model of ``folder`` (as ``save_pretrained`` wrote it) to ``output`` as ``export_model`` exports a
    module, its inputs read off the forward (``HF_INPUTS``), its outputs named after its output fields; then copy
    the tokenizer files, chat template and generation / preprocessor configs beside it (``COPIED_FILES``).

    ``kv_cache``: a causal LM or an encoder-decoder exported for generation (as ``export_model``'s); the eos, pad and
    decoder start ids are the folder's generation config's (else its config's), each one ``generation`` gives
    taking its place (an encoder-decoder's generation config's ``forced_bos_token_id`` recorded too). ``max_length``:
    as ``export_model``'s (default: the model's position table, else the config's ``max_position_embeddings``).
    ``options`` as for ``export_mha``.

    Returns an ``HFExport``: ``export_model``'s result, the architecture, the inputs declared and the files copied.
    Writes nothing when anything fails: the model file(s) are removed again if the files beside cannot be written.
    """
    from mha_deploy.exporters.export import export_model

    folder = Path(folder)
    if kv_cache and SentenceFolder.read(folder) is not None:
        raise ExportError(f"--hf {folder}: a sentence-transformers folder is an encoder with its pooling, which "
                          "generates nothing: drop --kv-cache")
    model = load_hf_model(folder)
    beside = BesideFiles.read(model.source)
    ids = _merged(model.generation_ids(), generation) if kv_cache else generation
    if max_length is None and model.sentence is not None and model.sentence.max_seq_length is not None:
        # encode truncates there: a file taking longer inputs would return vectors the model never gives
        max_length = min(model.sentence.max_seq_length, model.context_length() or model.sentence.max_seq_length)
    result = export_model(model.module, output, model.inputs, max_length=max_length, kv_cache=kv_cache,
                          position_ids=position_ids, generation=ids, cache_layout=cache_layout,
                          context_length=model.context_length(), mask_dtype=HF_MASK_DTYPE, **options)
    written = [Path(result.path)] + ([Path(result.encoder_path)] if getattr(result, "encoder_path", None) else [])
    try:
        copied = beside.write(Path(result.path).parent, model.source)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return HFExport(result, model.architecture, model.inputs, copied, ids)


@dataclass
class HFExport:
    """What ``export_hf_folder`` did: ``export_model``'s result (an ``ExportResult``, or an encoder-decoder's pair),
    the class the folder named, the inputs declared for it (``NAME:ROLE[:AXIS]``), the files copied beside and the
    generation ids passed to the export (with ``kv_cache``: the folder's, or the ones given in their place)."""

    result: object
    architecture: str
    inputs: tuple[str, ...]
    beside: list[Path]
    generation: GenerationIds | None = None


def _merged(found: GenerationIds | None, given: GenerationIds | None) -> GenerationIds | None:
    """The folder's ids, each one ``given`` sets (``--eos-id``, ``--pad-id``, ``--start-id``) in its place."""
    if given is None or found is None:
        return given or found
    return replace(
        found,
        eos_token_ids=given.eos_token_ids or found.eos_token_ids,
        pad_token_id=given.pad_token_id if given.pad_token_id is not None else found.pad_token_id,
        decoder_start_token_id=(given.decoder_start_token_id if given.decoder_start_token_id is not None
                                else found.decoder_start_token_id),
    )
