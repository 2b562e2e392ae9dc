"""A user's ``--module`` file and its factory, as they come (issue 31): code that exits at import, forwards that
are not functions of their inputs, declarations that do not fit the module, and what ``export_model`` leaves of
the caller's module."""

from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from mha_deploy.cli import main
from tests.adversarial.conftest import assert_loud

# A small classifier over a float sequence: the body every file below starts from.
MODEL = """
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))
"""


def _export(tmp_path, body: str, *inputs: str, factory: str = "build"):
    source = tmp_path / "net.py"
    source.write_text(textwrap.dedent(MODEL) + textwrap.dedent(body))
    output = tmp_path / "net.onnx"
    args = ["export", "--module", f"{source}:{factory}", *(a for spec in inputs or ("x:sequence",)
                                                           for a in ("--input", spec)), "-o", str(output)]
    return CliRunner().invoke(main, args), output


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("sys.exit(0)\n\ndef build():\n    return Net()\n", "importing"),
        ("raise SystemExit(3)\n\ndef build():\n    return Net()\n", "importing"),
        ("sys.exit('usage: net.py DATA')\n\ndef build():\n    return Net()\n", "importing"),
        ("def build():\n    sys.exit(0)\n", "build()"),
    ],
    ids=["exit-0-at-import", "exit-3-at-import", "exit-usage-at-import", "exit-0-in-factory"],
)
def test_a_module_that_exits_is_one_line_and_no_file(tmp_path, body, said):
    """It used to end the tool with the module's own status (0 or 3), no message and no file."""
    result, output = _export(tmp_path, body)
    assert_loud(result, "--module", said, "sys.exit(", "if __name__")
    assert not output.exists()
