"""The probes both exporters read a user's model with (torch module or ORT graph), on models written in numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from mha_deploy.errors import ExportError
from mha_deploy.exporters.probes import output_axes, paddable_axes, unpadded_mask_warnings
from mha_deploy.signature import OUTPUT, PADDING_MASK, TOKENS, Signature, TensorSpec

VOCAB, WIDTH = 10, 4
TABLE = np.random.default_rng(0).standard_normal((VOCAB, WIDTH))


@dataclass
class Sizes:
    batch: int
    lengths: dict[str, int]


def _signature(output_axes_: tuple, paddable=()) -> Signature:
    inputs = (
        TensorSpec("ids", TOKENS, "int64", ("batch", "seq"), vocab=VOCAB),
        TensorSpec("mask", PADDING_MASK, "bool", ("batch", "seq"), marks="ids"),
    )
    return Signature.custom(inputs, (TensorSpec("out", OUTPUT, "model", output_axes_),), paddable)


def masked_mean(feeds):
    weights = feeds["mask"][..., None].astype(np.float64)
    return {"out": (TABLE[feeds["ids"]] * weights).sum(1) / weights.sum(1)}


def unmasked_mean(feeds):
    return {"out": TABLE[feeds["ids"]].mean(1)}


def causal_sum(feeds):
    return {"out": np.cumsum(TABLE[feeds["ids"]], axis=1)}


def reads_the_last_key(feeds):
    # Every position sees the last one, padded or not: what attention without its mask does.
    embedded = TABLE[feeds["ids"]]
    return {"out": embedded + embedded[:, -1:]}


@pytest.mark.parametrize(
    ("run", "axes", "paddable"),
    [
        (masked_mean, ("batch", WIDTH), ("seq",)),
        (unmasked_mean, ("batch", WIDTH), ()),
        (causal_sum, ("batch", "seq", WIDTH), ("seq",)),
        (reads_the_last_key, ("batch", "seq", WIDTH), ()),
    ],
)
def test_paddable_axes_are_measured_on_real_outputs(run, axes, paddable):
    assert paddable_axes(_signature(axes), run) == paddable


def test_a_mask_that_padding_moves_anyway_is_warned_about():
    [warning] = unpadded_mask_warnings(_signature(("batch", WIDTH)))
    assert "'seq' axis" in warning and "mask masks it" in warning
    assert unpadded_mask_warnings(_signature(("batch", WIDTH), paddable=("seq",))) == []


def test_output_axes_follow_the_declared_lengths():
    first, second = Sizes(2, {"src": 3, "tgt": 5}), Sizes(4, {"src": 6, "tgt": 9})
    assert output_axes("out", (2, 5, 7), (4, 9, 7), first, second) == ("batch", "tgt", 7)
    assert output_axes("out", (2, 3), (4, 6), first, second) == ("batch", "src")


@pytest.mark.parametrize(
    ("shapes", "fragment"),
    [
        (((5, 2), (9, 4)), "axis 0 must be the batch"),
        (((), ()), "axis 0 must be the batch"),
        (((2, 8), (4, 12)), "axis 1 is 8 for lengths"),
    ],
)
def test_output_axes_that_follow_nothing_are_refused(shapes, fragment):
    with pytest.raises(ExportError, match=fragment):
        output_axes("out", *shapes, Sizes(2, {"seq": 3}), Sizes(4, {"seq": 6}))
