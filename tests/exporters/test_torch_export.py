"""The trace: a module whose code guards its length against its position table exports up to that length."""

import numpy as np
import pytest
import torch

from mha_deploy.errors import ExportError, InputError
from mha_deploy.exporters.export import export_model
from mha_deploy.runtime.session import MHASession

POSITIONS = 12


class _GuardedLength(torch.nn.Module):
    """Refuses a sequence longer than its position table in Python, as CLIP's text embeddings do."""

    def __init__(self, positions: int = POSITIONS):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = torch.nn.Embedding(10, 8), torch.nn.Embedding(positions, 8)
        self.linear = torch.nn.Linear(8, 8)

    def limit(self) -> int:
        return self.pos.num_embeddings

    def forward(self, ids):
        if ids.size(1) > self.limit():
            raise ValueError(f"sequence length must be at most {self.limit()}")
        return self.linear(self.embed(ids) + self.pos(torch.arange(ids.size(1))))


def test_a_guard_at_the_position_tables_size_exports_up_to_it(tmp_path):
    result = export_model(_GuardedLength(), tmp_path / "m.onnx", ["ids:tokens"])
    assert result.metadata.max_length == POSITIONS
    session = MHASession(tmp_path / "m.onnx", provider="cpu")
    module = _GuardedLength().eval()
    # A length the probes never ran at: the graph holds there as the module does.
    ids = np.random.default_rng(0).integers(0, 10, size=(3, 11))
    with torch.no_grad():
        expected = module(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(session.run({"ids": ids})["output"], expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(InputError, match=str(POSITIONS)):
        session.run({"ids": np.zeros((1, POSITIONS + 1), dtype=np.int64)})


class _GuardShorterThanItsTable(_GuardedLength):
    def limit(self) -> int:
        return 8


def test_a_guard_shorter_than_the_max_length_is_refused_naming_the_flag_that_would_accept_it(tmp_path):
    refusal = r"holds only for seq in \d+\.\.8.*--max-length 8 \(the max length now is 12\)"
    with pytest.raises(ExportError, match=refusal):
        export_model(_GuardShorterThanItsTable(), tmp_path / "m.onnx", ["ids:tokens"])
    assert not (tmp_path / "m.onnx").exists()
