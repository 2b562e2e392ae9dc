"""The files a model's users need besides the model, found beside it: the tokenizer and the chat template that
``export --hf`` copies next to the file it writes, read by ``generate`` and ``serve`` when no flag names them.
No torch, no onnxruntime: only paths."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The names export --hf writes them under (Hugging Face's own: a folder save_pretrained wrote reads the same).
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class BesideModel:
    """The tokenizer and chat template in a model file's folder (None where there is none)."""

    tokenizer: Path | None = None
    chat_template: Path | None = None

    @classmethod
    def of(cls, model: str | os.PathLike) -> BesideModel:
        folder = Path(model).parent
        return cls(*(path if path.is_file() else None
                     for path in (folder / TOKENIZER_FILE, folder / CHAT_TEMPLATE_FILE)))

    def resolve(self, tokenizer: Path | None, chat_template: Path | None,
                say: Callable[[str], None]) -> tuple[Path | None, Path | None]:
        """(tokenizer, chat template) as ``serve`` takes them: each the flag's, else the one found here, ``say``
        called with a line for each found here."""
        (tokenizer, first), (chat_template, second) = self.tokenizer_for(tokenizer), self.chat_template_for(
            chat_template)
        for note in (first, second):
            if note is not None:
                say(note)
        return tokenizer, chat_template

    def tokenizer_for(self, given: Path | None) -> tuple[Path | None, str | None]:
        """The tokenizer to use: ``given`` (``--tokenizer``), else the one found here; with a line to print when it
        is the one found here."""
        return _chosen(given, self.tokenizer, "--tokenizer")

    def chat_template_for(self, given: Path | None) -> tuple[Path | None, str | None]:
        """The chat template to use: ``given`` (``--chat-template``), else the one found here; with a line to print
        when it is the one found here."""
        return _chosen(given, self.chat_template, "--chat-template")


def _chosen(given: Path | None, found: Path | None, flag: str) -> tuple[Path | None, str | None]:
    if given is not None or found is None:
        return given, None
    return found, f"{found.name} beside the model: {found} ({flag} to use another)"
