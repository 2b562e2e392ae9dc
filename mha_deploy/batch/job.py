"""A dataset job: every shard of an input through a ``BatchRunner``, resumable and crash-safe.

Each output shard is streamed into a temporary file and renamed into place
when complete, then recorded in a manifest (written atomically too). The
manifest holds the model's SHA-256 and each input shard's size and
modification time, so a rerun skips exactly the shards finished with this model
on this input, redoes a shard whose input changed, and refuses (without
``overwrite``) to mix outputs of another model or to clobber files it did not
write. A shard killed half-way leaves only a temporary file, which is removed
by the next attempt at that shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from mha_deploy.atomic import atomic_path
from mha_deploy.batch.datasets import Shard, list_shards, open_reader, open_writer
from mha_deploy.batch.runner import BatchCallback, BatchRunner, RunStats
from mha_deploy.errors import InputError

MANIFEST_NAME = "_mha_deploy_manifest.json"
MANIFEST_FORMAT = 1


def manifest_path(input_path: Path, output_path: Path) -> Path:
    """Inside an output directory (``_``-prefixed, so Spark and Ray readers skip it), or beside an output file."""
    if Path(input_path).is_dir():
        return Path(output_path) / MANIFEST_NAME
    return Path(output_path).with_name(f".{Path(output_path).name}.mha-deploy.json")


def model_fingerprint(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _remove_stale_temporaries(output: Path) -> None:
    # What a killed process left of this shard (atomic_path's naming); never someone else's file.
    for stale in output.parent.glob(f".{output.stem}.*.tmp{output.suffix}"):
        stale.unlink(missing_ok=True)


class DatasetJob:
    """The shards of ``input_path`` -> ``output_path``, with what is already done."""

    def __init__(
        self,
        input_path: str | os.PathLike,
        output_path: str | os.PathLike,
        model: str | os.PathLike,
        overwrite: bool = False,
    ):
        self.input_path, self.output_path = Path(input_path), Path(output_path)
        if self.input_path.resolve() == self.output_path.resolve():
            raise InputError("the output must differ from the input (the input would be overwritten)")
        self.shards = list_shards(self.input_path, self.output_path)
        self.manifest_path = manifest_path(self.input_path, self.output_path)
        self.model_path = Path(model)
        self.model = ""  # its fingerprint, taken when the job is planned (after the model was loaded)
        self.overwrite = overwrite
        self._records: dict[str, dict] = {}

    def plan(self) -> tuple[list[Shard], list[Shard]]:
        """(shards to run, shards already done); claims the output by writing the manifest."""
        self.model = model_fingerprint(self.model_path)
        previous = None if self.overwrite else self._load_manifest()
        if previous is None:
            if not self.overwrite:
                self._refuse_foreign_outputs()
        elif previous["model"] != self.model:
            raise InputError(
                f"{self.manifest_path.parent}: existing outputs were written by another model "
                f"({previous['model'][:19]}…, now {self.model[:19]}…); pass --overwrite to redo them "
                "or choose another --output"
            )
        else:
            self._records = previous["shards"]
        todo, done = [], []
        for shard in self.shards:
            record = self._records.get(shard.name)
            if record and record["input"] == shard.fingerprint() and shard.output.exists():
                done.append(shard)
            else:
                self._records.pop(shard.name, None)
                todo.append(shard)
        self._save_manifest()
        return todo, done

    def record(self, shard: Shard, stats: RunStats) -> None:
        """Note ``shard`` as finished (after its output was renamed into place)."""
        self._records[shard.name] = {
            "input": shard.fingerprint(),
            "output": shard.output.name,
            "items": stats.items,
            "tokens": stats.tokens,
            "skipped_items": [{"id": e.item_id, "error": e.message} for e in stats.errors],
        }
        self._save_manifest()

    def abandon(self) -> None:
        """After a failure: if nothing was ever finished, leave no manifest behind either."""
        if not self._records:
            self.manifest_path.unlink(missing_ok=True)

    def _refuse_foreign_outputs(self) -> None:
        existing = [s.output for s in self.shards if s.output.exists()]
        if existing:
            raise InputError(
                f"{existing[0]} exists and was not written by a resumable run of this job (no manifest "
                f"{self.manifest_path.name}); pass --overwrite to replace it or choose another --output"
            )

    def _load_manifest(self) -> dict | None:
        if not self.manifest_path.exists():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_text())
            if manifest.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {manifest.get('format')}, expected {MANIFEST_FORMAT}")
            manifest["model"], manifest["shards"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{self.manifest_path}: unreadable ({exc}); pass --overwrite to redo the job") from exc
        return manifest

    def _save_manifest(self) -> None:
        manifest = {"format": MANIFEST_FORMAT, "model": self.model, "shards": self._records}
        with atomic_path(self.manifest_path) as tmp:
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def count_items(shards: list[Shard], runner: BatchRunner) -> int:
    """Items in ``shards``, from their indexes and footers (no tensor is read)."""
    session = runner.session
    total = 0
    for shard in shards:
        with open_reader(shard.path, session.signature, session.metadata.d_model, runner.window_items) as reader:
            total += reader.count()
    return total


def run_shard(runner: BatchRunner, shard: Shard, on_batch: BatchCallback | None = None) -> RunStats:
    """Read ``shard`` lazily, run it window by window, and stream its outputs into place atomically."""
    session = runner.session
    stats = RunStats(provider=session.provider)
    start = time.perf_counter()
    _remove_stale_temporaries(shard.output)
    with (
        open_reader(shard.path, session.signature, session.metadata.d_model, runner.window_items) as reader,
        open_writer(shard.output, like=shard.path, signature=session.signature) as writer,
    ):
        for window in runner.run_stream(reader, stats, on_batch, source=shard.name):
            writer.write(window)
    stats.seconds = time.perf_counter() - start
    stats.shards_written = 1
    return stats


def run_dataset(
    job: DatasetJob,
    runner: BatchRunner,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
) -> RunStats:
    """Run every shard not done yet, one after the other; ``on_start(total items)`` before the first."""
    stats = RunStats(provider=runner.session.provider)
    start = time.perf_counter()
    todo, done = job.plan()
    stats.shards_skipped = len(done)
    try:
        if on_start:
            on_start(count_items(todo, runner))
        for shard in todo:
            shard_stats = run_shard(runner, shard, on_batch)
            job.record(shard, shard_stats)
            stats.merge(shard_stats)
    except BaseException:
        job.abandon()
        raise
    finally:
        stats.seconds = time.perf_counter() - start
    return stats
