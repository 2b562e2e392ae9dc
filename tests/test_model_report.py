"""inspect names each attention's kernel from the tags the fusion rules write, not by recognising their graphs."""

from __future__ import annotations

import onnx

from mha_deploy.exporters.fusion.padding_flash import PADDING_FLASH_KERNEL
from mha_deploy.exporters.fusion.short_sequence import short_sequence_kernel
from mha_deploy.metadata import Signature
from mha_deploy.model_report import describe_model
from mha_deploy.onnx_nodes import KERNEL_PROP, LONG_KERNEL, all_nodes


def _tags(model: onnx.ModelProto) -> dict[str, str]:
    return {p.value: node.output[0] for node in all_nodes(model.graph) for p in node.metadata_props
            if p.key == KERNEL_PROP}


def test_the_kernel_line_is_the_rules_tags(export_model, tmp_path):
    path, _ = export_model(Signature("self", "padding"))
    model = onnx.load(path)
    # short_sequence's If holds padding_flash's: each rule wrote what its own If runs.
    assert set(_tags(model)) == {short_sequence_kernel(LONG_KERNEL, 256, 64), PADDING_FLASH_KERNEL}
    (attention,) = describe_model(path).attention_ops
    assert attention.kernel == short_sequence_kernel(PADDING_FLASH_KERNEL, 256, 64)
    # Whatever a rule writes is what inspect says: nothing downstream re-derives it.
    for node in all_nodes(model.graph):
        for prop in node.metadata_props:
            if prop.value == PADDING_FLASH_KERNEL:
                prop.value = "a kernel the rule named"
    retagged = tmp_path / "retagged.onnx"
    onnx.save(model, retagged)
    (attention,) = describe_model(retagged).attention_ops
    assert attention.kernel == short_sequence_kernel("a kernel the rule named", 256, 64)
