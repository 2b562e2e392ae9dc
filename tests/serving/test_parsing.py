"""/v1 request bodies: a body with the wrong keys is refused with a message naming each offending key."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.serving.http.parsing import RequestError, RequestLimits, parse_request
from tests.conftest import TEST_D_MODEL

ROW = [0.5] * TEST_D_MODEL


@pytest.fixture(scope="module")
def metadata(export_model):
    return MHASession(export_model(Signature("self", "padding"))[0], provider="cpu").metadata


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ({"y": [ROW]}, ["missing x", "unexpected input 'y'", "this model takes x"]),
        ({"x": [ROW], "mask": [[True]]}, ["unexpected input 'mask'"]),
        # A v2 body sent to /v1: the key is named, quoted, and where such a body goes is said.
        ({"inputs": [{"name": "x"}]}, ["unexpected input 'inputs'", "/v2/models/NAME/infer"]),
    ],
    ids=["wrong-name", "extra-key", "v2-body"],
)
def test_v1_names_the_offending_key(metadata, body, fragments):
    with pytest.raises(RequestError) as refused:
        parse_request(json.dumps(body).encode(), "application/json", metadata, RequestLimits())
    assert refused.value.status == 422
    for fragment in fragments:
        assert fragment in refused.value.message, refused.value.message


def test_a_batch_names_the_missing_mask_and_says_what_it_is(export_model):
    from mha_deploy.errors import InputError

    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    with pytest.raises(InputError, match=r"missing key_padding_mask: .* True = real token"):
        session.run({"x": np.ones((1, 3, TEST_D_MODEL), np.float32)})
