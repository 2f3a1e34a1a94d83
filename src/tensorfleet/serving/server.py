"""``tensorfleet serve-model``: predictions over HTTP from the latest checkpoint, hot-reloaded as deltas land.

The training script says how to serve itself with two functions, so the same model class trains
on the fleet and serves without it::

    def serving_model(argv: list[str]) -> nn.Module      # the module, built from the script's flags
    def predict(module: nn.Module, inputs) -> outputs     # JSON in, JSON-able out (tensors are fine)

Routes: ``POST /v1/predict`` with ``{"inputs": ...}`` answers ``{"outputs": ..., "model": {checkpoint,
global_step, saved_at, applied_at}}``, the version that answered; ``GET /v1/model`` the served version,
the chain, the rows per table and the recent reloads; ``GET /healthz`` 200 once a checkpoint is
loaded (503 before: the server starts before training has saved anything); ``GET /metrics``.
Bad input is a 400 with the script's message (what ``predict`` raises of ``BAD_INPUT``: torch's
RuntimeError included, its word for a shape or dtype it cannot use; any other exception is the
script's bug, a 500); nothing a request sends changes the served state.
What a caller can make the server spend is bounded: a body of at most ``MAX_BODY_BYTES``, parsed in
the thread pool, and at most ``MAX_PREDICTIONS`` requests parsed or predicting at once (more: 503).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tensorfleet.errors import ConfigError, DataError, InvalidArgumentError, LaunchError
from tensorfleet.serving.model import NotLoadedError, ServedModel
from tensorfleet.serving.reload import Reloader
from tensorfleet.train.manifest import check_checkpoint_directory
from tensorfleet.web import BodyLimit, bind, json_safe, serve_in_thread, url_host, wait_for_stop_signal

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
MAX_PREDICTIONS = 32  # requests being parsed or predicted at once; a parsed JSON list is ~10x its text
DEFAULT_PORT = 8500
START_TIMEOUT_S = 10.0
# What a script's predict raises for input it cannot use: the caller's fault, answered 400.
# torch says it cannot use an input (a shape, a dtype) with RuntimeError; running out of memory is not the caller's.
BAD_INPUT = (InvalidArgumentError, DataError, ValueError, TypeError, KeyError, IndexError, RuntimeError)

Predict = Callable[[torch.nn.Module, Any], Any]


def load_script(path: str | Path) -> ModuleType:
    """Import a training script as a module (its ``__main__`` block does not run), with its folder on
    ``sys.path`` as ``python SCRIPT`` would have it; ConfigError if it lacks the serving functions."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such file")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"tensorfleet_served_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses and pickle look the module up there
    spec.loader.exec_module(module)
    missing = [name for name in ("serving_model", "predict") if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(f"{path} has no {' or '.join(missing)}(): a served script defines "
                          "serving_model(argv) -> nn.Module and predict(module, inputs) -> outputs")
    return module


def jsonable(value: Any) -> Any:
    """Tensors and arrays as lists, recursively, NaN as None."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return json_safe(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return json_safe(value)


class _BadBody(Exception):
    """The request's body is not a JSON object with "inputs"."""


class Counters:
    """Requests answered and refused, for /metrics (updated from the thread pool: under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = {"predictions": 0, "bad_requests": 0, "unavailable": 0, "errors": 0}

    def add(self, name: str) -> None:
        with self._lock:
            self.values[name] += 1


def create_app(model: ServedModel, predict: Predict, reloader: Reloader) -> Starlette:
    """The serving app (routes: see the module's docstring)."""
    counters = Counters()
    slots = threading.BoundedSemaphore(MAX_PREDICTIONS)

    def parse_and_predict(body: bytes) -> tuple[Any, Any]:
        try:
            inputs = json.loads(body)["inputs"]
        except (ValueError, TypeError, KeyError, RecursionError):
            raise _BadBody() from None
        return model.predict(predict, inputs)

    async def predict_route(request: Request) -> Response:
        if not slots.acquire(blocking=False):
            counters.add("unavailable")
            return JSONResponse({"error": f"busy: {MAX_PREDICTIONS} requests in progress"}, 503,
                                headers={"Retry-After": "1"})
        try:
            outputs, version = await run_in_threadpool(parse_and_predict, await request.body())
        except _BadBody:
            counters.add("bad_requests")
            return JSONResponse({"error": 'send a JSON object {"inputs": ...}'}, 400)
        except NotLoadedError as exc:
            counters.add("unavailable")
            return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": "1"})
        except torch.OutOfMemoryError as exc:  # a RuntimeError too, but the server's state, not the input's
            counters.add("unavailable")
            return JSONResponse({"error": f"out of memory: {exc}"}, 503, headers={"Retry-After": "1"})
        except BAD_INPUT as exc:
            counters.add("bad_requests")
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, 400)
        except Exception as exc:  # noqa: BLE001 - the script's bug: logged, answered, the server goes on
            counters.add("errors")
            log.exception("predict raised")
            return JSONResponse({"error": f"predict raised {type(exc).__name__}: {exc}"}, 500)
        finally:
            slots.release()
        counters.add("predictions")
        return JSONResponse({"outputs": jsonable(outputs), "model": version.to_json()})

    def model_route(request: Request) -> Response:
        version = model.version
        return JSONResponse(json_safe({
            "version": version.to_json() if version else None, "chain": list(model.chain),
            "tables": model.table_rows(), "directory": str(reloader.directory), "follow": reloader.follow,
            "last_error": reloader.last_error, "reloads": list(reloader.history)}),
            headers={"Cache-Control": "no-store"})

    def healthz(request: Request) -> Response:
        if model.version is None:
            return PlainTextResponse("no checkpoint loaded yet\n", 503)
        return PlainTextResponse("ok\n")

    def metrics(request: Request) -> Response:
        version = model.version
        lines = [f"tensorfleet_serving_{name}_total {value}" for name, value in counters.values.items()]
        lines += [f"tensorfleet_serving_reloads_total {reloader.reloads}",
                  f"tensorfleet_serving_reload_failures_total {reloader.failures}",
                  f"tensorfleet_serving_global_step {version.global_step if version else -1}",
                  f"tensorfleet_serving_checkpoint_age_seconds {time.time() - version.saved_at if version else -1:.3f}"]
        lines += [f'tensorfleet_serving_table_rows{{table="{name}"}} {rows}'
                  for name, rows in model.table_rows().items()]
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)

    app = Starlette(routes=[Route("/v1/predict", predict_route, methods=["POST"]), Route("/v1/model", model_route),
                            Route("/healthz", healthz), Route("/metrics", metrics)])
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return app


class ModelServer:
    """A served model: the reloader's thread and uvicorn's, on ``host:port`` (0: a free port)."""

    def __init__(self, module: torch.nn.Module, predict: Predict, directory: str | Path, *, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, follow: bool = True, poll_interval_s: float = 0.25) -> None:
        self.model = ServedModel(module)
        self.reloader = Reloader(self.model, directory, follow=follow)
        self._predict, self._host, self._port, self._interval = predict, host, port, poll_interval_s
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._socket is not None, "start() first"
        return f"http://{url_host(self._host)}:{self._socket.getsockname()[1]}"

    def start(self) -> "ModelServer":
        """Bind (OSError for a taken port, in the caller's thread), then serve and follow the directory; ConfigError
        first if other users may write the directory (they could swap what is served)."""
        check_checkpoint_directory(self.reloader.directory)
        self._socket = bind(self._host, self._port)
        config = uvicorn.Config(create_app(self.model, self._predict, self.reloader), loop="asyncio", http="h11",
                                lifespan="off", log_config=None, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, timeout_keep_alive=5, limit_concurrency=256)
        self._server, self._thread, serving = serve_in_thread(config, self._socket, name="tensorfleet-serving",
                                                              timeout=START_TIMEOUT_S)
        if not serving:
            self.stop()
            raise LaunchError(f"the model server did not start serving on {self._host}:{self._port}")
        self.reloader.start(self._interval)
        return self

    def stop(self) -> None:
        self.reloader.stop()
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(5.0)
        if self._socket is not None:
            self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM; return 0."""
    logging.basicConfig(level=logging.INFO, format="tensorfleet serve-model: %(message)s")
    if not args.poll_interval > 0:
        raise ConfigError(f"--poll-interval {args.poll_interval}: must be a positive number of seconds")
    script = load_script(args.model)
    module = script.serving_model(list(args.script_args))
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"{args.model}: serving_model() returned {type(module).__name__}, not an nn.Module")
    server = ModelServer(module, script.predict, args.directory, host=args.host, port=args.port,
                         follow=args.follow, poll_interval_s=args.poll_interval)
    try:
        server.start()
    except OSError as exc:
        raise ConfigError(f"cannot serve on {args.host}:{args.port}: {exc.strerror}; choose another --port "
                          "(0: a free one)") from None
    print(f"tensorfleet serve-model: {server.url}/v1/predict, following {args.directory}"
          f"{'' if args.follow else ' (first checkpoint only)'}; Ctrl-C stops it", flush=True)
    try:
        wait_for_stop_signal()
    finally:
        server.stop()
    return 0
