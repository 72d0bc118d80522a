"""``hidden-states serve``: the part of vLLM's OpenAI server that speculators 0.9 talks to, serving
the hidden states of the token ids it sends (docs/guides/serve.md). One module per surface, as vLLM's
OpenAI entrypoints:

* this module: the command (:func:`serve`): plan, bind, load, serve until a signal, drain, stop;
* ``serve.model``: the served model, planned by the planner and loaded once;
* ``serve.http_server``: the HTTP server, its routes and connections;
* ``serve.protocol``: the wire protocol: a completion request's ids, the replies, the errors, the key;
* ``serve.batching``: requests into the backend's batches, each row's states to its file;
* ``serve.state_files``: one request's safetensors file, the private directory, the sweep.

vLLM's engine runs in processes of its own; a request it holds when one of them dies would never be
answered (vLLM's client in this process does not fail it). So a thread watches those processes
(``processes.Children``): at a death ``/health`` turns 503, every request held is answered with an
error naming the process, and the server stops, non-zero. The first SIGTERM/SIGINT drains; a second
kills vLLM's processes and stops at once.
"""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from .. import model_ids, processes
from ..errors import UsageError
from ..processes import EXIT_WAIT
from ..settings import ENGINE_STEPS_HELD, ModelSettings, ServeSettings
from .batching import Gatherer
from .http_server import REQUEST_TIMEOUT, StatesServer, exposure_warning
from .model import ServedModel
from .state_files import StateFiles, default_directory

PROGRESS_INTERVAL = 30.0  # seconds between the server's progress lines
WATCH_INTERVAL = 0.2  # seconds between two looks at vLLM's processes: a death is noticed within this
REPLY_WAIT = 5.0  # seconds a stopping server waits for the replies it is writing (a client reads them at once)


def no_exits(wait: float = 0.0) -> list[processes.Exit]:
    return []


class ServeFailed(RuntimeError):
    """The backend's engine stopped while serving (the server drained what it could and stopped)."""


class EngineStopped(RuntimeError):
    """What each request held when vLLM's engine stopped is answered with (500)."""


class Aborted(Exception):
    """A second SIGTERM/SIGINT while draining: vLLM's processes were killed, requests held are not answered.

    Attributes:
        signum: the second signal.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def serve_until_signal(server: StatesServer, gatherer: Gatherer, log, drain_timeout: float = REQUEST_TIMEOUT,
                       report_every: float = PROGRESS_INTERVAL, engine_exits=no_exits, kill_engine=lambda: None,
                       watch_every: float = WATCH_INTERVAL) -> int | None:
    """Serve until SIGTERM or SIGINT, or until vLLM's engine is gone, then stop taking connections,
    answer every request taken, and return the signal's number (None: the engine is gone, and
    ``server.engine_stopped`` says why). A line every ``report_every`` s while requests come.
    Runs on the main thread (signals are delivered there).

    Args:
        engine_exits: ``(wait=0.0) -> [processes.Exit]``: vLLM's processes that have died
            (``Children.first_exits``), looked at every ``watch_every`` s from a thread of its own, while
            serving and while draining.
        kill_engine: ``() -> [pid]``: kills vLLM's processes; a second signal calls it, then raises
            :class:`Aborted`.
    """
    stop = threading.Event()
    finished = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        if len(received) > 1:  # the first drains; this one stops now
            # counted, and the watcher stopped, before the kill: the engine's death that follows is this
            # signal's doing, not a failure to answer the requests held with
            held = gatherer.held
            finished.set()
            pids = kill_engine()
            name = signal.Signals(signum).name
            raise Aborted(f"a second {name} while draining: vLLM's processes killed (pids "
                          f"{', '.join(map(str, pids)) or 'none left'}), {held} request(s) left unanswered", signum)
        stop.set()

    def engine_gone(why: str) -> None:
        if finished.is_set():  # a second signal killed the engine, or serving ended
            return
        server.engine_stopped = why
        answered = gatherer.stop_with(EngineStopped(why))
        log(f"error: {why}: the server stops ({answered} request(s) held answered with this error)")
        stop.set()

    def watch():
        while not finished.wait(watch_every):
            exits = engine_exits()
            if not exits and gatherer.failure is not None:  # vLLM's client may hear of a death before this
                exits = engine_exits(wait=EXIT_WAIT)  # watch sees the process end
            if exits:
                return engine_gone("vLLM's engine is gone: " + "; ".join(exit.explain() for exit in exits))
            if gatherer.failure is not None:  # the backend refused or failed a batch: its engine is gone
                return engine_gone(f"the engine stopped ({type(gatherer.failure).__name__}: "
                                   f"{gatherer.failure or '(no message)'})")

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="hidden-states-http", daemon=True)
    watcher = threading.Thread(target=watch, name="hidden-states-engine-watch", daemon=True)
    thread.start()
    watcher.start()
    try:
        said, tokens, last = time.monotonic(), 0, 0
        while not stop.wait(1.0):
            if time.monotonic() - said >= report_every and server.served != last:
                seconds, said = time.monotonic() - said, time.monotonic()
                log(f"served {server.served - last} requests in {seconds:.0f} s "
                    f"({(gatherer.tokens - tokens) / seconds:,.0f} tokens/s), {server.refused} refused so far")
                tokens, last = gatherer.tokens, server.served
        if received:
            log(f"{signal.Signals(received[0]).name}: no new connections; answering the requests taken "
                f"(a second {signal.Signals(received[0]).name} stops at once)")
        server.stop_accepting()  # a new connection is refused; connections already open go on (new requests: 503)
        answered = gatherer.drain(timeout=drain_timeout)
        reply_wait = max(REPLY_WAIT, server.keep_alive_timeout)  # a write waits this long on its client
        if not answered:
            log(f"warning: requests still unanswered after {drain_timeout:.0f} s; stopping anyway")
        elif not server.replies_written(timeout=reply_wait):
            log(f"warning: replies still being written after {reply_wait:.0f} s (a client not reading them); "
                f"stopping anyway")
        return None if server.engine_stopped else received[0]
    finally:
        finished.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def engine_tokens(options: ServeSettings, backend) -> int | None:
    """The gatherer's limit on the tokens in the engine (None: the regions' only)."""
    if options.engine_tokens is None:
        step = backend.tokens_per_submit
        return None if step is None else ENGINE_STEPS_HELD * step
    return options.engine_tokens or None


def serve(settings: ModelSettings, options: ServeSettings, log) -> int:
    """``hidden-states serve``: plan, bind the port, load the model, serve until SIGTERM/SIGINT, drain,
    shut vLLM down. Returns the exit code (0: drained and stopped)."""
    model = ServedModel(settings, log)
    for line in model.plan():
        log(line)
    files = StateFiles(Path(options.states_dir) if options.states_dir else default_directory(),
                       model.settings.state_dtype, options.sweep_after, log=log,
                       flag="--states-dir" if options.states_dir else "the default --states-dir")
    model_id = options.served_model_name or model_ids.served_name(settings.model_path)
    try:  # before the load: a port in use is said in seconds, not after the model loaded
        server = StatesServer((options.host, options.port), model_id=model_id, vocab_size=model.vocab_size,
                              max_seq_len=model.settings.max_seq_len, log=log, api_key=options.api_key,
                              keep_alive_timeout=options.keep_alive_timeout, max_connections=options.max_connections)
    except OSError as exc:
        raise UsageError(f"--host {options.host} --port {options.port}: {exc.strerror or exc}") from None
    warning = exposure_warning(options.host, options.api_key)
    if warning:
        log(warning)
    if server.max_connections < options.max_connections:
        log(f"--max-connections {options.max_connections}: {server.max_connections}, half the process's file "
            f"descriptor limit (ulimit -n)")
    try:
        with processes.contained() as children:
            try:
                model.load()
                gatherer = Gatherer(model.backend, files, model.layer_order, batch_size=model.settings.batch_size,
                                    window=options.gather_window, writer_threads=model.settings.writer_threads,
                                    engine_tokens=engine_tokens(options, model.backend), certifier=model.certifier)
                server.gatherer = gatherer
                files.start_sweeping()
                host, port = server.server_address[:2]
                log(f"serving {model_id} at http://{host}:{port}/v1: layers {model.layer_ids} (speculators 0.9's "
                    f"--target-layer-ids {' '.join(map(str, model.layer_ids[:-1]))}), files in {files.directory}, "
                    f"swept after {options.sweep_after:g} s; at most "
                    f"{f'{gatherer.engine_tokens:,} tokens' if gatherer.engine_tokens else 'what the regions hold'} "
                    f"in the engine")
                started = time.monotonic()
                try:
                    signum = serve_until_signal(server, gatherer, log, engine_exits=children.first_exits,
                                                kill_engine=children.kill)
                except Aborted:
                    model.backend = None  # vLLM's processes are killed: no orderly shutdown to wait for
                    raise
                seconds = time.monotonic() - started
                log(f"stopped after {seconds:.0f} s: {server.served} requests served ({gatherer.tokens:,} tokens in "
                    f"{gatherer.batches} batches), {server.refused} refused, {files.swept} uncollected files swept")
                if model.certifier is not None:
                    log(f"certificates: {model.certifier.said()}")
                if signum is None:
                    failure = engine_failure(children, server.engine_stopped)
                    # what is left of a dead engine (its core, when a worker died) has nothing to finish:
                    # killed, so that closing the backend never waits on an engine that only looks alive
                    children.kill()
                    raise failure
            finally:
                files.stop()
                model.close()
    finally:
        server.server_close()
    return 0


def engine_failure(children: processes.Children, why: str) -> Exception:
    """The error ``serve`` ends with when vLLM's engine is gone: the process that died, how, and the
    likely cause, as ``extract`` names it (``processes.ProcessDied``); else what the backend said."""
    died = processes.death(children, ". The server stopped on it, every request it held answered with an error: "
                                     "restart it", wait=EXIT_WAIT)
    return died if died is not None else ServeFailed(why)
