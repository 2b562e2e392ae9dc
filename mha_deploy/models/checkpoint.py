"""Read attention weights saved under any common naming scheme into the reference module."""

from __future__ import annotations

import os
import pickle
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from mha_deploy.atomic import atomic_path
from mha_deploy.checkpoint_names import PACKED, PARAMS, PROJECTIONS, names_of, names_text
from mha_deploy.errors import CheckpointError, ModelConfigError
from mha_deploy.models.attention import MultiHeadAttention

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")
REFERENCE_KEYS = tuple(f"{ref}.{param}" for ref in PROJECTIONS for param in PARAMS)
WEIGHT_KEYS = tuple(f"{ref}.weight" for ref in PROJECTIONS)
BIAS_KEYS = tuple(f"{ref}.bias" for ref in PROJECTIONS)

_HOW_TO_SAVE = "save one with torch.save(module.state_dict(), path)"
# How many names an error lists before "and N more": a big checkpoint has thousands of keys.
_LISTED = 8


def _source_names() -> dict[str, tuple[str, ...]]:
    """Every recognised key name -> the reference keys it holds, stacked along dim 0 in this order."""
    names = {
        f"{alias}.{param}": (f"{ref}.{param}",)
        for ref, (_, aliases) in PROJECTIONS.items()
        for alias in aliases
        for param in PARAMS
    }
    return {**names, **PACKED}


_SOURCES = _source_names()


def read_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Return the tensors and the metadata (empty for torch files) of a checkpoint file."""
    path = Path(path)
    source = f"checkpoint {path}"
    if not path.is_file():
        raise CheckpointError(f"{source}: {'not a file' if path.exists() else 'file not found'}")
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        state, metadata = _read_safetensors(path, source)
    elif suffix in TORCH_SUFFIXES:
        state, metadata = _unwrap(_read_torch(path, source)), {}
    else:
        accepted = ", ".join(SAFETENSORS_SUFFIXES + TORCH_SUFFIXES)
        raise CheckpointError(f"{source}: unknown suffix {suffix or '(none)'!r}; expected one of {accepted}")
    _require_tensors(state, source)
    return dict(state), metadata


def _read_safetensors(path: Path, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        state = safetensors.torch.load_file(path, device="cpu")
        with safetensors.safe_open(path, framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:  # the Rust reader raises SafetensorError and OSError alike
        raise CheckpointError(f"{source}: cannot read it as safetensors ({exc})") from exc
    return state, dict(metadata)


def _read_torch(path: Path, source: str) -> object:
    try:
        # weights_only: a pickle may run arbitrary code, so only tensors and plain containers load.
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words it "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module x is blocked";
        # protocols 4 and 5 name a global with STACK_GLOBAL, which torch's safe loader refuses as "Unsupported
        # operand 149" without naming it: the pickle's opcodes (read, never run) do.
        found = re.search(r"GLOBAL (\S+)", str(exc))
        unsafe = found.group(1) if found is not None else _unsafe_global(path)
        if unsafe is not None:
            raise CheckpointError(
                f"{source}: unsafe pickle refused: it pickles {unsafe}, which loading would import and "
                "call (how a malicious pickle runs code), so it is never unpickled; not a plain state dict of "
                f"tensors; {_HOW_TO_SAVE}"
            ) from exc
        if re.search(r"Unsupported operand 149\b", str(exc)):
            raise CheckpointError(
                f"{source}: pickled with protocol 4 or later, which torch.load(weights_only=True) does not read; "
                f"{_HOW_TO_SAVE} (its default protocol), or save it as .safetensors"
            ) from exc
        raise CheckpointError(
            f"{source}: cannot read it as a torch file (corrupt, not a pickle, or pickle opcodes a "
            "state dict never holds, which are refused unread)"
        ) from exc
    except Exception as exc:  # damaged files surface as many exception types
        raise CheckpointError(
            f"{source}: cannot read it as a torch file ({type(exc).__name__}: {exc})"
        ) from exc


def _unsafe_global(path: Path) -> str | None:
    """The first global the pickle in ``path`` (a plain pickle, or torch.save's zip holding one) names that
    torch's safe loader does not allow, read from its opcodes without running any; None when it names none or
    cannot be read."""
    import pickletools
    import zipfile

    from torch import _weights_only_unpickler

    allowed = set(_weights_only_unpickler._get_allowed_globals())
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                data = archive.read(member) if member is not None else b""
        else:
            data = path.read_bytes()
        strings: list[object] = []  # what the opcodes pushed, the last two of them being STACK_GLOBAL's operands
        memo: dict[int, object] = {}
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "STACK_GLOBAL"):
                name = arg.replace(" ", ".") if opcode.name == "GLOBAL" else ".".join(map(str, strings[-2:]))
                if name not in allowed:
                    return name
            elif opcode.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if opcode.name == "MEMOIZE" else arg] = strings[-1] if strings else None
            elif opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(arg))
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # a damaged file: the caller says so
        return None
    return None


def _unwrap(obj: object) -> object:
    if isinstance(obj, Mapping):
        for key in WRAPPER_KEYS:
            if isinstance(obj.get(key), Mapping):
                return obj[key]
    return obj


def _require_tensors(state: object, source: str) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{source}: not a plain state dict of tensors (it holds a {type(state).__name__}); {_HOW_TO_SAVE}"
        )
    bad = [
        f"{key!r} ({type(value).__name__})"
        for key, value in state.items()
        if not isinstance(key, str) or not isinstance(value, torch.Tensor)
    ]
    if bad:
        raise CheckpointError(
            f"{source}: not a plain state dict of tensors (non-tensor entries: {_listing(bad, 5)}); {_HOW_TO_SAVE}"
        )


def _listing(items: list[str], limit: int = _LISTED) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def to_reference_state_dict(
    state: Mapping[str, torch.Tensor], *, source: str = "state dict", prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Rename and split one attention block of ``state`` onto the reference keys ``W_q.weight`` ... ``W_o.bias``
    (``REFERENCE_KEYS``; the biases only if the checkpoint has them, for all four projections).

    ``prefix`` takes the block out of a bigger state dict (e.g. ``"layers.0.self_attn."``): keys outside it are
    ignored, keys under it must be the block's. Without it, ``state`` must hold the block alone, its keys
    possibly under one common prefix (``module.``). Raises one ``CheckpointError`` listing every missing,
    unexpected, conflicting or misshapen key, and the prefixes in ``state`` that hold a whole block.
    """
    _require_tensors(state, source)
    if prefix and not prefix.endswith("."):
        prefix += "."
    recognised, unexpected = _recognise(state, source, prefix)
    found = {name: state[key] for name, key in recognised.items()}
    d_model = _infer_d_model(found)
    providers = _providers(recognised)
    problems = []
    missing = _missing(providers)
    if missing:
        problems.append("missing " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected keys: " + _listing(unexpected))
    problems += _shape_problems(found, recognised, d_model)
    problems += [
        f"{ref} given by several keys: {', '.join(keys)}" for ref, keys in providers.items() if len(keys) > 1
    ]
    if problems:
        hints = _hints(state, providers, missing, unexpected, prefix)
        raise CheckpointError(f"{source}: " + "; ".join(problems + hints))
    return _split(found, d_model)


def _missing(providers: Mapping[str, list[str]]) -> list[str]:
    """The reference keys no key provides: every weight, and the biases unless none is given (bias-free)."""
    if not any(key in providers for key in BIAS_KEYS):
        return [key for key in WEIGHT_KEYS if key not in providers]
    return [key for key in REFERENCE_KEYS if key not in providers]


def _hints(
    state: Mapping[str, torch.Tensor],
    providers: Mapping[str, list[str]],
    missing: list[str],
    unexpected: list[str],
    prefix: str | None,
) -> list[str]:
    """What the user can do about the problems: the prefixes that hold a whole block (those that would leave
    an unexpected key out), the names read for an absent projection, the rule for biases."""
    hints = []
    candidates = [p for p in candidate_prefixes(state) if any(not key.startswith(p) for key in unexpected)]
    if candidates:
        hints.append(_pick_one(candidates))
    if not providers:
        where = "" if prefix is None else f" under the prefix {prefix!r}"
        hints.append(f"no key{where} matches a known naming scheme; names read: {names_text()}")
    elif absent := [ref for ref in PROJECTIONS if f"{ref}.weight" in missing]:
        hints.append(f"names read (with .weight and .bias) for the {names_of(absent)}")
    biased = [ref for ref in PROJECTIONS if f"{ref}.bias" in providers]
    unbiased = [ref for ref in PROJECTIONS if f"{ref}.weight" in providers and f"{ref}.bias" not in providers]
    if biased and unbiased:
        hints.append(
            f"{', '.join(unbiased)} {'has' if len(unbiased) == 1 else 'have'} no bias but {', '.join(biased)} "
            f"{'has' if len(biased) == 1 else 'have'}: a block has biases on all four projections or on none"
        )
    return hints


def _pick_one(candidates: list[str]) -> str:
    return (
        "to take one attention block out of a bigger checkpoint, pass its prefix (--prefix; prefix= in Python), "
        f"one of {_listing([repr(p) for p in candidates], 16)}"
    )


def candidate_prefixes(state: Mapping[str, object]) -> list[str]:
    """The key prefixes of ``state`` under which the weights of all four projections are found, in natural
    order (``layers.2.`` before ``layers.10.``)."""
    by_prefix: dict[str, dict[str, str]] = {}
    for key in state:
        if (match := _match(key)) is not None:
            by_prefix.setdefault(match[0], {})[match[1]] = key
    return sorted(
        (p for p, recognised in by_prefix.items() if set(WEIGHT_KEYS) <= set(_providers(recognised))),
        key=_natural_order,
    )


def _natural_order(text: str) -> list[str | int]:
    # re.split with a group alternates text and digits, so like positions always compare like types.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _match(key: str) -> tuple[str, str] | None:
    """Split ``key`` into (prefix, recognised name), or None."""
    parts = key.split(".")
    for start in range(len(parts)):
        name = ".".join(parts[start:])
        if name in _SOURCES:
            return key[: len(key) - len(name)], name
    return None


def _recognise(
    state: Mapping[str, torch.Tensor], source: str, prefix: str | None
) -> tuple[dict[str, str], list[str]]:
    """Return {recognised name: original key} and the unrecognised keys of the block."""
    if prefix is not None:
        return _recognise_under(state, source, prefix)
    matches = {key: match for key in state if (match := _match(key)) is not None}
    prefixes = sorted({prefix for prefix, _ in matches.values()}, key=_natural_order)
    if len(prefixes) > 1:
        candidates = candidate_prefixes(state)
        partial = [repr(p) for p in prefixes if p not in candidates]
        if not candidates:
            detail = f" ({_listing(partial, 16)}), none with all four projections; names read: {names_text()}"
        else:
            detail = f"; {_pick_one(candidates)}"
            if partial:
                detail += f"; only some projections under {_listing(partial)}"
        raise CheckpointError(f"{source}: attention weights under several prefixes{detail}")
    recognised = {name: key for key, (_, name) in matches.items()}
    return recognised, [key for key in state if key not in matches]


def _recognise_under(state: Mapping[str, torch.Tensor], source: str, prefix: str) -> tuple[dict[str, str], list[str]]:
    """Like ``_recognise``, for the keys that start with ``prefix``; the rest is ignored."""
    block = [key for key in state if key.startswith(prefix)]
    if not block:
        candidates = candidate_prefixes(state)
        raise CheckpointError(
            f"{source}: no key starts with the prefix {prefix!r}"
            + (f"; {_pick_one(candidates)}" if candidates else "; no prefix holds all four projections")
        )
    recognised = {key[len(prefix):]: key for key in block if key[len(prefix):] in _SOURCES}
    return recognised, [key for key in block if key[len(prefix):] not in _SOURCES]


def _infer_d_model(found: Mapping[str, torch.Tensor]) -> int | None:
    # A vote, so that one misshapen tensor is reported instead of every well-shaped one.
    votes: Counter[int] = Counter()
    for name, tensor in found.items():
        stacked = len(_SOURCES[name])
        if tensor.ndim >= 1 and tensor.shape[0] % stacked == 0:
            votes[tensor.shape[0] // stacked] += 1
        if tensor.ndim == 2:
            votes[tensor.shape[1]] += 1
    return votes.most_common(1)[0][0] if votes else None


def _expected_shape(name: str, d_model: int) -> tuple[int, ...]:
    rows = len(_SOURCES[name]) * d_model
    return (rows, d_model) if name.endswith("weight") else (rows,)


def _shape_problems(
    found: Mapping[str, torch.Tensor], recognised: Mapping[str, str], d_model: int | None
) -> list[str]:
    if d_model is None:
        return ["cannot tell d_model: no recognised tensor has a usable shape"] if found else []
    problems = []
    for name, tensor in found.items():
        expected = _expected_shape(name, d_model)
        if tuple(tensor.shape) != expected:
            problems.append(f"{recognised[name]} has shape {tuple(tensor.shape)}, expected {expected}")
    return problems


def _providers(recognised: Mapping[str, str]) -> dict[str, list[str]]:
    providers: dict[str, list[str]] = {}
    for name, key in recognised.items():
        for ref in _SOURCES[name]:
            providers.setdefault(ref, []).append(key)
    return providers


def _split(found: Mapping[str, torch.Tensor], d_model: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in found.items():
        # clone: split() returns views of one storage, which safetensors refuses to save.
        out.update(
            (ref, part.clone()) for ref, part in zip(_SOURCES[name], tensor.split(d_model), strict=True)
        )
    return {key: out[key] for key in REFERENCE_KEYS if key in out}


def load_checkpoint(
    path: str | os.PathLike, num_heads: int | None = None, dropout: float = 0.0, *, prefix: str | None = None
) -> MultiHeadAttention:
    """Build the reference ``MultiHeadAttention`` from a checkpoint file, in eval mode.

    ``num_heads`` defaults to the ``num_heads`` metadata of a safetensors file. ``prefix`` picks the attention
    block out of a bigger checkpoint (see ``to_reference_state_dict``). A checkpoint without biases gives a
    module whose projections have none.
    """
    source = f"checkpoint {path}"
    state, metadata = read_state_dict(path)
    weights = to_reference_state_dict(state, source=source, prefix=prefix)
    d_model = weights["W_q.weight"].shape[0]
    heads = _num_heads(num_heads, metadata, source)
    try:
        module = MultiHeadAttention(d_model, heads, dropout=dropout, bias="W_q.bias" in weights)
    except ModelConfigError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    module.load_state_dict({key: value.to(torch.float32) for key, value in weights.items()})
    return module.eval()


def _num_heads(num_heads: int | None, metadata: Mapping[str, str], source: str) -> int:
    if num_heads is not None:
        return num_heads
    if "num_heads" not in metadata:
        raise CheckpointError(
            f"{source}: num_heads is required (CLI flag --heads); the weights do not determine it "
            "and the file has no num_heads metadata"
        )
    try:
        return int(metadata["num_heads"])
    except ValueError:
        raise CheckpointError(
            f"{source}: metadata num_heads={metadata['num_heads']!r} is not an integer; "
            "pass num_heads (--heads)"
        ) from None


def save_checkpoint(module: nn.Module, path: str | os.PathLike) -> None:
    """Atomically write ``module.state_dict()`` to a ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` file.

    Safetensors metadata records the module's ``d_model`` (or ``embed_dim``) and ``num_heads``.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES:
        accepted = ", ".join(SAFETENSORS_SUFFIXES + TORCH_SUFFIXES)
        raise CheckpointError(
            f"checkpoint {path}: unknown suffix {suffix or '(none)'!r}; expected one of {accepted}"
        )
    state = {key: value.detach().cpu().contiguous() for key, value in module.state_dict().items()}
    try:
        with atomic_path(path) as tmp:
            if suffix in SAFETENSORS_SUFFIXES:
                tmp.write_bytes(safetensors.torch.save(state, metadata=_metadata(module)))
            else:
                torch.save(state, tmp)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: cannot write it ({type(exc).__name__}: {exc})") from exc


def _metadata(module: nn.Module) -> dict[str, str]:
    # nn.MultiheadAttention calls d_model embed_dim.
    values = {
        "d_model": getattr(module, "d_model", getattr(module, "embed_dim", None)),
        "num_heads": getattr(module, "num_heads", None),
    }
    return {key: str(value) for key, value in values.items() if isinstance(value, int)}
