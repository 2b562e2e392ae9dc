"""``mha-deploy inspect``: what an ONNX file holds."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mha_deploy.cli.group import main, one_line
from mha_deploy.errors import MHADeployError


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model, as_json):
    """Show a model's inputs and outputs (with dynamic dims), opsets, ops, the kernel each attention runs on
    ORT's CPU provider, and recorded metadata.

    \b
    Example:
      mha-deploy inspect mha.onnx --json
    """
    from mha_deploy.model_report import describe_model

    report = describe_model(model)
    problem = _metadata_problem(model) if report.metadata is not None else None
    if problem:
        click.echo(f"warning: its metadata does not describe its graph, which infer and serve refuse: {problem}",
                   err=True)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "metadata_problem": problem}, indent=2, default=_json_default))
        return
    click.echo(report.text())


def _metadata_problem(model: Path) -> str | None:
    """What the check every session makes on load finds wrong with ``model``'s metadata, or None."""
    from mha_deploy.runtime.session import check_model_file

    try:
        check_model_file(model)
    except MHADeployError as exc:
        return one_line(exc)
    return None



def _json_default(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
