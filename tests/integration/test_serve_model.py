"""``tensorfleet serve-model`` as a user runs it: a process following a checkpoint directory that a writer
fills while clients ask for predictions over HTTP. No request fails, no answer mixes two versions, and
the served version reaches the newest checkpoint without a restart."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tensorfleet.testing.local_cluster import REPO
from tensorfleet.testing.serving import serve_model

pytestmark = pytest.mark.cluster
SCRIPT = Path(__file__).with_name("served_model.py")
sys.path.insert(0, str(SCRIPT.parent))
import served_model  # noqa: E402 - the served script, also the checkpoints' writer


def request(connection: http.client.HTTPConnection, method: str, path: str, body: object = None,
            raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(payload) if "json" in kind else payload.decode()


def wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_serve_model_picks_up_deltas_while_answering_no_failed_request_no_torn_row(tmp_path):
    with serve_model(tmp_path, SCRIPT, ["--poll-interval", "0.05"]) as (process, url):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        probe = http.client.HTTPConnection(host, port, timeout=10)
        assert request(probe, "GET", "/healthz")[0] == 503  # started before training saved anything
        status, reply = request(probe, "POST", "/v1/predict", {"inputs": {"ids": [1]}})
        assert status == 503 and "no checkpoint" in reply["error"]
        served_model.write_version(tmp_path, 1, base=None)
        wait_for(lambda: request(probe, "GET", "/healthz")[0] == 200, what="the first checkpoint")

        ids = list(range(0, 80))
        done = threading.Event()
        answers: list[list[int]] = [[] for _ in range(3)]
        failures: list[str] = []

        def client(index: int) -> None:
            connection = http.client.HTTPConnection(host, port, timeout=10)
            while not done.is_set():
                try:
                    status, reply = request(connection, "POST", "/v1/predict", {"inputs": {"ids": ids}})
                except OSError as exc:
                    failures.append(f"client {index}: {exc!r}")
                    return
                if status != 200:
                    failures.append(f"client {index}: HTTP {status} {reply}")
                    return
                step = reply["model"]["global_step"]
                outputs = reply["outputs"]
                if outputs["version"] != [float(step)] or outputs["rows"] != served_model.expected_rows(step, ids):
                    failures.append(f"client {index}: a torn answer at version {step}: {outputs}")
                    return
                if answers[index] and answers[index][-1] > step:
                    failures.append(f"client {index}: version {step} after {answers[index][-1]}")
                    return
                answers[index].append(step)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        base = "model.ckpt-1.safetensors"
        for step in range(2, 31):
            base = served_model.write_version(tmp_path, step, base=base, max_to_keep=3).name
            time.sleep(0.03)
        wait_for(lambda: request(probe, "GET", "/v1/model")[1]["version"]["global_step"] == 30, what="version 30")
        done.set()
        for thread in threads:
            thread.join(30)
        assert not failures, failures[:3]
        assert all(answers) and len({step for steps in answers for step in steps}) > 3  # deltas landed under load
        model = request(probe, "GET", "/v1/model")[1]
        assert model["tables"] == {"t": 50} and model["chain"][-1] == "model.ckpt-30.delta.safetensors"
        assert model["reloads"][-1]["global_step"] == 30 and model["reloads"][0]["kind"] == "chain"

        # Bad input: a clear 400, and the server goes on serving the same version.
        for body, expected in ((b"not json", "JSON object"), (b'{"ids": [1]}', "JSON object"),
                               (b"[" * 100_000 + b"]" * 100_000, "JSON object"),  # nesting past the recursion limit
                               (b'{"inputs": {"nope": [1]}}', "KeyError"),
                               (b'{"inputs": {"ids": ["x"]}}', "Error"),
                               (b'{"inputs": {"ids": [-5000]}}', "DataError: id -5000 is not known")):
            status, reply = request(probe, "POST", "/v1/predict", raw=body)
            assert status == 400 and expected in reply["error"], (body, status, reply)
        status, reply = request(probe, "POST", "/v1/predict", {"inputs": {"ids": [30, 79]}})
        assert status == 200 and reply["outputs"]["rows"] == served_model.expected_rows(30, [30, 79])
        metrics = request(probe, "GET", "/metrics")[1]
        assert "tensorfleet_serving_global_step 30" in metrics and "tensorfleet_serving_bad_requests_total 6" in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0


def test_serve_model_with_no_reload_keeps_its_first_checkpoint(tmp_path):
    served_model.write_version(tmp_path, 1, base=None)
    with serve_model(tmp_path, SCRIPT, ["--poll-interval", "0.05", "--no-reload"]) as (process, url):
        probe = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=10)
        wait_for(lambda: request(probe, "GET", "/healthz")[0] == 200, what="the first checkpoint")
        served_model.write_version(tmp_path, 2, base="model.ckpt-1.safetensors")
        time.sleep(0.5)  # ten polls: none may apply it
        status, reply = request(probe, "POST", "/v1/predict", {"inputs": {"ids": [1]}})
        assert status == 200 and reply["model"]["global_step"] == 1


def test_serve_model_refuses_a_script_without_the_serving_functions(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('training only')\n")
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "serve-model", str(tmp_path), "--model",
                           str(script), "--port", "0"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "serving_model(argv) -> nn.Module and predict(module, inputs)" in done.stderr


def test_a_runtime_error_of_predict_is_the_callers_400_and_a_bug_is_a_500(tmp_path):
    """Issue 28: torch says 'cannot use this input' (a shape, a dtype) with RuntimeError; that was a 500."""
    import torch

    from tensorfleet.serving.server import ModelServer

    def predict(module, inputs):
        if inputs == "bug":
            return module.no_such_attribute  # the script's own bug
        return module.version.view(inputs["shape"])  # a shape the version cannot take: RuntimeError

    served_model.write_version(tmp_path, 1, base=None)
    with ModelServer(served_model.serving_model([]), predict, tmp_path, port=0) as server:
        probe = http.client.HTTPConnection(urlsplit(server.url).hostname, urlsplit(server.url).port, timeout=30)
        wait_for(lambda: request(probe, "GET", "/v1/model")[1]["version"] is not None, what="version 1")
        status, reply = request(probe, "POST", "/v1/predict", {"inputs": {"shape": [3, 3]}})
        assert status == 400 and reply["error"].startswith("RuntimeError: shape '[3, 3]' is invalid"), reply
        assert request(probe, "POST", "/v1/predict", {"inputs": {"shape": [1]}})[0] == 200
        status, reply = request(probe, "POST", "/v1/predict", {"inputs": "bug"})
        assert status == 500 and "AttributeError" in reply["error"]
        probe.close()
