"""``hidden-states serve`` on CPU vLLM with speculators 0.9.0's real client and trainer.

One server (the tiny Llama, speculators-0.5 layer ids 1 3 4 6, in this venv) answers:
``speculators generate-offline-data --validate-outputs`` run twice at once (two jobs), whose files
must hold HF's states (the harness's comparison) and ``extract``'s for the same rows; speculators
0.9.0's trainer generating its samples on line (``--on-missing generate``) for a few steps; a wrong
request, as the client reports it; and last, a SIGTERM mid-job (the server drains, exits 0, leaves no
process) and a new server on the same port, the client's own retries carrying the job through.

Engine starts: the server, ``extract`` once, the restarted server. speculators 0.9.0 needs Python
>= 3.11 and transformers >= 5: marked ``formats``, run on vLLM 0.32.0 only (scripts/test_matrix.py).

``VLLM_COMPAT_SERVER_PYTHON``: the Python of another vLLM release's environment, where the server runs
(with this checkout alone on its path) while the client, the trainer and HF's reference stay here:
the compatibility runs of docs/guides/serve.md (``-k two_offline_jobs``).
"""
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hidden_states.certify.certificate import NAMES, PREFIX
from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.extract_runs import run_cli
from tests.e2e.trainers import run_trainer, speculators_09

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.formats]

IDS_05 = [1, 3, 4, 6]  # harness.LAYER_IDS (0 2 3 5), counted as layers done
API_KEY = "e2e-serve-key"  # the server's (VLLM_API_KEY); the clients carry it in the URL (docs/guides/serve.md)
KEYED = {"Authorization": f"Bearer {API_KEY}"}  # what a client of our own sends
START_TIMEOUT = 600
PREPARED = Path(__file__).with_name("prepared_driver.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SERVER_PYTHON = os.environ.get("VLLM_COMPAT_SERVER_PYTHON")


def server_env() -> dict:
    """speculators 0.9.0's folder (it has no in-process capture: the extractor's own runs, as for extract
    below, which needs its ``datasets``), then this checkout; another release's server: this checkout
    alone (speculators 0.9.0's folder would bring it this environment's versions)."""
    path = [ROOT] if SERVER_PYTHON else [str(speculators_09()), ROOT]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_API_KEY": API_KEY}


def client_env() -> dict:
    """speculators 0.9.0's folder; its log (rich) as wide as its lines."""
    return {**os.environ, "PYTHONPATH": str(speculators_09()), "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}


class Server:
    """``hidden-states serve`` in a subprocess, its output in a log file; it asks for ``API_KEY``, and
    serves the model under its path, the trainer's ``--verifier-name-or-path``."""

    def __init__(self, model: Path, states: Path, port: int, log: Path):
        self.port, self.log = port, log
        self.plain_url = f"http://127.0.0.1:{port}/v1"
        self.url = f"http://hs:{API_KEY}@127.0.0.1:{port}/v1"  # what speculators 0.9's client is given
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [SERVER_PYTHON or sys.executable, "-m", "hidden_states", "serve", "--model-path", str(model), "--layer-ids",
                 *map(str, IDS_05), "--preset", "cpu-tiny", "--port", str(port), "--states-dir", str(states),
                 "--served-model-name", str(model)],
                env=server_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.output()[-6000:]}")
            try:
                models = urllib.request.Request(f"{self.plain_url}/models",
                                                headers=KEYED)
                with urllib.request.urlopen(models, timeout=5) as reply:
                    self.models = json.load(reply)
                return
            except OSError:
                time.sleep(1)
        self.proc.kill()
        raise AssertionError(f"the server did not answer within {START_TIMEOUT} s:\n{self.output()[-6000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> set[int]:
        found, todo = set(), [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    children = {int(c) for c in (task / "children").read_text().split()}
                except OSError:
                    continue
                todo += children - found
                found |= children
        return found

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def rows(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(16, 200))] for _ in range(count)]


def prepared(root: Path, name: str, ids: list[list[int]]) -> Path:
    """A speculators 0.9 prepared dataset (``input_ids``, ``loss_mask``, ``seq_len``, torch format), as its
    ``prepare-data`` leaves it; written with the client's own ``datasets``."""
    (root / f"{name}.json").write_text(json.dumps(ids))
    subprocess.run([sys.executable, str(PREPARED), str(root / f"{name}.json"), str(root / name)], check=True,
                   env=client_env(), capture_output=True, timeout=300)
    return root / name


def generate(url: str, data: Path, out: Path, *extra: str) -> subprocess.Popen:
    """speculators 0.9.0's ``generate-offline-data`` against ``url``, failing on any sample's error."""
    return subprocess.Popen([sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint", url,
                             "--preprocessed-data", str(data), "--output", str(out), "--validate-outputs",
                             "--fail-on-error", "--concurrency", "4", *extra],
                            env=client_env(), cwd=data.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finished(proc: subprocess.Popen, timeout: float = 900) -> str:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-6000:]
    return output


def load(out: Path, index: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / f"hs_{index}.safetensors"))


def judged(model: Path, out: Path, ids: list[list[int]]) -> str:
    """The harness's verdict on the job's files against HF (every token, every layer)."""
    got = []
    for i, row in enumerate(ids):
        saved = load(out, i)
        assert saved["token_ids"].tolist() == row
        got.append({"input_ids": row, "hidden_states": [saved["hidden_states"][:, j] for j in range(len(IDS_05))]})
    run = harness.Run(calls=[got], report=None, error=None, log="")
    return harness.judge(run, [ids], harness.reference(model, [ids]))


@pytest.fixture(scope="module")
def setup(model, tmp_path_factory):
    """The server, the states folder, two jobs' datasets; the server is stopped at the end whatever happened."""
    root = tmp_path_factory.mktemp("serve")
    jobs = {"a": rows(10, seed=31), "b": rows(10, seed=32)}
    data = {name: prepared(root, name, ids) for name, ids in jobs.items()}
    held = {"server": Server(model, root / "states", free_port(), root / "server.log")}
    yield root, jobs, data, held
    held["server"].stop()


def test_two_offline_jobs_at_once_get_hfs_states(model, setup):
    root, jobs, data, held = setup
    server = held["server"]
    assert server.models["data"][0]["id"] == str(model)
    running = {name: generate(server.url, data[name], root / f"out-{name}") for name in jobs}
    for name, proc in running.items():
        finished(proc)
        assert judged(model, root / f"out-{name}", jobs[name]) == "ok", name
        saved = load(root / f"out-{name}", 0)
        # the states, the ids, and the row's certificate (which the client moved along and its readers skip)
        assert set(saved) == {"hidden_states", "token_ids", *(PREFIX + name for name in NAMES)}, set(saved)
        assert saved["hidden_states"].shape[1:] == (4, 128)
    assert list((root / "states").iterdir()) == []  # every file was moved by its client
    if SERVER_PYTHON:  # a compatibility run: the files came from that environment's vLLM
        release = subprocess.run([SERVER_PYTHON, "-c", "import vllm; print(vllm.__version__.split('+')[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        assert f"audit: vLLM {release}, " in server.output(), server.output()[-3000:]


def test_the_files_equal_extracts_for_the_same_rows(model, setup):
    """``extract --backend vllm-engine`` on job a's rows: the same tensors the server wrote."""
    import torch

    root, jobs, _, _ = setup
    lines = "".join(json.dumps({"input_ids": ids}) + "\n" for ids in jobs["a"])
    (root / "a.jsonl").write_text(lines)
    proc = run_cli("--model-path", str(model), "--prepared-data", str(root / "a.jsonl"), "--output-dir",
                   str(root / "extracted"), "--preset", "cpu-tiny", "--format", "speculators-0.5", "--layer-ids",
                   *map(str, IDS_05), "--backend", "vllm-engine", env_extra={"PYTHONPATH": server_env()["PYTHONPATH"]})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for i in range(len(jobs["a"])):
        served = load(root / "out-a", i)
        extracted = load(root / "extracted" / "hidden_states", i)
        assert torch.equal(served["token_ids"], extracted["token_ids"])
        assert torch.equal(served["hidden_states"], extracted["hidden_states"]), f"row {i}"


def test_speculators_09s_trainer_generates_on_line_through_the_server(model, setup, tmp_path):
    root, _, data, held = setup
    losses = run_trainer(sys.executable, speculators_09(), ["--speculator-type", "eagle3",
        "--verifier-name-or-path", str(model), "--data-path", str(data["b"]),
        "--target-layer-ids", *map(str, IDS_05[:-1]), "--num-layers", "1", "--total-seq-len", "512",
        "--epochs", "3", "--save-path", str(tmp_path / "checkpoints"), "--num-workers", "0",
        "--on-missing", "generate", "--vllm-endpoint", held["server"].url, "--lr", "3e-3", "--log-freq", "1",
        "--logger", "", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--scheduler-type", "none"],
        tmp_path)
    assert len(losses) >= 3 and all(loss == loss and loss > 0 for loss in losses), losses
    assert not (data["b"] / "hidden_states").exists()  # nothing cached: every sample came from the server
    assert list((root / "states").iterdir()) == []  # the trainer loaded and deleted each file


def test_a_wrong_request_is_reported_by_the_client_as_the_server_says(setup):
    _, _, _, held = setup
    script = ("import sys, openai\n"
              "from speculators.data_generation.vllm_client import generate_hidden_states\n"
              "client = openai.OpenAI(base_url=sys.argv[1], api_key='EMPTY', max_retries=0)\n"
              "model = client.models.list().data[0].id\n"
              "try:\n"
              "    generate_hidden_states(client, model, {'input_ids': [5] * 5000}, max_retries=0)\n"
              "except Exception as exc:\n"
              "    print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", script, held["server"].url], capture_output=True, text=True,
                          env=client_env(), timeout=120)
    assert "BadRequestError" in proc.stdout and "5000 tokens, more than the server's --max-seq-len 1024" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]
    unkeyed = ("import sys, openai\n"
               "for url in sys.argv[1:]:\n"
               "    try:\n"
               "        openai.OpenAI(base_url=url, api_key='EMPTY', max_retries=0).models.list()\n"
               "    except Exception as exc:\n"
               "        print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", unkeyed, held["server"].plain_url,  # no key, a wrong one
                           held["server"].url.replace(API_KEY, "wrong")], capture_output=True, text=True,
                          env=client_env(), timeout=120)
    refusals = [line for line in proc.stdout.splitlines() if line.startswith("AuthenticationError")]
    assert len(refusals) == 2 and all("asks for an API key" in line for line in refusals), proc.stdout + proc.stderr


def test_a_server_restart_mid_job_is_carried_through_by_the_clients_retries(model, setup):
    """SIGTERM while a job runs: the server answers what it took, exits 0 and leaves no process; a new
    server on the same port loads, and the client's retries (backing off 2, 4, 8, ... s) finish the job."""
    root, _, _, held = setup
    ids = rows(40, seed=33)
    data = prepared(root, "c", ids)
    out = root / "out-c"
    client = generate(held["server"].url, data, out, "--max-retries", "7")
    while len(list(out.glob("hs_*.safetensors"))) < 3:
        assert client.poll() is None, client.communicate()[0][-4000:]
        time.sleep(0.2)
    old = held["server"]
    children = old.descendants()
    assert children, "vLLM's engine runs in a child process"
    assert old.stop() == 0, old.output()[-4000:]
    assert "SIGTERM: no new connections; answering the requests taken" in old.output()
    deadline = time.monotonic() + 30  # vLLM's processes end with the server (contained: they die with it anyway)
    while [pid for pid in children if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == [], "processes left by the server"
    held["server"] = Server(model, root / "states", old.port, root / "server-restarted.log")
    output = finished(client)
    assert "Retrying" in output  # the client did meet the restart
    assert judged(model, out, ids) == "ok"


def engine_core(server: Server) -> int:
    """vLLM's engine-core process under the server (vLLM titles it ``VLLM::EngineCore``)."""
    cores = [pid for pid in server.descendants()
             if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]
    assert len(cores) == 1, {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in server.descendants()}
    return cores[0]


def request_held(server: Server, core: int, ids: list[int]) -> tuple[list, http.client.HTTPConnection]:
    """A completion sent while the engine core is stopped (SIGSTOP), on a thread; returns once the
    server has handed it to the engine (``/stats``), with the list its reply (or error) lands in and a
    kept-alive connection for more calls."""
    watch = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    watch.request("GET", "/stats", headers=KEYED)
    rows = json.load(watch.getresponse())["rows"]
    os.kill(core, signal.SIGSTOP)
    replies: list = []

    def send():
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            connection.request("POST", "/v1/completions", body=json.dumps({"model": server.models["data"][0]["id"],
                               "prompt": ids, "max_tokens": 1}), headers={**KEYED, "Content-Type": "application/json"})
            reply = connection.getresponse()
            replies.append((reply.status, json.loads(reply.read())))
        except OSError as exc:
            replies.append(exc)

    threading.Thread(target=send, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:
        watch.request("GET", "/stats", headers=KEYED)
        if json.load(watch.getresponse())["rows"] > rows:
            return replies, watch
        assert time.monotonic() < deadline, "the request did not reach the engine"
        time.sleep(0.05)


def last_line(server: Server) -> str:
    """The server's last line (multiprocessing's resource tracker, a process of its own, may warn after it)."""
    lines = server.output().splitlines()
    tracker = [i for i, line in enumerate(lines) if "resource_tracker" in line]
    return [line for line in lines[:tracker[0] if tracker else None] if line.strip()][-1]


def test_a_dead_engine_answers_what_it_held_turns_health_503_and_stops_naming_the_process(setup):
    """vLLM's engine core killed (SIGKILL) with a request in it: the request is answered with an error
    naming the process, ``/health`` answers 503, and the server exits 1 within seconds, its last line
    naming the process and the signal as ``extract``'s does. (Before: the request waited 900 s,
    ``/health`` said 200, and the server exited 19 minutes later.)"""
    _, _, _, held = setup
    server = held["server"]
    core = engine_core(server)
    replies, kept = request_held(server, core, rows(1, seed=34)[0])
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    health = []
    while not health or health[-1] == 200:
        try:
            kept.request("GET", "/health")
            answer = kept.getresponse()
            answer.read()
            health.append(answer.status)
        except OSError as exc:
            health.append(type(exc).__name__)
        assert time.monotonic() - killed < 20, health
        time.sleep(0.02)
    assert health[-1] == 503, health
    code = server.proc.wait(timeout=60)
    seconds = time.monotonic() - killed
    assert code == 1 and seconds < 30, (code, seconds, server.output()[-4000:])
    while not replies:  # written before the server ended; the client's thread may read it later
        assert time.monotonic() - killed < 60, server.output()[-4000:]
        time.sleep(0.05)
    assert isinstance(replies[0], tuple), (replies, server.output()[-4000:])
    status, reply = replies[0]
    assert status == 500 and f"vLLM's process EngineCore (pid {core}) was killed by SIGKILL" in reply["error"]["message"], \
        (status, reply)
    assert last_line(server).startswith(f"hidden-states: failed: ProcessDied: vLLM's process EngineCore (pid {core}) "
                                        f"was killed by SIGKILL"), server.output()[-4000:]


def test_a_second_sigterm_while_draining_stops_at_once_and_kills_vllms_processes(model, tmp_path):
    """The first SIGTERM drains; with a request the engine will not answer (its process stopped), the
    drain would wait 900 s: a second SIGTERM kills vLLM's processes and the server exits 143 at once,
    saying so. (Before: the second SIGTERM was ignored.)"""
    server = Server(model, tmp_path / "states", free_port(), tmp_path / "server.log")
    try:
        core = engine_core(server)
        children = server.descendants()
        request_held(server, core, rows(1, seed=35)[0])
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "SIGTERM: no new connections" not in server.output():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.output()[-4000:]
            time.sleep(0.1)
        time.sleep(1)
        assert server.proc.poll() is None, server.output()[-4000:]  # draining: the request is held
        server.proc.send_signal(signal.SIGTERM)
        second = time.monotonic()
        while "hidden-states: aborted:" not in server.output():  # said at once, vLLM's processes killed
            assert time.monotonic() - second < 15, server.output()[-4000:]
            time.sleep(0.1)
        code = server.proc.wait(timeout=90)
        assert code == 143, (code, server.output()[-4000:])
        assert last_line(server).startswith(f"hidden-states: aborted: a second SIGTERM while draining: vLLM's "
                                            f"processes killed (pids {core}), 1 request(s) left unanswered"), \
            server.output()[-4000:]
        deadline = time.monotonic() + 10
        while [pid for pid in children if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == [], "processes left by the server"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        for pid in server.descendants():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
