"""A sentence-transformers folder (what ``SentenceTransformer.save`` writes) read as one model for ``export --hf``.

``modules.json`` lists the pipeline: a ``Transformer`` (its config, weights and tokenizer at the folder's root, or in
a subfolder such as ``0_Transformer`` in older saves), a ``Pooling`` (``1_Pooling/config.json``) and optionally a
``Normalize``. The export is the transformer with that pooling and normalisation after it, so that the file's one
output is what ``SentenceTransformer.encode`` returns: ``sentence_embedding`` [batch, d], pooled over the
attention mask. Other modules (``Dense``, ``LayerNorm``, routers, ...) are refused naming them: a file without them
would return vectors that differ from the model's.

Pooling as sentence-transformers computes it (``sentence_transformers/.../pooling.py``): ``cls`` is the first real
token (left padding too), ``lasttoken`` the last, ``max`` the largest value over real tokens, ``mean`` the mean over
them, ``mean_sqrt_len_tokens`` their sum over sqrt(count), ``weightedmean`` the mean weighted by position counted
from the first real token; several modes are concatenated in the order the config lists them. Both spellings of the
config are read: ``pooling_mode`` (sentence-transformers 6) and the ``pooling_mode_*_tokens`` flags before it.
``include_prompt: false`` only changes vectors when ``encode`` is given a prompt, which the file never is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mha_deploy.errors import ExportError

MODULES_FILE = "modules.json"
SENTENCE_CONFIG_FILE = "sentence_bert_config.json"
OUTPUT = "sentence_embedding"  # sentence-transformers' own name for the pooled (and normalised) vector
# Module types by their class name: sentence-transformers has moved them between packages across versions
# (sentence_transformers.models.Pooling, sentence_transformers.sentence_transformer.modules.pooling.Pooling).
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The flags of sentence-transformers before 6, in the order it concatenated the modes they turn on.
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
NORM_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize calls


@dataclass(frozen=True)
class SentenceFolder:
    """What a sentence-transformers folder holds: where its transformer lies, its pooling modes (concatenated in
    this order), whether it normalises, and the longest input ``encode`` takes (``max_seq_length``; longer inputs
    are truncated there, so a file taking more would return vectors ``encode`` never does)."""

    folder: Path
    transformer: Path
    pooling: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None = None

    @classmethod
    def read(cls, folder: Path) -> SentenceFolder | None:
        """The pipeline of ``folder``'s ``modules.json``; None when it has none (a plain ``save_pretrained``
        folder). An ``ExportError`` naming the module when it holds one the file cannot reproduce."""
        path = folder / MODULES_FILE
        if not path.is_file():
            return None
        modules = _json(folder, path)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ExportError(f"--hf {folder}: {MODULES_FILE} is not a list of modules (as SentenceTransformer.save "
                              "writes it)")
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        expected = [TRANSFORMER, POOLING, NORMALIZE]
        wrong = next((i for i, kind in enumerate(kinds) if i >= len(expected) or kind != expected[i]), None)
        if wrong is not None:
            raise ExportError(
                f"--hf {folder}: {MODULES_FILE}'s module {wrong} is {modules[wrong].get('type')!r}; --hf exports a "
                f"sentence-transformers folder of {TRANSFORMER}, {POOLING} and optionally {NORMALIZE}, in that "
                f"order ({' -> '.join(kinds)} here): export the model with --module, your code doing the rest")
        if len(kinds) < 2:
            raise ExportError(f"--hf {folder}: {MODULES_FILE} lists {' -> '.join(kinds) or 'no module'}; a "
                              f"sentence-embedding model needs a {TRANSFORMER} then a {POOLING}")
        transformer = folder / str(modules[0].get("path", ""))
        pooling = _pooling_modes(folder, folder / str(modules[1].get("path", "")) / "config.json")
        return cls(folder, transformer, pooling, len(modules) == 3, _max_seq_length(folder, transformer))

    def describe(self) -> str:
        return f"{' + '.join(self.pooling)} pooling" + (", normalised" if self.normalize else "")


def _json(folder: Path, path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"--hf {folder}: no {path.relative_to(folder)} (a sentence-transformers folder has it "
                          "where modules.json points)") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"--hf {folder}: {path.relative_to(folder)} cannot be read: {exc}") from exc


def _pooling_modes(folder: Path, path: Path) -> tuple[str, ...]:
    config = _json(folder, path)
    if not isinstance(config, dict):
        raise ExportError(f"--hf {folder}: {path.relative_to(folder)} is not a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:
        # sentence-transformers reads no flag as mean pooling
        modes = tuple(name for flag, name in LEGACY_POOLING_FLAGS.items() if config.get(flag)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else ()
    unknown = [m for m in modes if m not in POOLING_MODES]
    if not modes or unknown:
        raise ExportError(f"--hf {folder}: {path.relative_to(folder)}: pooling mode {mode!r} is not one of "
                          f"{', '.join(POOLING_MODES)}")
    return modes


def _max_seq_length(folder: Path, transformer: Path) -> int | None:
    path = transformer / SENTENCE_CONFIG_FILE
    if not path.is_file():
        return None
    config = _json(folder, path)
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return value if type(value) is int and value > 0 else None


def pool(states, mask, mode: str):
    """``mode``'s vector [batch, d] of token states [batch, seq, d] over ``mask`` [batch, seq] (True/1 = real)."""
    import torch

    real = mask.to(torch.bool)
    weights = real.unsqueeze(-1).to(states.dtype)  # [batch, seq, 1]
    if mode in ("mean", "mean_sqrt_len_tokens"):
        count = weights.sum(1).clamp(min=1e-9)  # [batch, 1]
        return (states * weights).sum(1) / (count if mode == "mean" else count.sqrt())
    if mode == "max":
        return states.masked_fill(~real.unsqueeze(-1), float("-inf")).amax(1)
    positions = torch.arange(states.shape[1], device=states.device)  # [seq]
    first = real.to(torch.int32).argmax(1)  # the first real token: 0 unless padded on the left
    if mode == "cls":
        return _row(states, first)
    if mode == "lasttoken":
        # the highest real position; a row with none takes position 0 of states zeroed by the mask, as s-t does
        last = (real.to(torch.int64) * positions).argmax(1)
        return _row(states * weights, last)
    if mode == "weightedmean":
        position_weights = (positions.unsqueeze(0) + 1 - first.unsqueeze(1)).to(states.dtype)  # [batch, seq]
        weighted = weights * position_weights.unsqueeze(-1)
        return (states * weighted).sum(1) / weighted.sum(1).clamp(min=1e-9)
    raise ValueError(f"unknown pooling mode {mode!r}")


def _row(states, index):
    """states[b, index[b]] for each b: [batch, d]."""
    gathered = index.to(states.device).long().view(-1, 1, 1).expand(-1, 1, states.shape[-1])
    return states.gather(1, gathered).squeeze(1)


def sentence_module(encoder, sentence: SentenceFolder):
    """``encoder`` (the transformer, a ``PreTrainedModel``) with ``sentence``'s pooling and normalisation after
    it: a module whose forward takes the encoder's parameters and returns ``{OUTPUT: [batch, d]}``."""
    import torch

    modes, normalize = sentence.pooling, sentence.normalize

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.encoder = inner
            self.config = inner.config

        def forward(self, **inputs):
            states = self.encoder(**inputs).last_hidden_state  # [batch, seq, d]
            mask = inputs["attention_mask"]
            vector = torch.cat([pool(states, mask, mode) for mode in modes], dim=-1)  # [batch, modes * d]
            if normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=1, eps=NORM_EPS)
            return {OUTPUT: vector}

    return SentenceEmbedding(encoder).eval()
