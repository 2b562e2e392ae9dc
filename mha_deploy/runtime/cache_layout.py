"""Which KV-cache layout a decoder file keeps (``metadata.CACHE_RAGGED`` or ``CACHE_HOLES``), decided in one place.

The stepper needs it to feed the file, and the CUDA checks to refuse a ragged file off the CPU provider; both ask
``read_cache_layout``, so that a file without mha-deploy metadata (an Optimum-style copy, or one whose metadata was
stripped) reads the same to both. onnx only.
"""

from __future__ import annotations

import os
import re

import onnx

from mha_deploy.metadata import CACHE_HOLES, CACHE_RAGGED, ModelMetadata
from mha_deploy.runtime.session_file import read_graph

# A self-attention cache input in Optimum's names (``.decoder.`` in an encoder-decoder's decoder).
SELF_CACHE = re.compile(r"^past_key_values\.(\d+)\.(?:decoder\.)?(key|value)$")


def read_cache_layout(metadata: ModelMetadata | None, graph: onnx.GraphProto | str | os.PathLike | None) -> str:
    """How the file keeps its cache: what its metadata records (``metadata.cache_layout``), else read off the graph
    (given, or read from its path without its weights): ragged when a contrib GroupQueryAttention reads its past
    straight from a ``past_key_values.*`` input (it then writes present at each row's own length, in the past's
    buffer when bound to it), holes otherwise, and holes when there is no graph to read."""
    recorded = getattr(metadata, "cache_layout", None)
    if recorded is not None:
        return recorded
    if isinstance(graph, str | os.PathLike):
        if not os.path.isfile(graph):
            return CACHE_HOLES
        graph = read_graph(graph).graph  # the graph only: its weights' bytes stay in the file (session_file)
    if graph is None:
        return CACHE_HOLES
    inputs = {value.name for value in graph.input}
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft" and len(node.input) > 3 \
                and node.input[3] in inputs and SELF_CACHE.match(node.input[3]):
            return CACHE_RAGGED
    return CACHE_HOLES
