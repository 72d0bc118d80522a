"""``--backend vllm-engine --pp-size 2`` on vLLM's CPU backend (its multiprocessing executor, one host):
each stage's worker captures the layers its stage runs into the same regions, and the rows written are
HF's, token by token, layer by layer, as at one stage. The stages' layers are vLLM's split (6 layers:
[3, 3]) or ``VLLM_PP_LAYER_PARTITION``'s; the layers asked for straddle the stages (a stage's last and
the next one's first), include the last layer (the certificates read it), and in one run leave the
first stage with none to capture; in one run (uneven) both stages send their rows through the parent's region
sink (``VLLM_COMPAT_REGION_SINK=always``), as stages on other hosts do. One core per stage
(``VLLM_CPU_OMP_THREADS_BIND``). A stage's worker killed mid-run is named with its stage, and
the rerun resumes. The even split runs at ``--tp-size 2`` too (four ranks: two per stage, each
stage's first tensor-parallel rank capturing, one core list per rank: "0|1|0|1").

Where: the dense Llama on vllm-cpu 0.17.0 (marker ``pipeline``), whose CPU backend runs vLLM's stages as
they are; ``hidden-states generate`` over two stages on vllm-cpu 0.26.0 (marker ``generate``: that
release's lane, where vLLM's stages run as they are too); ``hidden-states serve --pp-size 2`` on
vllm-cpu 0.32.0 (no marker but ``extractor``: that release's suite); the DeepSeek family (MLA, routed
experts; vLLM's CPU backend runs it from 0.29) on vllm-cpu 0.32.0 with the certificates (marker
``certificates``). On 0.32.0 vLLM's stages need the shim's ``cpu_pp_intermediate_buffers``."""
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time

import pytest

from tests.e2e import harness
from tests.e2e.extract_runs import (cli, data_files, extract_args, failure_line, run_cli, shared_core_binding,
                                    write_jsonl)
from tests.e2e.process_tree import cmdline, descendants
from tests.e2e.generate_runs import CONVERSATIONS, conversations_file, judge_rows, marker_model, regenerated, run_generate

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor]

ROWS = 12
STAGES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def write_rows(path) -> list[list[int]]:
    """Uneven rows, four of them (one batch) sharing a 300-token prefix: vLLM's prefix cache gives
    three of them their first blocks, whose rows are copied from the first one's region."""
    rng = random.Random(31)
    shared = [rng.randrange(4, 512) for _ in range(300)]
    rows = [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 400))] for _ in range(4)]
    rows += [shared + [rng.randrange(4, 512) for _ in range(rng.randrange(20, 80))] for _ in range(4)]
    rows += [[rng.randrange(4, 512) for _ in range(rng.randrange(20, 400))] for _ in range(ROWS - len(rows))]
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
    return rows


@pytest.fixture(scope="module")
def model():
    return harness.tiny_model("llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "data.jsonl"
    return path, write_rows(path)


@pytest.fixture(scope="module")
def hf(model):
    from hidden_states.fixtures.reference import load_model

    return load_model(model)


def pipeline_run(model, data, out, layers: list[int], partition: str | None = None, env_extra=None, tp: int = 1):
    """Two stages of ``tp`` ranks each, one core list per rank (vLLM's CPU worker takes the list's entry
    at its rank)."""
    args = extract_args(model, data, out, "--backend", "vllm-engine", "--pp-size", "2", "--tp-size", str(tp))
    at = args.index("--layer-ids")
    args[at + 1:at + 5] = [str(layer) for layer in layers]
    env = {"VLLM_CPU_OMP_THREADS_BIND": shared_core_binding(2 * tp),
           **({"VLLM_PP_LAYER_PARTITION": partition} if partition else {}), **(env_extra or {})}
    proc = run_cli(*args, env_extra=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def assert_prefix_cache_served_rows(stderr: str) -> None:
    """vLLM's prefix cache gave some rows their first blocks (the summary line counts them)."""
    cached = re.search(r"; ([\d,]+) from vLLM's prefix cache\)", stderr)
    assert cached and int(cached.group(1).replace(",", "")) > 0, stderr[-2000:]


def assert_rows_are_hfs(hf, rows, out, layers: list[int], routed=frozenset()) -> None:
    """Every row's every token at every layer within harness.TOLERANCE of HF's, and each layer's mean
    error within harness.MEAN_TOLERANCE; at a routed layer (``routed``) a share of the tokens may be
    over (harness.ROUTED_TOKEN_SHARE: near-ties between experts), and the mean is held to
    harness.ROUTED_MEAN_TOLERANCE."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, relative_errors

    assert sorted(data_files(out)) == list(range(len(rows)))
    reference = decoder_layer_outputs(hf, rows, layers)
    pooled: dict[int, list] = {layer: [] for layer in layers}
    for i, ids in enumerate(rows):
        saved = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == ids
        for layer, got, want in zip(layers, saved["hidden_states"], reference[i], strict=True):
            errors = relative_errors(got, want)
            pooled[layer].append(errors)
            if layer not in routed:
                assert float(errors.max()) < harness.TOLERANCE, (i, layer, float(errors.max()))
                assert float(errors.mean()) < harness.MEAN_TOLERANCE, (i, layer, float(errors.mean()))
    for layer in routed & set(layers):
        every = torch.cat(pooled[layer])
        over = float((every > harness.TOLERANCE).float().mean())
        assert over <= harness.ROUTED_TOKEN_SHARE, (layer, over)
        assert float(every.mean()) < harness.ROUTED_MEAN_TOLERANCE, (layer, float(every.mean()))


def verified(out, rows) -> None:
    """``hidden-states verify`` passes on every row of ``out``."""
    command, env = cli()
    checked = subprocess.run([*command[:-1], "verify", str(out)], env=env, capture_output=True, text=True,
                             timeout=300)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stderr.strip().splitlines()[-1] == (f"[hidden-states] verify: ok: {len(rows)} certified rows hold "
                                                      f"the engine's states")


@pytest.mark.pipeline
def test_two_stages_of_two_tensor_parallel_ranks_write_hfs_rows_across_the_stage_boundary_certified(
        model, data, hf, tmp_path):
    """--tp-size 2 --pp-size 2 (four ranks), [3, 3]: layers 0 and 2 from stage 0 (2 its last), 3 and 5
    from stage 1 (3 its first, 5 the model's last, which the certificates check against the engine's
    logprobs), each stage's rows from its first tensor-parallel rank (its hidden states are whole on
    every rank). Two stages of one rank each, the same split and layers: the killed-stage test below."""
    path, rows = data
    proc = pipeline_run(model, path, tmp_path / "out", [0, 2, 3, 5], tp=2)
    assert "4 ranks" in proc.stderr and "--tp-size 2 --pp-size 2" in proc.stderr, proc.stderr[-3000:]
    assert "certificates: on: every row is checked against the engine's logprobs" in proc.stderr
    assert json.loads((tmp_path / "out" / "data_config.json").read_text())["capture"] == "own"
    assert_prefix_cache_served_rows(proc.stderr)
    assert_rows_are_hfs(hf, rows, tmp_path / "out", [0, 2, 3, 5])
    verified(tmp_path / "out", rows)


@pytest.mark.pipeline
@pytest.mark.parametrize("partition, layers, sink", [("4,2", [3, 4, 5], True), ("1,5", [2, 3, 5], False)],
                         ids=["uneven-4-2-through-the-region-sink", "first-stage-captures-nothing"])
def test_uneven_stages_write_hfs_rows(model, data, hf, tmp_path, partition, layers, sink):
    """VLLM_PP_LAYER_PARTITION=4,2: stage 0 captures layer 3 alone, and both stages send their rows
    over TCP to the parent's region sink (``VLLM_COMPAT_REGION_SINK=always``), as stages on other hosts
    do (vLLM's Ray executor, which vllm-cpu refuses: GPUs), instead of mapping the pool: the rows are
    HF's and certified all the same, prefix-cached rows included. 1,5: stage 0 captures none of them."""
    path, rows = data
    proc = pipeline_run(model, path, tmp_path / "out", layers, partition,
                        env_extra={"VLLM_COMPAT_REGION_SINK": "always"} if sink else None)
    assert_prefix_cache_served_rows(proc.stderr)
    if sink:
        config = json.loads((tmp_path / "out" / "data_config.json").read_text())
        address = (config.get("region_sink") or {}).get("address", "")
        assert address.startswith("127.0.0.1:") and config["region_sink"]["stages"] == [0, 1], proc.stderr[-2000:]
        assert "certificates: on: every row is checked against the engine's logprobs" in proc.stderr
    assert_rows_are_hfs(hf, rows, tmp_path / "out", layers)
    if sink:
        verified(tmp_path / "out", rows)


@pytest.mark.pipeline
def test_what_cannot_run_with_stages_is_refused_before_the_load(model, data, tmp_path):
    path, _ = data
    proc = run_cli(*extract_args(model, path, tmp_path / "out", "--backend", "vllm-engine", "--pp-size", "2",
                                 "--cuda-graphs"), env_extra=STAGES)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--cuda-graphs: not with --pp-size 2" in proc.stderr
    # four ranks, two core lists: vLLM 0.17's worker would index past them at its start
    proc = run_cli(*extract_args(model, path, tmp_path / "out", "--backend", "vllm-engine", "--pp-size", "2",
                                 "--tp-size", "2"), env_extra=STAGES)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("VLLM_CPU_OMP_THREADS_BIND='0|1': 2 core lists for 4 ranks (--tp-size 2 x --pp-size 2)"
            in proc.stderr.strip().splitlines()[-1]), proc.stderr[-3000:]
    assert "starting the vllm-engine backend" not in proc.stderr and not data_files(tmp_path / "out")


@pytest.mark.certificates
def test_deepseek_stages_write_hfs_rows_certified(data, tmp_path):
    """MLA and routed experts over two stages, VLLM_PP_LAYER_PARTITION=2,4: layers 0 (dense) and 1 (the
    first routed) from stage 0 (1 its last), 2 (stage 1's first) and 5 (the last: certificates). Every
    layer past the first is routed (first_k_dense_replace=1), judged as harness.ROUTED_LAYERS says."""
    from hidden_states.fixtures.reference import load_model

    if not harness.family_runs_here("deepseek"):
        pytest.skip("vLLM's CPU backend runs MLA from vllm-cpu 0.29.0")
    path, rows = data
    model = harness.tiny_model("deepseek")
    proc = pipeline_run(model, path, tmp_path / "out", [0, 1, 2, 5], "2,4")
    assert "certificates: on: every row is checked against the engine's logprobs" in proc.stderr
    assert_rows_are_hfs(load_model(model), rows, tmp_path / "out", [0, 1, 2, 5],
                        routed=frozenset({1, 2, 5}))
    verified(tmp_path / "out", rows)


@pytest.mark.generate
def test_generate_over_two_stages_writes_hfs_reply_and_training_rows_certified(tmp_path):
    """``hidden-states generate --pp-size 2``, [3, 3]: each stage stores its layers of every reply's
    prompt and decode rows (0 and 2 on stage 0, 3 and 5 on stage 1) into the reply's region with
    counters of its own; a training row is then prefilled under its reply's salt, in the reply's
    region (the stages' second pair of counters: the marker model renders a reply back as its ids) or
    in one of its own (the reply's rows copied, every stage's ids with them). Every row is HF's, token
    by token, layer by layer, the decode-time rows among them, certified and verified."""
    from hidden_states.inputs.conversations import MESSAGES, Record
    from hidden_states.inputs.tokenization import ChatTokenizer, common_prefix, load_tokenizer

    model = marker_model(tmp_path)
    out = tmp_path / "out"
    proc = run_generate(model, conversations_file(tmp_path, CONVERSATIONS), out, "--pp-size", "2", env_extra=STAGES)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "captured 0 2 on stage 0, 3 5 on stage 1" in proc.stderr, proc.stderr[-3000:]
    assert f"certificates: {len(CONVERSATIONS)} rows certified" in proc.stderr, proc.stderr[-3000:]
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.3", 1024)
    in_place = 0
    for line in regenerated(out):
        replied = chat.prompt_ids(line["messages"][:-1]) + line["generated"][-1]["token_ids"]
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0].input_ids
        in_place += common_prefix(row, replied) == len(replied)
    said = re.search(r"(\d+) prefilled in their reply's region", proc.stderr)
    assert in_place and said and int(said.group(1)) == in_place, proc.stderr[-3000:]
    assert in_place < len(CONVERSATIONS)  # and rows in regions of their own
    judge_rows(model, out, proc.stderr)
    verified(out, CONVERSATIONS)


def test_serve_over_two_stages_answers_with_hfs_states_certified(model, tmp_path):
    """``hidden-states serve --pp-size 2`` (speculators 0.9's ids 1 3 4 6: layers 0 and 2 from stage 0,
    3 and 5 from stage 1) on vllm-cpu 0.32.0, with the shim's cpu_pp_intermediate_buffers: a few
    completions at once, each file's states HF's, its certificate among them; SIGTERM stops it, exit 0."""
    import http.client
    import os
    import signal
    import socket
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from hidden_states.certify.certificate import NAMES, PREFIX
    from tests.conftest import ROOT

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **STAGES}
    with open(log, "wb") as sink:
        server = subprocess.Popen([sys.executable, "-m", "hidden_states", "serve", "--model-path", str(model),
                                   "--layer-ids", "1", "3", "4", "6", "--preset", "cpu-tiny", "--pp-size", "2",
                                   "--port", str(port), "--states-dir", str(tmp_path / "states")],
                                  env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        connection.request(method, path, body=json.dumps(body) if body else None,
                           headers={"Content-Type": "application/json"} if body else {})
        response = connection.getresponse()
        reply = json.loads(response.read() or b"{}")
        connection.close()
        return response.status, reply

    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if call("GET", "/v1/models")[0] == 200:
                    break
            except OSError:
                time.sleep(1)
        assert "captured 0 2 on stage 0, 3 5 on stage 1" in log.read_text(), log.read_text()[-3000:]
        rng = random.Random(41)
        ids = [[rng.randrange(4, 512) for _ in range(rng.randrange(16, 200))] for _ in range(6)]
        with ThreadPoolExecutor(len(ids)) as pool:
            replies = list(pool.map(lambda row: call("POST", "/v1/completions", {
                "model": model.name, "prompt": row, "max_tokens": 1, "return_token_ids": True}), ids))
        got = []
        for row, (status, reply) in zip(ids, replies):
            assert status == 200, reply
            saved = load_file(reply["kv_transfer_params"]["hidden_states_path"])
            assert set(saved) == {"hidden_states", "token_ids", *(PREFIX + name for name in NAMES)}, set(saved)
            assert saved["token_ids"].tolist() == row
            got.append({"input_ids": row, "hidden_states": [saved["hidden_states"][:, j] for j in range(4)]})
        run = harness.Run(calls=[got], report=None, error=None, log="")
        assert harness.judge(run, [ids], harness.reference(model, [ids])) == "ok"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        returned = server.wait(timeout=120)
    assert returned == 0, log.read_text()[-3000:]


def _stage_frozen_mid_run(model, root, count: int):
    """An extraction of ``count`` rows at --pp-size 2 whose stage 1 worker (``VLLM::Worker_PP1``, found
    as soon as vLLM titles it) is frozen (SIGSTOP) once 4 files are written, and then given 2 s to write
    what it computed or end without it: (rows, out, args, the run's process, the worker's pid)."""
    root.mkdir(parents=True)
    rows = [row["input_ids"] for row in write_jsonl(root / "data.jsonl", count, seed=6)]
    out = root / "out"
    args = extract_args(model, root / "data.jsonl", out, "--backend", "vllm-engine", "--pp-size", "2",
                        "--batch-size", "4")
    command, env = cli(*args, env_extra=STAGES)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    stage: list[int] = []
    while not stage or (len(data_files(out)) < 4 if out.exists() else True):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        if not stage:  # vLLM titles each stage's worker process (setproctitle) once it runs
            stage = [pid for pid in descendants(proc.pid) if cmdline(pid).startswith(b"VLLM::Worker_PP1")]
            assert len(stage) <= 1, {pid: cmdline(pid)[:80] for pid in descendants(proc.pid)}
        time.sleep(0.005)
    os.kill(stage[0], signal.SIGSTOP)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=2)
    return rows, out, args, proc, stage[0]


@pytest.mark.pipeline
def test_a_stage_killed_mid_run_is_named_and_the_rerun_resumes_with_hfs_rows(model, hf, tmp_path):
    """SIGKILL to stage 1's worker (``VLLM::Worker_PP1``) once a few files are written: the run stops,
    exit 1, in one line naming the stage and its process, and the samples left unwritten; every file
    it kept is whole, and the same command resumes and writes the rest, HF's rows."""
    import torch

    for attempt, count in enumerate((300, 600, 1200)):
        # the run must still need stage 1 when its worker dies: a run that ends without it tests nothing
        # (its files outrun by the engine, a fast run's last forward done before the kill), so the
        # worker is frozen first, and the scenario runs again on more rows where the run ends frozen
        rows, out, args, proc, stage = _stage_frozen_mid_run(model, tmp_path / f"attempt-{attempt}", count)
        if proc.poll() is None and len(data_files(out)) < count:
            break
        os.kill(stage, signal.SIGKILL)
        proc.communicate(timeout=300)
    else:
        pytest.fail("each attempt's run ended with stage 1 frozen: no run needed the stage when it died")
    os.kill(stage, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    stage = [stage]
    failed = failure_line(err)
    assert re.search(r"vLLM's process EngineCore_DP0 \(pid \d+\) exited with code 1", failed), failed
    assert (f"the first of its workers to end was pipeline stage 1's (VLLM::Worker_PP1, pid {stage[0]}): that stage "
            f"died first") in failed, failed
    assert "rerun the same command to resume" in failed, failed
    # the samples the run was waiting for when the stage died are named in the same line, the rest counted
    stopped_on = re.search(r"extracting samples (.+?) failed: ", failed)
    assert stopped_on, failed
    named = {int(index) for index in re.findall(r"(\d+) \(line \d+\)", stopped_on.group(1))}
    assert re.search(r"\[hidden-states\] stopped: .* samples not extracted", err), err[-3000:]
    survived = data_files(out)
    assert 4 <= len(survived) < len(rows)
    assert named and not named & set(survived), (named, sorted(survived))
    for index in survived:  # every file the run kept is whole and holds its sample
        saved = torch.load(out / f"data_{index}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == rows[index]
        assert [tuple(layer.shape) for layer in saved["hidden_states"]] == [(len(rows[index]), 128)] * 4
    assert not list(out.glob(".tmp-*"))
    resumed = run_cli(*args, env_extra=STAGES)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(rows) - len(survived)} samples extracted, {len(survived)} already finished" in resumed.stderr
    after = data_files(out)
    assert all(after[i].st_mtime_ns == survived[i].st_mtime_ns for i in survived), "a finished sample was redone"
    assert_rows_are_hfs(hf, rows, out, harness.LAYER_IDS)
