"""``--engine ray``: the same job on a local Ray cluster the test starts, the same bytes as the local engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray
import ray.data
from click.testing import CliRunner

from mha_deploy.batch.job import DatasetJob
from mha_deploy.batch.ray_engine import RayOptions, run_dataset_on_ray
from mha_deploy.cli import main
from mha_deploy.errors import InputError, ProviderUnavailableError
from mha_deploy.metadata import Signature
from tests.batch.test_resume import files, write_dataset
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL
SIGNATURE = Signature("self", "padding")


def test_cuda_on_ray_needs_gpus(tmp_path, export_model):
    write_dataset(tmp_path / "in", shards=1, items=2)
    job = DatasetJob(tmp_path / "in", tmp_path / "out", export_model(SIGNATURE)[0])
    with pytest.raises(ProviderUnavailableError, match="needs --num-gpus > 0"):
        run_dataset_on_ray(job, export_model(SIGNATURE)[0], provider="cuda", ray=RayOptions(num_gpus=0))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_engine_equals_local_engine(tmp_path, export_model, ray_cluster):
    from tests.batch.test_datasets import write_parquet

    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=3, items=12, mean_log_length=3.5)
    with np.load(tmp_path / "in" / "shard-2.npz") as arrays:
        write_parquet(tmp_path / "in" / "shard-2.parquet", {k: {"x": arrays[k]} for k in arrays.files})
    (tmp_path / "in" / "shard-2.npz").unlink()
    common = ["infer", model, "--input", tmp_path / "in", "--provider", "cpu", "--max-batch-tokens", "256",
              "--no-progress"]
    invoke = lambda *args: CliRunner().invoke(main, [str(a) for a in [*common, *args]])  # noqa: E731

    local = invoke("--output", tmp_path / "local", "--threads", "1")
    assert local.exit_code == 0, local.output
    result = invoke("--output", tmp_path / "ray", "--engine", "ray", "--concurrency", "2", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["items"] == 36 and summary["shards_written"] == 3 and summary["provider"] == "cpu"
    assert files(tmp_path / "ray") == files(tmp_path / "local"), "same shards, same bytes"

    again = invoke("--output", tmp_path / "ray", "--engine", "ray", "--json")
    assert json.loads(again.stdout)["shards_skipped"] == 3, again.output


@pytest.mark.slow
def test_ray_engine_stops_at_a_bad_item(tmp_path, export_model, ray_cluster):
    model = export_model(SIGNATURE)[0]
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "a.npz", good=np.ones((2, D), np.float32), bad=np.ones((0, D), np.float32))
    job = DatasetJob(tmp_path / "in", tmp_path / "out", model)
    with pytest.raises(InputError, match=r"a\.npz: item 'bad': x is empty"):
        run_dataset_on_ray(job, model, provider="cpu", threads=1)
    assert not list((tmp_path / "out").glob("*.npz")), "no output shard"
