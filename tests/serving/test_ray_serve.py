"""The server as a Ray Serve deployment (``mha_deploy.serving.ray_serve``) on a local Ray cluster: two replicas of a
generator answer OpenAI's official client (completions and chat, plain and streaming, greedy and seeded) and
Triton's generate as the single-process server does; a replica killed under a stream ends that stream with an
error, and later requests are answered; the plain Open Inference Protocol server of an encoder, started by
``mha-deploy serve --ray-autoscaling ... --ray-address`` with two replicas, answers ``/v2/models/NAME/infer`` as
the single server does. One cluster for the module, tiny models, one ORT thread per replica."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from tests.serving.helpers import V2_DATATYPES, Server, batch_request, free_port
from tests.serving.test_generation_server import TEMPLATE, train_tokenizer

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from mha_deploy.serving.http import GenerationOptions, ServeConfig, ServeError  # noqa: E402
from mha_deploy.serving.ray_serve import RayServeOptions, deploy, replica_reports  # noqa: E402

PROMPT = "the cat sat on the"
NAME = "tiny"
GENERATION = {"max_new_tokens": 600, "max_length": 700}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster with Ray Serve's proxy on a free loopback port: ``(gcs address, port)``."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address, free_port()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def generator(request, lm_cache, tmp_path_factory):
    """TinyLM with a tokenizer and a chat template: ``(Ray Serve URL, single server)``, the same settings in both,
    two replicas on Ray; the Ray application is deleted when the module's generator tests are done. The single
    server starts first, and loads while the cluster does."""
    path = lm_cache("causal_lm")[0]
    directory = tmp_path_factory.mktemp("ray-gen")
    train_tokenizer(directory / "tokenizer.json", 50)
    (directory / "chat.jinja").write_text(TEMPLATE)
    files = {"tokenizer": directory / "tokenizer.json", "chat_template": directory / "chat.jinja"}
    single = Server(path, directory / "server.log", "--threads", "1", "--name", NAME, "--tokenizer",
                    str(files["tokenizer"]), "--chat-template", str(files["chat_template"]),
                    *(arg for key, value in GENERATION.items() for arg in (f"--{key.replace('_', '-')}", str(value))))
    try:
        port = request.getfixturevalue("cluster")[1]
        config = ServeConfig(path, port=port, provider="cpu", threads=1, name=NAME,
                             generation=GenerationOptions(**files, **GENERATION))
        url = deploy(config, RayServeOptions(replicas=2, app_name="gen"))
        yield url, single.wait_ready()
    finally:
        single.stop()
        with contextlib.suppress(Exception):
            serve.delete("gen")


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234}}


def ask(url: str, route: str, stream: bool, sampling: dict) -> tuple[str, str]:
    """(text, finish reason) of one request through OpenAI's client."""
    api = openai_client(url)
    if route == "chat":
        answer = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=12, stream=stream, **sampling)
        if not stream:
            return answer.choices[0].message.content, answer.choices[0].finish_reason
        chunks = [c for c in answer if c.choices]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    answer = api.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, stream=stream, **sampling)
    if not stream:
        return answer.choices[0].text, answer.choices[0].finish_reason
    chunks = [c for c in answer if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_two_replicas_answer_the_openai_client_as_the_single_server(generator, route, stream, sampling):
    url, single = generator
    expected = ask(f"http://{single.url}", route, stream, SAMPLING[sampling])
    assert expected[0] and expected[1] == "length"
    # Both replicas answer (the proxy spreads requests), each as the single server.
    for _ in range(3):
        assert ask(url, route, stream, SAMPLING[sampling]) == expected


def test_triton_generate_health_and_metrics_per_replica(generator):
    url, single = generator
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 6}}
    expected = httpx.post(f"http://{single.url}/v2/models/{NAME}/generate", json=body).json()
    answered_by = set()
    for _ in range(6):
        response = httpx.post(f"{url}/v2/models/{NAME}/generate", json=body, timeout=30)
        assert response.status_code == 200 and response.json()["output_ids"] == expected["output_ids"]
        answered_by.add(response.headers["x-replica"])
    replicas = httpx.get(f"{url}/replicas", timeout=30).json()
    assert len(replicas) == 2 and all(r["status"] == "ready" for r in replicas)
    assert answered_by <= {r["replica"] for r in replicas}
    for report in replica_reports("gen"):  # each replica's own counters: together they saw every request
        metrics = httpx.get(f"{url}/replicas/{report['replica']}/metrics", timeout=30)
        assert metrics.status_code == 200 and "mha_generation_tokens_total" in metrics.text
    assert sum(r["accepted"] for r in replica_reports("gen")) >= 6
    assert httpx.get(f"{url}/replicas/nobody/metrics", timeout=30).status_code == 404


def test_a_second_application_of_the_same_name_is_refused(generator, cluster, encoder):
    with pytest.raises(ServeError, match="an application named 'gen' already runs on this Ray cluster"):
        deploy(ServeConfig(encoder[1], port=cluster[1]), RayServeOptions(app_name="gen"))
    with pytest.raises(ServeError, match=f"its HTTP proxy on 127.0.0.1:{cluster[1]}: give --host 127.0.0.1 --port"):
        deploy(ServeConfig(encoder[1], port=free_port()), RayServeOptions(app_name="other"))


def replica_actor(replica_id: str):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def test_a_killed_replica_fails_its_requests_in_flight_and_later_requests_are_answered(generator):
    url, single = generator
    expected = ask(f"http://{single.url}", "completions", False, SAMPLING["greedy"])
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 600, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        # Plain requests in flight on both replicas, then a stream; the stream's replica is killed under it.
        plain = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30) for _ in range(8)]
        deadline = time.monotonic() + 20
        while sum(r["accepted"] > r["answered"] for r in replica_reports("gen")) < 2:
            assert time.monotonic() < deadline, "the plain requests never ran on both replicas"
        events, finished = 0, False
        start = time.monotonic()
        with pytest.raises(httpx.HTTPError), httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    finished = line == "data: [DONE]"
                    if events == 2:  # the stream is running on this replica
                        ray.kill(replica_actor(response.headers["x-replica"]), no_restart=True)
        assert 2 <= events < 600 and not finished and time.monotonic() - start < 30
        # A plain request on the killed replica gets the proxy's 500; one on the live replica ends whole.
        answers = [future.result() for future in plain]
    statuses = sorted(answer.status_code for answer in answers)
    assert 500 in statuses and set(statuses) <= {200, 500}, statuses
    assert all(len(a.json()["choices"][0]["token_ids"]) == 600 for a in answers if a.status_code == 200)
    # Later requests go to the live replica (and to the one Ray Serve starts in the killed one's place).
    for _ in range(4):
        assert ask(url, "completions", False, SAMPLING["greedy"]) == expected


@pytest.fixture(scope="module")
def encoder(export_model):
    signature = Signature("self", "padding")
    return signature, export_model(signature)[0]


def infer(url: str, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": V2_DATATYPES[v.dtype],
                        "data": v.ravel().tolist()} for k, v in inputs.items()]}
    response = httpx.post(f"{url}/v2/models/{name}/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in response.json()["outputs"]}


def test_the_oip_server_of_an_encoder_on_two_autoscaled_replicas_equals_the_single_server(cluster, generator, encoder,
                                                                                tmp_path):
    serve.delete("gen")  # one route prefix per cluster: the generator's application gives way
    address, port = cluster
    signature, path = encoder
    single = Server(path, tmp_path / "single.log", "--threads", "1")
    # Ray Serve's autoscaling config passed through: at least two replicas (ready before the command reports).
    autoscaling = json.dumps({"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 16})
    replicated = Server(path, tmp_path / "ray.log", "--threads", "1", "--ray-autoscaling", autoscaling,
                        "--ray-address", address, "--port", str(port))
    replicated.port = port  # the proxy's (the last --port wins)
    try:
        single.wait_ready()
        wait_for_line(replicated, "on Ray Serve at", timeout=90)  # every replica ready (/readyz: the first one)
        rng = np.random.default_rng(0)
        for lengths in ([3, 5], [7], [2, 4, 6]):
            inputs = batch_request(signature, rng, len(lengths), lengths, 64)
            ours, theirs = infer(f"http://{replicated.url}", path.stem, inputs), infer(
                f"http://{single.url}", path.stem, inputs)
            assert ours.keys() == theirs.keys()
            for name in ours:
                np.testing.assert_array_equal(ours[name], theirs[name])
        assert len(httpx.get(f"http://{replicated.url}/replicas", timeout=30).json()) == 2
        replicated.process.send_signal(signal.SIGTERM)  # the command deletes its application and leaves
        assert replicated.process.wait(timeout=60) == 0, replicated.log()
        assert "mha-deploy" not in serve.status().applications
    finally:
        single.stop()
        if replicated.process.poll() is None:
            replicated.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                replicated.process.wait(timeout=60)
        replicated.stop()
        with contextlib.suppress(Exception):
            serve.delete("mha-deploy")


def wait_for_line(server: Server, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert server.process.poll() is None, f"exited with {server.process.returncode}:\n{server.log()}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{server.log()}"
        time.sleep(0.2)


def test_a_model_that_does_not_load_fails_the_deployment_with_its_error(cluster, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an ONNX file")
    config = ServeConfig(bad, port=cluster[1], provider="cpu")
    try:
        with pytest.raises(ServeError, match=r"replica cannot serve .*ONNX Runtime cannot load it"):
            deploy(config, RayServeOptions(replicas=1, app_name="bad", start_retries=1))
    finally:
        serve.delete("bad")


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--grpc-port", "9001", "--ray-replicas", "2"], 1, "--grpc-port: not available with Ray Serve replicas"),
    (["--header-timeout", "3", "--access-log", "--ray-replicas", "2"], 1, "--header-timeout, --access-log: not"),
    (["--ray-address", "127.0.0.1:6379"], 2, "--ray-address needs --ray-replicas or --ray-autoscaling"),
    (["--ray-autoscaling", '{"max_replicas": "many"}'], 1, "autoscaling: "),
    (["--ray-autoscaling", "no-such.json"], 1, "neither a JSON object nor a readable file"),
    (["--ray-autoscaling", "[1, 2]"], 1, "autoscaling: expected a JSON object"),
    (["--ray-replicas", "2", "--provider", "cuda"], 1, "provider cuda on Ray needs GPUs per replica"),
], ids=["grpc", "connection-guards", "address-alone", "bad-field", "no-file", "not-an-object", "cuda"])
def test_what_replicas_cannot_carry_is_refused_before_any_cluster_starts(encoder, args, code, message, monkeypatch):
    from click.testing import CliRunner

    from mha_deploy.cli import main
    from mha_deploy.serving import ray_serve

    def started(*args, **kwargs):
        raise AssertionError("a cluster or an application was started")

    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(ray_serve, "_start", started)
    result = CliRunner().invoke(main, ["serve", str(encoder[1]), *args])
    assert result.exit_code == code and message in result.output, result.output


def test_a_missing_model_is_refused_naming_every_node(tmp_path):
    from mha_deploy.serving.ray_serve import server_application

    with pytest.raises(ServeError, match="every node that runs a replica needs it"):
        server_application(ServeConfig(tmp_path / "absent.onnx"), RayServeOptions(replicas=2))
