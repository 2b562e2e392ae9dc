"""Tests for mha_deploy.models.checkpoint."""

from __future__ import annotations

import os
import random
import re

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.testing import assert_close

from mha_deploy.checkpoint_names import PACKED, PROJECTIONS
from mha_deploy.errors import CheckpointError
from mha_deploy.models.attention import MultiHeadAttention
from mha_deploy.models.checkpoint import (
    REFERENCE_KEYS,
    candidate_prefixes,
    load_checkpoint,
    read_state_dict,
    save_checkpoint,
    to_reference_state_dict,
)
from tests.conftest import names_listed, randomise_parameters

D_MODEL, HEADS = 8, 2
NOISE = random.Random(0).randbytes(256)


def _reference(seed: int = 0, bias: bool = True) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(D_MODEL, HEADS, dropout=0.0, bias=bias).eval()


def _inputs(batch: int = 2, q_len: int = 3, kv_len: int = 5) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(batch, q_len, D_MODEL, generator=gen)
    k = torch.randn(batch, kv_len, D_MODEL, generator=gen)
    v = torch.randn(batch, kv_len, D_MODEL, generator=gen)
    return q, k, v


def _write(state: object, path) -> None:
    if str(path).endswith(".safetensors"):
        safetensors.torch.save_file(state, path)
    else:
        torch.save(state, path)


def _renamed(stems: tuple[str, str, str, str], prefix: str = ""):
    def rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mapping = dict(zip(("W_q", "W_k", "W_v", "W_o"), stems, strict=True))
        return {
            f"{prefix}{mapping[key.split('.')[0]]}.{key.split('.')[1]}": value for key, value in state.items()
        }

    return rename


def _packed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "in_proj_weight": torch.cat([state[f"W_{r}.weight"] for r in "qkv"]),
        "in_proj_bias": torch.cat([state[f"W_{r}.bias"] for r in "qkv"]),
        "out_proj.weight": state["W_o.weight"],
        "out_proj.bias": state["W_o.bias"],
    }


SCHEMES = {
    "reference": _renamed(("W_q", "W_k", "W_v", "W_o")),
    "lowercase": _renamed(("w_q", "w_k", "w_v", "w_o")),
    "linear": _renamed(("query_linear", "key_linear", "value_linear", "out_linear")),
    "proj": _renamed(("q_proj", "k_proj", "v_proj", "out_proj")),
    "dataparallel": _renamed(("W_q", "W_k", "W_v", "W_o"), prefix="module."),
    "nested": _renamed(("query_linear", "key_linear", "value_linear", "out_linear"), prefix="model.attn."),
    "packed": _packed,
    "packed_prefixed": lambda state: {f"encoder.0.self_attn.{k}": v for k, v in _packed(state).items()},
}


def _assert_same_forward(actual: MultiHeadAttention, expected: MultiHeadAttention) -> None:
    q, k, v = _inputs()
    mask = torch.ones(2, 1, 1, 5)
    mask[0, ..., -2:] = 0
    with torch.no_grad():
        for m in (None, mask):
            assert_close(actual(q, k, v, m), expected(q, k, v, m), rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_round_trip_each_naming_scheme(tmp_path, scheme, suffix):
    original = _reference()
    path = tmp_path / f"ckpt{suffix}"
    _write(SCHEMES[scheme](original.state_dict()), path)

    loaded = load_checkpoint(path, num_heads=HEADS)

    assert not loaded.training
    assert (loaded.d_model, loaded.num_heads) == (D_MODEL, HEADS)
    _assert_same_forward(loaded, original)


@pytest.mark.parametrize(
    ("ref", "alias"), [(ref, alias) for ref, (_, aliases) in PROJECTIONS.items() for alias in aliases]
)
@pytest.mark.parametrize("bias", [True, False], ids=["biased", "bias_free"])
def test_every_alias_of_every_projection_loads(tmp_path, ref, alias, bias):
    original = _reference(seed=1, bias=bias)
    state = {key.replace(f"{ref}.", f"{alias}.", 1) if key.startswith(f"{ref}.") else key: value
             for key, value in original.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)

    loaded = load_checkpoint(path, num_heads=HEADS)

    assert (loaded.W_q.bias is not None) == bias
    _assert_same_forward(loaded, original)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("scheme", ["reference", "linear", "proj", "packed"])
def test_bias_free_projections_load_without_biases(tmp_path, scheme, suffix):
    original = _reference(seed=2, bias=False)
    path = tmp_path / f"ckpt{suffix}"
    packed = {"in_proj_weight": torch.cat([original.state_dict()[f"W_{r}.weight"] for r in "qkv"]),
              "out_proj.weight": original.W_o.weight}
    _write(packed if scheme == "packed" else SCHEMES[scheme](original.state_dict()), path)

    loaded = load_checkpoint(path, num_heads=HEADS)

    assert set(loaded.state_dict()) == {f"W_{r}.weight" for r in "qkvo"}
    _assert_same_forward(loaded, original)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
@pytest.mark.parametrize("wrapper", ["state_dict", "model", "model_state_dict"])
def test_round_trip_wrapped_state_dict(tmp_path, wrapper, suffix):
    original = _reference(seed=3)
    path = tmp_path / f"ckpt{suffix}"
    torch.save({wrapper: SCHEMES["lowercase"](original.state_dict()), "epoch": 7}, path)

    _assert_same_forward(load_checkpoint(path, num_heads=HEADS), original)


def test_other_dtypes_load_as_float32(tmp_path):
    original = _reference(seed=5)
    path = tmp_path / "half.pt"
    torch.save({k: v.to(torch.bfloat16) for k, v in original.state_dict().items()}, path)

    loaded = load_checkpoint(path, num_heads=HEADS)

    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    for key, value in loaded.state_dict().items():
        assert_close(value, original.state_dict()[key].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_to_reference_state_dict_returns_owned_reference_keys():
    original = _reference()
    converted = to_reference_state_dict(_packed(original.state_dict()))

    assert tuple(converted) == REFERENCE_KEYS
    for key, value in original.state_dict().items():
        assert_close(converted[key], value, rtol=0, atol=0)
    safetensors.torch.save(converted)  # split parts must not share storage


def _assert_matches_torch_attention(loaded: MultiHeadAttention, torch_mha: nn.MultiheadAttention, self_attention=True):
    """``loaded`` computes what ``torch_mha`` (batch_first) does, with and without a key padding mask.

    torch runs one packed projection and its own SDPA kernel, the reference three matmuls and an explicit
    softmax: the same math in another order, so fp32 rounding differs by ~1e-7; 1e-5 leaves room for that
    and is far below what loading the wrong weights gives (the other layer of an encoder: ~3e-1).
    """
    q, k, v = _inputs(q_len=5) if not self_attention else (_inputs(q_len=5)[0],) * 3
    pad = torch.zeros(2, 5, dtype=torch.bool)  # True = padding, torch's convention
    pad[0, -2:] = True
    pad[1, 1] = True
    with torch.no_grad():
        for key_padding_mask in (None, pad):
            expected, _ = torch_mha(q, k, v, key_padding_mask=key_padding_mask, need_weights=False)
            actual, _ = loaded(q, k, v, None if key_padding_mask is None else (~pad)[:, None, None, :])
            assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False], ids=["biased", "bias_free"])
@pytest.mark.parametrize("self_attention", [False, True], ids=["cross", "self"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_matches_torch_multihead_attention(tmp_path, suffix, self_attention, bias):
    torch_mha = randomise_parameters(nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True, bias=bias), seed=0)
    path = tmp_path / f"mha{suffix}"
    _write(torch_mha.state_dict(), path)

    loaded = load_checkpoint(path, num_heads=HEADS)

    assert (loaded.W_o.bias is not None) == bias
    _assert_matches_torch_attention(loaded, torch_mha, self_attention)


def _transformer_encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=16, batch_first=True)
    return randomise_parameters(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), seed=7)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("prefix", ["layers.1.self_attn.", "layers.1.self_attn", "layers.0.self_attn."])
def test_prefix_takes_one_layer_out_of_a_transformer_encoder(tmp_path, prefix, suffix):
    encoder = _transformer_encoder()
    path = tmp_path / f"encoder{suffix}"
    _write(encoder.state_dict(), path)
    layer = int(prefix.split(".")[1])

    loaded = load_checkpoint(path, num_heads=HEADS, prefix=prefix)

    _assert_matches_torch_attention(loaded, encoder.layers[layer].self_attn)
    with pytest.raises(AssertionError):  # the two layers differ: loading the other one would be caught
        _assert_matches_torch_attention(loaded, encoder.layers[1 - layer].self_attn)


class _UserAttention(nn.Module):
    """The projections of a user's bias-free attention, under names of the alias table."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value, self.output_linear = (
            nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(4)
        )


class _UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, D_MODEL)
        self.decoder = nn.Module()
        self.decoder.blocks = nn.ModuleList(nn.ModuleDict({"attn": _UserAttention(), "norm": nn.LayerNorm(D_MODEL)})
                                            for _ in range(3))
        self.head = nn.Linear(D_MODEL, 10)


def test_prefix_takes_a_bias_free_block_out_of_a_user_model(tmp_path):
    user = randomise_parameters(_UserModel(), seed=3)
    path = tmp_path / "user.safetensors"
    _write(user.state_dict(), path)

    loaded = load_checkpoint(path, num_heads=HEADS, prefix="decoder.blocks.2.attn.")

    block = user.decoder.blocks[2]["attn"]
    names = {"W_q": block.query, "W_k": block.key, "W_v": block.value, "W_o": block.output_linear}
    assert set(loaded.state_dict()) == {f"{ref}.weight" for ref in names}
    for ref, linear in names.items():
        assert_close(getattr(loaded, ref).weight, linear.weight, rtol=0, atol=0)


def test_candidate_prefixes_in_natural_order():
    state = {f"layers.{i}.attention.{name}.weight": torch.zeros(1) for i in (10, 2, 0) for name in "qkvo"}
    state |= {"layers.3.attention.q.weight": torch.zeros(1), "head.out.weight": torch.zeros(1)}

    assert candidate_prefixes(state) == ["layers.0.attention.", "layers.2.attention.", "layers.10.attention."]


def test_save_checkpoint_of_torch_multihead_attention_records_heads(tmp_path):
    torch_mha = nn.MultiheadAttention(D_MODEL, 4, batch_first=True)
    path = tmp_path / "mha.safetensors"
    save_checkpoint(torch_mha, path)

    _, metadata = read_state_dict(path)
    assert metadata == {"d_model": str(D_MODEL), "num_heads": "4"}
    assert load_checkpoint(path).num_heads == 4


def test_num_heads_from_metadata_unless_given(tmp_path):
    original = _reference()
    path = tmp_path / "ref.safetensors"
    save_checkpoint(original, path)

    loaded = load_checkpoint(path)
    assert loaded.num_heads == HEADS
    _assert_same_forward(loaded, original)
    assert load_checkpoint(path, num_heads=4).num_heads == 4


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_save_checkpoint_is_atomic_and_overwrites(tmp_path, suffix):
    path = tmp_path / f"ref{suffix}"
    path.write_bytes(b"old contents")
    original = _reference(seed=9)

    save_checkpoint(original, path)

    assert os.listdir(tmp_path) == [path.name]
    (tmp_path / "plain").touch()
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode  # same permissions as a normal write
    _assert_same_forward(load_checkpoint(path, num_heads=HEADS), original)


def test_save_checkpoint_failure_leaves_no_temp_file(tmp_path):
    with pytest.raises(CheckpointError, match="unknown suffix"):
        save_checkpoint(_reference(), tmp_path / "ref.onnx")
    (tmp_path / "taken.pt").mkdir()  # the final rename onto a directory fails
    with pytest.raises(CheckpointError, match="cannot write"):
        save_checkpoint(_reference(), tmp_path / "taken.pt")
    assert os.listdir(tmp_path) == ["taken.pt"]


@pytest.mark.parametrize(
    ("suffix", "metadata", "fragments"),
    [
        (".pt", None, ["num_heads is required", "--heads"]),
        (".safetensors", {}, ["num_heads is required", "--heads"]),
        (".safetensors", {"num_heads": "two"}, ["num_heads='two' is not an integer"]),
    ],
)
def test_num_heads_unknown(tmp_path, suffix, metadata, fragments):
    path = tmp_path / f"ref{suffix}"
    state = _reference().state_dict()
    if metadata is None:
        torch.save(state, path)
    else:
        safetensors.torch.save_file(state, path, metadata=metadata)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("num_heads", [3, 0])
def test_num_heads_invalid_for_d_model(tmp_path, num_heads):
    path = tmp_path / "ref.pt"
    save_checkpoint(_reference(), path)

    with pytest.raises(CheckpointError, match=rf"{re.escape(f'checkpoint {path}: ')}.*\b{num_heads}\b"):
        load_checkpoint(path, num_heads=num_heads)


def _drop(key):
    return lambda state: {k: v for k, v in state.items() if k != key}


def _set(key, shape):
    return lambda state: {**state, key: torch.zeros(shape)}


@pytest.mark.parametrize(
    ("mutate", "fragments"),
    [
        (_drop("W_k.bias"), ["missing W_k.bias", "W_k has no bias but W_q, W_v, W_o have"]),
        (_set("blah.weight", (8, 8)), ["unexpected keys: blah.weight"]),
        (_set("W_o.weight", (4, 5)), ["W_o.weight has shape (4, 5), expected (8, 8)"]),
        (_set("W_q.weight", (8, 6)), ["W_q.weight has shape (8, 6), expected (8, 8)"]),
        (_set("W_v.bias", (7,)), ["W_v.bias has shape (7,), expected (8,)"]),
        (_set("W_k.weight", (8,)), ["W_k.weight has shape (8,), expected (8, 8)"]),
        (
            lambda s: _set("extra", (1,))(_set("W_o.weight", (4, 5))(_drop("W_k.bias")(s))),
            ["missing W_k.bias; unexpected keys: extra; W_o.weight has shape (4, 5), expected (8, 8)"],
        ),
        (
            lambda s: {**_packed(s), "in_proj_weight": torch.zeros(20, 8)},
            ["in_proj_weight has shape (20, 8)"],
        ),
        (
            lambda s: _drop("in_proj_bias")(_packed(s)),
            ["missing W_q.bias, W_k.bias, W_v.bias", "W_q, W_k, W_v have no bias but W_o has"],
        ),
        (
            lambda s: {k: v for k, v in s.items() if k in ("W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight",
                                                            "W_v.bias")},
            ["missing W_q.bias, W_k.bias, W_o.bias", "W_q, W_k, W_o have no bias but W_v has",
             "biases on all four projections or on none"],
        ),
        (lambda s: {**s, "q_proj.weight": s["W_q.weight"]}, ["W_q.weight given by several keys"]),
        (
            lambda s: {**SCHEMES["nested"](s), "model.norm.weight": torch.ones(8)},
            ["unexpected keys: model.norm.weight"],
        ),
        (
            lambda s: {**SCHEMES["dataparallel"](s), "other.W_q.weight": s["W_q.weight"]},
            ["several prefixes", "one of 'module.'; only some projections under 'other.'"],
        ),
        (lambda s: {"weight": s["W_q.weight"]}, ["unexpected keys: weight", "no key matches a known naming"]),
    ],
    ids=[
        "missing",
        "unexpected",
        "shape",
        "non_square",
        "bias_length",
        "weight_1d",
        "combined",
        "packed_shape",
        "packed_no_bias",
        "one_bias",
        "conflict",
        "prefixed_unexpected",
        "two_prefixes",
        "unrecognised",
    ],
)
def test_state_dict_problems_are_named(tmp_path, mutate, fragments):
    path = tmp_path / "bad.pt"
    torch.save(mutate(_reference().state_dict()), path)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, num_heads=HEADS)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path}: ")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("ref", sorted(PROJECTIONS))
def test_missing_projection_error_names_its_every_alias(ref):
    state = {key: value for key, value in _reference().state_dict().items() if not key.startswith(f"{ref}.")}

    with pytest.raises(CheckpointError) as info:
        to_reference_state_dict(state)
    role, aliases = PROJECTIONS[ref]
    assert f"missing {ref}.weight, {ref}.bias" in str(info.value)
    assert names_listed(str(info.value), role) == list(aliases)


def test_no_projection_found_error_names_every_alias():
    with pytest.raises(CheckpointError) as info:
        to_reference_state_dict({"encoder.fc.weight": torch.zeros(8, 8)})
    message = str(info.value)
    assert "no key matches a known naming scheme" in message
    for role, aliases in PROJECTIONS.values():
        assert names_listed(message, role) == list(aliases)
    for name in PACKED:
        assert name in message


def _encoder_state() -> dict[str, torch.Tensor]:
    return _transformer_encoder().state_dict()


@pytest.mark.parametrize(
    ("make", "prefix", "fragments", "absent"),
    [
        (
            _encoder_state,
            None,
            ["attention weights under several prefixes", "pass its prefix (--prefix; prefix= in Python), one of "
             "'layers.0.self_attn.', 'layers.1.self_attn.'"],
            [],
        ),
        (
            _encoder_state,
            "layers.2.self_attn.",
            ["no key starts with the prefix 'layers.2.self_attn.'", "one of 'layers.0.self_attn.', "
             "'layers.1.self_attn.'"],
            [],
        ),
        (
            _encoder_state,
            "layers.1.",
            ["missing W_q.weight, W_k.weight, W_v.weight, W_o.weight",
             "unexpected keys: layers.1.self_attn.in_proj_weight, layers.1.self_attn.in_proj_bias",
             "one of 'layers.0.self_attn.', 'layers.1.self_attn.'",
             "no key under the prefix 'layers.1.' matches a known naming scheme"],
            [],
        ),
        (
            lambda: {**SCHEMES["nested"](_reference().state_dict()), "model.norm.weight": torch.ones(8)},
            None,
            ["unexpected keys: model.norm.weight", "pass its prefix (--prefix; prefix= in Python), one of "
             "'model.attn.'"],
            [],
        ),
        (
            lambda: {**SCHEMES["nested"](_reference().state_dict()), "model.attn.rotary.freq": torch.ones(8),
                     "model.norm.weight": torch.ones(8)},
            "model.attn.",
            ["unexpected keys: model.attn.rotary.freq"],
            ["model.norm.weight", "--prefix"],  # outside the prefix: ignored; no other prefix would help
        ),
        (
            lambda: {f"model.{i}.attn.{k}": v for i in range(30) for k, v in _reference().state_dict().items()},
            None,
            ["several prefixes", "'model.15.attn.' and 14 more"],
            ["'model.16.attn.'"],
        ),
        (
            lambda: {"a.W_q.weight": torch.zeros(8, 8), "b.W_k.weight": torch.zeros(8, 8)},
            None,
            ["several prefixes ('a.', 'b.'), none with all four projections; names read: query: W_q"],
            ["--prefix"],
        ),
    ],
    ids=["no_prefix", "absent_prefix", "prefix_above_the_block", "outside_keys", "unexpected_under_prefix",
         "many_candidates", "no_whole_block"],
)
def test_prefix_problems_are_named(make, prefix, fragments, absent):
    with pytest.raises(CheckpointError) as info:
        to_reference_state_dict(make(), prefix=prefix)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    for fragment in absent:
        assert fragment not in message


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (_reference, ["pickles mha_deploy.models.attention.MultiHeadAttention"]),
        (lambda: {"W_q.weight": torch.ones(1), "name": "mha"}, ["'name' (str)"]),
        (lambda: {"state_dict": {"W_q.weight": 1.5}}, ["'W_q.weight' (float)"]),
        (lambda: [torch.ones(1)], ["holds a list"]),
    ],
    ids=["module", "string_value", "wrapped_float", "list"],
)
def test_not_a_plain_state_dict(tmp_path, make, fragments):
    path = tmp_path / "obj.pt"
    torch.save(make(), path)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, num_heads=HEADS)
    message = str(info.value)
    for fragment in [str(path), "not a plain state dict of tensors", "torch.save(module.state_dict(), path)"]:
        assert fragment in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("absent.pt", None, "file not found"),
        ("random.pt", NOISE, "cannot read it as a torch file"),
        ("truncated.pt", b"\x80\x02" + NOISE[:64], "cannot read it as a torch file"),
        ("random.safetensors", NOISE, "cannot read it as safetensors"),
        ("empty.safetensors", b"", "cannot read it as safetensors"),
        ("model.onnx", b"onnx", "unknown suffix '.onnx'"),
        ("weights", b"", "unknown suffix '(none)'"),
    ],
)
def test_unreadable_files(tmp_path, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)

    with pytest.raises(CheckpointError) as info:
        read_state_dict(path)
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path, num_heads=HEADS)
