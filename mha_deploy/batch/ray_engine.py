"""A dataset job on Ray Data, for when one machine is not enough (``pip install "mha-deploy[ray]"``).

Ray Data hands shards to a pool of actors (``map_batches`` with a callable
class, an ``ActorPoolStrategy`` of ``concurrency`` actors, ``num_gpus`` each).
What an actor runs on a shard is a ``ShardTask``: loaded once per actor, in
``__init__`` (infer's ``InferShards``: one ``MHASession``; generate's
``GenerationShards``: one KV-cache stepper), then called on each shard it gets
exactly as the local engine calls it (``job.run_shard``, ``run_prompt_shard``:
lazy read, batching, atomic streamed write), so outputs are the same bytes.
The driver keeps the manifest: it plans which shards are left and records each
one an actor reports done. Inputs and outputs must live on a filesystem every
node sees (NFS, a shared mount), and the model files at the same path on every node.

With ``num_gpus`` Ray sets ``CUDA_VISIBLE_DEVICES`` per actor, so each actor's
session sees its own GPU as device 0; with none reserved Ray hides every GPU,
hence ``provider="cuda"`` needs ``num_gpus > 0``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from mha_deploy.batch.datasets import Shard
from mha_deploy.batch.job import DatasetJob, count_items, run_shard
from mha_deploy.batch.planner import left_out_note
from mha_deploy.batch.runner import BatchCallback, BatchRunner, ItemError, RunStats
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError, MHADeployError, ProviderUnavailableError
from mha_deploy.runtime.session import MHASession


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: join the running Ray, or start a local one
    concurrency: int = 1  # actors, each with one session
    num_gpus: float = 0  # per actor


class ShardTask(Protocol):
    """What an actor runs on a shard. It travels to the actors pickled, so it holds paths and settings, not
    sessions: ``load`` opens the model (once per actor) and returns what runs one shard into its output."""

    provider: str

    def load(self, threads: int) -> Callable[[Shard], RunStats]: ...


@dataclass(frozen=True)
class InferShards:
    """``infer``'s task: one ``MHASession`` of ``model`` per actor, each shard through a ``BatchRunner``."""

    model: str
    provider: str
    options: RunnerOptions

    def load(self, threads: int) -> Callable[[Shard], RunStats]:
        runner = BatchRunner(MHASession(self.model, provider=self.provider, threads=threads), self.options)
        return functools.partial(run_shard, runner)


class ShardWorker:
    """A Ray Data actor: the task loaded once, any number of shards (one per batch row)."""

    def __init__(self, task: ShardTask, threads: int):
        self.run = task.load(threads)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        reports, fatal = [], []
        for name, path, output in zip(batch["shard"], batch["path"], batch["output"], strict=True):
            shard = Shard(str(name), Path(str(path)), Path(str(output)))
            try:
                reports.append(json.dumps(_stats_to_json(self.run(shard))))
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
    # A CPU session on the driver checks the model and the options before any actor starts, and reads the metadata.
    local = BatchRunner(MHASession(model, provider="cpu", threads=1), options)
    job.options = local.options
    job.left_out = left_out_note(local.session.signature)
    task = InferShards(str(Path(model).resolve()), provider, local.options)
    return run_shards_on_ray(job, task, lambda todo: count_items(todo, local), threads, ray, on_start, on_batch)


def check_gpus(provider: str, ray: RayOptions) -> None:
    if provider == "cuda" and not ray.num_gpus:
        raise ProviderUnavailableError(
            "provider cuda on Ray needs --num-gpus > 0: Ray hides every GPU from an actor that reserves none"
        )


def run_shards_on_ray(
    job: DatasetJob,
    task: ShardTask,
    count: Callable[[list[Shard]], int],
    threads: int | None = None,
    ray: RayOptions | None = None,
    on_start: Callable[[int], None] | None = None,
    on_batch: BatchCallback | None = None,
) -> RunStats:
    """The job's loop of ``job.run_shards`` with Ray actors running ``task`` on the shards: plan,
    ``on_start(count(todo))``, record each shard an actor reports done; ``threads`` per actor (default: the
    cluster's CPUs shared among the actors). ``job.options`` must already be the task's."""
    ray_options = ray or RayOptions()
    check_gpus(task.provider, ray_options)
    ray_module = _import_ray()
    stats = RunStats(provider="ray")
    start = time.perf_counter()
    owns_lock = not job.lock.held  # as run_dataset: release the output only if this call took it
    started_ray = False
    try:
        # Outside the part that abandons the job: a plan refused (another job's outputs) leaves their manifest be.
        todo, done = job.plan()
        stats.shards_skipped = len(done)
        try:
            if on_start:
                on_start(count(todo))
            if not todo:
                return stats
            if not ray_module.is_initialized():
                ray_module.init(address=ray_options.address, log_to_driver=False)
                started_ray = True
            for shard, shard_stats in _run_on_actors(ray_module, todo, task, threads, ray_options):
                job.record(shard, shard_stats)
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


def _run_on_actors(ray_module, todo: list[Shard], task: ShardTask, threads: int | None, ray: RayOptions):
    """(shard, its stats) as each actor reports one done; an ``InputError`` with the first shard that failed."""
    actor_threads = threads or max(1, int(ray_module.cluster_resources().get("CPU", 1)) // ray.concurrency)
    shards = {shard.name: shard for shard in todo}
    rows = [{"shard": s.name, "path": str(s.path.resolve()), "output": str(s.output.resolve())} for s in todo]
    results = ray_module.data.from_items(rows).map_batches(
        ShardWorker,
        fn_constructor_kwargs={"task": task, "threads": actor_threads},
        batch_size=1,
        batch_format="numpy",
        # map_batches(concurrency=) is deprecated in Ray 2.60; a fixed-size actor pool says the same. A shard is a
        # long task: one at a time per actor (Ray Data queues 2 by default), so that an actor that started first
        # does not hold a queued shard that another, idle by then, could run.
        compute=ray_module.data.ActorPoolStrategy(size=ray.concurrency, max_tasks_in_flight_per_actor=1),
        num_cpus=actor_threads,
        num_gpus=ray.num_gpus or None,
    )
    for row in results.iter_rows():
        if row["fatal"]:
            raise InputError(str(row["fatal"]))
        yield shards[str(row["shard"])], _stats_from_json(json.loads(row["stats"]))
