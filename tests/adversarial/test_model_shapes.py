"""Attacks through a model's shapes: graphs and modules that export, then give each caller something else
(an output whose rank follows the inputs' values, rows of a batch that mix, an output without a name). Each is
refused before a file is written, in one line that says what the model does; a session never hands a caller
an output of another shape than its metadata says."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from mha_deploy.errors import ExportError, ModelFileError  # noqa: E402
from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.exporters.export import set_metadata  # noqa: E402
from mha_deploy.exporters.optimize import optimize_model  # noqa: E402
from mha_deploy.metadata import ModelMetadata  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from mha_deploy.signature import OUTPUT, PADDING_MASK, TOKENS, Signature, TensorSpec  # noqa: E402
from tests.adversarial.conftest import assert_loud  # noqa: E402
from tests.conftest import USER_MODELS  # noqa: E402

WIDTH, VOCAB = 8, 20


def _if_graph(condition: str) -> onnx.ModelProto:
    """ids -> embeddings [batch, seq, 8], then an If: as they are, or summed over the width ([batch, seq]) when
    ``condition`` holds: "padded" (some mask position False) or "batch over 8" (a size parity never draws)."""
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["kept"])], "then", [],
                             [helper.make_tensor_value_info("kept", TensorProto.FLOAT, None)])
    other = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "width_axis"], ["summed"], keepdims=0)], "else", [],
        [helper.make_tensor_value_info("summed", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([2], np.int64), "width_axis")],
    )
    if condition == "padded":
        nodes = [helper.make_node("Cast", ["mask"], ["mask_int"], to=TensorProto.INT64),
                 helper.make_node("ReduceMin", ["mask_int"], ["all_real"], keepdims=0),
                 helper.make_node("Cast", ["all_real"], ["condition"], to=TensorProto.BOOL)]
    else:
        nodes = [helper.make_node("Shape", ["ids"], ["batch"], start=0, end=1),
                 helper.make_node("LessOrEqual", ["batch", "eight"], ["small"]),
                 helper.make_node("Squeeze", ["small"], ["condition"])]
    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["x"]), *nodes,
         helper.make_node("If", ["condition"], ["output"], then_branch=then, else_branch=other)],
        "if_rank",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", "seq"])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(table, "table"),
                     numpy_helper.from_array(np.array([8], np.int64), "eight")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("condition", ["padded", "batch over 8"])
def test_an_if_whose_branches_differ_in_rank_is_refused_by_optimize_naming_it(tmp_path, condition):
    source, output = tmp_path / "if_rank.onnx", tmp_path / "fused.onnx"
    onnx.save(_if_graph(condition), source)
    with pytest.raises(ExportError, match=r"an If node returns 'output' with rank 3 from its then branch and 2 from "
                                          r"its else branch, so the model's output shape depends on its inputs"):
        optimize_model(source, output, ["ids:tokens", "mask:padding-mask"])
    assert not output.exists()


def test_a_session_never_hands_out_an_output_of_another_rank_than_its_metadata_says():
    """An in-memory model (no load check) whose output loses an axis at batch 9: the run is refused in one line
    naming the output and the shape, instead of returned to be cut per item at the wrong axes."""
    model = _if_graph("batch over 8")
    inputs = (TensorSpec("ids", TOKENS, "int64", ("batch", "seq"), vocab=VOCAB),
              TensorSpec("mask", PADDING_MASK, "bool", ("batch", "seq"), marks="ids"))
    signature = Signature.custom(inputs, (TensorSpec("output", OUTPUT, "model", ("batch", "seq", WIDTH)),), ("seq",))
    set_metadata(model, ModelMetadata(d_model=WIDTH, num_heads=1, signature=signature))
    session = MHASession(model.SerializeToString(), provider="cpu")
    feeds = {"ids": np.ones((9, 4), np.int64), "mask": np.ones((9, 4), bool)}
    assert session.run({name: array[:8] for name, array in feeds.items()})["output"].shape == (8, 4, WIDTH)
    with pytest.raises(ModelFileError, match=r"output output came back with shape \(9, 4\) where the model's "
                                             r"metadata says \[batch, seq, 8\]"):
        session.run(feeds)


class MixesTheBatch(nn.Module):
    """Centres every token on the mean of the whole batch's real tokens: an item's outputs follow its batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, ids, mask):
        x = self.embed(ids)
        return self.head(x - x[mask].mean(0))


def test_a_module_that_mixes_the_rows_of_a_batch_is_refused_at_export_saying_so(tmp_path):
    output = tmp_path / "mixes.onnx"
    with pytest.raises(ExportError, match=r"output output of an item changes by .* when a shorter item shares its "
                                          r"batch .*: the model mixes the rows of a batch"):
        export_model(MixesTheBatch(), output, ["ids:tokens", "mask:padding-mask"])
    assert not output.exists()


def test_an_empty_output_name_is_one_line_naming_the_output(tmp_path):
    from click.testing import CliRunner

    from mha_deploy.cli import main

    output = tmp_path / "m.onnx"
    result = CliRunner().invoke(main, [
        "export", "--module", f"{USER_MODELS / 'classifier.py'}:build", "--input", "input_ids:tokens",
        "--input", "attention_mask:padding-mask", "--output-name", "", "-o", str(output),
    ])
    assert_loud(result, "output 0 is named ''", "--output-name NAME")
    assert not output.exists()
