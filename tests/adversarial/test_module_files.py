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


GUARD = ("--module", "if __name__")  # where the file or factory exits: named, with the usual cause's fix


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ("sys.exit(0)\n\ndef build():\n    return Net()\n", ("importing", "sys.exit(0)", *GUARD)),
        ("raise SystemExit(3)\n\ndef build():\n    return Net()\n", ("importing", "sys.exit(3)", *GUARD)),
        ("sys.exit('usage: net.py DATA')\n\ndef build():\n    return Net()\n",
         ("importing", "sys.exit('usage: net.py DATA')", *GUARD)),
        ("def build():\n    sys.exit(0)\n", ("build()", "sys.exit(0)", *GUARD)),
        ("class Quitting(Net):\n    def forward(self, x):\n        sys.exit(0)\n\n"
         "def build():\n    return Quitting()\n", ("Quitting called sys.exit(0)", "a forward must return")),
    ],
    ids=["exit-0-at-import", "exit-3-at-import", "exit-usage-at-import", "exit-0-in-factory", "exit-0-in-forward"],
)
def test_a_module_that_exits_is_one_line_and_no_file(tmp_path, body, fragments):
    """It used to end the tool with the module's own status (0 or 3), no message and no file."""
    result, output = _export(tmp_path, body)
    assert_loud(result, *fragments)
    assert not output.exists()


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ("class Noisy(Net):\n    def forward(self, x):\n        return super().forward(x + torch.randn_like(x))\n",
         ("Noisy.forward gives different outputs for the same inputs", "draws random numbers")),
        ("class Dropping(Net):\n    def forward(self, x):\n"
         "        return super().forward(nn.functional.dropout(x, 0.5, training=True))\n",
         ("Dropping.forward gives different outputs", "dropout")),
        ("class Counting(Net):\n    def __init__(self):\n        super().__init__()\n"
         "        self.register_buffer('steps', torch.zeros(()))\n"
         "    def forward(self, x):\n        self.steps += 1\n        return super().forward(x) * self.steps\n",
         ("Counting.forward gives different outputs", "changes its state as it runs (steps)")),
        ("class Growing(Net):\n    def __init__(self):\n        super().__init__()\n        self.scale = 1.0\n"
         "    def forward(self, x):\n        self.scale *= 2\n        return super().forward(x) * self.scale\n",
         ("Growing.forward gives different outputs", "changes its state as it runs (scale)")),
    ],
    ids=["randn", "dropout-forced", "buffer", "attribute"],
)
def test_a_forward_that_is_not_a_function_of_its_inputs_is_named_as_such(tmp_path, body, fragments):
    """It used to fail parity with no word about randomness or mutation."""
    name = body.split("(")[0].removeprefix("class ")
    result, output = _export(tmp_path, body + f"\n\ndef build():\n    return {name}()\n")
    assert_loud(result, *fragments)
    assert not output.exists()


def _module(tmp_path, body: str):
    from mha_deploy.exporters.own_model import import_model_file

    (tmp_path / "net.py").write_text(textwrap.dedent(MODEL) + textwrap.dedent(body))
    return import_model_file(tmp_path / "net.py")


KEEPER = """
class Keeper(Net):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.seen = 0

    def forward(self, x):
        self.calls += 1  # state the output does not depend on: allowed, and put back
        self.seen = self.seen + 1
        return super().forward(self.drop(x))
"""


@pytest.mark.parametrize("outcome", ["exported", "failed"])
def test_export_model_leaves_the_callers_module_as_it_was(tmp_path, outcome):
    """Training mode, buffers and plain attributes as given, whether the export succeeds or fails; it used to
    leave the module in eval mode with its buffers advanced by the probes."""
    from mha_deploy.errors import ExportError
    from mha_deploy.exporters import export_model

    module = _module(tmp_path, KEEPER).Keeper().train()
    module.attn.eval()  # a mix of modes, each kept
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    output = tmp_path / "keeper.onnx"
    if outcome == "exported":
        export_model(module, output, ["x:sequence"], fuse="none", pack_tokens=False)
        assert output.exists()
    else:
        with pytest.raises(ExportError, match="declared inputs"):
            export_model(module, output, ["x:sequence:seq:7"])  # a width the module cannot take
    assert module.training and module.drop.training and module.head.training and not module.attn.training
    assert int(module.calls) == 0 and module.seen == 0
    assert all(torch_equal(module.state_dict()[k], v) for k, v in weights.items())


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_export_model_raises_what_its_docstring_says_and_the_original_type_too(tmp_path):
    """SignatureError and CheckpointError from export_model, where its docstring says ExportError: now both."""
    import torch

    from mha_deploy.errors import CheckpointError, ExportError, SignatureError
    from mha_deploy.exporters import export_model

    module = _module(tmp_path, "").Net()
    with pytest.raises(ExportError) as duplicate:
        export_model(module, tmp_path / "a.onnx", ["x:sequence"], output_names=["x"])
    assert isinstance(duplicate.value, SignatureError) and "declared twice" in str(duplicate.value)

    torch.save({"head.weight": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(CheckpointError) as wrong:  # an except clause users already have keeps working
        export_model(module, tmp_path / "a.onnx", ["x:sequence"], checkpoint=tmp_path / "wrong.pt")
    assert isinstance(wrong.value, ExportError) and "does not fit Net" in str(wrong.value)
    assert not (tmp_path / "a.onnx").exists()


@pytest.mark.parametrize("kind", ["SignatureError", "CheckpointError", "ModelFileError", "OutputError"])
def test_as_export_error_keeps_the_kind_and_the_message(kind):
    from mha_deploy import errors

    original = getattr(errors, kind)("what was wrong; what to do")
    converted = errors.as_export_error(original)
    assert isinstance(converted, errors.ExportError) and isinstance(converted, type(original))
    assert str(converted) == str(original)


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        # The width is read off the first layer that has one: here a LayerNorm after an 80-wide projection.
        ("class Projected(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
         "        self.norm = nn.LayerNorm(16)\n        self.proj = nn.Linear(80, 16)\n"
         "        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)\n"
         "    def forward(self, x):\n        h = self.norm(self.proj(x))\n"
         "        return self.attn(h, h, h, need_weights=False)[0]\n",
         ("mat1 and mat2 shapes cannot be multiplied", "the width 16 of x was read off norm (LayerNorm)",
          "--input x:sequence:seq:WIDTH")),
        # A Python loop over the length: traced at one length, it used to fail parity with ORT's Reshape error.
        ("class Looping(Net):\n    def forward(self, x):\n        h = self.attn(x, x, x, need_weights=False)[0]\n"
         "        return self.head(torch.stack([h[:, i] * (i + 1) for i in range(x.size(1))], 1))\n",
         ("does not trace with a dynamic 'seq' axis (inputs x)", "only for seq = 3", "Python loop")),
        # Control flow on a value: the error used to follow ~250 lines of FX graph on stderr.
        ("class Branching(Net):\n    def forward(self, x):\n        h = self.attn(x, x, x, need_weights=False)[0]\n"
         "        if torch.isnan(h).any():\n            return self.head(h.nan_to_num())\n"
         "        return self.head(h)\n",
         ("the forward decides on a tensor's values at", "net.py:", "(`if torch.isnan(h).any():`)",
          "torch.where")),
    ],
    ids=["width-off-a-layernorm", "loop-over-length", "data-dependent-branch"],
)
def test_a_declaration_the_module_does_not_fit_says_why_in_one_line(tmp_path, body, fragments):
    name = body.split("(")[0].removeprefix("class ")
    result, output = _export(tmp_path, body + f"\n\ndef build():\n    return {name}()\n")
    assert_loud(result, *fragments)
    assert len(result.stderr.strip().splitlines()) == 2, result.stderr[:2000]  # "exporting ...", then the error
    assert not output.exists()
