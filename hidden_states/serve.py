"""``hidden-states serve``'s HTTP surface: the part of vLLM's OpenAI server that speculators 0.9 talks to.

speculators 0.9.0's client (``data_generation/vllm_client.py``; ``generate-offline-data --endpoint
URL/v1``, the trainer's ``--on-missing generate --vllm-endpoint URL/v1``) makes two calls:

* ``GET /v1/models``: it uses the first id, and the trainer refuses one that is not its
  ``--verifier-name-or-path``;
* ``POST /v1/completions`` with ``model``, ``prompt`` (token ids), ``max_tokens: 1`` and
  ``return_token_ids: true``: the reply's ``choices[0].prompt_token_ids`` must equal the ids sent,
  and its top-level ``kv_transfer_params.hidden_states_path`` names the states' file
  (``state_files``).

A request that cannot be served gets an OpenAI-style error (``{"error": {"message": ...}}``, which
the client prints): 400 for a malformed one, 404 for another model's. None is refused for load:
requests wait (``serve_batches``). The server is the standard library's threading HTTP server, one
thread per connection, HTTP/1.1 keep-alive: it runs in every vLLM release's environment as it is.
"""
from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import processes
from .errors import UsageError
from .serve_batches import Draining, Gatherer
from .serve_model import ServedModel
from .settings import ENGINE_STEPS_HELD, ServeSettings, Settings
from .state_files import StateFiles

MAX_BODY = 64 * 1024 * 1024  # bytes of one request's JSON: far above any row's token ids
# How long a request may wait for its file: past the client's own 120 s per attempt, a request is lost anyway.
REQUEST_TIMEOUT = 900.0
PROGRESS_INTERVAL = 30.0  # seconds between the server's progress lines


class ServeFailed(RuntimeError):
    """The backend's engine stopped while serving (the server drained what it could and stopped)."""


class BadRequest(Exception):
    """A request the server cannot serve: its HTTP status and the message the client shows."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def completion_ids(body: dict, model_id: str, vocab_size: int, max_seq_len: int) -> list[int]:
    """The token ids of a ``/v1/completions`` request, or :class:`BadRequest` saying what is wrong."""
    model = body.get("model")
    if model != model_id:
        raise BadRequest(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist: this server serves "
                                               f"`{model_id}` (GET /v1/models)", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # OpenAI's batch of prompts, of one
    if not isinstance(prompt, list) or not prompt or not all(type(i) is int for i in prompt):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "prompt must be a non-empty list of token ids: this server "
                                                 "returns hidden states for token ids and tokenizes no text",
                         "prompt")
    outside = [i for i in prompt if not 0 <= i < vocab_size]
    if outside:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"prompt: token ids {outside[:5]} outside the model's vocabulary "
                                                 f"[0, {vocab_size})", "prompt")
    if len(prompt) > max_seq_len:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"prompt: {len(prompt)} tokens, more than the server's "
                                                 f"--max-seq-len {max_seq_len}", "prompt")
    if body.get("max_tokens", 1) != 1:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"max_tokens {body.get('max_tokens')!r}: must be 1 (the reply "
                                                 f"carries the prompt's hidden states; nothing is generated)",
                         "max_tokens")
    if body.get("stream"):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "stream: not served (one reply per request)", "stream")
    return prompt


def completion_reply(ids: list[int], path: str, model_id: str) -> dict:
    """What vLLM's ``/v1/completions`` answers with ``return_token_ids`` and a hidden-states connector."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_id,
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "prompt_token_ids": ids, "token_ids": []}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
            "kv_transfer_params": {"hidden_states_path": path}}


def models_reply(model_id: str, max_seq_len: int, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "hidden-states", "root": model_id,
                                        "max_model_len": max_seq_len}]}


def stats_reply(server: StatesServer, gatherer: Gatherer) -> dict:
    """``GET /stats``: what the server did since it started (counters only grow: a client takes two
    readings and their difference)."""
    return {"served": server.served, "refused": server.refused, "batches": gatherer.batches, "rows": gatherer.rows,
            "tokens": gatherer.tokens, "stages": gatherer.stages.snapshot()}


def error_reply(status: HTTPStatus, message: str, param: str | None = None) -> dict:
    kind = "NotFoundError" if status == HTTPStatus.NOT_FOUND else \
        "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


class StatesServer(ThreadingHTTPServer):
    """The HTTP server; its handlers reach the gatherer and the served model's facts through it.

    Args:
        address: (host, port), bound at once; port 0 takes a free one (``server_address`` says which).
        gatherer: where requests go (may be set once the model is loaded, before serving starts).
        model_id: the served model's id (``/v1/models``).
        vocab_size, max_seq_len: the bounds a request's ids are checked against.
        log: one line per message.
    """

    daemon_threads = True  # a kept-alive idle connection does not hold the process at exit
    allow_reuse_address = True
    request_queue_size = 1024  # clients at high concurrency open their connections at once

    def __init__(self, address, *, model_id: str, vocab_size: int, max_seq_len: int, log,
                 gatherer: Gatherer | None = None):
        super().__init__(address, Handler)
        self.gatherer, self.model_id = gatherer, model_id
        self.vocab_size, self.max_seq_len, self.log = vocab_size, max_seq_len, log
        self.created = int(time.time())
        self.served = 0
        self.refused = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client's pool reuses its connections
    server: StatesServer

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(HTTPStatus.OK, models_reply(self.server.model_id, self.server.max_seq_len, self.server.created))
        elif self.path.rstrip("/") in ("/health", "/v1/health"):
            self._send(HTTPStatus.OK, {})
        elif self.path.rstrip("/") == "/stats" and self.server.gatherer is not None:
            self._send(HTTPStatus.OK, stats_reply(self.server, self.server.gatherer))
        else:
            self._fail(HTTPStatus.NOT_FOUND, f"GET {self.path}: not served (GET /v1/models, POST /v1/completions)")

    def do_POST(self) -> None:
        try:
            body = self._body()
            if self.path.rstrip("/") in ("/v1/chat/completions", "/chat/completions"):
                raise BadRequest(HTTPStatus.BAD_REQUEST, "/v1/chat/completions (rows with multimodal messages) is not "
                                                         "served: only token ids, through /v1/completions")
            if self.path.rstrip("/") not in ("/v1/completions", "/completions"):
                raise BadRequest(HTTPStatus.NOT_FOUND, f"POST {self.path}: not served (POST /v1/completions)")
            server = self.server
            ids = completion_ids(body, server.model_id, server.vocab_size, server.max_seq_len)
        except BadRequest as exc:
            self._fail(exc.status, str(exc), exc.param)
            return
        try:
            path = self.server.gatherer.submit(ids).result(timeout=REQUEST_TIMEOUT)
        except Draining as exc:  # the client retries: a restarted server answers
            self._fail(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), close=True)
            return
        except Exception as exc:  # noqa: BLE001 - the extraction failed for this request: the client hears why
            self.server.log(f"request of {len(ids)} tokens failed: {type(exc).__name__}: {exc}")
            self._fail(HTTPStatus.INTERNAL_SERVER_ERROR, f"extracting the prompt's states failed: "
                                                         f"{type(exc).__name__}: {exc or '(no message)'}")
            return
        self.server.served += 1
        self._send(HTTPStatus.OK, completion_reply(ids, path, self.server.model_id))

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "a JSON body with a Content-Length is needed") from None
        if length > MAX_BODY:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes: at most {MAX_BODY}")
        try:
            body = json.loads(self.rfile.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _fail(self, status: HTTPStatus, message: str, param: str | None = None, close: bool = False) -> None:
        self.server.refused += 1
        self._send(status, error_reply(status, message, param), close=close)

    def _send(self, status: HTTPStatus, reply: dict, close: bool = False) -> None:
        data = json.dumps(reply).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client went away: a file made for it waits for the sweep
            self.close_connection = True
            if self.command == "POST":  # (a GET: a readiness probe that gave up while the model loaded)
                self.server.log(f"a client disconnected before its reply to {self.command} {self.path}")

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """One line per request is noise at thousands a second: errors only (``_fail`` counts them)."""


def serve_until_signal(server: StatesServer, gatherer: Gatherer, log, drain_timeout: float = REQUEST_TIMEOUT,
                       report_every: float = PROGRESS_INTERVAL) -> int | None:
    """Serve until SIGTERM or SIGINT (or until the backend refuses batches: its engine is gone), then
    stop taking connections, answer every request taken, and return the signal's number (None: the
    engine's failure, ``gatherer.failure``). A line every ``report_every`` s while requests come.
    Runs on the main thread (signals are delivered there)."""
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="hidden-states-http", daemon=True)
    thread.start()
    try:
        said, tokens, last = time.monotonic(), 0, 0
        while not stop.wait(1.0) and gatherer.failure is None:
            if time.monotonic() - said >= report_every and server.served != last:
                seconds, said = time.monotonic() - said, time.monotonic()
                log(f"served {server.served - last} requests in {seconds:.0f} s "
                    f"({(gatherer.tokens - tokens) / seconds:,.0f} tokens/s), {server.refused} refused so far")
                tokens, last = gatherer.tokens, server.served
        why = (signal.Signals(received[0]).name if received else
               f"the engine stopped ({type(gatherer.failure).__name__}: {gatherer.failure})")
        log(f"{why}: no new connections; answering the requests taken")
        server.shutdown()  # the accept loop ends; connections already open go on (new requests: 503)
        answered = gatherer.drain(timeout=drain_timeout)
        server.server_close()
        if not answered:
            log(f"warning: requests still unanswered after {drain_timeout:.0f} s; stopping anyway")
        return received[0] if received else None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def engine_tokens(options: ServeSettings, backend) -> int | None:
    """The gatherer's limit on the tokens in the engine (None: the regions' only)."""
    if options.engine_tokens is None:
        step = backend.tokens_per_submit
        return None if step is None else ENGINE_STEPS_HELD * step
    return options.engine_tokens or None


def serve(settings: Settings, options: ServeSettings, log) -> int:
    """``hidden-states serve``: plan, bind the port, load the model, serve until SIGTERM/SIGINT, drain,
    shut vLLM down. Returns the exit code (0: drained and stopped)."""
    model = ServedModel(settings, log)
    for line in model.plan():
        log(line)
    files = StateFiles(Path(options.states_dir), model.settings.state_dtype, options.sweep_after)
    model_id = options.served_model_name or settings.model_path
    try:  # before the load: a port in use is said in seconds, not after the model loaded
        server = StatesServer((options.host, options.port), model_id=model_id, vocab_size=model.vocab_size,
                              max_seq_len=model.settings.max_seq_len, log=log)
    except OSError as exc:
        raise UsageError(f"--host {options.host} --port {options.port}: {exc.strerror or exc}") from None
    try:
        with processes.contained():
            try:
                model.load()
                gatherer = Gatherer(model.backend, files, model.layer_order, batch_size=model.settings.batch_size,
                                    window=options.gather_window, writer_threads=model.settings.writer_threads,
                                    engine_tokens=engine_tokens(options, model.backend))
                server.gatherer = gatherer
                files.start_sweeping()
                host, port = server.server_address[:2]
                log(f"serving {model_id} at http://{host}:{port}/v1: layers {model.layer_ids} (speculators 0.9's "
                    f"--target-layer-ids {' '.join(map(str, model.layer_ids[:-1]))}), files in {files.directory}, "
                    f"swept after {options.sweep_after:g} s; at most "
                    f"{f'{gatherer.engine_tokens:,} tokens' if gatherer.engine_tokens else 'what the regions hold'} "
                    f"in the engine")
                started = time.monotonic()
                signum = serve_until_signal(server, gatherer, log)
                seconds = time.monotonic() - started
                log(f"stopped after {seconds:.0f} s: {server.served} requests served ({gatherer.tokens:,} tokens in "
                    f"{gatherer.batches} batches), {server.refused} refused, {files.swept} uncollected files swept")
                if signum is None:
                    raise ServeFailed(f"the engine stopped: {type(gatherer.failure).__name__}: {gatherer.failure}") \
                        from gatherer.failure
            finally:
                files.stop()
                model.close()
    finally:
        server.server_close()
    return 0
