"""Users' own models (tests/user_models) through `mha-deploy export --module`: every attention fused on every
execution path, no Softmax left, parity against the module on both padding sides, the Signature read off
the module; and bad declarations as one-line errors that name the input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from mha_deploy.cli import main  # noqa: E402
from mha_deploy.errors import ExportError, InputError  # noqa: E402
from mha_deploy.exporters import export_model  # noqa: E402
from mha_deploy.model_report import describe_model  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import USER_MODELS, assert_equals_module, module_feeds, user_module  # noqa: E402

# model file -> attentions in it
ATTENTIONS = {
    "classifier": 2, "causal_lm": 2, "seq2seq": 6, "feature_encoder": 2, "torch_encoder": 2, "sdpa_classifier": 2,
    "swiglu_tagger": 2,
}
ATTENTION_OPS = {"MultiHeadAttention", "GroupQueryAttention", "Attention"}


def _attention_sites(graph: onnx.GraphProto) -> int:
    """Attentions on every execution path of ``graph``: each attention op, or If whose branches each hold one
    path's worth; asserts that both branches of an If agree."""
    sites = 0
    for node in graph.node:
        if node.op_type in ATTENTION_OPS:
            sites += 1
        elif node.op_type == "If":
            branches = [_attention_sites(attr.g) for attr in node.attribute if attr.name in ("then_branch",
                                                                                            "else_branch")]
            assert len(set(branches)) == 1, f"If {node.name}: its branches hold {branches} attentions"
            sites += branches[0]
    return sites


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_every_attention_is_fused_on_every_path(own_model, name):
    path, output = own_model(name)
    model = onnx.load(str(path))
    assert "parity PASSED" in output
    assert f"{ATTENTIONS[name]} fused" in output
    assert _attention_sites(model.graph) == ATTENTIONS[name]
    assert not [node.name for node in all_nodes(model.graph) if node.op_type == "Softmax"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_outputs_equal_the_module_on_real_rows(own_model, name, side):
    path, _ = own_model(name)
    session = MHASession(path, provider="cpu")
    signature = session.signature
    lengths = {axis: 23 + 6 * i for i, axis in enumerate(signature.sequence_axes)}
    feeds = module_feeds(session, 3, lengths, side, seed=7)
    assert_equals_module(session, user_module(name).build(), feeds, f"{name} ({side} padding)")


@pytest.mark.parametrize(
    ("name", "inputs", "outputs", "paddable"),
    [
        ("classifier", {"input_ids": ("tokens", ("batch", "seq")),
                        "attention_mask": ("padding_mask", ("batch", "seq"))},
         {"output": ("batch", 3)}, {"seq"}),
        ("causal_lm", {"tokens": ("tokens", ("batch", "seq")), "mask": ("padding_mask", ("batch", "seq"))},
         {"output": ("batch", "seq", 50)}, {"seq"}),
        ("seq2seq", {"src": ("tokens", ("batch", "src_seq")), "src_mask": ("padding_mask", ("batch", "src_seq")),
                     "tgt": ("tokens", ("batch", "tgt_seq")), "tgt_mask": ("padding_mask", ("batch", "tgt_seq"))},
         {"output": ("batch", "tgt_seq", 50)}, {"src_seq", "tgt_seq"}),
        ("feature_encoder", {"features": ("sequence", ("batch", "frames", 20)),
                             "frame_mask": ("padding_mask", ("batch", "frames"))},
         {"output": ("batch", "frames", 32)}, {"frames"}),
    ],
)
def test_the_signature_is_read_off_the_module(own_model, name, inputs, outputs, paddable):
    session = MHASession(own_model(name)[0], provider="cpu")
    signature = session.signature
    assert {spec.name: (spec.role, spec.axes) for spec in signature.inputs} == inputs
    assert {spec.name: spec.axes for spec in signature.outputs} == outputs
    assert signature.paddable_axes == paddable
    assert session.metadata.fusion == "mha"


def test_token_ids_keep_to_the_vocabulary(own_model):
    session = MHASession(own_model("classifier")[0], provider="cpu")
    assert session.signature.tensors["input_ids"].vocab == 50
    with pytest.raises(InputError, match="input_ids holds id 50: this model's vocabulary is ids 0 to 49"):
        session.run({"input_ids": np.array([[1, 50]]), "attention_mask": np.ones((1, 2), bool)})


class _UnpooledMask(torch.nn.Module):
    """Mean-pools without its mask: right-padding changes its output, so its axis must not be padded."""

    def __init__(self):
        super().__init__()
        self.inner = user_module("classifier").build()

    def forward(self, input_ids, attention_mask):
        x = self.inner.embed(input_ids)
        for block in self.inner.blocks:
            x = block(x, attention_mask.unsqueeze(1).unsqueeze(2))
        return x.mean(dim=1)


def test_a_model_that_reads_padding_is_not_padded(tmp_path):
    result = export_model(_UnpooledMask(), tmp_path / "m.onnx", ["input_ids:tokens", "attention_mask:padding-mask"])
    assert result.metadata.signature.paddable_axes == frozenset()
    assert any("changes real outputs although attention_mask masks it" in w for w in result.warnings)


class _SpecialisesLength(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.size(1) > 4:  # a Python branch on the length: torch.export fixes the length it traced
            return self.linear(x) * 2
        return self.linear(x)


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)

    def forward(self, ids, mask):
        return self.embed(ids) * mask.unsqueeze(-1)


class _PositionalOnly(_TwoInputs):
    def forward(self, ids=None, mask=None, /):
        return super().forward(ids, mask)


class _ScaleFirst(_TwoInputs):
    def forward(self, scale=1.0, ids=None, mask=None, /):
        return super().forward(ids, mask) * scale


class _CacheFirst(_TwoInputs):
    """GPT-2's shape of forward: a cache between the ids and the mask, more options after, keyword-only ones,
    **kwargs; only the ids and the mask are declared."""

    def forward(self, ids=None, past=None, mask=None, scale=1.0, *, shift=0.0, **kwargs):
        assert past is None and not kwargs
        return super().forward(ids, mask) * scale + shift


class _KeywordOnly(_TwoInputs):
    def forward(self, ids, *, mask, scale=2.0):
        return super().forward(ids, mask) * scale


@pytest.mark.parametrize(
    ("module", "inputs"),
    [
        (_TwoInputs, ["mask:padding-mask", "ids:tokens"]),
        (_CacheFirst, ["ids:tokens", "mask:padding-mask"]),
        (_CacheFirst, ["mask:padding-mask", "ids:tokens"]),
        (_KeywordOnly, ["mask:padding-mask", "ids:tokens"]),
        (_PositionalOnly, ["ids:tokens", "mask:padding-mask"]),
    ],
)
def test_inputs_bind_by_name_in_any_order(tmp_path, module, inputs):
    """Each declared input reaches the parameter of its name, the others keep their defaults, and the file takes
    its inputs in the declared order."""
    model = module()
    result = export_model(model, tmp_path / "m.onnx", inputs, fuse="none")
    assert result.parity.passed
    session = MHASession(tmp_path / "m.onnx", provider="cpu")
    assert session.input_names == tuple(decl.split(":")[0] for decl in inputs)
    ids, mask = np.array([[3, 4, 5], [6, 7, 0]]), np.array([[True, True, True], [True, True, False]])
    with torch.no_grad():
        expected = _TwoInputs.forward(model, torch.from_numpy(ids), torch.from_numpy(mask))
    scale = {_KeywordOnly: 2.0}.get(module, 1.0)
    got = session.run({"ids": ids, "mask": mask})["output"]
    np.testing.assert_allclose(got[mask], (expected * scale).numpy()[mask], atol=1e-6)


@pytest.mark.parametrize(
    ("module", "inputs", "message"),
    [
        (_TwoInputs, ["ids:tokens", "pad:padding-mask"],
         r"^input pad is not a parameter of _TwoInputs.forward\(ids, mask\): name each input after .* \(ids, mask\)"),
        (_TwoInputs, ["ids:tokens"], r"^_TwoInputs.forward\(ids, mask\) also needs mask: declare an input for every "
                                     r"parameter without a default \(--input mask:ROLE\)"),
        (_ScaleFirst, ["ids:tokens", "mask:padding-mask"],
         r"^input ids of _ScaleFirst.forward\(scale, ids, mask\) is positional-only and follows scale, which is not "),
        (_TwoInputs, ["ids:tokens", "mask:padding-mask:other"], r"^input mask: a padding mask marks .* none is"),
        (_TwoInputs, ["ids:sequence:seq:8", "mask:padding-mask"], r"fails on the declared inputs \(ids:sequence"),
        (_TwoInputs, ["ids:tokens", "mask:weights"], r"^input mask: role must be one of"),
        (_SpecialisesLength, ["x:sequence"], r"^the module does not trace with a dynamic 'seq' axis \(inputs x\)"),
    ],
)
def test_bad_declarations_are_one_line_errors_naming_the_input(tmp_path, module, inputs, message):
    with pytest.raises(ExportError, match=message) as info:
        export_model(module(), tmp_path / "m.onnx", inputs)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_built_in_model_flags_with_a_module(tmp_path):
    result = CliRunner().invoke(main, ["export", "--module", f"{USER_MODELS / 'classifier'}.py:build", "--input",
                                       "input_ids:tokens", "--mask", "padding", "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2
    assert "--mask describe the built-in ones" in result.output


@pytest.mark.parametrize(
    ("options", "op"),
    [({"fuse": "onnx"}, "Attention"), ({"dtype": "fp16"}, "MultiHeadAttention"),
     ({"quantize": "int8-dynamic"}, "MultiHeadAttention"), ({"quantize": "int4"}, "MultiHeadAttention")],
)
def test_every_export_option_takes_a_users_model(tmp_path, options, op):
    inputs = user_module("classifier").INPUTS
    result = export_model(user_module("classifier").build(), tmp_path / "m.onnx", inputs, **options)
    assert result.parity.passed and not result.warnings
    assert result.fusion.fused == 2 and {o.op_type.split(".")[-1] for o in result.fusion.ops} == {op}


class _BigVocabulary(torch.nn.Module):
    """BERT-like: more token ids (1000) than positions (64); ids past 64 are valid."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(64, 8)
        self.tok = torch.nn.Embedding(1000, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1)))[None]
        return self.head((x * mask.unsqueeze(-1)).sum(1))


def test_the_vocabulary_is_the_table_the_ids_index(tmp_path):
    result = export_model(_BigVocabulary(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"], max_length=64)
    assert result.metadata.signature.tensors["ids"].vocab == 1000
    session = MHASession(tmp_path / "m.onnx", provider="cpu")
    session.run({"ids": np.array([[999, 500]]), "mask": np.ones((1, 2), bool)})
    with pytest.raises(InputError, match="holds id 1000: this model's vocabulary is ids 0 to 999"):
        session.run({"ids": np.array([[1000, 1]]), "mask": np.ones((1, 2), bool)})


@pytest.mark.parametrize(("given", "recorded"), [(None, 64), (40, 40), (65, None)], ids=["read", "given", "too-long"])
def test_the_max_length_is_the_position_tables_unless_given_shorter(tmp_path, given, recorded):
    path = tmp_path / "m.onnx"
    if recorded is None:
        with pytest.raises(ExportError, match="--max-length 65 is longer than the module's position table pos takes "
                                              r"\(64 positions\)"):
            export_model(_BigVocabulary(), path, ["ids:tokens", "mask:padding-mask"], max_length=given)
        assert not path.exists()
        return
    result = export_model(_BigVocabulary(), path, ["ids:tokens", "mask:padding-mask"], max_length=given)
    assert result.metadata.max_length == recorded
    assert max(int(shape.split("x")[1].split("/")[0]) for shape in result.parity.shapes) == recorded
    with pytest.raises(InputError, match=f"ids is {recorded + 1} tokens long, this model takes at most {recorded} "):
        MHASession(path, provider="cpu").run({"ids": np.ones((1, recorded + 1), np.int64),
                                              "mask": np.ones((1, recorded + 1), bool)})


# (model file, factory) -> the max length read off its position tables: an arange (BERT), RoBERTa's positions
# after padding_idx (514 rows, 512 positions), BART's table with its offset of 2 indexed inside its own forward;
# none for T5's relative position buckets and a model without a position table.
POSITION_TABLES = {
    ("hf_encoder", "build_bert"): 512,
    ("hf_encoder", "build_roberta"): 512,
    ("hf_seq2seq", "build_bart"): 512,
    ("hf_seq2seq", "build_t5"): None,
    ("causal_lm", "build"): None,
}


@pytest.mark.parametrize(("name", "factory"), list(POSITION_TABLES))
def test_position_tables_are_read_off_the_module(name, factory):
    from mha_deploy.exporters.own_model import declare_model, position_tables

    model = user_module(name)
    declared = declare_model(getattr(model, factory)(), model.INPUTS)
    tables = position_tables(declared.wrapper, declared.signature)
    assert min((table.max_length for table in tables), default=None) == POSITION_TABLES[name, factory], tables


class CacheObjectLM(torch.nn.Module):
    """A forward with Hugging Face's ``use_cache`` convention: on (by its config, as ``from_pretrained`` leaves it),
    it returns a cache object beside the logits; off, ``None`` in its place."""

    def __init__(self, use_cache):
        super().__init__()
        self.config = type("Config", (), {"use_cache": use_cache})()
        self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)

    def forward(self, input_ids, use_cache=None):
        cache = object() if (self.config.use_cache if use_cache is None else use_cache) else None
        return {"logits": self.head(self.embed(input_ids)), "past_key_values": cache}


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_forward_returning_a_cache_object_is_called_with_use_cache_off(use_cache):
    from mha_deploy.exporters.own_model import declare_model

    declared = declare_model(CacheObjectLM(use_cache), ["input_ids:tokens"])
    assert declared.signature.output_names == ("logits",)
    noted = [w for w in declared.warnings if "use_cache=False" in w]
    assert noted == (["CacheObjectLM.forward called with use_cache=False: the cache object it returns otherwise is "
                      "not a tensor (with --kv-cache the file keeps its own cache)"] if use_cache else [])


# The kernel each user model's attentions end on (op -> count): padding masks as the op's own key_padding_mask
# (flash when nothing is padded), causal ones (tril, pad & tril) on GroupQueryAttention; none through a float
# attention_bias, which would materialise [batch, heads, q, kv].
KERNELS = {
    "classifier": {"MultiHeadAttention+key_padding_mask": 2},
    "causal_lm": {"GroupQueryAttention+seqlens_k": 2},
    "seq2seq": {"MultiHeadAttention+key_padding_mask": 4, "GroupQueryAttention+seqlens_k": 2},
    "feature_encoder": {"MultiHeadAttention+key_padding_mask": 2},
    "torch_encoder": {"MultiHeadAttention+key_padding_mask": 2},
    "sdpa_classifier": {"MultiHeadAttention+key_padding_mask": 2},
    "swiglu_tagger": {"MultiHeadAttention+key_padding_mask": 2},
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_each_mask_lands_on_the_native_kernel(own_model, name):
    ops = describe_model(own_model(name)[0]).attention_ops
    kinds: dict[str, int] = {}
    for op in ops:
        masks = sorted(role for role in op.inputs if role in ("key_padding_mask", "seqlens_k", "attention_bias"))
        key = "+".join([op.op.split("::")[-1], *masks])
        kinds[key] = kinds.get(key, 0) + 1
    assert kinds == KERNELS[name]


class _SoftFill(torch.nn.Module):
    """Masks with -1.0, which is no masking value: no rule may fuse it (the op's fill would change the result)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids, mask):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, 2, 4).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1) / 2.0).masked_fill(mask[:, None, None, :] == 0, -1.0)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, 8)


@pytest.mark.parametrize("fuse", ["mha", "onnx"])
def test_explicit_fusion_names_what_it_left_unfused_and_writes_nothing(tmp_path, fuse):
    with pytest.raises(ExportError, match=r"not fused: .*Softmax.*fill -1.0 is not a masking value") as info:
        export_model(_SoftFill(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"], fuse=fuse)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_auto_falls_back_to_the_checked_plain_graph_with_a_warning(tmp_path):
    result = export_model(_SoftFill(), tmp_path / "m.onnx", ["ids:tokens", "mask:padding-mask"])
    assert result.metadata.fusion == "none" and result.parity.passed
    assert any("--fuse auto: mha fusion not used" in w and "exported the unfused graph" in w for w in result.warnings)
    # A -1 "mask" hides nothing: padding moves the outputs, so the axis is not padded either.
    assert result.metadata.signature.paddable_axes == frozenset()


def test_the_export_refuses_what_a_load_would_refuse_in_the_same_words(tmp_path, monkeypatch):
    """The export runs the load check on the file it is about to write: a file whose metadata the graph
    contradicts (here the heads, recorded as 7 over 4-head attentions) is not written, and the refusal names
    the problem in the words a load would."""
    from mha_deploy.errors import ModelFileError
    from mha_deploy.exporters import export as export_module

    monkeypatch.setattr(export_module, "graph_heads", lambda model, d_model: {7})
    module, inputs = user_module("classifier").build(), user_module("classifier").INPUTS
    problem = "the graph's attentions split up to 4 heads, its metadata says 7"
    with pytest.raises(ExportError, match=f"m.onnx: {problem}; the load check every session runs would refuse"):
        export_model(module, tmp_path / "m.onnx", inputs)
    assert list(tmp_path.iterdir()) == []
    # the same file written without the check: every session refuses it, in the same words
    monkeypatch.setattr(export_module, "_check_loads", lambda model, output: None)
    export_model(module, tmp_path / "m.onnx", inputs)
    with pytest.raises(ModelFileError, match=f"m.onnx: {problem}; the file was edited after export"):
        MHASession(tmp_path / "m.onnx", provider="cpu")
