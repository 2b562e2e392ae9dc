"""Issue 31, defect 5: a forward returning a dict with a ``None`` value (a Hugging Face ``ModelOutput``'s loss)
and a tuple inside shifted every output name, so a client asking for ``logits`` got the first hidden state.
Each returned tensor is named where the forward returned it; ``None`` is skipped without moving a name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402


class _LossLogitsHidden(torch.nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)
        self.returns = returns

    def forward(self, ids, mask):
        h0 = self.embed(ids) * mask.unsqueeze(-1)
        h1 = self.hidden(h0)
        return self.returns(self.head(h1), h0, h1)


# what the forward returns -> the names the file must hold, each name -> how to find that tensor in the result
SHAPES = {
    "dict with None and a tuple": (
        lambda logits, h0, h1: {"loss": None, "logits": logits, "hidden_states": (h0, h1)},
        {"logits": lambda r: r["logits"], "hidden_states.0": lambda r: r["hidden_states"][0],
         "hidden_states.1": lambda r: r["hidden_states"][1]},
    ),
    "tuple with None first": (
        lambda logits, h0, h1: (None, logits, [h0, None, h1]),
        {"output_1": lambda r: r[1], "output_2.0": lambda r: r[2][0], "output_2.2": lambda r: r[2][2]},
    ),
    "nested dicts": (
        lambda logits, h0, h1: {"logits": logits, "extra": {"past": None, "hidden": h1}},
        {"logits": lambda r: r["logits"], "extra.hidden": lambda r: r["extra"]["hidden"]},
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_output_is_named_where_the_forward_returned_it(tmp_path, shape):
    returns, where = SHAPES[shape]
    module = _LossLogitsHidden(returns)
    export_model(module, tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"], fuse="none")
    session = MHASession(tmp_path / "m.onnx", provider="cpu")
    assert session.output_names == tuple(where)
    ids, mask = np.array([[1, 2, 3], [4, 5, 0]]), np.array([[True] * 3, [True, True, False]])
    with torch.no_grad():
        result = module(torch.from_numpy(ids), torch.from_numpy(mask))
    got = session.run({"ids": ids, "mask": mask})
    for name, find in where.items():
        np.testing.assert_allclose(got[name][mask], find(result).numpy()[mask], atol=1e-6, err_msg=name)
