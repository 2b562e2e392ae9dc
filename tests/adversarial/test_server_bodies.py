"""Attacks on the HTTP server's request parsing that already fail safely, kept so (parsing only, no server).

Body-size and Content-Length limits belong to the server's own tests.
"""

from __future__ import annotations

import io
import time
import zipfile

import numpy as np
import pytest

from mha_deploy.metadata import ModelMetadata, Signature
from tests.adversarial.conftest import D

parsing = pytest.importorskip("mha_deploy.serving.http.parsing")

METADATA = ModelMetadata(d_model=D, num_heads=4, signature=Signature("self", "padding"))
LIMITS = parsing.RequestLimits()


def _npz(**members: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)
    return buffer.getvalue()


def _npy(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_body_is_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    body = _npz(x=_npy(np.array([_Payload(marker)], dtype=object), allow_pickle=True))
    with pytest.raises(parsing.RequestError) as refused:
        parsing.parse_request(body, parsing.NPZ, METADATA, LIMITS)
    assert refused.value.status == 422 and refused.value.kind == "not_numeric"
    assert not marker.exists()


def test_npz_bomb_body_is_refused_from_its_header():
    """256 MiB of zeros in a few hundred KiB; refused by its shape before a byte of data is unpacked."""
    body = _npz(x=_npy(np.zeros((1 << 20, D), np.float32)))
    assert len(body) < 2**20
    start = time.perf_counter()
    with pytest.raises(parsing.RequestError) as refused:
        parsing.parse_request(body, parsing.NPZ, METADATA, LIMITS)
    assert refused.value.status == 422 and refused.value.kind == "too_many_tokens"
    assert time.perf_counter() - start < 1.0


def test_finite_values_beyond_float32_are_refused():
    body = _npz(x=_npy(np.full((2, D), 1e300)))
    with pytest.raises(parsing.RequestError) as refused:
        parsing.parse_request(body, parsing.NPZ, METADATA, LIMITS)
    assert refused.value.status == 422 and refused.value.kind == "not_finite"


def test_an_npz_body_holding_a_member_twice_is_refused():
    """Round 2, defect 7: answered 200 with the last copy, although ``infer`` refuses the same file."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        archive.writestr("x.npy", _npy(np.zeros((2, D), np.float32)))
        archive.writestr("x.npy", _npy(np.ones((3, D), np.float32)))
    with pytest.raises(parsing.RequestError) as refused:
        parsing.parse_request(buffer.getvalue(), parsing.NPZ, METADATA, LIMITS)
    assert refused.value.status == 400 and refused.value.kind == "duplicate_member"
    assert "x.npy twice" in refused.value.message
