"""A dataset job: every shard of an input through a ``BatchRunner``, locked, resumable and crash-safe.

Each output shard is streamed into a temporary file and renamed into place
when complete, then recorded in a manifest (written atomically too). The
output is locked for the whole run (``OutputLock``), so two jobs never write
one output and the temporaries a killed run left can be removed safely.

The manifest records what produced each output: the model's SHA-256, the input
(its path for the whole job; per shard its size and SHA-256), the options that
change results, and the output's size and SHA-256. A rerun skips a shard only
when all of that still holds, so a truncated, damaged or replaced output, or an
input whose bytes changed (even with its size and mtime kept, as ``cp -p``
does), is redone. It refuses, without ``overwrite``, outputs of another model or
of another input, and files it did not write.

Of the options, only ``on_error`` can change what a finished shard holds
(``skip`` leaves bad items out): a shard finished with skipped items counts as
done only for a run that skips too. Batch size, token budget and bucketing
change the padding, hence at most the last bits of a float; they are recorded,
not compared.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from mha_deploy.atomic import atomic_path, stale_temporaries
from mha_deploy.batch.base import RawItem
from mha_deploy.batch.datasets import Shard, list_shards, open_reader, open_writer, output_keys
from mha_deploy.batch.lock import OutputError, OutputInUseError, OutputLock, lock_path
from mha_deploy.batch.planner import left_out_note
from mha_deploy.batch.runner import BatchCallback, BatchRunner, RunStats
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError, MHADeployError
from mha_deploy.runtime.digest import sha256_digest

__all__ = [
    "MANIFEST_FORMAT", "MANIFEST_NAME", "DatasetJob", "OutputError", "OutputInUseError", "count_items",
    "manifest_path", "model_fingerprint", "run_dataset", "run_shard", "run_shards",
]

MANIFEST_NAME = "_mha_deploy_manifest.json"
# 2: per shard, the input's SHA-256, the output's size and SHA-256 and the options; the job's input path.
MANIFEST_FORMAT = 2


def manifest_path(input_path: Path, output_path: Path) -> Path:
    """Inside an output directory (``_``-prefixed, so Spark and Ray readers skip it), or beside an output file."""
    if Path(input_path).is_dir():
        return Path(output_path) / MANIFEST_NAME
    return Path(output_path).with_name(f".{Path(output_path).name}.mha-deploy.json")


def model_fingerprint(path: str | os.PathLike) -> str:
    return sha256_digest(path)


class DatasetJob:
    """The shards of ``input_path`` -> ``output_path``, with what is already done.

    Use it as a context manager to hold the output's lock from the start
    (``plan`` takes it otherwise) until the end; ``options`` are the runner's,
    set by ``run_dataset`` from its runner (and recorded in the manifest).
    ``shards`` replaces infer's listing (``list_shards``); ``settings`` are
    what else makes the outputs what they are, refused when a rerun differs.
    """

    def __init__(
        self,
        input_path: str | os.PathLike,
        output_path: str | os.PathLike,
        model: str | os.PathLike,
        overwrite: bool = False,
        options: RunnerOptions | None = None,
        shards: list[Shard] | None = None,
        settings: dict | None = None,
    ):
        self.input_path, self.output_path = Path(input_path), Path(output_path)
        if self.input_path.resolve() == self.output_path.resolve():
            raise InputError("the output must differ from the input (the input would be overwritten)")
        # Another command's shards (generate writes JSONL whatever it reads); infer's by default.
        self.shards = shards if shards is not None else list_shards(self.input_path, self.output_path)
        # What else decides the outputs' contents (generate: the search, its ids, the encoder): recorded and, like
        # the model, compared on a rerun, so that outputs made another way are never taken as done.
        self.settings = dict(settings or {})
        self.manifest_path = manifest_path(self.input_path, self.output_path)
        self.lock = OutputLock(lock_path(self.output_path, self.input_path.is_dir()), self.output_path)
        self.model_path = Path(model)
        self.model = ""  # its fingerprint, taken when the job is planned (after the model was loaded)
        self.overwrite = overwrite
        self.options = options or RunnerOptions()
        self.redo_reasons: dict[str, str] = {}  # shard name -> why a shard recorded as done is redone
        self.unrecorded: list[str] = []  # shards whose input changed while they ran: redone next time
        self.left_out: str | None = None  # the outputs no item's results hold, and why (planner.left_out_note)
        self._records: dict[str, dict] = {}
        self._planned: dict[str, dict[str, int]] = {}

    def __enter__(self) -> DatasetJob:
        self.lock.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the output's lock."""
        self.lock.release()

    def plan(self) -> tuple[list[Shard], list[Shard]]:
        """(shards to run, shards already done); locks the output and claims it by writing the manifest."""
        self.lock.acquire()
        for stale in stale_temporaries(self.manifest_path):
            stale.unlink(missing_ok=True)
        self.model = model_fingerprint(self.model_path)
        previous = None if self.overwrite else self._load_manifest()
        records: dict[str, dict] = {}
        if previous is None:
            if not self.overwrite:
                self._refuse_foreign_outputs()
        else:
            if self._outputs_exist(previous):
                # Outputs made another way would be mixed with this run's, or taken for them: refused. A manifest
                # whose outputs are all gone protects nothing; its shards are redone below, each with the reason.
                self._refuse_another_job(previous)
            # Format 1 recorded no digests: what it lists cannot be verified, so it is redone.
            records = previous["shards"] if previous["format"] == MANIFEST_FORMAT else {}
        self._records = dict(records)
        todo, done = [], []
        for shard in self.shards:
            reason = self._not_done_because(shard, records.get(shard.name))
            if reason is None:
                done.append(shard)
                continue
            if shard.name in records:
                self.redo_reasons[shard.name] = reason
            self._records.pop(shard.name, None)
            self._planned[shard.name] = shard.fingerprint()
            todo.append(shard)
        self._save_manifest()
        return todo, done

    def record(self, shard: Shard, stats: RunStats) -> None:
        """Note ``shard`` as finished (after its output was renamed into place)."""
        if shard.fingerprint() != self._planned.get(shard.name):
            # Changed while it ran: the output may hold some of each version. Not done; the next run redoes it.
            self.unrecorded.append(shard.name)
            return
        self._records[shard.name] = {
            "input": {**shard.fingerprint(), "sha256": sha256_digest(shard.path)},
            "output": {
                "name": shard.output.name,
                "size": shard.output.stat().st_size,
                "sha256": sha256_digest(shard.output),
            },
            "options": self.options.to_dict(),
            "items": stats.items,
            "tokens": stats.tokens,
            "skipped_items": [{"id": e.item_id, "error": e.message} for e in stats.errors],
        }
        self._save_manifest()

    def abandon(self) -> None:
        """After a failure: if nothing was ever finished, leave no manifest behind either."""
        if not self._records:
            self.manifest_path.unlink(missing_ok=True)

    def _not_done_because(self, shard: Shard, record: dict | None) -> str | None:
        """Why ``shard`` must be run (again), or None when its output is verified to be what this job makes."""
        if record is None:
            return "not done yet"
        skipped = len(record["skipped_items"])
        if skipped and self.options.on_error != "skip":
            return f"it was finished with --on-error skip, leaving out {skipped} bad items; this run stops at them"
        expected = record["output"]
        if not shard.output.is_file():
            return f"its output {shard.output} is missing"
        size = shard.output.stat().st_size
        if size != expected["size"]:
            return f"its output is {size} bytes, {expected['size']} were written (truncated or replaced)"
        if shard.path.stat().st_size != record["input"]["size"]:
            return "its input changed"
        if sha256_digest(shard.output) != expected["sha256"]:
            return "its output's bytes differ from those written (damaged or replaced)"
        if sha256_digest(shard.path) != record["input"]["sha256"]:
            return "its input changed"
        return None

    def _outputs_exist(self, previous: dict) -> bool:
        """Whether any output ``previous`` (a manifest) records, or any this job writes, exists."""
        recorded = [self.manifest_path.parent / record["output"]["name"] for record in previous["shards"].values()
                    if previous["format"] == MANIFEST_FORMAT]
        return any(path.exists() for path in (*recorded, *(shard.output for shard in self.shards)))

    def _refuse_another_job(self, previous: dict) -> None:
        where = self.manifest_path.parent if self.input_path.is_dir() else self.output_path
        if previous["model"] != self.model:
            raise InputError(
                f"{where}: existing outputs were written by another model "
                f"({previous['model'][:19]}…, now {self.model[:19]}…); pass --overwrite to redo them "
                "or choose another --output"
            )
        settings = previous.get("settings", {})
        if settings != self.settings:
            changed = sorted(k for k in {*settings, *self.settings} if settings.get(k) != self.settings.get(k))
            raise InputError(
                f"{where}: existing outputs were made with other settings ({', '.join(changed)} differ); pass "
                "--overwrite to redo them or choose another --output"
            )
        source = previous.get("input")
        if source is not None and source != str(self.input_path.resolve()):
            raise InputError(
                f"{where} holds the outputs of --input {source}, not of {self.input_path.resolve()}; "
                "pass --overwrite to replace them or choose another --output"
            )

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
            if manifest.get("format") not in (1, MANIFEST_FORMAT):
                raise ValueError(f"format {manifest.get('format')}, expected {MANIFEST_FORMAT}")
            if not isinstance(manifest["model"], str) or not isinstance(manifest["shards"], dict):
                raise ValueError("model or shards of the wrong type")
            if manifest["format"] == MANIFEST_FORMAT:
                for name, record in manifest["shards"].items():
                    _check_record(name, record)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{self.manifest_path}: unreadable ({exc}); pass --overwrite to redo the job") from exc
        return manifest

    def _save_manifest(self) -> None:
        manifest = {
            "format": MANIFEST_FORMAT,
            "model": self.model,
            "input": str(self.input_path.resolve()),
            "shards": self._records,
        }
        if self.settings:  # only when set: infer's manifests stay as they were
            manifest["settings"] = self.settings
        try:
            with atomic_path(self.manifest_path) as tmp:
                tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        except OSError as exc:
            raise OutputError(f"{self.manifest_path}: cannot write the manifest ({exc.strerror or exc})") from exc


def _check_record(name: str, record: dict) -> None:
    """A hand-edited or damaged manifest is refused whole, not half trusted."""
    sizes = (record["input"]["size"], record["output"]["size"])
    digests = (record["input"]["sha256"], record["output"]["sha256"])
    if not all(isinstance(n, int) for n in sizes) or not all(isinstance(d, str) for d in digests):
        raise ValueError(f"shard {name!r}: sizes or digests of the wrong type")
    if not isinstance(record["output"]["name"], str):
        raise ValueError(f"shard {name!r}: output name of the wrong type")
    if not isinstance(record["skipped_items"], list):
        raise ValueError(f"shard {name!r}: skipped_items is not a list")


def count_items(shards: list[Shard], runner: BatchRunner) -> int:
    """Items in ``shards``, from their indexes and footers (no tensor is read)."""
    session = runner.session
    total = 0
    for shard in shards:
        with open_reader(shard.path, session.signature, session.metadata.d_model, runner.window_items) as reader:
            total += reader.count()
    return total


def run_shard(runner: BatchRunner, shard: Shard, on_batch: BatchCallback | None = None) -> RunStats:
    """Read ``shard`` lazily, run it window by window, and stream its outputs into place atomically.

    The caller holds the output's lock (``DatasetJob``): temporaries of this
    shard's output that exist now were left by a killed run.
    """
    session = runner.session
    stats = RunStats(provider=session.provider)
    start = time.perf_counter()
    for stale in stale_temporaries(shard.output):
        stale.unlink(missing_ok=True)
    keys_of = functools.partial(output_keys, signature=session.signature, suffix=shard.output.suffix)
    try:
        with (
            open_reader(shard.path, session.signature, session.metadata.d_model, runner.window_items) as reader,
            open_writer(shard.output, like=shard.path, signature=session.signature) as writer,
        ):
            items = _claim_output_keys(_read(reader, shard), keys_of)
            for window in runner.run_stream(items, stats, on_batch, source=shard.name):
                writer.write(window)
    except MHADeployError:
        raise
    except OSError as exc:  # reading errors are InputErrors by now: this is the output (disk full, permissions)
        raise OutputError(f"{shard.output}: cannot write it ({exc.strerror or exc})") from exc
    stats.seconds = time.perf_counter() - start
    stats.shards_written = 1
    return stats


def _read(reader: Iterable[RawItem], shard: Shard) -> Iterator[RawItem]:
    """The reader's items; whatever goes wrong inside it is an ``InputError`` naming the file and the last item."""
    items = iter(reader)
    last = None
    while True:
        try:
            raw = next(items)
        except StopIteration:
            return
        except MHADeployError:
            raise
        except Exception as exc:  # pyarrow, zipfile, OSError...: a damaged file
            where = f" after item {last!r}" if last is not None else ""
            raise InputError(f"{shard.path}: cannot read it{where} ({type(exc).__name__}: {exc})") from exc
        last = raw.item_id
        yield raw


def _claim_output_keys(items: Iterable[RawItem], keys_of: Callable[[str], tuple[str, ...]]) -> Iterator[RawItem]:
    """Items whose output keys no earlier item of the shard took; the others become bad items.

    An output shard keys results by id: ``a`` and ``a.attn_weights`` (items ``a``
    and ``a.attn_weights`` of a model returning weights), or the same id twice,
    would overwrite each other without a word.
    """
    owners: dict[str, str] = {}
    for raw in items:
        keys = keys_of(raw.item_id)
        taken = next((key for key in keys if key in owners), None)
        if raw.problem is None and taken is not None:
            owner = owners[taken]
            if owner == raw.item_id:
                problem = "appears twice in this shard: the second would overwrite the first's outputs"
            else:
                problem = (
                    f"its output {taken!r} would overwrite that of item {owner!r} (an id plus a suffix the "
                    f"output uses for {owner!r}'s other outputs); rename one of them"
                )
            yield raw._replace(item=None, problem=problem)
            continue
        for key in keys:
            owners.setdefault(key, raw.item_id)
        yield raw


def run_dataset(
    job: DatasetJob,
    runner: BatchRunner,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
) -> RunStats:
    """Run every shard not done yet, one after the other; ``on_start(total items)`` before the first.

    The output stays locked until the end (and after, when the caller holds ``job`` open itself).
    """
    job.left_out = left_out_note(runner.session.signature)
    return run_shards(
        job, runner.options, runner.session.provider, lambda todo: count_items(todo, runner),
        lambda shard: run_shard(runner, shard, on_batch), on_start,
    )


def run_shards(
    job: DatasetJob,
    options: RunnerOptions,
    provider: str,
    count: Callable[[list[Shard]], int],
    run_one: Callable[[Shard], RunStats],
    on_start: Callable[[int], None] | None = None,
) -> RunStats:
    """The job's loop for any command's shards: plan, ``on_start(count(todo))``, ``run_one`` each shard not done
    and record it, leave no manifest if nothing finished; the output locked throughout."""
    stats = RunStats(provider=provider)
    start = time.perf_counter()
    owns_lock = not job.lock.held
    job.options = options
    try:
        todo, done = job.plan()
        stats.shards_skipped = len(done)
        try:
            if on_start:
                on_start(count(todo))
            for shard in todo:
                shard_stats = run_one(shard)
                job.record(shard, shard_stats)
                stats.merge(shard_stats)
        except BaseException:
            job.abandon()
            raise
    finally:
        stats.seconds = time.perf_counter() - start
        if owns_lock:
            job.close()
    return stats
