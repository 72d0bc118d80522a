"""The HTTP server of ``hidden-states serve``: its routes, its connections, the bodies it reads.

The server is the standard library's threading HTTP server, one thread per connection, HTTP/1.1
keep-alive: it runs in every vLLM release's environment as it is. ``GET /v1/models``, ``POST
/v1/completions`` (the wire protocol: ``serve.protocol``), ``GET /health`` and ``GET /stats``; a
completion's ids go to the gatherer (``serve.batching``), which answers with the states' file. None
is refused for load: requests wait.

On a shared host (docs/guides/serve.md, "On a shared host"): with an API key every route but ``/health``
asks for it (401); a body is JSON only (415), its ``Content-Length`` checked before a byte of it is
read (411, 400, 413) and its nesting bounded (400); a connection idle or stalled for the keep-alive
timeout is closed; past ``max_connections`` open ones a new connection takes the place of one idle
between requests, else is answered 503 and closed; when
accept runs out of file descriptors the loop waits instead of spinning.
"""
from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import resource
import select
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .batching import Draining, Gatherer
from .protocol import (MAX_BODY, MAX_DEPTH, TOO_DEEP, BadRequest, carries_key, completion_ids, completion_reply,
                       error_reply, models_reply)

# How long a request may wait for its file: past the client's own 120 s per attempt, a request is lost anyway.
REQUEST_TIMEOUT = 900.0
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BACKOFF = 0.1  # seconds the accept loop waits when the process has no descriptor left


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable beyond this host with no key asked, else None."""
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"warning: listening on {host or 'every address'} without an API key: anyone who can reach this port can "
            f"have prompts run and read the model's id; give --api-key (or VLLM_API_KEY), or --host 127.0.0.1")


def descriptor_bound(wanted: int) -> int:
    """``wanted`` connections, at most half the process's file descriptor limit (vLLM, the model's
    files and the writers need the rest)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft // 2))


def stats_reply(server: StatesServer, gatherer: Gatherer) -> dict:
    """``GET /stats``: what the server did since it started (counters only grow: a client takes two
    readings and their difference)."""
    return {"served": server.served, "refused": server.refused, "batches": gatherer.batches, "rows": gatherer.rows,
            "tokens": gatherer.tokens, "stages": gatherer.stages.snapshot()}


class StatesServer(ThreadingHTTPServer):
    """The HTTP server; its handlers reach the gatherer and the served model's facts through it.

    Args:
        address: (host, port), bound at once; port 0 takes a free one (``server_address`` says which).
        gatherer: where requests go (may be set once the model is loaded, before serving starts).
        model_id: the served model's id (``/v1/models``).
        vocab_size, max_seq_len: the bounds a request's ids are checked against.
        log: one line per message.
        api_key: the key requests must carry (``carries_key``); None: none asked.
        keep_alive_timeout: seconds a connection may be idle, or stall mid-request, before it is closed.
        max_connections: connections open at once (at most ``descriptor_bound``); a new one past it
            takes the place of one waiting for its next request (closed), else is answered 503 and
            closed, on the accept loop, without a thread.
    """

    daemon_threads = True  # a kept-alive idle connection does not hold the process at exit
    allow_reuse_address = True
    request_queue_size = 1024  # clients at high concurrency open their connections at once

    def __init__(self, address, *, model_id: str, vocab_size: int, max_seq_len: int, log,
                 gatherer: Gatherer | None = None, api_key: str | None = None, keep_alive_timeout: float = 5.0,
                 max_connections: int = 512):
        super().__init__(address, Handler)
        self.gatherer, self.model_id = gatherer, model_id
        self.vocab_size, self.max_seq_len, self.log = vocab_size, max_seq_len, log
        self.api_key, self.keep_alive_timeout = api_key, keep_alive_timeout
        self.max_connections = descriptor_bound(max_connections)
        self.created = int(time.time())
        self.served = 0
        self.refused = 0
        self.turned_away = 0  # connections past max_connections
        self.engine_stopped: str | None = None  # why vLLM's engine is gone (``/health`` then answers 503)
        self._open = 0
        self._open_lock = threading.Lock()
        self._idle: set = set()  # open connections waiting for their next request (under _open_lock)
        self._replying = 0  # requests read whose reply is not yet written (under _replies)
        self._replies = threading.Condition()

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:  # the listening socket stays readable: do not spin on it
                time.sleep(ACCEPT_BACKOFF)
            raise  # (socketserver drops the attempt; the connection waits in the backlog for the next)

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self._open >= self.max_connections
            idle = next((c for c in self._idle if not self._readable(c)), None) if full else None
            if idle is not None:  # a kept-alive connection waiting for nothing gives its place up
                self._idle.discard(idle)
                self._evict(idle)
                full = False
            if not full:
                self._open += 1
        if full:
            self.turned_away += 1
            self._turn_away(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the connection is not open
            with self._open_lock:
                self._open -= 1
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1

    def waiting(self, connection) -> None:
        """``connection`` waits for its next request: it may be closed for a new connection's place."""
        with self._open_lock:
            self._idle.add(connection)

    def working(self, connection) -> bool:
        """``connection``'s next request has come: it keeps its place. False: it was closed for
        another connection's meanwhile (the request is not read)."""
        with self._open_lock:
            if connection in self._idle:
                self._idle.discard(connection)
                return True
            return False

    @staticmethod
    def _readable(connection) -> bool:
        """Whether bytes (or the client's close) wait on ``connection``: its next request may have come
        before its handler's thread looked, and is not dropped for another connection."""
        poller = select.poll()  # (select.select cannot look at descriptors past 1023)
        try:
            poller.register(connection, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # (closed meanwhile)
            return True

    @staticmethod
    def _evict(connection) -> None:
        try:  # its handler's wait for the next request ends at once, as at the client's close
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _turn_away(self, request) -> None:
        reply = json.dumps(error_reply(HTTPStatus.SERVICE_UNAVAILABLE, f"the server holds its most connections "
                                       f"({self.max_connections}); retry")).encode()
        try:
            request.setblocking(False)  # a small reply into an empty socket buffer: never waits
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply))
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """One line, not socketserver's traceback, for a connection whose handling failed."""
        exc = sys.exc_info()[1]
        self.log(f"a connection from {client_address[0]} failed: {type(exc).__name__}: {exc or '(no message)'}")

    @contextlib.contextmanager
    def replying(self):
        """A request read and being answered, until its reply is written (``replies_written``)."""
        with self._replies:
            self._replying += 1
        try:
            yield
        finally:
            with self._replies:
                self._replying -= 1
                self._replies.notify_all()

    def replies_written(self, timeout: float) -> bool:
        """Wait until every request read has its reply written; False after ``timeout`` s. A handler's
        thread is a daemon (an idle kept-alive connection must not hold the process at exit), so the
        process ending first would cut a reply: the 500 naming a dead engine among them."""
        with self._replies:
            return self._replies.wait_for(lambda: self._replying == 0, timeout)

    def stop_accepting(self) -> None:
        """End the accept loop and close the listening socket: a new connection is refused at once
        (not left in the backlog); connections already open are answered."""
        self.shutdown()
        self.socket.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client's pool reuses its connections
    server: StatesServer

    def setup(self) -> None:
        self.timeout = self.server.keep_alive_timeout  # every read and write of the connection, the wait
        super().setup()                                # for its next request too

    def handle_one_request(self) -> None:
        """Wait for the next request as an idle connection (which a new one past ``max_connections``
        may close: ``StatesServer.process_request``), then read and answer it."""
        self.server.waiting(self.connection)
        try:
            arrived = self.rfile.peek(1)
        except OSError:  # (the keep-alive timeout among them)
            arrived = b""
        if not self.server.working(self.connection) or not arrived:
            self.close_connection = True
            return
        with self.server.replying():
            super().handle_one_request()

    def finish(self) -> None:
        self.server.working(self.connection)  # (no longer idle, whatever ended it)
        super().finish()

    def _authorized(self) -> bool:
        """Whether the request carries the server's key (always, with none asked); if not, a 401 is
        sent and the connection closed (a body, if any, is not read)."""
        if self.server.api_key is None or carries_key(self.headers.get("Authorization"), self.server.api_key):
            return True
        self._fail(HTTPStatus.UNAUTHORIZED, "this server asks for an API key: Authorization: Bearer KEY, or KEY as "
                                            "the password of the URL (http://any:KEY@host:port/v1)", close=True)
        return False

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", "/v1/health"):  # a probe: no key, no data
            if self.server.engine_stopped:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, error_reply(HTTPStatus.SERVICE_UNAVAILABLE,
                                                                       self.server.engine_stopped))
            else:
                self._send(HTTPStatus.OK, {})
        elif not self._authorized():
            return
        elif self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(HTTPStatus.OK, models_reply(self.server.model_id, self.server.max_seq_len, self.server.created))
        elif self.path.rstrip("/") == "/stats" and self.server.gatherer is not None:
            self._send(HTTPStatus.OK, stats_reply(self.server, self.server.gatherer))
        else:
            self._fail(HTTPStatus.NOT_FOUND, f"GET {self.path}: not served (GET /v1/models, POST /v1/completions)")

    def do_POST(self) -> None:
        if not self._authorized():
            return
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
        """The request's JSON object. Its type and length are checked before a byte of it is read; a
        body refused unread closes the connection (its bytes would be read as the next request)."""
        keep_alive, self.close_connection = not self.close_connection, True  # until the body is read whole
        if self.headers.get_content_type() != "application/json":
            raise BadRequest(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Type {self.headers.get('Content-Type')}: "
                                                                f"the body must be application/json")
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length") is None:
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is needed (no chunked bodies)")
        given = self.headers.get("Content-Length", "").strip()
        if not given.isdigit() or not given.isascii():
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length {given!r}: not a number of bytes")
        length = int(given)
        if length > MAX_BODY:
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes: at most {MAX_BODY}")
        try:
            data = self.rfile.read(length)
        except (TimeoutError, socket.timeout):  # (one class from Python 3.10 on)
            raise BadRequest(HTTPStatus.REQUEST_TIMEOUT, f"the body did not come within "
                                                         f"{self.server.keep_alive_timeout:g} s") from None
        if len(data) < length:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"body of {len(data)} bytes, not the {length} of its "
                                                     f"Content-Length")
        self.close_connection = not keep_alive
        if TOO_DEEP.search(data):
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body nests deeper than {MAX_DEPTH} levels")
        try:
            body = json.loads(data)
        except RecursionError:  # nested through other values than openers in a row
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body nests deeper than {MAX_DEPTH} levels") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _fail(self, status: HTTPStatus, message: str, param: str | None = None, close: bool = False) -> None:
        self.server.refused += 1
        self._send(status, error_reply(status, message, param), close=close or self.close_connection)

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
        except (BrokenPipeError, ConnectionResetError, TimeoutError, socket.timeout):
            # the client went away: a file made for it waits for the sweep
            self.close_connection = True
            if self.command == "POST":  # (a GET: a readiness probe that gave up while the model loaded)
                self.server.log(f"a client disconnected before its reply to {self.command} {self.path}")

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """One line per request is noise at thousands a second: errors only (``_fail`` counts them)."""
