"""Export-time parity's default tolerance on a model with logits in the hundreds: an exact fp32 export passes
(an absolute atol would refuse it: fp32 rounding grows with the magnitudes summed), and the same graph with one
weight nudged fails."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from mha_deploy.compare import compare_outputs  # noqa: E402
from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.exporters.parity import DEFAULT_ATOL, DEFAULT_RTOL, check_parity, torch_reference  # noqa: E402
from mha_deploy.inputs import InputCase, make_inputs, real_query_rows  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import user_module  # noqa: E402

# The LM head scaled so that logits reach the hundreds, as a trained GPT's do.
LOGIT_SCALE = 100.0


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory):
    """(module, path) of a 2-layer causal LM (d_model 64, vocabulary 512) whose logits reach ~240, exported
    unfused in fp32 with the default tolerance."""
    torch.manual_seed(1)
    module = user_module("causal_lm").TinyLM(vocab=512, d_model=64, n_layers=2).eval()
    with torch.no_grad():
        module.lm_head.weight.mul_(LOGIT_SCALE)
    path = tmp_path_factory.mktemp("parity") / "large-logits.onnx"
    result = export_model(module, path, ["tokens:tokens", "mask:padding-mask"], fuse="none", pack_tokens=False)
    assert result.parity.passed and result.parity.atol_per_row, result.parity.summary()
    return module, path


def _nudged(path, delta: float) -> bytes:
    """The file with one weight of the first feed-forward layer ([64, 256]) moved by ``delta``."""
    model = onnx.load(str(path))
    weight = next(init for init in model.graph.initializer if list(init.dims) == [64, 256])
    values = onnx.numpy_helper.to_array(weight).copy()
    values.flat[7] += delta
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    return model.SerializeToString()


# 1e-3 is 1.4% of that weight's scale (std 0.07): the error it makes on the logits (~0.014) is 7x the
# tolerance there (1e-5 x ~200); the exact export's own error stays ~80x below it (measured).
@pytest.mark.parametrize(("delta", "passed"), [(0.0, True), (1e-3, False)], ids=["exact", "one-weight-nudged"])
def test_the_default_tolerance_passes_rounding_and_fails_a_real_error(large_logits, delta, passed):
    module, path = large_logits
    session = MHASession(_nudged(path, delta), provider="cpu")
    report = check_parity(module, session)
    assert report.passed == passed, report.summary()
    assert "atol=1e-05 x row scale rtol=0.0001" in report.summary()
    if not passed:
        return
    # The same exact export under an absolute atol of the same size: refused by its rounding alone.
    feeds = make_inputs(session.signature, 0, InputCase(2, 64, 64, "right"), seed=3)
    expected = torch_reference(module, session.signature, feeds)
    assert np.abs(expected["output"]).max() > 100
    (absolute,) = compare_outputs(session.signature, session.run(feeds), expected,
                                  real_query_rows(session.signature, feeds), DEFAULT_ATOL, DEFAULT_RTOL)
    assert not absolute.passed and absolute.max_abs_err < 1e-3, absolute.summary()
