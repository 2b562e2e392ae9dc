"""The names checkpoints give the attention's four projections: one table.

The loader (``mha_deploy.models.checkpoint``) reads weights by these names, and
``mha-deploy export --help`` and the loader's errors list them from here, so an
accepted name is written once. Dependency-free, so that the CLI shows them
without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable

# Reference projection -> what it is, and the module names a checkpoint saves it under (each with
# ``.weight`` and, for all four projections or none, ``.bias``). The names come from the seeds'
# classes, torch, Hugging Face models and common tutorials (``linears.N``: four cloned Linears).
# ``dense`` is left out: BERT names its output projection so, but also its feed-forward layers.
PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "W_q": ("query", ("W_q", "w_q", "query_linear", "q_proj", "q_linear", "q_lin", "query", "wq", "q", "linears.0")),
    "W_k": ("key", ("W_k", "w_k", "key_linear", "k_proj", "k_linear", "k_lin", "key", "wk", "k", "linears.1")),
    "W_v": ("value", ("W_v", "w_v", "value_linear", "v_proj", "v_linear", "v_lin", "value", "wv", "v", "linears.2")),
    "W_o": ("output", ("W_o", "w_o", "out_linear", "out_proj", "output_linear", "o_proj", "out_lin", "out", "wo",
                       "o", "linears.3")),
}
PARAMS = ("weight", "bias")

# Tensors saved without a module of their own (torch.nn.MultiheadAttention): name -> the reference
# keys it holds, stacked along dim 0 in this order. Packed q, k, v when kdim == vdim == embed_dim,
# separate weights (and still a packed bias) otherwise.
PACKED: dict[str, tuple[str, ...]] = {
    "in_proj_weight": ("W_q.weight", "W_k.weight", "W_v.weight"),
    "in_proj_bias": ("W_q.bias", "W_k.bias", "W_v.bias"),
    **{f"{role}_proj_weight": (f"W_{role}.weight",) for role in "qkv"},
}


def names_of(projections: Iterable[str] = PROJECTIONS) -> str:
    """The names read for ``projections`` (reference names such as ``W_o``), as one line of text."""
    return "; ".join(f"{PROJECTIONS[ref][0]}: {', '.join(PROJECTIONS[ref][1])}" for ref in projections)


def names_text() -> str:
    """Every accepted name, for ``--help`` and for an error that finds no projection at all."""
    return (
        f"{names_of()} (each with .weight, and .bias on all four or none); or torch.nn.MultiheadAttention's "
        f"{', '.join(PACKED)} with out_proj for the output"
    )
