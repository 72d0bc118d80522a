"""``hidden-states serve``'s HTTP surface, batching, backpressure, sweep, errors and SIGTERM, on a fake
engine backend (the real one, with speculators 0.9's real client: tests/e2e/test_serve.py)."""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from hidden_states.serve import serve_until_signal
from hidden_states.serve.http_server import StatesServer
from hidden_states.serve.batching import Draining, Gatherer
from hidden_states.serve.state_files import StateFiles
from tests.unit.fakes import FakeBackend
from tests.unit.waiting import until

MODEL = "org/tiny-model"
VOCAB, HIDDEN, LAYERS = 512, 8, 3


def fake_layers(ids: list[int], layer_ids=None) -> list:
    """Per-layer states a test can recompute: layer k of token t is ids[t] * (k + 1) + the column (the
    served layers are ``LAYERS``: a served backend has no settings, so no ``layer_ids``)."""
    base = torch.tensor(ids, dtype=torch.float32)[:, None] + torch.arange(HIDDEN, dtype=torch.float32)
    return [(base * (k + 1)).to(torch.bfloat16) for k in range(LAYERS)]


def engine_backend(**options) -> FakeBackend:
    """A started engine backend's surface: ``submit(batch) -> Future`` of each row's ``fake_layers``,
    resolved on a thread of its own (as the engine feed does); ``options``: FakeBackend's (``capacity``
    rows at most held between submit and the writer's release, ``delay``, ``fail``, ...)."""
    return FakeBackend(states=fake_layers, threaded=True, **options)


@pytest.fixture
def served(tmp_path):
    """A server on a free port over a fake backend; yields a factory taking the backend's options."""
    started = []

    def start(backend=None, window=0.0, batch_size=32, state_dtype="model"):
        backend = backend or engine_backend()
        files = StateFiles(tmp_path / "states", state_dtype, sweep_after=600)
        gatherer = Gatherer(backend, files, list(range(LAYERS)), batch_size=batch_size, window=window,
                            writer_threads=2)
        server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                              gatherer=gatherer)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        started.append((server, gatherer))
        return server, gatherer, backend

    yield start
    for server, gatherer in started:
        server.shutdown()
        server.server_close()
        gatherer.drain(timeout=5)


def call(server, method, path, body=None, raw=None):
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    response = connection.getresponse()
    reply = json.loads(response.read() or b"{}")
    connection.close()
    return response.status, reply


def completion(ids, **extra):
    return {"model": MODEL, "prompt": ids, "max_tokens": 1, "return_token_ids": True, **extra}


def test_models_lists_the_served_id_first(served):
    server, *_ = served()
    status, reply = call(server, "GET", "/v1/models")
    assert status == 200 and reply["data"][0]["id"] == MODEL and reply["data"][0]["max_model_len"] == 64


def test_a_completion_answers_with_the_ids_and_a_whole_file_of_their_states(served):
    server, *_ = served()
    ids = [5, 7, 11, 13, 2]
    status, reply = call(server, "POST", "/v1/completions", completion(ids))
    assert status == 200, reply
    assert reply["choices"][0]["prompt_token_ids"] == ids
    path = reply["kv_transfer_params"]["hidden_states_path"]
    assert os.path.isfile(path) and not os.path.exists(path + ".lock")
    saved = load_file(path)
    assert set(saved) == {"hidden_states", "token_ids"}
    assert saved["token_ids"].dtype == torch.int64 and saved["token_ids"].tolist() == ids
    assert saved["hidden_states"].shape == (len(ids), LAYERS, HIDDEN)
    assert torch.equal(saved["hidden_states"], torch.stack(fake_layers(ids), dim=1))
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".tmp-")]


def test_fp8_files_hold_speculators_09s_fp8_layout(served):
    server, *_ = served(state_dtype="fp8")
    ids = [3, 9, 27]
    status, reply = call(server, "POST", "/v1/completions", completion(ids))
    assert status == 200, reply
    saved = load_file(reply["kv_transfer_params"]["hidden_states_path"])
    assert saved["hidden_states"].dtype == torch.float8_e4m3fn and saved["hidden_states_scales"].shape == (3, 1, 1)
    restored = saved["hidden_states"].float() * saved["hidden_states_scales"]
    expected = torch.stack(fake_layers(ids), dim=1).float()
    assert torch.allclose(restored, expected, rtol=0.07)


@pytest.mark.parametrize("body, status, said", [
    (completion([1, 2], model="other/model"), 404, "does not exist"),
    (completion("hello there"), 400, "list of token ids"),
    (completion([]), 400, "non-empty"),
    (completion([1, VOCAB]), 400, "outside the model's vocabulary"),
    (completion(list(range(65))), 400, "--max-seq-len 64"),
    (completion([1, 2], max_tokens=16), 400, "max_tokens 16: must be 1"),
    (completion([1, 2], stream=True), 400, "stream"),
    ([1, 2], 400, "JSON object"),
])
def test_a_wrong_request_gets_an_openai_error_saying_what(served, body, status, said):
    server, _, backend = served()
    got, reply = call(server, "POST", "/v1/completions", body)
    assert got == status and said in reply["error"]["message"], reply
    assert backend.batches == []


def test_other_paths_and_broken_bodies_are_refused_clearly(served):
    server, *_ = served()
    assert call(server, "POST", "/v1/completions", raw=b"{not json")[0] == 400
    status, reply = call(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and "only token ids" in reply["error"]["message"]
    assert call(server, "GET", "/v1/nothing")[0] == 404


def test_a_failed_extraction_is_a_500_naming_the_cause(served):
    server, *_ = served(engine_backend(fail="the engine loop has stopped"))
    status, reply = call(server, "POST", "/v1/completions", completion([1, 2, 3]))
    assert status == 500 and "the engine loop has stopped" in reply["error"]["message"]


def concurrently(server, bodies):
    results = [None] * len(bodies)

    def one(i):
        results[i] = call(server, "POST", "/v1/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_requests_arriving_together_go_to_the_engine_as_one_batch(served):
    server, gatherer, backend = served(window=0.5)
    bodies = [completion([i + 1] * 3) for i in range(6)]
    results = concurrently(server, bodies)
    assert all(status == 200 for status, _ in results), results
    assert len(backend.batches) < len(bodies), backend.batches
    assert sorted(map(tuple, (ids for batch in backend.batches for ids in batch))) == sorted(
        tuple(body["prompt"]) for body in bodies)
    for (_, reply), body in zip(results, bodies):  # each reply names the file of its own ids
        assert load_file(reply["kv_transfer_params"]["hidden_states_path"])["token_ids"].tolist() == body["prompt"]


def test_a_batch_holds_at_most_one_engine_step_of_tokens_and_batch_size_rows(tmp_path):
    backend = engine_backend(tokens_per_submit=10)
    gatherer = Gatherer(backend, StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=3, window=0.3,
                        writer_threads=1)
    futures = [gatherer.submit([i + 1] * 4) for i in range(7)]
    for future in futures:
        future.result(timeout=30)
    gatherer.drain(timeout=5)
    assert all(sum(map(len, batch)) <= 10 for batch in backend.batches), backend.batches
    assert all(len(batch) <= 3 for batch in backend.batches)
    assert sum(map(len, backend.batches)) == 7


def test_backpressure_holds_requests_and_answers_every_one(served):
    """More clients than the backend can hold: requests wait (never a 429), all are answered."""
    server, _, backend = served(engine_backend(capacity=2, delay=0.05), batch_size=1)
    results = concurrently(server, [completion([i + 1, i + 2]) for i in range(12)])
    assert [status for status, _ in results] == [200] * 12, results
    assert backend.most_held <= 2


def test_stats_say_where_the_requests_waited(served):
    """GET /stats: an engine that takes 0.5 s a batch shows as time in the engine; with room for one row
    at a time, the rows behind it show as time in submit (backpressure) and in the queue, not in the
    engine (bounds with room for a loaded host: a row's wait behind another is a whole batch)."""
    delay = 0.5
    server, _, backend = served(engine_backend(capacity=1, delay=delay), batch_size=1)
    status, before = call(server, "GET", "/stats")
    assert status == 200 and before["served"] == 0 and before["stages"]["requests"] == 0
    results = concurrently(server, [completion([i + 1, i + 2]) for i in range(4)])
    assert [status for status, _ in results] == [200] * 4
    _, after = call(server, "GET", "/stats")
    seconds = after["stages"]["seconds"]
    assert (after["served"], after["rows"], after["batches"], after["stages"]["requests"]) == (4, 4, 4, 4)
    # 10 ms under: the stats are rounded to the millisecond, and the engine's sleep starts inside submit
    assert 4 * delay - 0.01 <= seconds["in_engine"] < 4 * delay + 1.5 * delay, seconds
    # the 2nd, 3rd and 4th rows each wait in submit for the row before; behind it, in the queue
    assert seconds["in_submit"] >= delay * 3 - 0.1, seconds
    assert seconds["queued"] + seconds["in_submit"] >= delay * (1 + 2 + 3) - 0.1, seconds
    assert seconds["writing"] < seconds["in_engine"], seconds


@pytest.mark.parametrize("engine_tokens, most", [(8, 8), (None, 12 * 4)])
def test_the_engine_holds_at_most_engine_tokens_the_rest_wait_in_the_queue(tmp_path, engine_tokens, most):
    """Twelve requests of 4 tokens at once: with a limit of 8 tokens, two at a time reach the engine (the
    others wait, all are answered); without one, all twelve do."""
    backend = engine_backend(delay=0.1)
    gatherer = Gatherer(backend, StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=1, window=0.0,
                        writer_threads=2, engine_tokens=engine_tokens)
    futures = [gatherer.submit([i + 1] * 4) for i in range(12)]
    assert all(future.result(timeout=30) for future in futures)
    gatherer.drain(timeout=5)
    assert backend.most_unresolved == most, backend.most_unresolved


def test_a_batch_over_engine_tokens_goes_alone(tmp_path):
    backend = engine_backend(delay=0.05)
    gatherer = Gatherer(backend, StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=1, window=0.0,
                        writer_threads=1, engine_tokens=3)
    assert [f.result(timeout=30) for f in [gatherer.submit([7] * 5), gatherer.submit([8] * 5)]]
    gatherer.drain(timeout=5)
    assert backend.most_unresolved == 5


def test_files_nobody_collected_are_swept_and_nothing_else(tmp_path):
    files = StateFiles(tmp_path, "model", sweep_after=60)
    path = files.write([1, 2, 3], fake_layers([1, 2, 3]))
    collected = files.write([4], fake_layers([4]))
    os.replace(collected, tmp_path / "hs_0.safetensors")  # what the client does with its file
    (tmp_path / "notes.txt").write_text("not the server's")
    assert files.sweep() == 0 and path.exists()
    assert files.sweep(now=time.time() + 61) == 1
    assert not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs_0.safetensors", "notes.txt"]


def test_a_draining_gatherer_takes_no_new_request(tmp_path):
    gatherer = Gatherer(engine_backend(), StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=4, window=0,
                        writer_threads=1)
    assert gatherer.drain(timeout=5)
    with pytest.raises(Draining):
        gatherer.submit([1])


def test_sigterm_answers_the_requests_taken_then_stops(tmp_path):
    """SIGTERM while a request is in the engine: it is answered with its file, the server stops
    listening, and ``serve_until_signal`` returns the signal for a clean exit."""
    backend = engine_backend(delay=1.0)
    files = StateFiles(tmp_path, "model", 600)
    gatherer = Gatherer(backend, files, [0, 1, 2], batch_size=4, window=0, writer_threads=1)
    server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                          gatherer=gatherer)
    address = server.server_address[:2]
    answered = []

    def client():
        answered.append(call(server, "POST", "/v1/completions", completion([4, 5, 6])))

    def terminate():
        until(lambda: backend.batches, "the request to reach the engine")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=client, daemon=True).start()
    threading.Thread(target=terminate, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    assert serve_until_signal(server, gatherer, log=lambda line: None, drain_timeout=30) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    until(lambda: answered, "the request's reply")
    status, reply = answered[0]
    assert status == 200 and os.path.isfile(reply["kv_transfer_params"]["hidden_states_path"])
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection(*address, timeout=5).request("GET", "/v1/models")


def test_a_client_gone_before_its_reply_leaves_a_file_for_the_sweep_and_the_server_serving(served, tmp_path):
    server, gatherer, backend = served(engine_backend(delay=0.5))
    body = json.dumps(completion([8, 9, 10])).encode()
    with socket.create_connection(server.server_address[:2]) as gone:
        gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    until(lambda: list((tmp_path / "states").glob("served-*.safetensors")), "the file of the client gone")
    left = list((tmp_path / "states").glob("served-*.safetensors"))
    assert len(left) == 1
    assert call(server, "POST", "/v1/completions", completion([1, 2]))[0] == 200
    assert gatherer.files.sweep(now=time.time() + 601) == 2 and not left[0].exists()  # this server's files


def test_serve_flags_the_servers_defaults_under_a_preset_and_the_flags(tmp_path):
    from hidden_states.cli import parse
    from hidden_states.cli.serve_command import serve_settings_from
    from hidden_states.settings import ModelSettings

    given = str(tmp_path)
    settings, options = serve_settings_from(parse(["serve", "--model-path", given]))
    assert type(settings) is ModelSettings  # the model's settings alone: no input, no output directory
    assert {"prepared_data", "output_dir"}.isdisjoint(field.name for field in dataclasses.fields(settings))
    assert (settings.backend, settings.batch_size, settings.writer_threads) == ("vllm-engine", 32, 4)
    assert settings.max_writer_threads == 4  # a fixed pool: the extractor's growing writer is not serve's
    assert options.served_model_name == tmp_path.name and options.port == 8000 and options.states_dir is None
    assert options.api_key is None and options.keep_alive_timeout == 5 and options.max_connections == 512
    settings, options = serve_settings_from(parse(["serve", "--model-path", given, "--preset", "h200",
                                                   "--served-model-name", "org/m", "--gather-ms", "20"]))
    assert settings.batch_size == 8 and options.served_model_name == "org/m" and options.gather_window == 0.02
    assert options.engine_tokens is None
    assert serve_settings_from(parse(["serve", "--model-path", given, "--engine-tokens", "0"]))[1].engine_tokens == 0
    settings, _ = serve_settings_from(parse(["serve", "--model-path", given, "--preset", "h200", "--batch-size", "64",
                                             "--state-dtype", "fp8", "--layer-ids", "1", "3"]))
    assert settings.batch_size == 64 and settings.state_dtype == "fp8" and settings.layer_ids == [1, 3]


def test_the_served_model_is_planned_by_the_planner_and_gets_extracts_backend_settings(fake_model, monkeypatch):
    """serve plans with the planner's parts (no input, no output directory) and its backend gets what
    a run's plan gives extract's for the same model settings: the layers, the regions' sequences."""
    from hidden_states import backends
    from hidden_states.plan import planner, run_plan
    from hidden_states.serve import model as serve_model
    from hidden_states.settings import ModelSettings, Settings

    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: "not run (a fake backend)")
    monkeypatch.setattr(planner, "check_environment", lambda: [])
    created = []
    monkeypatch.setattr(backends, "create", lambda name, settings: created.append(settings) or FakeBackend(settings))
    settings = ModelSettings(str(fake_model), batch_size=32, writer_threads=4, max_writer_threads=4,
                             layer_ids=[3, 1, 2], forward_check=False)
    model = serve_model.ServedModel(settings, log=lambda line: None)
    lines = model.plan()
    assert lines[0] == "settings: --backend vllm-engine --batch-size 32 --max-seq-len 2048 --tp-size 1 " \
                       "--gpu-memory-utilization 0.8 --writer-threads 4"
    assert lines[-1] == "audit: not run (a fake backend)" and model.layer_ids == [3, 1, 2] and model.vocab_size == 64
    model.load()
    as_extract = run_plan.RunPlan(Settings(str(fake_model), "data", "out", **{
        f.name: getattr(model.settings, f.name) for f in dataclasses.fields(ModelSettings) if f.name != "model_path"}),
        model.model_plan, None, {})
    assert created == [as_extract.backend_settings()]
    # speculators 0.9's ids count the embeddings' output as 0: the extractor's are one less
    assert created[0].layer_ids == [0, 1, 2] and created[0].sequences_in_flight == 3 * 32 + 4
    assert model.layer_order == [0, 1, 2]  # speculators 0.9's layers go to the files in the model's order
    model.close()


def test_engine_tokens_default_to_engine_steps_and_a_negative_is_refused(tmp_path):
    from types import SimpleNamespace

    from hidden_states.cli import parse
    from hidden_states.cli.serve_command import serve_settings_from
    from hidden_states.errors import UsageError
    from hidden_states.serve import engine_tokens
    from hidden_states.settings import ENGINE_STEPS_HELD, ServeSettings

    steps = SimpleNamespace(tokens_per_submit=8192)
    assert engine_tokens(ServeSettings(), steps) == ENGINE_STEPS_HELD * 8192
    assert engine_tokens(ServeSettings(engine_tokens=0), steps) is None
    assert engine_tokens(ServeSettings(engine_tokens=5000), steps) == 5000
    assert engine_tokens(ServeSettings(), SimpleNamespace(tokens_per_submit=None)) is None
    with pytest.raises(UsageError, match="--engine-tokens -1: must be at least 0"):
        serve_settings_from(parse(["serve", "--model-path", str(tmp_path), "--engine-tokens", "-1"]))


def test_serve_refuses_a_port_in_use_before_loading_anything(tmp_path, capsys, monkeypatch):
    """A port taken is said at once (exit 2), before the model load (the plan, which reads the model, faked)."""
    from hidden_states.serve import model as serve_model
    from hidden_states.cli import main

    monkeypatch.setattr(serve_model.ServedModel, "plan", lambda self: setattr(self, "vocab_size", VOCAB) or [])
    monkeypatch.setattr(serve_model.ServedModel, "load", lambda self: pytest.fail("the model was loaded"))
    taken = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None)
    port = taken.server_address[1]
    try:
        code = main(["serve", "--model-path", str(tmp_path), "--port", str(port), "--states-dir", str(tmp_path / "s")])
    finally:
        taken.server_close()
    assert code == 2 and f"--port {port}: Address already in use" in capsys.readouterr().err


def test_an_engine_that_stops_stops_the_server(tmp_path):
    """The backend refusing batches (its engine loop gone): the request hears why (500), the server
    drains and returns None (``serve`` then fails with exit 1), not serving errors forever."""

    class Stopped(FakeBackend):
        def submit(self, batch):
            raise RuntimeError("the engine loop has stopped: EngineDeadError")

    gatherer = Gatherer(Stopped(), StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=4, window=0,
                        writer_threads=1)
    server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                          gatherer=gatherer)
    answered = []
    threading.Thread(target=lambda: answered.append(call(server, "POST", "/v1/completions", completion([1, 2]))),
                     daemon=True).start()
    lines = []
    assert serve_until_signal(server, gatherer, log=lines.append, drain_timeout=30) is None
    until(lambda: answered, "the request's reply")
    assert answered and answered[0][0] == 500 and "EngineDeadError" in answered[0][1]["error"]["message"]
    assert "the engine stopped (RuntimeError" in lines[0]


class Held(FakeBackend):
    """An engine that takes batches and never answers them (its process stopped, then killed)."""

    def submit(self, batch):
        with self.lock:
            self.batches.append(batch)
        return Future()


class DeadEngine:
    """``engine_exits`` for ``serve_until_signal``: none until ``dies()`` holds (the test's moment,
    whatever the host's speed), then the engine core killed by SIGKILL; ``at`` says when it was seen."""

    def __init__(self, dies, pid: int = 4321):
        self.dies, self.pid, self.at = dies, pid, None

    def __call__(self, wait=0.0):
        from hidden_states.processes import Exit

        deadline = time.monotonic() + wait
        while not self.dies() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.at is None and self.dies():
            self.at = time.monotonic()
        return [Exit("EngineCore", self.pid, -signal.SIGKILL)] if self.at is not None else []


def idle_server(tmp_path, backend):
    gatherer = Gatherer(backend, StateFiles(tmp_path, "model", 600), [0, 1, 2], batch_size=4, window=0,
                        writer_threads=1)
    server = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None,
                          gatherer=gatherer)
    return server, gatherer


def get(connection, path):
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def test_an_engine_process_dying_while_idle_turns_health_503_and_stops_the_server(tmp_path):
    """No request in flight: nothing asks the engine, so only the watch on its processes can notice;
    the server stops within moments, ``/health`` (on a connection kept alive) says why, and a request
    sent after the death is answered with that, not left waiting."""
    server, gatherer = idle_server(tmp_path, Held())
    address = server.server_address[:2]
    kept: list[http.client.HTTPConnection] = []
    healthy = threading.Event()  # the engine dies once a kept-alive connection has heard 200

    def connect():
        kept.append(http.client.HTTPConnection(*address, timeout=30))
        if get(kept[0], "/health")[0] == 200:
            healthy.set()

    threading.Thread(target=connect, daemon=True).start()
    lines = []
    death = DeadEngine(healthy.is_set)
    assert serve_until_signal(server, gatherer, log=lines.append, drain_timeout=60, engine_exits=death) is None
    assert time.monotonic() - death.at < 10  # (not the drain's 60 s)
    assert "vLLM's process EngineCore (pid 4321) was killed by SIGKILL" in server.engine_stopped
    status, reply = get(kept[0], "/health")
    assert status == 503 and "EngineCore (pid 4321) was killed by SIGKILL" in reply["error"]["message"]
    kept[0].request("POST", "/v1/completions", body=json.dumps(completion([1, 2])),
                    headers={"Content-Type": "application/json"})
    response = kept[0].getresponse()
    said = json.loads(response.read())["error"]["message"]
    assert response.status == 503 and "EngineCore (pid 4321) was killed by SIGKILL" in said
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection(*address, timeout=5).request("GET", "/health")
    assert any(line.startswith("error: vLLM's engine is gone: vLLM's process EngineCore (pid 4321)") for line in lines)


def test_requests_held_when_the_engine_dies_are_answered_with_its_death_at_once(tmp_path):
    """Requests in the engine and in the queue when its process dies: each gets a 500 naming the
    process within moments (the engine would never answer them)."""
    backend = Held()
    server, gatherer = idle_server(tmp_path, backend)
    answered = []

    def client(ids):
        answered.append(call(server, "POST", "/v1/completions", completion(ids)))

    for ids in ([1, 2], [3, 4, 5], [6]):
        threading.Thread(target=client, args=(ids,), daemon=True).start()
    death = DeadEngine(lambda: gatherer.held == 3 and backend.batches)  # all three taken, the engine given some
    assert serve_until_signal(server, gatherer, log=lambda line: None, drain_timeout=60, engine_exits=death) is None
    assert time.monotonic() - death.at < 10  # (not the drain's 60 s)
    until(lambda: len(answered) == 3, "the three replies")
    assert [status for status, _ in answered] == [500] * 3, answered
    assert all("EngineCore (pid 4321) was killed by SIGKILL" in reply["error"]["message"] for _, reply in answered)
    assert backend.batches  # they had reached the engine


def test_the_server_returns_only_once_the_replies_to_held_requests_are_written(tmp_path, monkeypatch):
    """A handler's thread is a daemon: ``serve`` ends the process once ``serve_until_signal`` returns,
    so a reply still being written then is cut, and the client hears a dropped connection instead of
    the 500 naming the dead engine. On a busy host the handler's thread runs late; here it is slowed."""
    from hidden_states.serve import http_server

    sent = []
    send = http_server.Handler._send

    def slow_send(self, status, reply, close=False):
        if self.command == "POST":
            time.sleep(0.5)
        send(self, status, reply, close)
        sent.append(status)

    monkeypatch.setattr(http_server.Handler, "_send", slow_send)
    backend = Held()
    server, gatherer = idle_server(tmp_path, backend)
    answered = []
    threading.Thread(target=lambda: answered.append(call(server, "POST", "/v1/completions", completion([1, 2]))),
                     daemon=True).start()
    death = DeadEngine(lambda: gatherer.held == 1 and backend.batches)
    assert serve_until_signal(server, gatherer, log=lambda line: None, drain_timeout=60, engine_exits=death) is None
    assert sent == [500]
    until(lambda: answered, "the request's reply")
    assert answered[0][0] == 500 and "EngineCore (pid 4321) was killed by SIGKILL" in answered[0][1]["error"]["message"]


def test_a_batch_vllm_fails_as_its_engine_dies_is_answered_naming_the_process(tmp_path):
    """vLLM's own client may fail the batch in the engine ("EngineDeadError") a moment before the
    watch sees the process end: the reply still names the process, not only vLLM's vague error."""

    class Dying(FakeBackend):
        failed_at: list[float] = []  # when vLLM's client failed the batch

        def engine_alive(self):
            return False

        def submit(self, batch):
            future = super().submit(batch)
            future.add_done_callback(lambda _: self.failed_at.append(time.monotonic()))
            return future

    backend = Dying(states=fake_layers, threaded=True, delay=0.2, fail="EngineDeadError: EngineCore encountered an issue")
    server, gatherer = idle_server(tmp_path, backend)
    answered = []
    threading.Thread(target=lambda: answered.append(call(server, "POST", "/v1/completions", completion([1, 2]))),
                     daemon=True).start()
    # the process is seen dead a moment after vLLM's client failed the batch
    death = DeadEngine(lambda: backend.failed_at and time.monotonic() >= backend.failed_at[0] + 0.3)
    assert serve_until_signal(server, gatherer, log=lambda line: None, drain_timeout=60, engine_exits=death) is None
    until(lambda: answered, "the request's reply")
    status, reply = answered[0]
    assert status == 500 and "vLLM's process EngineCore (pid 4321) was killed by SIGKILL" in reply["error"]["message"]


def test_a_second_signal_while_draining_kills_vllms_processes_and_stops_at_once(tmp_path):
    """The first SIGTERM drains, but a request the engine never answers would hold the drain for its
    whole timeout: a second SIGTERM kills vLLM's processes and ends ``serve_until_signal`` now."""
    from hidden_states.processes import Exit
    from hidden_states.serve import Aborted

    server, gatherer = idle_server(tmp_path, Held())
    killed, lines, second = [], [], []
    threading.Thread(target=lambda: call(server, "POST", "/v1/completions", completion([1])), daemon=True).start()

    def terminate_twice():
        until(lambda: gatherer.held == 1, "the request to be held")
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: any(line.startswith("SIGTERM: no new connections") for line in lines),
              "the first SIGTERM to start the drain")  # (two signals at once would be heard as one)
        second.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_twice, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)

    def kill_engine():  # the engine's death is visible to the watcher before the kill returns
        killed.append(1)
        time.sleep(0.5)
        return [4321]

    def engine_exits(wait=0.0):
        return [Exit("EngineCore", 4321, -signal.SIGKILL)] if killed else []

    with pytest.raises(Aborted) as aborted:
        serve_until_signal(server, gatherer, log=lines.append, drain_timeout=300, kill_engine=kill_engine,
                           engine_exits=engine_exits, watch_every=0.05)
    assert time.monotonic() - second[0] < 10 and killed == [1]  # (not the drain's 300 s)
    assert aborted.value.signum == signal.SIGTERM
    # the request held is counted as the signal found it, not answered as if the engine had died of itself
    assert str(aborted.value) == ("a second SIGTERM while draining: vLLM's processes killed (pids 4321), "
                                  "1 request(s) left unanswered")
    assert not [line for line in lines if line.startswith("error:")], lines
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_dead_engine_process_is_named_in_serves_last_error(tmp_path):
    """``serve``'s error when the engine is gone names the process as ``extract``'s does; without a
    dead process, what the backend said."""
    from hidden_states.processes import Exit, ProcessDied
    from hidden_states.serve import ServeFailed, engine_failure

    class Children:
        def __init__(self, exits):
            self.exits = exits

        def first_exits(self, wait=0.0):
            return self.exits

        def oom_kills(self):
            return 0

    died = engine_failure(Children([Exit("EngineCore", 77, -signal.SIGKILL)]), "vLLM's engine is gone")
    assert isinstance(died, ProcessDied)
    assert str(died).startswith("vLLM's process EngineCore (pid 77) was killed by SIGKILL: ")
    failed = engine_failure(Children([]), "the engine stopped (RuntimeError: cancelled)")
    assert isinstance(failed, ServeFailed) and str(failed) == "the engine stopped (RuntimeError: cancelled)"


def test_serve_takes_log_level_quiet_and_a_config_file(tmp_path):
    import logging

    from hidden_states import log_levels
    from hidden_states.cli import parse
    from hidden_states.cli.serve_command import serve_settings_from
    from hidden_states.errors import UsageError

    given = str(tmp_path)
    assert log_levels.level_of(parse(["serve", "--model-path", given])) == logging.INFO
    assert log_levels.level_of(parse(["serve", "--model-path", given, "--quiet"])) == logging.ERROR
    assert log_levels.level_of(parse(["serve", "--model-path", given, "--log-level", "warning"])) == logging.WARNING
    config = tmp_path / "serve.toml"
    config.write_text(f'model-path = "{given}"\nport = 9001\nbatch-size = 16\nlayer-ids = [1, 3]\nquiet = true\n')
    args = parse(["serve", "--config", str(config), "--batch-size", "4"])  # the command line over the file
    settings, options = serve_settings_from(args)
    assert (options.port, settings.batch_size, settings.layer_ids) == (9001, 4, [1, 3])
    assert log_levels.level_of(args) == logging.ERROR
    config.write_text("output-dir = 'x'\n")  # extract's flag, not serve's
    with pytest.raises(UsageError, match=rf"{config}: 'output-dir' is not a setting"):
        parse(["serve", "--config", str(config)])


def test_serve_shows_its_plan_before_the_load_and_quiet_keeps_errors_only(tmp_path, capfd, monkeypatch):
    """The plan is said before anything loads; at --quiet only the error (a port in use, from the
    config file) and nothing of the plan."""
    import sys

    from hidden_states.serve import model as serve_model
    from hidden_states.cli import main

    # the run's lines go through fd 2, as a terminal's would (pytest's own sys.stderr would bypass the filter)
    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))
    monkeypatch.setattr(serve_model.ServedModel, "plan",
                        lambda self: setattr(self, "vocab_size", VOCAB) or ["layers: [1, 3] (planned)"])
    monkeypatch.setattr(serve_model.ServedModel, "load", lambda self: pytest.fail("the model was loaded"))
    taken = StatesServer(("127.0.0.1", 0), model_id=MODEL, vocab_size=VOCAB, max_seq_len=64, log=lambda line: None)
    port = taken.server_address[1]
    config = tmp_path / "serve.toml"
    config.write_text(f'port = {port}\nstates-dir = "{tmp_path / "s"}"\n')
    try:
        code = main(["serve", "--model-path", str(tmp_path), "--config", str(config)])
        shown = capfd.readouterr().err
        assert code == 2 and "[hidden-states] layers: [1, 3] (planned)" in shown, shown
        assert f"--port {port}: Address already in use" in shown
        code = main(["serve", "--model-path", str(tmp_path), "--config", str(config), "--quiet"])
        shown = capfd.readouterr().err
    finally:
        taken.server_close()
    assert code == 2 and f"--port {port}: Address already in use" in shown and "planned" not in shown, shown
