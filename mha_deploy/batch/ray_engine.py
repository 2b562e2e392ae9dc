"""The same dataset job on Ray Data, for when one machine is not enough (``pip install "mha-deploy[ray]"``).

Ray Data hands shards to a pool of actors (``map_batches`` with a callable
class, an ``ActorPoolStrategy`` of ``concurrency`` actors, ``num_gpus`` each); every actor holds one
``MHASession``, created in ``__init__``, and runs each shard it gets exactly as
the local engine does (``job.run_shard``: lazy read, length bucketing, atomic
streamed write), so outputs are the same bytes. The driver keeps the manifest:
it plans which shards are left and records each one an actor reports done.
Inputs and outputs must live on a filesystem every node sees (NFS, a shared mount).

With ``num_gpus`` Ray sets ``CUDA_VISIBLE_DEVICES`` per actor, so each actor's
session sees its own GPU as device 0; with none reserved Ray hides every GPU,
hence ``provider="cuda"`` needs ``num_gpus > 0``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mha_deploy.batch.datasets import Shard
from mha_deploy.batch.job import DatasetJob, count_items, run_shard
from mha_deploy.batch.runner import BatchCallback, BatchRunner, ItemError, RunStats
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError, MHADeployError, ProviderUnavailableError
from mha_deploy.runtime.session import MHASession


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: join the running Ray, or start a local one
    concurrency: int = 1  # actors, each with one session
    num_gpus: float = 0  # per actor


class ShardWorker:
    """A Ray Data actor: one session, any number of shards (one per batch row)."""

    def __init__(self, model: str, provider: str, threads: int | None, options: RunnerOptions):
        self.runner = BatchRunner(MHASession(model, provider=provider, threads=threads), options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        reports, fatal = [], []
        for name, path, output in zip(batch["shard"], batch["path"], batch["output"], strict=True):
            shard = Shard(str(name), Path(str(path)), Path(str(output)))
            try:
                reports.append(json.dumps(_stats_to_json(run_shard(self.runner, shard))))
                fatal.append("")
            except MHADeployError as exc:
                reports.append("{}")
                fatal.append(str(exc) or type(exc).__name__)
        return {"shard": batch["shard"], "stats": np.array(reports), "fatal": np.array(fatal)}


def _stats_to_json(stats: RunStats) -> dict:
    return {
        "provider": stats.provider,
        "items": stats.items,
        "tokens": stats.tokens,
        "padded_tokens": stats.padded_tokens,
        "batch_ms": stats.batch_ms,
        "errors": [[e.shard, e.item_id, e.message] for e in stats.errors],
    }


def _stats_from_json(raw: dict) -> RunStats:
    stats = RunStats(
        provider=raw["provider"],
        items=raw["items"],
        tokens=raw["tokens"],
        padded_tokens=raw["padded_tokens"],
        batch_ms=list(raw["batch_ms"]),
        shards_written=1,
    )
    stats.errors = [ItemError(*error) for error in raw["errors"]]
    return stats


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise InputError('--engine ray needs Ray Data: pip install "mha-deploy[ray]"') from exc
    return ray


def run_dataset_on_ray(
    job: DatasetJob,
    model: str | os.PathLike,
    provider: str = "auto",
    threads: int | None = None,
    ray: RayOptions | None = None,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
    options: RunnerOptions | None = None,
) -> RunStats:
    """Run ``job``'s unfinished shards on Ray actors, each with a ``BatchRunner`` of ``options``."""
    ray_options = ray or RayOptions()
    if provider == "cuda" and not ray_options.num_gpus:
        raise ProviderUnavailableError(
            "provider cuda on Ray needs --num-gpus > 0: Ray hides every GPU from an actor that reserves none"
        )
    ray_module = _import_ray()
    # A CPU session on the driver checks the model and the options before any actor starts, and reads the metadata.
    local = BatchRunner(MHASession(model, provider="cpu", threads=1), options)
    job.options = local.options
    stats = RunStats(provider="ray")
    start = time.perf_counter()
    owns_lock = not job.lock.held  # as run_dataset: release the output only if this call took it
    todo, done = job.plan()
    stats.shards_skipped = len(done)
    started_ray = False
    try:
        if on_start:
            on_start(count_items(todo, local))
        if not todo:
            return stats
        if not ray_module.is_initialized():
            ray_module.init(address=ray_options.address, log_to_driver=False)
            started_ray = True
        actor_threads = threads or max(1, int(ray_module.cluster_resources().get("CPU", 1)) // ray_options.concurrency)
        shards = {shard.name: shard for shard in todo}
        rows = [{"shard": s.name, "path": str(s.path.resolve()), "output": str(s.output.resolve())} for s in todo]
        results = ray_module.data.from_items(rows).map_batches(
            ShardWorker,
            fn_constructor_kwargs={
                "model": str(Path(model).resolve()),
                "provider": provider,
                "threads": actor_threads,
                "options": local.options,
            },
            batch_size=1,
            batch_format="numpy",
            # map_batches(concurrency=) is deprecated in Ray 2.60; a fixed-size actor pool says the same.
            compute=ray_module.data.ActorPoolStrategy(size=ray_options.concurrency),
            num_cpus=actor_threads,
            num_gpus=ray_options.num_gpus or None,
        )
        for row in results.iter_rows():
            if row["fatal"]:
                raise InputError(str(row["fatal"]))
            shard_stats = _stats_from_json(json.loads(row["stats"]))
            job.record(shards[str(row["shard"])], shard_stats)
            stats.provider = shard_stats.provider
            stats.merge(shard_stats)
            if on_batch:
                on_batch(shard_stats.items, shard_stats.tokens)
    except BaseException:
        job.abandon()
        raise
    finally:
        stats.seconds = time.perf_counter() - start
        if started_ray:
            ray_module.shutdown()
        if owns_lock:
            job.close()
    return stats
