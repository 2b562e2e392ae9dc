"""The progress bar dataset commands show on stderr, and what they say about a run when it ends."""

from __future__ import annotations


def run_with_progress(run, show: bool, label: str = "infer"):
    """``run(on_start, on_batch)`` with a rich progress bar on stderr, named ``label``: items, items/s and
    tokens/s (generate counts new tokens)."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("items"),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not show, transient=False) as bar:
        task = bar.add_task(label, total=None, rate="")
        counts = {"items": 0, "tokens": 0, "start": time.perf_counter()}

        def on_batch(items: int, tokens: int) -> None:
            counts["items"] += items
            counts["tokens"] += tokens
            elapsed = max(time.perf_counter() - counts["start"], 1e-9)
            rate = f"{counts['items'] / elapsed:.1f} items/s {counts['tokens'] / elapsed:,.0f} tokens/s"
            bar.update(task, advance=items, rate=rate)

        return run(lambda total: bar.update(task, total=total), on_batch)


def echo_run_notes(job, errors, noun: str) -> None:
    """On stderr: the shards a dataset run redid and why, those it could not record, and the first 20 of the
    ``noun``s it skipped (the manifest lists them all)."""
    import click

    for name, reason in job.redo_reasons.items():
        click.echo(f"redid {name}: {reason}", err=True)
    for name in job.unrecorded:
        click.echo(f"warning: {name} changed while it ran; not recorded as done, the next run redoes it", err=True)
    for error in errors[:20]:
        click.echo(f"skipped {error}", err=True)
    if len(errors) > 20:
        click.echo(f"... and {len(errors) - 20} more {noun} (all listed in {job.manifest_path})", err=True)
