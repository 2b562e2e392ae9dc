"""``export_model``: a user's own ``nn.Module`` built around the reference attention -> a checked ONNX file.

The user declares what the forward takes (``NAME:ROLE[:AXIS][:FEATURES]``: token ids, float sequences,
segment ids, padding masks; ``NAME:image[:CxHxW]`` and ``NAME:audio[:MELxFRAMES]``, sizes read off a Hugging
Face config when not given); everything else is read off the module:

- the outputs, and whether each has a row per position (per token) or one per item, from two eager runs
  at different sizes;
- the length axes along which right-padding (zeros or id 0 past each item's end, its mask False there)
  leaves every real output unchanged: the axes the batch runner and the server may pad. A classifier
  that pools without its mask, or a model that is not causal and reads unmasked keys, is not padded;
- the vocabulary of each tokens or segments input, from the embedding table its ids index in the exported
  graph (``graph_vocabularies``); until then the probes draw each input's ids below the table an eager run
  sees them index (``_id_tables``; below the smallest ``nn.Embedding`` where none is seen), so that BERT's
  token_type_ids stay within their 2 rows while its input_ids range over the vocabulary.

Then it goes the way of the lone block: torch.onnx.export with a dynamic batch and every length axis
dynamic, the fusion chain, parity against the module at unseen shapes on both padding sides, and the
Signature written into the file, so that runtime, batch and serving take the model like any other.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

from mha_deploy.errors import CheckpointError, ExportError, first_line
from mha_deploy.exporters.probes import output_axes, paddable_axes, unpadded_mask_warnings
from mha_deploy.exporters.reference_form import in_reference_form
from mha_deploy.exporters.torch_export import TRACE_BATCH, not_dynamic
from mha_deploy.signature import (
    AUDIO,
    BATCH_AXIS,
    ID_ROLES,
    IMAGE,
    MODEL_DTYPE,
    OUTPUT,
    PADDING_MASK,
    SEGMENTS,
    SEQUENCE,
    TOKENS,
    Signature,
    TensorSpec,
)
from mha_deploy.token_tables import indexed_tables, non_finite_rows

# The roles as the CLI spells them -> the Signature's.
ROLES = {"tokens": TOKENS, "sequence": SEQUENCE, "padding-mask": PADDING_MASK, "segments": SEGMENTS,
         "image": IMAGE, "audio": AUDIO}
# Roles without a length axis: sizes CxHxW and MELxFRAMES, every one fixed (only the batch is dynamic).
FIXED_SHAPES = {"image": ("channels", "height", "width"), "audio": ("mel", "frames")}
DEFAULT_AXIS = "seq"
# Tracing lengths per declared axis, in declaration order: >= 2, pairwise different, never the tracing batch
# (so that torch.export neither specialises an axis nor unifies two), and a second set for the probe run
# that tells a length axis from a fixed size.
_TRACE_LENGTHS = (3, 5, 7, 11)
_PROBE_BATCH, _PROBE_LENGTHS = 4, (6, 9, 13, 17)
# The layers whose input width is the width of the sequence that feeds them, in the order they are tried.
_WIDTH_OF = (
    (nn.Linear, lambda m: m.in_features),
    (nn.LayerNorm, lambda m: m.normalized_shape[-1]),
    (nn.MultiheadAttention, lambda m: m.embed_dim),
    (nn.Conv1d, lambda m: m.in_channels),
)
_OUTPUT_DTYPES = {torch.float32: MODEL_DTYPE, torch.float16: MODEL_DTYPE, torch.int64: "int64", torch.bool: "bool"}


@dataclass(frozen=True)
class InputDecl:
    """One declared input of the forward: ``NAME:ROLE[:AXIS][:FEATURES]`` on the command line, or
    ``NAME:image[:CxHxW]`` / ``NAME:audio[:MELxFRAMES]`` (no length axis; sizes from the module's config
    when not given)."""

    name: str
    role: str  # tokens | sequence | segments | padding-mask | image | audio
    axis: str | None = DEFAULT_AXIS  # None for an image or audio input
    features: int | None = None  # a sequence's width; read off the module when not given
    sizes: tuple[int, ...] | None = None  # an image's (C, H, W), audio's (mel, frames); read off the config if None

    @classmethod
    def parse(cls, text: str) -> InputDecl:
        parts = text.split(":")
        if len(parts) < 2 or not all(parts):
            raise ExportError(f"--input {text!r}: expected NAME:ROLE[:AXIS][:FEATURES], e.g. ids:tokens")
        name, role, rest = parts[0], parts[1], parts[2:]
        axis, features, sizes = DEFAULT_AXIS, None, None
        for part in rest:
            if part.isdigit():
                features = int(part)
            elif re.fullmatch(r"\d+(x\d+)+", part):
                sizes = tuple(int(size) for size in part.split("x"))
            elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
                axis = part
                if role in FIXED_SHAPES:
                    raise ExportError(f"--input {text!r}: an {role} input has no length axis; give its sizes "
                                      f"({_spelled_sizes(role)}) or nothing")
            else:
                raise ExportError(f"--input {text!r}: {part!r} is neither an axis name nor a feature width")
        if role in FIXED_SHAPES:
            if features is not None:  # one number for a several-axis size
                raise ExportError(f"--input {text!r}: an {role} input's sizes are "
                                  f"{_spelled_sizes(role)}, e.g. {name}:{role}:"
                                  f"{'3x224x224' if role == 'image' else '80x3000'}")
            return cls(name, role, None, None, sizes)
        if sizes is not None:
            raise ExportError(f"--input {text!r}: sizes AxB are for an image or audio input")
        return cls(name, role, axis, features)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ExportError(f"input {self.name}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role in FIXED_SHAPES:
            object.__setattr__(self, "axis", None)
            wanted = FIXED_SHAPES[self.role]
            if self.sizes is not None and (len(self.sizes) != len(wanted) or min(self.sizes) < 1):
                raise ExportError(f"input {self.name}: an {self.role} input's sizes are {', '.join(wanted)} "
                                  f"({_spelled_sizes(self.role)}), each at least 1; got {self.sizes}")
        elif self.sizes is not None:
            raise ExportError(f"input {self.name}: sizes are for an image or audio input")
        if self.axis == BATCH_AXIS:
            raise ExportError(f"input {self.name}: {BATCH_AXIS!r} is the batch axis, not a length axis")
        if self.features is not None and (self.role != "sequence" or self.features < 1):
            raise ExportError(f"input {self.name}: a feature width is for a sequence input, and at least 1")


def _spelled_sizes(role: str) -> str:
    """``CHANNELSxHEIGHTxWIDTH``: how an image's or audio input's sizes are written on the command line."""
    return "x".join(axis.upper() for axis in FIXED_SHAPES[role])


def import_model_file(path: Path, spec: str | None = None):
    """The Python file at ``path``, imported as ``--module`` imports a user's file: under a name of its own,
    its neighbours importable as they are when the user runs it. ``spec`` (the ``--module`` argument, else the
    path) names it in errors."""
    spec = spec or str(path)
    if not path.is_file():
        raise ExportError(f"--module {spec!r}: {path} {'is not a file' if path.exists() else 'does not exist'}")
    name = f"_mha_deploy_user_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ExportError(f"--module {spec!r}: {path} cannot be imported as Python source")
    source = importlib.util.module_from_spec(loader_spec)
    # The file's own imports of its neighbours resolve as they do when the user runs it.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = source
    try:
        loader_spec.loader.exec_module(source)
    except SystemExit as exc:
        raise ExportError(f"--module {spec!r}: importing {path} {_exited(exc)}") from exc
    except Exception as exc:
        raise ExportError(f"--module {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    return source


def _exited(exc: SystemExit) -> str:
    """A user's code that called ``sys.exit`` (a script's ``if __name__`` guard missing, an argparse run at
    import): said as such, so that the tool does not exit with the user's status and no word."""
    return (f"called sys.exit({exc.code!r}) (SystemExit): build the module without exiting, e.g. keep script "
            "code (argument parsing, training) under `if __name__ == \"__main__\":`")


def load_factory(spec: str) -> nn.Module:
    """``FILE.py:FACTORY`` -> the ``nn.Module`` that calling ``FACTORY()`` from that file returns."""
    path_text, _, factory = spec.rpartition(":")
    if not path_text or not factory.isidentifier():
        raise ExportError(f"--module {spec!r}: expected FILE.py:FACTORY, e.g. model.py:build")
    path = Path(path_text)
    source = import_model_file(path, spec)
    build = getattr(source, factory, None)
    if not callable(build):
        found = sorted(n for n, v in vars(source).items() if callable(v) and not n.startswith("_"))
        raise ExportError(f"--module {spec!r}: {path} has no callable {factory!r} (it has: {', '.join(found)})")
    try:
        module = build()
    except SystemExit as exc:
        raise ExportError(f"--module {spec!r}: {factory}() {_exited(exc)}") from exc
    except Exception as exc:
        raise ExportError(f"--module {spec!r}: {factory}() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, nn.Module):
        raise ExportError(f"--module {spec!r}: {factory}() returned a {type(module).__name__}, not an nn.Module")
    return module


def declare_inputs(inputs: Sequence[InputDecl | str]) -> tuple[InputDecl, ...]:
    decls = tuple(d if isinstance(d, InputDecl) else InputDecl.parse(d) for d in inputs)
    if not decls:
        raise ExportError("declare the forward's inputs: --input NAME:ROLE for each, e.g. --input ids:tokens")
    names = [d.name for d in decls]
    if duplicate := next((n for n in names if names.count(n) > 1), None):
        raise ExportError(f"input {duplicate} is declared twice")
    for decl in decls:
        if decl.role == "padding-mask" and not any(d.role in ("tokens", "sequence") and d.axis == decl.axis
                                                   for d in decls):
            raise ExportError(
                f"input {decl.name}: a padding mask marks a tokens or sequence input on its axis {decl.axis!r}, "
                f"and none is declared there (give both the same axis: NAME:ROLE:AXIS)"
            )
        if decl.role == "segments" and not any(d.role == "tokens" and d.axis == decl.axis for d in decls):
            raise ExportError(
                f"input {decl.name}: segment ids mark the positions of a tokens input on their axis {decl.axis!r}, "
                f"and none is declared there (give both the same axis: NAME:ROLE:AXIS)"
            )
    if not any(d.role in ("tokens", "sequence", *FIXED_SHAPES) for d in decls):
        raise ExportError("declare at least one tokens, sequence, image or audio input")
    return decls


@dataclass(frozen=True)
class Binding:
    """How the declared inputs reach the user's forward: by name, whatever the order of either. ``positional``
    holds the indices (into the declared inputs) passed positionally, which only a forward whose parameters
    have no names to bind to needs (``*args``, positional-only parameters); ``keywords`` the parameter name ->
    index of the rest. Parameters not declared keep their defaults."""

    positional: tuple[int, ...]
    keywords: tuple[tuple[str, int], ...]
    # Parameters the export sets itself (name, value): ``use_cache=False`` (``_no_cache_object``)
    fixed: tuple[tuple[str, object], ...] = ()

    @classmethod
    def in_order(cls, count: int) -> Binding:
        """Every declared input positionally, in order: a forward torch wrapped beyond inspection."""
        return cls(tuple(range(count)), ())

    def call(self, module: nn.Module, inputs: Sequence[torch.Tensor]):
        return module(*(inputs[i] for i in self.positional), **{name: inputs[i] for name, i in self.keywords},
                      **dict(self.fixed))


def check_forward(module: nn.Module, decls: Sequence[InputDecl]) -> Binding:
    """How the declared inputs bind to the module's forward: each to the parameter of its name, in any order;
    a parameter without a default that no input is declared for is an error naming it."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return Binding.in_order(len(decls))  # the trace will tell
    takes = f"{type(module).__name__}.forward({', '.join(_spelled(p) for p in parameters)})"
    named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    index = {d.name: i for i, d in enumerate(decls)}
    if not named:
        if any(p.kind == p.VAR_POSITIONAL for p in parameters):
            return Binding.in_order(len(decls))  # forward(*inputs): declaration order is all there is
        if any(p.kind == p.VAR_KEYWORD for p in parameters):
            return Binding((), tuple((d.name, i) for i, d in enumerate(decls)))
    names = [p.name for p in named]
    for decl in decls:
        if decl.name not in names:
            raise ExportError(
                f"input {decl.name} is not a parameter of {takes}: name each input after the parameter it is "
                f"passed as ({', '.join(names) or 'none'})"
            )
    missing = [p.name for p in named if p.name not in index and p.default is p.empty]
    if missing:
        raise ExportError(
            f"{takes} also needs {', '.join(missing)}: declare an input for every parameter without a default "
            f"(--input {missing[0]}:ROLE)"
        )
    positional: list[int] = []
    for parameter in named:
        if parameter.kind != parameter.POSITIONAL_ONLY or parameter.name not in index:
            continue
        before = [p.name for p in named[: named.index(parameter)] if p.kind == p.POSITIONAL_ONLY]
        if len(positional) != len(before):  # a positional-only parameter before it is left to its default
            skipped = next(name for name in before if name not in index)
            raise ExportError(
                f"input {parameter.name} of {takes} is positional-only and follows {skipped}, which is not "
                f"declared: declare {skipped} too"
            )
        positional.append(index[parameter.name])
    keywords = tuple((p.name, index[p.name]) for p in named if p.name in index and p.kind != p.POSITIONAL_ONLY)
    return Binding(tuple(positional), keywords)


def without_cache_object(module: nn.Module, binding: Binding) -> Binding | None:
    """``binding`` calling the forward with ``use_cache=False``, for a forward that returned a cache object (a Hugging
    Face decoder's ``DynamicCache``, which is not a tensor: its ``use_cache`` on by default or by its config, as
    ``from_pretrained`` leaves it); None when the forward has no ``use_cache`` parameter left to set."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    parameter = parameters.get("use_cache")
    taken = {name for name, _ in binding.keywords}
    if parameter is None or parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) or \
            "use_cache" in taken or binding.fixed:
        return None
    return replace(binding, fixed=(("use_cache", False),))


def _spelled(parameter: inspect.Parameter) -> str:
    prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
    return prefix + parameter.name


def _width_layer(module: nn.Module) -> tuple[str, nn.Module, int] | None:
    """(name, layer, input width) of the first layer in ``module`` whose input width is known (``_WIDTH_OF``)."""
    for name, layer in module.named_modules():
        for kind, width in _WIDTH_OF:
            if isinstance(layer, kind):
                return name, layer, int(width(layer))
    return None


def width_guesses(module: nn.Module, decls: Sequence[InputDecl]) -> str:
    """For an error on the declared inputs: where the widths that were not declared were read, and how to
    declare them ('' when every sequence's width was declared)."""
    guessed = [d for d in decls if d.role == "sequence" and d.features is None]
    found = _width_layer(module)
    if not guessed or found is None:
        return ""
    name, layer, width = found
    return (f"; the width {width} of {', '.join(d.name for d in guessed)} was read off {name or 'the module'} "
            f"({type(layer).__name__}), the first layer with an input width: if that is not the input's width, "
            f"declare it, e.g. --input {guessed[0].name}:sequence:{guessed[0].axis}:WIDTH")


def feature_width(module: nn.Module, decl: InputDecl) -> int:
    if decl.features is not None:
        return decl.features
    if (found := _width_layer(module)) is not None:
        return found[2]
    raise ExportError(
        f"input {decl.name}: cannot tell the sequence's feature width from the module; declare it, "
        f"e.g. --input {decl.name}:sequence:{decl.axis}:80"
    )


def fixed_shape(module: nn.Module, decl: InputDecl) -> tuple[int, ...]:
    """An image's (channels, height, width) or audio's (mel, frames): as declared, else from the module's Hugging
    Face config (``num_channels`` and ``image_size``; Whisper's ``num_mel_bins`` and ``2 * max_source_positions``
    frames, the only length its encoder takes)."""
    if decl.sizes is not None:
        return decl.sizes
    config = getattr(module, "config", None)
    if decl.role == "image":
        # CLIP's two towers: the image sizes are its vision config's.
        config = getattr(config, "vision_config", None) or config
        channels, size = getattr(config, "num_channels", None), getattr(config, "image_size", None)
        size = (size, size) if type(size) is int else tuple(size) if isinstance(size, (list, tuple)) else ()
        if type(channels) is int and len(size) == 2 and all(type(n) is int for n in size):
            return (channels, *size)
        example = "3x224x224"
    else:
        mel, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
        if type(mel) is int and type(positions) is int:
            return (mel, 2 * positions)
        example = "80x3000"
    raise ExportError(
        f"input {decl.name}: the module has no config that gives the {decl.role}'s sizes "
        f"({', '.join(FIXED_SHAPES[decl.role])}); declare them, e.g. --input {decl.name}:{decl.role}:{example}"
    )


def probe_vocabulary(module: nn.Module) -> int:
    """The ids the probes draw before the graph says which table the ids index: below the smallest
    ``nn.Embedding`` (ids there index every table the module holds), else below 2."""
    sizes = [layer.num_embeddings for layer in module.modules() if isinstance(layer, nn.Embedding)]
    return min(sizes) if sizes else 2


def graph_vocabularies(specs: Sequence[TensorSpec], model: onnx.ModelProto) -> tuple[tuple[TensorSpec, ...], list[str]]:
    """``specs`` with each tokens input's vocabulary read off ``model``: the rows of the tables its ids index
    (``mha_deploy.token_tables``), so that parity draws ids across the whole table and the runtime refuses
    the rest. A table that cannot be read leaves the vocabulary unknown, with a warning; a table whose rows
    the ids index hold NaN or Inf is an ExportError (parity would rarely draw those ids; every run would)."""
    found, warnings = [], []
    for spec in specs:
        if spec.role in ID_ROLES:
            tables, unreadable = indexed_tables(model, spec.name)
            for table, rows in non_finite_rows(model, tables).items():
                shape = next(f"[{t.rows}, {t.width}]" for t in tables if t.name == table)
                listed = ", ".join(map(str, rows[:8])) + (f" and {len(rows) - 8} more" if len(rows) > 8 else "")
                raise ExportError(
                    f"input {spec.name}: the {shape} embedding table its ids index ({table} in the graph) holds "
                    f"NaN or Inf in row(s) {listed}, so those ids give NaN: fix those rows of the checkpoint "
                    "(zero them if the ids are never used)"
                )
            rows = None if unreadable or not tables else tables[0].rows
            if rows is None:
                warnings.append(
                    f"input {spec.name}: the vocabulary is unknown (no Gather from a stored [vocab, width] table "
                    "reads the ids as they are): parity draws ids 0 and 1 only, and runs refuse only negative ids"
                )
            spec = replace(spec, vocab=rows)
        found.append(spec)
    return tuple(found), warnings


def load_checkpoint(module: nn.Module, path: str | os.PathLike) -> None:
    """Load ``path`` (safetensors, or a torch file through ``weights_only``) into ``module``, strictly."""
    from mha_deploy.models.checkpoint import read_state_dict

    state, _ = read_state_dict(path)
    expected = module.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    misshapen = [
        f"{key} {tuple(state[key].shape)} (the module's is {tuple(expected[key].shape)})"
        for key in expected
        if key in state and state[key].shape != expected[key].shape
    ]
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if keys:
            problems.append(f"{label} {', '.join(keys[:8])}{f' and {len(keys) - 8} more' if len(keys) > 8 else ''}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit {type(module).__name__}: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)


# Plain attribute values a forward may count or toggle (self.calls += 1), kept and compared by value.
_SCALARS = (bool, int, float, str, type(None))


class ModuleState:
    """What running a module may change of it: each submodule's training flag, its buffers (in place or
    rebound) and parameters (in place), and its plain scalar attributes; ``copy`` keeps the buffers' values
    too, so that ``restore`` can put them back."""

    def __init__(self, module: nn.Module, copy: bool = False):
        self.training = {layer: layer.training for layer in module.modules()}
        self.tensors = {
            name: (tensor, tensor._version)
            for name, tensor in (*module.named_buffers(remove_duplicate=False),
                                 *module.named_parameters(remove_duplicate=False))
        }
        self.buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()} if copy else {}
        self.attributes = {
            (prefix, key): value
            for prefix, layer in module.named_modules()
            for key, value in vars(layer).items()
            if not key.startswith("_") and key != "training" and isinstance(value, _SCALARS)
        }

    def changed(self, module: nn.Module) -> list[str]:
        """The buffers, parameters and attributes of ``module`` that differ from when this state was taken."""
        now = dict((*module.named_buffers(remove_duplicate=False), *module.named_parameters(remove_duplicate=False)))
        tensors = [name for name, (tensor, version) in self.tensors.items()
                   if now.get(name) is not tensor or tensor._version != version]
        layers = dict(module.named_modules())
        attributes = [f"{prefix}.{key}" if prefix else key for (prefix, key), value in self.attributes.items()
                      if prefix in layers and getattr(layers[prefix], key, value) != value]
        return tensors + attributes

    def restore(self, module: nn.Module) -> None:
        """Training flags, buffers and attributes as they were (parameters a forward changed are not kept)."""
        for layer, training in self.training.items():
            layer.training = training
        layers = dict(module.named_modules())
        with torch.no_grad():
            for name, value in self.buffers.items():
                prefix, _, leaf = name.rpartition(".")
                original = self.tensors[name][0]
                if layers.get(prefix) is not None and original.shape == value.shape:
                    original.copy_(value)
                    layers[prefix]._buffers[leaf] = original
        for (prefix, key), value in self.attributes.items():
            if prefix in layers:
                setattr(layers[prefix], key, value)


def not_a_function_of_inputs(module: nn.Module, before: ModuleState, first, again) -> ExportError | None:
    """The error for a forward whose two runs on the same inputs gave ``first`` and ``again``, if they differ:
    an exported graph is a fixed function of its inputs, so parity could only fail, saying nothing of why."""
    differ = [(a - b).abs().max().item() if a.is_floating_point() else 1.0 for a, b in zip(first, again, strict=True)
              if a.shape != b.shape or not torch.equal(a, b)]
    if not differ:
        return None
    changed = before.changed(module)
    why = (f"it changes its state as it runs ({', '.join(changed[:6])}); keep state updates out of forward"
           if changed else
           "it draws random numbers (dropout active in eval mode, torch.rand/randn/bernoulli in forward); "
           "make it deterministic, or pass the randomness in as an input")
    return ExportError(f"{type(module).__name__}.forward gives different outputs for the same inputs (by up to "
                       f"{max(differ):.3g}): {why}; an exported graph computes a fixed function of its inputs")


class NotATensorOutput(ExportError):
    """The forward returned something other than tensors (and tuples, lists, dicts of them, or None)."""


class DeclaredModule(nn.Module):
    """The user's module as the graph runs it: bool padding masks in, converted to the dtype its forward
    takes (bool, or 0/1 integers or floats for code written around tokenizers' masks), and a flat tuple of
    tensors out (a tensor, a tuple or list, or a dict's values)."""

    variadic_from = 0  # torch_export: forward takes every input through *inputs

    def __init__(self, module: nn.Module, mask_dtypes: Sequence[torch.dtype | None], binding: Binding):
        super().__init__()
        self.module = module
        self.mask_dtypes = tuple(mask_dtypes)
        self.binding = binding

    def module_args(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The declared inputs as the user's forward takes them (masks in its dtype)."""
        return [x if dtype is None else x.to(dtype) for x, dtype in zip(inputs, self.mask_dtypes, strict=True)]

    def forward(self, *inputs):
        return tuple(flatten_outputs(self.binding.call(self.module, self.module_args(inputs))))


def named_outputs(result) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a forward returns, in order, each with the name of where it was returned: a lone tensor is
    ``output``; a dict's value its key; a tuple's or list's item ``output_<i>`` at the top, ``<name>.<i>``
    inside (``hidden_states.0``). ``None`` values (a Hugging Face output's loss, its cache when off) are skipped
    without moving any other name; a result holding one tensor names it ``output`` unless a dict names it."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value, name: str | None) -> None:
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            found.append((name or "output", value))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, str(key) if name is None else f"{name}.{key}")
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                walk(item, f"output_{index}" if name is None else f"{name}.{index}")
        else:
            raise NotATensorOutput(
                f"the forward returns a {type(value).__name__}{f' as {name}' if name else ''}: outputs must be "
                "tensors (or tuples, lists or dicts of them)"
            )

    walk(result, None)
    if len(found) == 1 and not isinstance(result, Mapping):
        return [("output", found[0][1])]
    return found


def flatten_outputs(result) -> list[torch.Tensor]:
    """The tensors of ``named_outputs(result)``, in the same order."""
    return [tensor for _, tensor in named_outputs(result)]


def default_output_names(result) -> tuple[str, ...]:
    """The names of ``named_outputs(result)``, which must differ (else ``--output-name`` must name them)."""
    names = tuple(name for name, _ in named_outputs(result))
    if duplicate := next((n for n in names if names.count(n) > 1), None):
        raise ExportError(f"two of the forward's outputs would both be named {duplicate}: name them with "
                          "--output-name, one per output in order")
    return names


@dataclass
class _Probe:
    """The declared inputs at one set of sizes."""

    batch: int
    lengths: dict[str, int]  # length axis -> length

    def tensors(self, decls, vocab: Mapping[str, int], widths, gen) -> list[torch.Tensor]:
        """Random inputs, each id input's below its ``vocab``; padding masks True everywhere; images and audio
        at their fixed sizes (``widths``)."""
        tensors = []
        for decl in decls:
            if decl.role in FIXED_SHAPES:
                tensors.append(torch.randn(self.batch, *widths[decl.name], generator=gen))
                continue
            length = self.lengths[decl.axis]
            if decl.role in ("tokens", "segments"):
                tensors.append(torch.randint(0, vocab[decl.name], (self.batch, length), generator=gen))
            elif decl.role == "sequence":
                tensors.append(torch.randn(self.batch, length, widths[decl.name], generator=gen))
            else:
                tensors.append(torch.ones(self.batch, length, dtype=torch.bool))
        return tensors


def _mask_dtypes(module, decls, samples, binding: Binding) -> list[torch.dtype | None]:
    """bool masks if the forward takes them; else the first of int64, float32 it runs with."""
    dtypes: list[torch.dtype | None] = [None] * len(decls)
    masks = [i for i, d in enumerate(decls) if d.role == "padding-mask"]
    for dtype in (None, torch.int64, torch.float32):
        for i in masks:
            dtypes[i] = dtype
        try:
            with torch.no_grad():
                DeclaredModule(module, dtypes, binding)(*samples)
            return dtypes
        except ExportError:
            raise
        except Exception as exc:
            failure = exc
    declared = ", ".join(f"{d.name}:{d.role}" for d in decls)
    raise ExportError(
        f"the module fails on the declared inputs ({declared}): {type(failure).__name__}: {first_line(failure)}"
        + width_guesses(module, decls)
    )


def _output_specs(
    names: Sequence[str], at_first: Sequence[torch.Tensor], at_second: Sequence[torch.Tensor], first: _Probe,
    second: _Probe,
) -> tuple[TensorSpec, ...]:
    """Each output's axes, from its tensors at two probes' sizes: batch first, a length axis where its size
    follows one, fixed sizes elsewhere."""
    specs = []
    for name, a, b in zip(names, at_first, at_second, strict=True):
        dtype = _OUTPUT_DTYPES.get(a.dtype)
        if dtype is None:
            raise ExportError(f"output {name} is {a.dtype}: outputs must be float32, float16, int64 or bool")
        specs.append(TensorSpec(name, OUTPUT, dtype, output_axes(name, a.shape, b.shape, first, second)))
    return tuple(specs)


def _paddable_axes(wrapper: DeclaredModule, signature: Signature) -> tuple[str, ...]:
    """The length axes along which right-padding an item leaves each of its real outputs unchanged (probes)."""

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            outputs = wrapper(*(torch.from_numpy(feeds[name]) for name in signature.input_names))
        return {name: tensor.double().numpy() for name, tensor in zip(signature.output_names, outputs, strict=True)}

    return paddable_axes(signature, run)


def trace_failure(exc: BaseException, signature: Signature) -> ExportError:
    """A one-line error for a module that torch.export cannot trace with the declared dynamic axes."""
    text = str(exc)
    for axis in (*signature.sequence_axes, BATCH_AXIS):
        if re.search(rf"\b{re.escape(axis)}\b", text) and ("specializ" in text or "Constraints violated" in text):
            return not_dynamic(
                signature, axis,
                "its code fixes that size (a constant shape, a view to a fixed length, a Python loop over it); "
                f"torch.export said: {first_line(text)}",
            )
    # torch.onnx.export wraps torch.export's error in paragraphs of next steps; its cause comes after them.
    summary = re.search(r"## Exception summary\s+<class '(?:[\w.]+\.)?(\w+)'>: ([^\n]*)", text)
    where = _user_code(text)
    if "data-dependent" in text or (summary is not None and "DataDependent" in summary.group(1)):
        return ExportError(
            f"the forward decides on a tensor's values{where}, which a traced graph cannot (it holds one branch "
            "for every input): compute both and pick with torch.where, or use torch.cond"
        )
    if summary is not None:
        return ExportError(f"torch.onnx.export failed: {summary.group(1)}: {first_line(summary.group(2))}{where}")
    return ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {first_line(text)}")


def _user_code(text: str) -> str:
    """`` at FILE:LINE (`code`)``: the last frame outside torch an export error quotes, or ''."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*([^\n]+)', text)
    frames = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0]]
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f" at {path}:{line} (`{code.strip()}`)"


@dataclass
class Declared:
    """A user's module ready to export: the module as declared (the parity reference), the copy to trace
    (torch's own attention in the reference form, ``reference_form``), its Signature and tracing facts."""

    wrapper: DeclaredModule
    traced: DeclaredModule
    signature: Signature
    d_model: int
    warnings: list[str]


def declare_model(
    module: nn.Module, inputs: Sequence[InputDecl | str], output_names: Sequence[str] | None = None
) -> Declared:
    """Read the Signature of ``module`` for the declared ``inputs`` (see the module docstring)."""
    module = module.eval()
    decls = declare_inputs(inputs)
    binding = check_forward(module, decls)
    axes = list(dict.fromkeys(d.axis for d in decls if d.axis is not None))
    if len(axes) > len(_TRACE_LENGTHS):
        raise ExportError(f"{len(axes)} length axes declared; at most {len(_TRACE_LENGTHS)} are supported")
    vocab = dict.fromkeys((d.name for d in decls if d.role in ("tokens", "segments")), probe_vocabulary(module))
    widths = {d.name: feature_width(module, d) for d in decls if d.role == "sequence"}
    fixed = {d.name: fixed_shape(module, d) for d in decls if d.role in FIXED_SHAPES}
    first = _Probe(TRACE_BATCH, {axis: _TRACE_LENGTHS[i] for i, axis in enumerate(axes)})
    second = _Probe(_PROBE_BATCH, {axis: _PROBE_LENGTHS[i] for i, axis in enumerate(axes)})
    gen = torch.Generator().manual_seed(0)
    runs = [first.tensors(decls, vocab, widths | fixed, gen)]
    before = ModuleState(module)
    notes = []
    try:
        mask_dtypes = _mask_dtypes(module, decls, runs[0], binding)
    except NotATensorOutput:
        binding = without_cache_object(module, binding)
        if binding is None:
            raise
        mask_dtypes = _mask_dtypes(module, decls, runs[0], binding)
        notes.append(f"{type(module).__name__}.forward called with use_cache=False: the cache object it returns "
                     "otherwise is not a tensor (with --kv-cache the file keeps its own cache)")
    wrapper = DeclaredModule(module, mask_dtypes, binding)
    # Each id input's own table, now that a run has shown which it indexes: the probes draw within it.
    vocab |= _id_tables(wrapper, decls, runs[0])
    runs = [first.tensors(decls, vocab, widths | fixed, gen), second.tensors(decls, vocab, widths | fixed, gen)]
    with torch.no_grad():
        result = binding.call(module, wrapper.module_args(runs[0]))
    at_first = flatten_outputs(result)
    with torch.no_grad():
        if error := not_a_function_of_inputs(module, before, at_first, wrapper(*runs[0])):
            raise error
    count = len(at_first)
    names = tuple(output_names) if output_names else default_output_names(result)
    if len(names) != count:
        raise ExportError(f"{len(names)} output names given, the forward returns {count} tensors")
    with torch.no_grad():
        at_second = wrapper(*runs[1])
    outputs = _output_specs(names, at_first, at_second, first, second)
    specs = tuple(_input_spec(d, decls, vocab, widths, fixed) for d in decls)
    draft = Signature.custom(specs, outputs)
    signature = Signature.custom(specs, outputs, _paddable_axes(wrapper, draft))
    warnings = [*notes, *unpadded_mask_warnings(signature)]
    d_model = next(iter(widths.values()), 0) or _embedding_width(module) or _config_width(module)
    traced, _ = in_reference_form(module)
    return Declared(wrapper, DeclaredModule(traced, wrapper.mask_dtypes, binding), signature, d_model, warnings)


def _input_spec(decl: InputDecl, decls, vocab: Mapping[str, int], widths, fixed) -> TensorSpec:
    """The TensorSpec of one declared input (an id input's probe vocabulary until the graph states its table)."""
    if decl.role == "padding-mask":
        # It marks the first tokens or sequence input of its axis.
        marks = next(d.name for d in decls if d.role in ("tokens", "sequence") and d.axis == decl.axis)
        return TensorSpec(decl.name, PADDING_MASK, "bool", (BATCH_AXIS, decl.axis), marks=marks)
    if decl.role in ("tokens", "segments"):
        return TensorSpec(decl.name, ROLES[decl.role], "int64", (BATCH_AXIS, decl.axis), vocab=vocab[decl.name])
    if decl.role in FIXED_SHAPES:
        return TensorSpec(decl.name, ROLES[decl.role], MODEL_DTYPE, (BATCH_AXIS, *fixed[decl.name]))
    return TensorSpec(decl.name, SEQUENCE, MODEL_DTYPE, (BATCH_AXIS, decl.axis, widths[decl.name]))


def _id_tables(wrapper: DeclaredModule, decls: Sequence[InputDecl], sample: Sequence[torch.Tensor]) -> dict[str, int]:
    """Each tokens or segments input -> the rows of the smallest ``nn.Embedding`` table an eager run on ``sample``
    indexes with its ids as given (BERT's token_type_ids: the 2-row segment table); inputs seen indexing none are
    left out (their probes keep ids below the smallest table)."""
    tables = {id(layer.weight): layer.num_embeddings for layer in wrapper.module.modules()
              if isinstance(layer, nn.Embedding)}
    ids = {d.name: tensor for d, tensor in zip(decls, sample, strict=True) if d.role in ("tokens", "segments")}
    found: dict[str, int] = {}
    with _watched_embeddings() as calls, torch.no_grad():
        wrapper(*sample)
    for indices, weight in calls:
        rows = tables.get(id(weight))
        for name, tensor in ids.items():
            if rows is not None and indices.shape == tensor.shape and torch.equal(indices, tensor):
                found[name] = min(found.get(name, rows), rows)
    return found


@contextlib.contextmanager
def _watched_embeddings():
    """Every ``F.embedding`` call's (indices, weight) while the block runs: subclasses that index their table with
    positions they compute (BART's, Marian's position tables) call it too, not the modules' hooks."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    embedding = F.embedding

    def watched(indices, weight, *args, **kwargs):
        calls.append((indices, weight))
        return embedding(indices, weight, *args, **kwargs)

    F.embedding = watched
    try:
        yield calls
    finally:
        F.embedding = embedding


def _config_width(module: nn.Module) -> int:
    """The hidden width a Hugging Face config states (``hidden_size``, Whisper's ``d_model``), else 0: the width of
    a model whose inputs are images or audio, which neither the inputs nor an embedding table give."""
    config = getattr(module, "config", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    return width if type(width) is int else 0


# Two lengths the position tables are read at: short, so that any table holds them.
_POSITION_PROBE_LENGTHS = (3, 7)
# The token ids the probes are filled with, one at a time (any vocabulary holds them).
_POSITION_PROBE_IDS = (0, 1, 2)


@dataclass(frozen=True)
class PositionTable:
    """An ``nn.Embedding`` indexed by position: the longest sequence it takes, and where it sits."""

    name: str
    max_length: int


def position_tables(wrapper: DeclaredModule, signature: Signature) -> list[PositionTable]:
    """The ``nn.Embedding`` s of the user's module indexed by position, read off two eager runs, unpadded, at
    two lengths (every length axis alike): those whose largest index grows by exactly the length's growth (an
    ``arange`` of the length plus an offset: GPT-2's, BART's offset 2, RoBERTa's ``padding_idx + 1 +
    cumsum(mask)``). Such a table holding ``n`` rows with the first position at index ``c`` takes at most
    ``n - c`` tokens; a longer sequence would index past it (ONNX Runtime: ``Gather ... idx=...``). A
    position table held as a plain tensor and sliced (a sinusoidal buffer) is not read."""

    user = wrapper.module
    names = {layer: name for name, layer in user.named_modules() if isinstance(layer, nn.Embedding)}
    growth = _POSITION_PROBE_LENGTHS[1] - _POSITION_PROBE_LENGTHS[0]
    found: dict[nn.Embedding, int] = {}
    # Every token the same id, tried with a few: RoBERTa's positions count the ids that are not its padding id,
    # which one filler (1) would be.
    for filler in _POSITION_PROBE_IDS:
        runs = [_largest_indices(wrapper, signature, length, names, filler) for length in _POSITION_PROBE_LENGTHS]
        largest = [seen for seen, _ in runs]
        token_tables = set().union(*(tokens for _, tokens in runs))
        for layer in names:
            grows = layer in largest[0] and largest[1].get(layer) == largest[0][layer] + growth
            if grows and layer not in token_tables:
                first = largest[0][layer] - (_POSITION_PROBE_LENGTHS[0] - 1)
                found.setdefault(layer, layer.num_embeddings - first)
    return [PositionTable(names[layer], length) for layer, length in found.items()]


def _largest_indices(
    wrapper: DeclaredModule, signature: Signature, length: int, tables, filler: int
) -> tuple[dict, set]:
    """One unpadded run at ``length``, every token id ``filler``: each of ``tables`` -> the largest index it was
    given, and those indexed by a tokens input as it is (a vocabulary, whatever its indices do)."""
    from mha_deploy.inputs import InputCase, make_inputs

    feeds = make_inputs(signature, 0, InputCase(2, length, length, "none"), seed=0)
    for spec in signature.inputs:
        if spec.role == TOKENS:
            feeds[spec.name] = np.full_like(feeds[spec.name], filler)
        elif spec.role == SEGMENTS:  # segment 0 throughout: any segment table holds it
            feeds[spec.name] = np.zeros_like(feeds[spec.name])
    ids = [torch.from_numpy(feeds[spec.name]) for spec in signature.inputs if spec.role == TOKENS]
    by_weight = {id(layer.weight): layer for layer in tables}
    seen: dict[nn.Embedding, int] = {}
    token_tables: set[nn.Embedding] = set()
    with _watched_embeddings() as calls, torch.no_grad():
        wrapper(*(torch.from_numpy(feeds[name]) for name in signature.input_names))
    for indices, weight in calls:
        layer = by_weight.get(id(weight))
        if layer is not None and indices.numel():
            seen[layer] = max(seen.get(layer, -1), int(indices.max()))
            if any(indices.shape == t.shape and torch.equal(indices, t) for t in ids):
                token_tables.add(layer)
    return seen, token_tables


def _embedding_width(module: nn.Module) -> int:
    return next((layer.embedding_dim for layer in module.modules() if isinstance(layer, nn.Embedding)), 0)


def count_attentions(model: onnx.ModelProto) -> int:
    """Attention subgraphs (Softmax over MatMul scores) and attention ops in a plain export."""
    import onnx_ir as ir

    from mha_deploy.exporters.fusion.pipeline import unfused_attentions

    return len(unfused_attentions(ir.serde.deserialize_model(model)))


__all__ = [
    "ROLES",
    "Binding",
    "Declared",
    "DeclaredModule",
    "InputDecl",
    "ModuleState",
    "check_forward",
    "count_attentions",
    "declare_inputs",
    "declare_model",
    "graph_vocabularies",
    "load_checkpoint",
    "load_factory",
    "position_tables",
    "trace_failure",
]
