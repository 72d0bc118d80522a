"""``hidden-states serve`` on a host it shares with other users (docs/guides/serve.md, "On a shared host"):
the states directory and its files, the sweep, the body checks, the API key, the connections' bounds,
the drain; a real ``StatesServer`` on loopback over a fake engine backend, real files, and another
Unix user (``nobody``) for the attacker's steps where the host has one."""
from __future__ import annotations

import base64
import errno
import http.client
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from hidden_states.errors import UsageError
from hidden_states.serve import serve_until_signal
from hidden_states.serve.http_server import StatesServer
from hidden_states.serve.batching import Gatherer
from hidden_states.serve.state_files import StateFiles
from tests.unit.fakes import FakeBackend
from tests.unit.waiting import until

MODEL = "tiny-model"
VOCAB, HIDDEN, LAYERS = 512, 8, 3
KEY = "s3cret-key"


def layers(ids: list[int], layer_ids=None) -> list:
    return [torch.full((len(ids), HIDDEN), float(k), dtype=torch.bfloat16) for k in range(LAYERS)]


def slow_backend(delay: float = 0.0, gate: threading.Event | None = None) -> FakeBackend:
    """An engine backend's surface: each batch's rows resolved after ``delay`` seconds on a thread, or,
    given a ``gate``, once the test sets it (a request then stays in the engine however slow the host)."""
    return FakeBackend(states=layers, threaded=True, delay=delay, gate=gate)


def other_user() -> pwd.struct_passwd:
    """``nobody``, to run an attacker's step as; skipped where the tests do not run as root."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("another Unix user's step needs root and setpriv")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody on this host")


def as_other_user(code: str, *args: str) -> subprocess.CompletedProcess:
    """Python ``code`` run as ``nobody`` (its groups cleared)."""
    user = other_user()
    return subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                           sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def shared_tmp():
    """A folder every user may reach (as /tmp is), unlike pytest's own 0700 ones; removed after."""
    folder = Path(tempfile.mkdtemp(prefix="shared-host-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# ---- the states directory and its files ----------------------------------------------------------

def test_the_default_states_directory_is_the_users_own_made_0700(tmp_path, monkeypatch):
    from hidden_states.serve.state_files import default_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert default_directory({}) == tmp_path / f"hidden-states-{os.geteuid()}"
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    assert default_directory({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "hidden-states"
    runtime.chmod(0o777)  # a runtime directory others may write in is not used
    assert default_directory({"XDG_RUNTIME_DIR": str(runtime)}) == tmp_path / f"hidden-states-{os.geteuid()}"
    files = StateFiles(default_directory({}), "model", 600)
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode, said", [(0o777, "writable by others"), (0o1777, "writable by others"),
                                        (0o770, "writable by its group")])
def test_a_states_directory_others_may_write_in_is_refused(tmp_path, mode, said):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(UsageError, match=f"--states-dir {shared}: {said}"):
        StateFiles(shared, "model", 600)


def test_a_states_directory_another_user_made_is_refused_and_its_links_never_followed(shared_tmp):
    """The attack on a fixed name in /tmp: another user makes the directory first and plants, under the
    server's next temporary name, a link to a file only the server's user may write."""
    victim = shared_tmp / "victim"
    victim.write_text("the server user's own file")
    victim.chmod(0o600)
    planted = shared_tmp / "states"
    made = as_other_user("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", str(planted))
    assert made.returncode == 0, made.stderr
    with pytest.raises(UsageError, match=rf"--states-dir {planted}: owned by uid {pwd.getpwnam('nobody').pw_uid}"):
        files = StateFiles(planted, "model", 600)
        name = f".tmp-served-{files._token}-0.safetensors"  # (what the attacker reads off a served name)
        as_other_user("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), str(planted / name))
        files.write([1, 2], layers([1, 2]))
    assert victim.read_text() == "the server user's own file"


def test_served_files_are_0600_in_a_0700_directory_no_other_user_reads(shared_tmp):
    files = StateFiles(shared_tmp / "states", "model", 600)
    path = files.write([1, 2, 3], layers([1, 2, 3]))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    read = as_other_user("import sys; open(sys.argv[1], 'rb').read(); print('read')", str(path))
    assert read.returncode != 0 and "PermissionError" in read.stderr, read.stdout + read.stderr


@pytest.mark.parametrize("where", ["temporary", "final"])
def test_a_link_planted_under_the_next_name_is_never_written_through(tmp_path, where):
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    files = StateFiles(tmp_path / "states", "model", 600)
    name = f"served-{files._token}-0.safetensors"
    link = files.directory / (f".tmp-{name}" if where == "temporary" else name)
    link.symlink_to(victim)
    with pytest.raises(OSError):
        files.write([1, 2], layers([1, 2]))
    assert victim.read_text() == "untouched" and link.is_symlink()
    assert files.write([3], layers([3])).name == f"served-{files._token}-1.safetensors"  # the next one is written


# ---- the sweep -------------------------------------------------------------------------------------

def test_the_sweep_removes_only_this_servers_files_and_survives_anything_else(tmp_path):
    """Two servers on one directory: the one with the shorter limit leaves the other's files; a
    directory, or a link, named like a served file is left and does not stop the sweep."""
    first = StateFiles(tmp_path, "model", sweep_after=600)
    second = StateFiles(tmp_path, "model", sweep_after=1)
    theirs = first.write([1, 2], layers([1, 2]))
    mine = second.write([3], layers([3]))
    (tmp_path / "served-00000000-0.safetensors").mkdir()
    (tmp_path / f"served-{second._token}-99.safetensors").mkdir()
    (tmp_path / f"served-{second._token}-98.safetensors").symlink_to(theirs)
    old = time.time() - 3600
    for path in tmp_path.iterdir():
        os.utime(path, (old, old), follow_symlinks=False)
    assert second.sweep() == 1 and not mine.exists()
    assert theirs.exists() and (tmp_path / "served-00000000-0.safetensors").is_dir()
    assert (tmp_path / f"served-{second._token}-99.safetensors").is_dir()
    assert first.sweep() == 1 and not theirs.exists()


def test_a_failing_sweep_is_said_and_the_sweeping_goes_on(tmp_path):
    lines: list[str] = []
    files = StateFiles(tmp_path, "model", sweep_after=1, log=lines.append)
    sweeps = []
    real = files.sweep

    def sweep(now=None):
        sweeps.append(now)
        if len(sweeps) == 2:  # the first sweep on the thread
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))
        return real(now)

    files.sweep = sweep
    files.start_sweeping(interval=0.05)
    try:
        until(lambda: len(sweeps) >= 5, "five sweeps (the sweeper thread ended after the failing one?)")
    finally:
        files.stop()
    assert any(f"sweep of {tmp_path} failed" in line and "Permission denied" in line for line in lines), lines


# ---- the HTTP surface --------------------------------------------------------------------------------

@pytest.fixture
def server_of(tmp_path):
    """A server on a free port over ``slow_backend``; yields a factory taking the server's options."""
    started = []

    def start(delay=0.0, gate=None, **options):
        gatherer = Gatherer(slow_backend(delay, gate), StateFiles(tmp_path / "states", "model", 600),
                            list(range(LAYERS)), batch_size=8, window=0.0, writer_threads=1)
        server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64,
                              log=lambda line: None, gatherer=gatherer, **options)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append((server, gatherer))
        return server

    yield start
    for server, gatherer in started:
        server.shutdown()
        server.server_close()
        gatherer.drain(timeout=5)


COMPLETION = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()


def request(server, method, path, body=None, headers=None) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    connection.request(method, path, body=body, headers={
        **({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})})
    response = connection.getresponse()
    reply = json.loads(response.read() or b"{}")
    connection.close()
    return response.status, reply, dict(response.getheaders())


def raw(server, data: bytes, wait: float = 15.0) -> bytes:
    """What the server answers to ``data`` sent as is (the connection left open), within ``wait`` s."""
    with socket.create_connection(server.server_address[:2]) as connection:
        connection.settimeout(wait)
        connection.sendall(data)
        got = b""
        try:
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                chunk = connection.recv(65536)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
        return got


def head(length: str | None, content_type: str = "application/json", path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("length, status, said", [
    ("-1", 400, "Content-Length '-1': not a number of bytes"),
    ("12abc", 400, "Content-Length '12abc': not a number of bytes"),
    (None, 411, "a Content-Length is needed"),
    (str(200 * 1024 * 1024), 413, "at most 67108864"),
])
def test_a_bad_content_length_is_refused_before_the_body_is_read_and_the_connection_closed(server_of, length,
                                                                                          status, said):
    server = server_of()
    got = raw(server, head(length) + b'{"model": "tiny-model", "prompt": [1, 2')  # the body never ends
    assert got.startswith(f"HTTP/1.1 {status} ".encode()), got[:300]
    assert said.encode() in got and b"Connection: close" in got, got[:600]


def test_a_body_not_json_is_415(server_of):
    server = server_of()
    got = raw(server, head(str(len(COMPLETION)), "text/plain") + COMPLETION)
    assert got.startswith(b"HTTP/1.1 415 "), got[:300]
    assert b"must be application/json" in got


@pytest.mark.parametrize("body", [b"[" * 100_000, b"[1," * 100_000, b'{"a":' * 50_000],
                         ids=["openers", "arrays-in-arrays", "objects-in-objects"])
def test_deeply_nested_json_gets_a_400_reply(server_of, body):
    server = server_of()
    status, reply, _ = request(server, "POST", "/v1/completions", body)
    assert status == 400 and "nests deeper than 16 levels" in reply["error"]["message"], reply
    assert request(server, "POST", "/v1/completions", COMPLETION)[0] == 200  # and the server serves on


def test_an_api_key_is_asked_on_every_route_but_health(server_of):
    server = server_of(api_key=KEY)
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/stats", None),
                               ("POST", "/v1/completions", COMPLETION), ("GET", "/v1/nothing", None)]:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": KEY}]:
            status, reply, _ = request(server, method, path, body, headers)
            assert status == 401 and reply["error"]["type"] == "AuthenticationError", (path, headers, reply)
            assert "API key" in reply["error"]["message"]
    assert request(server, "GET", "/health")[0] == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()}
    for headers in (bearer, basic):
        assert request(server, "GET", "/v1/models", headers=headers)[0] == 200
        status, reply, _ = request(server, "POST", "/v1/completions", COMPLETION, headers)
        assert status == 200 and os.path.isfile(reply["kv_transfer_params"]["hidden_states_path"]), reply


def test_replies_name_the_served_model_never_its_path(tmp_path):
    from hidden_states.cli import parse
    from hidden_states.cli.serve_command import serve_settings_from

    model = tmp_path / "models" / "Tiny-Llama"
    model.mkdir(parents=True)
    assert serve_settings_from(parse(["serve", "--model-path", str(model)]))[1].served_model_name == "Tiny-Llama"
    given = serve_settings_from(parse(["serve", "--model-path", str(model), "--served-model-name", str(model)]))
    assert given[1].served_model_name == str(model)  # (what the trainer's --verifier-name-or-path is, as given)


def test_an_idle_or_stalled_connection_is_closed_after_the_keep_alive_timeout(server_of):
    server = server_of(keep_alive_timeout=0.5)
    for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):  # idle; headers never finished
        with socket.create_connection(server.server_address[:2]) as connection:
            connection.settimeout(20)  # (a server that never closes it: TimeoutError)
            connection.sendall(sent)
            started = time.monotonic()
            # closed after its 0.5 s, not left open: 10 s leaves a busy host room
            assert connection.recv(1024) == b"" and time.monotonic() - started < 10
    # a body that stops half way: 408, the connection closed
    got = raw(server, head(str(len(COMPLETION))) + COMPLETION[:10])
    assert got.startswith(b"HTTP/1.1 408 "), got[:300]


def handler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if "process_request_thread" in t.name}


def test_connections_past_the_bound_get_a_503_and_a_request_in_progress_is_answered(server_of):
    """Four places: a request in the engine and three connections stalled mid-request hold them all;
    new connections are answered 503 and closed, with no thread of their own; the request is answered."""
    before = handler_threads()  # (other tests' handlers may still be ending)
    gate = threading.Event()  # the request stays in the engine until the test has turned connections away
    server = server_of(gate=gate, max_connections=4, keep_alive_timeout=60)
    answered = []
    worker = threading.Thread(target=lambda: answered.append(request(server, "POST", "/v1/completions", COMPLETION)))
    worker.start()
    stalled = []
    try:
        until(lambda: server.gatherer.backend.batches, "the request to reach the engine")
        stalled += [socket.create_connection(server.server_address[:2]) for _ in range(3)]
        for connection in stalled:
            connection.sendall(b"GET /v1/models HTTP/1.1\r\n")  # and the rest never comes
        until(lambda: server._open == 4, "the three stalled connections to be taken")
        turned = [raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(20)]
        assert all(got.startswith(b"HTTP/1.1 503 ") for got in turned), turned[0][:300]
        assert server.turned_away == 20
        handlers = handler_threads() - before
        assert len(handlers) <= 4, handlers  # no thread for a connection turned away
    finally:
        gate.set()
        for connection in stalled:
            connection.close()
    worker.join(timeout=60)
    assert answered and answered[0][0] == 200, answered
    # the connections closed free their places
    until(lambda: server._open == 0, "the closed connections to give their places back")
    assert request(server, "GET", "/v1/models")[0] == 200 and server.turned_away == 20


def test_idle_connections_give_their_places_to_new_ones(server_of):
    """Four places held by kept-alive connections waiting for nothing: a new connection is served,
    one idle connection closed for it."""
    server = server_of(max_connections=4, keep_alive_timeout=60)
    idle = [socket.create_connection(server.server_address[:2]) for _ in range(4)]
    try:
        until(lambda: len(server._idle) == 4, "the four connections to be taken and wait for a request")
        for _ in range(3):
            assert request(server, "GET", "/v1/models")[0] == 200
        closed = 0
        for connection in idle:
            connection.settimeout(2)  # (an evicted one was shut down before the reply above was sent)
            try:
                closed += connection.recv(1) == b""
            except TimeoutError:
                pass
        assert closed >= 1 and server.turned_away == 0
    finally:
        for connection in idle:
            connection.close()


def test_a_kept_alive_connection_whose_request_has_come_keeps_its_place():
    """Its handler's thread has not yet looked (a busy host): the request is there, so the connection
    is not idle and is not closed for a new one, which is answered 503 instead."""
    server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                          max_connections=1)
    kept, kept_client = socket.socketpair()
    new, new_client = socket.socketpair()
    try:
        kept_client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        server._open = 1  # (as process_request counted it)
        server.waiting(kept)  # (as its handler said before its last request)
        server.process_request(new, ("127.0.0.1", 0))
        new_client.settimeout(10)
        assert new_client.recv(1024).startswith(b"HTTP/1.1 503 ") and server.turned_away == 1
        kept_client.setblocking(False)
        with pytest.raises(BlockingIOError):  # not shut down: its reply is still to come
            kept_client.recv(1)
    finally:
        for end in (kept, kept_client, new, new_client):
            end.close()
        server.server_close()


def test_accept_out_of_descriptors_does_not_spin(server_of):
    """The listening socket stays readable while accept fails for want of descriptors: without a pause
    the accept loop retries as fast as the CPU allows (thousands a second even on a busy host). The
    pause (ACCEPT_BACKOFF) allows at most one attempt per pause; the bound is twice that, and a busy host
    only makes fewer attempts, never more."""
    from hidden_states.serve.http_server import ACCEPT_BACKOFF

    server = server_of()
    accepts = []

    class OutOfDescriptors:
        def __init__(self, real):
            self.real = real

        def accept(self):
            accepts.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")

        def __getattr__(self, name):
            return getattr(self.real, name)

    real = server.socket
    server.socket = OutOfDescriptors(real)
    waiting = socket.create_connection(server.server_address[:2])  # the listening socket stays readable
    try:
        until(lambda: accepts, "an attempt to accept the waiting connection")
        window = 1.0
        time.sleep(window)  # (the attempts made meanwhile are counted: a rate, not a condition)
        made = [at for at in accepts if accepts[0] <= at <= accepts[0] + window]
        assert len(made) <= 2 * (window / ACCEPT_BACKOFF + 1), len(made)
        server.socket = real
        waiting.settimeout(30)
        waiting.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert waiting.recv(1024).startswith(b"HTTP/1.1 200 ")  # taken once descriptors are back
    finally:
        server.socket = real
        waiting.close()


def test_a_draining_server_refuses_new_connections_and_answers_the_requests_taken(tmp_path):
    gate = threading.Event()  # the request stays in the engine until the new connection has been tried
    gatherer = Gatherer(slow_backend(gate=gate), StateFiles(tmp_path / "states", "model", 600), list(range(LAYERS)),
                        batch_size=8, window=0.0, writer_threads=1)
    server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                          gatherer=gatherer)
    address = server.server_address[:2]
    answered, refused = [], []

    def client():
        answered.append(request(server, "POST", "/v1/completions", COMPLETION))

    def terminate_then_connect():
        try:
            until(lambda: gatherer.backend.batches, "the request to reach the engine")
            os.kill(os.getpid(), signal.SIGTERM)
            # draining (the request still in the engine): the listening socket is closed at once
            until(lambda: server.socket.fileno() == -1, "the server to stop listening", within=10)
        except AssertionError:
            pass  # (the connection below then says what the server does while draining)
        try:
            socket.create_connection(address, timeout=10).close()
        except ConnectionRefusedError:
            refused.append(True)
        finally:
            gate.set()

    threading.Thread(target=client, daemon=True).start()
    threading.Thread(target=terminate_then_connect, daemon=True).start()
    assert serve_until_signal(server, gatherer, log=lambda line: None, drain_timeout=60) == signal.SIGTERM
    until(lambda: answered, "the request's reply")
    assert refused == [True], "a new connection was taken while draining"
    assert answered[0][0] == 200, answered


def test_listening_beyond_loopback_without_a_key_is_warned():
    from hidden_states.serve.http_server import exposure_warning

    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert "without an API key" in exposure_warning("192.168.1.7", None)
    assert exposure_warning("0.0.0.0", KEY) is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None


def test_the_api_key_comes_from_the_flag_else_vllms_variable(tmp_path, monkeypatch):
    from hidden_states.cli import parse
    from hidden_states.cli.serve_command import serve_settings_from

    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve_settings_from(parse(["serve", "--model-path", str(tmp_path)]))[1].api_key == "from-env"
    assert serve_settings_from(parse(["serve", "--model-path", str(tmp_path), "--api-key", KEY]))[1].api_key == KEY


def test_serve_refuses_a_shared_states_directory_before_loading_anything(tmp_path, capsys, monkeypatch):
    from hidden_states.serve import model as serve_model
    from hidden_states.cli import main

    monkeypatch.setattr(serve_model.ServedModel, "plan", lambda self: setattr(self, "vocab_size", VOCAB) or [])
    monkeypatch.setattr(serve_model.ServedModel, "load", lambda self: pytest.fail("the model was loaded"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code = main(["serve", "--model-path", str(tmp_path), "--port", "0", "--states-dir", str(shared)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"--states-dir {shared}: writable by others" in err[-1], err
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default one, made by someone else
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    default = tmp_path / f"hidden-states-{os.geteuid()}"
    default.mkdir(mode=0o777)
    default.chmod(0o777)
    code = main(["serve", "--model-path", str(tmp_path), "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"the default --states-dir {default}: writable by others" in err[-1], err
