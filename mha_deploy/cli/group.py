"""The ``mha-deploy`` command group: every command registers on ``main``; errors become one line."""

from __future__ import annotations

import contextlib
import os
import sys

import click

from mha_deploy import __version__
from mha_deploy.errors import MHADeployError


class _Group(click.Group):
    """Turns errors into one line on stderr (a traceback only with ``--debug``).

    Usage mistakes are ``click.UsageError`` (exit 2, Click's format); an
    ``MHADeployError`` exits 1 with its message; anything else exits 1 as unexpected.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`mha-deploy inspect m.onnx | head`): stop quietly, as SIGPIPE would stop a
            # C tool, and keep Python from failing again when it flushes stdout at exit.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(141)
        except Exception as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if isinstance(exc, MHADeployError):
                click.echo(f"error: {one_line(exc)}", err=True)
            else:
                click.echo(f"error: unexpected {type(exc).__name__}: {one_line(exc)} (rerun with --debug for details)",
                           err=True)
            ctx.exit(1)


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(__version__, prog_name="mha-deploy")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export the reference multi-head attention to ONNX and run it with ONNX Runtime.

    \b
    mha-deploy export -o mha.onnx
    mha-deploy infer mha.onnx --input items.npz --output out.npz
    mha-deploy inspect mha.onnx
    """
    ctx.ensure_object(dict)["debug"] = debug
