"""The extractor CLI end to end on CPU vLLM: output against HF, speculators' own dataset reader,
resume after kill -9 and SIGINT, a full disk, and every bad-input case."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.extract_runs import LAYERS, SPECULATORS, cli, data_files, extract_args, failure_line, run_cli, write_jsonl
from tests.e2e.process_tree import alive, cmdline, descendants, stop

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor]


@pytest.fixture(scope="module")
def extracted(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    rows = write_jsonl(root / "data.jsonl", 50, long_every=25)
    proc = run_cli(*extract_args(model, root / "data.jsonl", root / "out", "--batch-size", "8"), kv_cache=False)
    return root, rows, proc


def test_extracts_every_sample(extracted):
    root, rows, proc = extracted
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the plan first, the KV cache sized from its estimate (vLLM 0.17 would take half the host's memory);
    # how settings were chosen and the KV cache's size are details: the log file has them, the terminal not
    log = (root / "out" / "hidden-states.log").read_text()
    plan = log.index("[hidden-states] debug: settings: --backend speculators --batch-size 8")
    assert plan < log.index("[hidden-states] time: about ") < log.index("starting the speculators")
    assert proc.stderr.index("[hidden-states] time: about ") < proc.stderr.index("starting the speculators")
    assert "[hidden-states] debug: KV cache: VLLM_CPU_KVCACHE_SPACE=1 GiB per rank, from the estimate" in log
    assert "KV cache:" not in proc.stderr
    assert sorted(data_files(root / "out")) == list(range(50))
    assert "done: 50 samples extracted" in proc.stderr
    assert "2 samples truncated to --max-seq-len" in proc.stderr  # samples 24 and 49 are 1100 tokens


def test_the_terminal_gets_a_bounded_share_and_the_log_file_everything(extracted):
    """The default --log-level: our lines (each once) and third-party warnings on the terminal; vLLM's
    INFO lines, Gloo's, and vllm-compat's per-adapter lines from the worker in the log file only."""
    root, _, proc = extracted
    shown = proc.stderr.splitlines()
    log = (root / "out" / "hidden-states.log").read_text()
    assert proc.stdout == "" and all(line in log for line in shown), proc.stderr[-3000:]
    progress = [line for line in shown if re.match(r"\[hidden-states\] \d+/~?\d+ samples", line)]
    ours = [line for line in shown if line.startswith("[hidden-states]") and line not in progress]
    # the rest: the shim's two summaries and third-party warnings, each kind once (18 weight-dtype
    # warnings of vLLM's loader show as one); which warnings a host gets varies (NUMA, oneDNN, tcmalloc)
    assert len(ours) <= 15 and len(shown) - len(progress) - len(ours) <= 12, proc.stderr
    ours = [re.sub(r"pid \d+", "pid", line) for line in shown if "vllm-compat" in line]
    assert len(ours) == len(set(ours)) >= 2, ours  # the parent's summary and the worker's, once each
    assert not [line for line in shown if "[Gloo]" in line or re.search(r"(^|\) )INFO \d", line)], proc.stderr
    assert re.search(r"^\(\w+ pid=\d+\) INFO \d\d-\d\d ", log, re.M), log[-3000:]  # a worker's INFO line
    # the worker's own adapter results, logged at DEBUG for the file; CUDA is not named on this CPU run
    assert re.search(r"vllm-compat \(vllm process, pid \d+\): capture_transport: applied", log), log[-3000:]
    assert "CUDA tensors" not in log


def test_states_match_hf_and_masks_are_kept(extracted, model):
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    root, rows, _ = extracted
    saved = [torch.load(root / "out" / f"data_{i}.pt", weights_only=True) for i in range(50)]
    reference = decoder_layer_outputs(load_model(model), [s["input_ids"].tolist() for s in saved],
                                      [int(x) for x in LAYERS])
    for i, (sample, row, ref) in enumerate(zip(saved, rows, reference)):
        n = min(len(row["input_ids"]), 1024)
        assert sample["input_ids"].tolist() == row["input_ids"][:n]
        assert sample["loss_mask"].tolist() == row.get("loss_mask", [1] * n)[:n]
        for got, want in zip(sample["hidden_states"], ref):
            assert float(relative_errors(got, want).max()) < harness.TOLERANCE, f"sample {i}"


def test_config_and_lengths_describe_the_run(extracted, model):
    root, rows, _ = extracted
    config = json.loads((root / "out" / "data_config.json").read_text())
    assert config["layer_ids"] == [int(x) for x in LAYERS] and config["model"] == str(Path(model).resolve())
    assert config["packages"]["speculators"] == SPECULATORS and config["packages"]["vllm-compat"]
    assert config["settings"]["batch_size"] == 8 and config["settings"]["max_seq_len"] == 1024  # flag, preset
    applied = [r["id"] for r in config["vllm_compat"]["results"] if r["status"] in ("applied", "armed")]
    assert "capture_attribution" in applied
    lengths = json.loads((root / "out" / "sample_lengths.json").read_text())
    assert lengths == {str(i): min(len(r["input_ids"]), 1024) for i, r in enumerate(rows)}


def test_speculators_training_dataset_reads_the_output(extracted):
    sys.path.insert(0, str(harness.speculators_path(SPECULATORS)))
    import vllm_compat

    vllm_compat.apply()  # what a training script does too: speculators 0.3 imports only so under transformers 5
    from speculators.train.data import Eagle3SampleFileDataset

    root, rows, _ = extracted
    dataset = Eagle3SampleFileDataset(max_len=2048, datapath=str(root / "out"))
    assert len(dataset) == 50
    for k, path in enumerate(dataset.data):
        item = dataset[k]
        n = min(len(rows[int(Path(path).stem.split("_")[1])]["input_ids"]), 1024)
        # after speculators' one-token shift: layers 0, 2, 3 fused, layer 5 is the target's last state
        assert int(item["lengths"][0]) == n - 1
        assert tuple(item["hidden_states"].shape) == (n - 1, 3 * 128)
        assert tuple(item["verifier_last_hidden_states"].shape) == (n - 1, 128)


def test_rerun_skips_every_finished_sample(extracted, model):
    root, _, _ = extracted
    before = data_files(root / "out")
    proc = run_cli(*extract_args(model, root / "data.jsonl", root / "out", "--batch-size", "8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 samples extracted, 50 already finished" in proc.stderr
    assert {i: s.st_mtime_ns for i, s in data_files(root / "out").items()} == {
        i: s.st_mtime_ns for i, s in before.items()}


def test_rerun_with_other_layers_is_refused(extracted, model):
    root, _, _ = extracted
    args = extract_args(model, root / "data.jsonl", root / "out")
    args[args.index("--layer-ids") + 1] = "1"
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert "holds another extraction (layer_ids [0, 2, 3, 5], this run [1, 2, 3, 5])" in proc.stderr


def test_rerun_with_other_data_is_refused_naming_both_inputs(extracted, model):
    """The reported mix: another --data into a directory with finished samples. Refused before the model
    loads, naming both inputs and the two ways on; nothing in the directory changes."""
    root, _, _ = extracted
    before = {p.name: p.stat().st_mtime_ns for p in (root / "out").iterdir()}
    write_jsonl(root / "other.jsonl", 20, seed=11)
    proc = run_cli(*extract_args(model, root / "other.jsonl", root / "out"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hidden-states: error: {root / 'out'} holds another extraction (input "
                           f"{root / 'data.jsonl'} (")
    assert f"; this run's {root / 'other.jsonl'} (" in last
    assert last.endswith("with 50 finished samples: use another --output-dir, or --start-over to remove its files "
                         "and extract this one")
    assert {p.name: p.stat().st_mtime_ns for p in (root / "out").iterdir()} == before
    config = json.loads((root / "out" / "data_config.json").read_text())
    assert config["input"]["path"] == str(root / "data.jsonl") and len(config["input"]["sha256"]) == 64
    assert config["tokenization"] == {"rows": "tokenized", "max_seq_len": 1024}


def _mapped_segments(pids) -> set[str]:
    """The shared-memory segments (/dev/shm) these processes map: vLLM's message queues. Other jobs
    on the machine may have their own; only the run's are the test's business."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return found


def _assert_segments_removed(names: set[str], seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds  # multiprocessing's resource tracker removes a dead run's
    while any((Path("/dev/shm") / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n in names if (Path("/dev/shm") / n).exists()], "a shared-memory segment outlived the run"


def _run_until(model, data, out, files: int, *extra):
    """Start the extractor in a session of its own (as a terminal starts a job: its own process
    group), wait until ``files`` data files exist; return it and every process it started so far.

    It is returned held still (SIGSTOP; its vLLM processes run in groups of their own and idle):
    on a busy host a fast pass finished all its samples between the test seeing the files and the
    signal that was to interrupt it. The caller acts on it, then lets it go on (SIGCONT)."""
    command, env = cli(*extract_args(model, data, out, "--batch-size", "4", *extra))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    started: set[int] = set()
    while len(data_files(out)) < files if out.exists() else True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        started |= descendants(proc.pid)
        time.sleep(0.2)
    stop(proc.pid)
    started |= descendants(proc.pid)
    segments = _mapped_segments(started | {proc.pid})
    assert segments, "found no shared memory of vLLM's to check for"
    return proc, started, segments


def _assert_gone_within(pids: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in pids if alive(p)}
    assert not left, f"processes of the run outlived it by {seconds} s: {left}"


# Enough samples that the run outlasts the test noticing its first files by seconds (the poll is
# 0.2 s): with 40, a fast pass finished them all (0.8 s) before a signal sent on the 4th file arrived.
INTERRUPTED_ROWS, INTERRUPTED_SEED = 120, 6


@pytest.fixture(scope="module")
def clean_run(model, tmp_path_factory):
    """The samples the interruption tests use, extracted without interruption (the same batches)."""
    root = tmp_path_factory.mktemp("clean")
    write_jsonl(root / "data.jsonl", INTERRUPTED_ROWS, seed=INTERRUPTED_SEED)
    proc = run_cli(*extract_args(model, root / "data.jsonl", root / "out", "--batch-size", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out"


def _assert_same_as_clean(out: Path, clean: Path, indices) -> None:
    import torch

    for i in indices:
        got = torch.load(out / f"data_{i}.pt", weights_only=True)
        want = torch.load(clean / f"data_{i}.pt", weights_only=True)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], want["hidden_states"], strict=True)), i


@pytest.mark.faults
def test_kill_9_loses_at_most_the_batch_in_flight(model, tmp_path, clean_run):
    write_jsonl(tmp_path / "data.jsonl", INTERRUPTED_ROWS, seed=INTERRUPTED_SEED)
    proc, started, segments = _run_until(model, tmp_path / "data.jsonl", tmp_path / "out", 8)
    # one run at a time per directory: the same command again, while this one holds it (held still),
    # is refused naming it and writes nothing
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    second = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--batch-size", "4"))
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"hidden-states: error: --output-dir {tmp_path / 'out'}: another run (pid {proc.pid} on "), second.stderr[-2000:]
    assert "is writing into it; wait for it to end, or use another --output-dir" in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before
    proc.kill()
    proc.wait()
    # vLLM's workers die with the extractor, and multiprocessing's resource tracker removes their
    # shared memory. Without the parent-death signal they lingered 2.6 s here (vllm-cpu 0.16,
    # waiting out their busy loop; ~30 s reported elsewhere); with it, 0.15 s.
    _assert_gone_within(started, 1.5)
    _assert_segments_removed(segments)
    survived = data_files(tmp_path / "out")
    assert len(survived) >= 8
    _assert_same_as_clean(tmp_path / "out", clean_run, survived)
    resumed = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--batch-size", "4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{tmp_path / 'out'}: lock taken over from a run that ended (pid {proc.pid} on " in resumed.stderr
    assert f"{INTERRUPTED_ROWS - len(survived)} samples extracted, {len(survived)} already finished" in resumed.stderr
    after = data_files(tmp_path / "out")
    assert sorted(after) == list(range(INTERRUPTED_ROWS))
    assert all(after[i].st_mtime_ns == survived[i].st_mtime_ns for i in survived), "a finished sample was redone"
    assert not list((tmp_path / "out").glob(".tmp-*"))
    assert json.loads((tmp_path / "out" / "sample_lengths.json").read_text()) == json.loads(
        (clean_run / "sample_lengths.json").read_text())


@pytest.mark.faults
def test_a_signal_to_the_process_group_finishes_the_batch_and_resumes(model, tmp_path, clean_run):
    """What a Ctrl-C in a terminal does (SIGINT to the whole foreground group), then what `timeout`
    sends (SIGTERM to its group) to the run that resumed it: each time the batch in flight is finished
    and written, vLLM shut down, and the exit code is the signal's; the third run does the rest."""
    write_jsonl(tmp_path / "data.jsonl", INTERRUPTED_ROWS, seed=INTERRUPTED_SEED)
    out, done = tmp_path / "out", 0
    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        proc, started, segments = _run_until(model, tmp_path / "data.jsonl", out, done + 4)
        os.killpg(proc.pid, signum)  # pending while it is held, taken as soon as it goes on
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == code, (signum, err[-3000:])
        assert "rerun the same command to resume" in err and "interrupted:" in err, err[-3000:]
        assert "Traceback" not in err and "cancelled" not in err, err[-3000:]
        finished = data_files(out)
        extracted = len(finished) - done
        # the batch in flight was finished, whole batches only (this run's batches start where it resumed)
        assert extracted % 4 == 0 and extracted >= 8, (signum, done, extracted)
        # every sample of the input no file holds, not the batch in flight alone: exact, the input's lines
        # not read yet counted (it is longer than the preflight's read-ahead)
        assert (f"interrupted: {extracted} samples extracted, {done} already finished, "
                f"{INTERRUPTED_ROWS - len(finished)} samples not extracted, ") in err, err[-3000:]
        _assert_same_as_clean(out, clean_run, finished)
        _assert_gone_within(started, 5)
        _assert_segments_removed(segments)
        assert not list(out.glob(".tmp-*"))
        done = len(finished)
    resumed = run_cli(*extract_args(model, tmp_path / "data.jsonl", out, "--batch-size", "4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{INTERRUPTED_ROWS - done} samples extracted, {done} already finished" in resumed.stderr
    _assert_same_as_clean(out, clean_run, range(INTERRUPTED_ROWS))


@pytest.mark.faults
def test_a_killed_vllm_worker_is_named_and_the_rerun_resumes(model, tmp_path):
    """What the kernel's OOM killer does to a vLLM worker mid-run (seen at TP=8 on CPU): the error
    names the worker, its pid and SIGKILL, and the likely cause, where vLLM's own error is only
    'cancelled'; the finished files are kept and a rerun extracts the rest."""
    rows = write_jsonl(tmp_path / "data.jsonl", INTERRUPTED_ROWS, seed=INTERRUPTED_SEED)
    out = tmp_path / "out"
    proc, _, _ = _run_until(model, tmp_path / "data.jsonl", out, 4)
    # vLLM titles its workers' processes "VLLM::Worker..." (setproctitle) once they run
    workers = sorted(pid for pid in descendants(proc.pid) if cmdline(pid).startswith(b"VLLM::Worker"))
    assert workers, {pid: cmdline(pid)[:80] for pid in descendants(proc.pid)}
    os.kill(workers[0], signal.SIGKILL)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    failed = failure_line(err)
    assert re.search(rf"vLLM's process VllmWorker-\d+ \(pid {workers[0]}\) was killed by SIGKILL", failed), failed
    assert "the kernel's OOM killer" in failed and "dmesg" in failed and "--batch-size" in failed, failed
    assert "rerun the same command to resume" in failed, failed

    import torch

    survived = data_files(out)
    assert len(survived) >= 4
    for index in survived:  # every file the run kept is whole and holds its sample
        saved = torch.load(out / f"data_{index}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == rows[index]["input_ids"]
        assert [tuple(layer.shape) for layer in saved["hidden_states"]] == [(len(rows[index]["input_ids"]), 128)] * 4
    assert not list(out.glob(".tmp-*"))
    resumed = run_cli(*extract_args(model, tmp_path / "data.jsonl", out, "--batch-size", "4"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{INTERRUPTED_ROWS - len(survived)} samples extracted, {len(survived)} already finished" in resumed.stderr
    after = data_files(out)
    assert sorted(after) == list(range(INTERRUPTED_ROWS))
    assert all(after[i].st_mtime_ns == survived[i].st_mtime_ns for i in survived), "a finished sample was redone"


@pytest.mark.faults
def test_full_disk_stops_cleanly_and_keeps_finished_work(model, tmp_path):
    """The disk fills after 6 files; the rerun resumes on the same disk: its preflight asks for the
    room of the 14 samples left, which is there, not for the whole input's, which is not."""
    rows = write_jsonl(tmp_path / "data.jsonl", 20, seed=7)
    injected = {"PYTHONPATH": os.pathsep.join(p for p in [str(harness.ENOSPC),
                                                          str(harness.speculators_path(SPECULATORS)), ROOT,
                                                          os.environ.get("PYTHONPATH", "")] if p),
                "ENOSPC_AFTER": "6"}
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out"), env_extra=injected)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"hidden-states: error: writing sample \d+: .*data_\d+\.pt: no space left on device", proc.stderr)
    finished = data_files(tmp_path / "out")
    assert len(finished) == 6  # the saves that had room; every later one failed
    assert not list((tmp_path / "out").glob(".tmp-*"))
    assert re.search(r"stopped: 6 samples extracted, 0 already finished, 14 samples not extracted, .*, [1-9][\d.]* MB "
                     r"written", proc.stderr), proc.stderr[-3000:]
    # the disk now holds room for the rest and not for the whole input: half-way between the two
    tokens = [min(len(row["input_ids"]), 1024) for row in rows]
    left = sum(n for index, n in enumerate(tokens) if index not in finished) / sum(tokens)
    whole = harness.planned_disk_bytes(proc.stderr)
    room = {"ENOSPC_AFTER": "14", "DISK_FREE": str(int(whole * (1 + left) / 2)), "DISK_FREE_UNDER": str(tmp_path)}
    resumed = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out"), env_extra={**injected, **room})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(data_files(tmp_path / "out")) == list(range(20))
    assert "of hidden states for the 14 samples left in range (6 already finished)" in resumed.stderr
    assert re.search(r"done: 14 samples extracted, 6 already finished, ", resumed.stderr)


@pytest.mark.faults
def test_bad_line_mid_stream_keeps_what_came_before(model, tmp_path):
    write_jsonl(tmp_path / "data.jsonl", 80, seed=8)
    lines = (tmp_path / "data.jsonl").read_text().splitlines()
    lines[69] = '{"input_ids": [1, 2, "x"]}'
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out"))
    assert proc.returncode == 2
    assert f"{tmp_path / 'data.jsonl'}:70: input_ids[2] is 'x', not an integer" in proc.stderr
    assert sorted(data_files(tmp_path / "out")) == list(range(69))
    status = subprocess.run([sys.executable, "-m", "hidden_states", "status", str(tmp_path / "out")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=cli()[1])
    assert status.returncode == 0, status.stderr[-3000:]
    assert f"the run stopped at {tmp_path / 'data.jsonl'}:70 (a bad row)" in status.stdout
    assert f": 69 samples before {tmp_path / 'data.jsonl'}:70: input_ids[2] is 'x', not an integer, where it stops; " \
           f"every one finished" in status.stdout


@pytest.mark.faults
def test_a_line_not_json_past_the_peek_is_recovered_as_the_stop_message_says(model, tmp_path):
    """A line that is not JSON past the first 64 rows stops the run, which says to fix the line and rerun
    the same command; doing exactly that resumes: the finished samples kept byte for byte, the rest done.
    (The rerun was refused as another input: the stop was recorded by parsing the bad line again.)"""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, 80, seed=9)
    lines = data.read_text().splitlines()
    good = lines[69]
    lines[69] = '{"input_ids": [1, 2'
    data.write_text("\n".join(lines) + "\n")
    args = extract_args(model, data, tmp_path / "out")
    first = run_cli(*args)
    assert first.returncode == 2, first.stderr[-3000:]
    assert f"fix {data}:70 (the error below) and rerun the same command" in first.stderr, first.stderr[-3000:]
    kept = {i: (tmp_path / "out" / f"data_{i}.pt").read_bytes() for i in data_files(tmp_path / "out")}
    assert sorted(kept) == list(range(69))
    lines[69] = good
    data.write_text("\n".join(lines) + "\n")
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "11 samples extracted, 69 already finished" in second.stderr, second.stderr[-3000:]
    assert sorted(data_files(tmp_path / "out")) == list(range(80))
    assert all((tmp_path / "out" / f"data_{i}.pt").read_bytes() == body for i, body in kept.items())


@pytest.mark.faults
def test_strict_refuses_a_long_sample(model, tmp_path):
    write_jsonl(tmp_path / "data.jsonl", 6, seed=9, long_every=3)
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--strict"))
    assert proc.returncode == 2
    assert f"{tmp_path / 'data.jsonl'}:3: 1100 tokens, more than --max-seq-len 1024 (--strict)" in proc.stderr


def test_forward_check_stops_a_run_whose_kernels_are_wrong(tmp_path):
    """The DeepSeek-V3 layout with adapter cpu_rotary_head_layout disabled: vLLM's CPU rotary kernel
    mis-rotates MLA's 3-D q_pe, and the forward check, run after the load, stops the run before any
    file (the llama runs above pass the same check)."""
    if not harness.family_runs_here("deepseek"):
        pytest.skip("vLLM's CPU backend runs MLA from vllm-cpu 0.29.0")
    from vllm_compat.adapters.cpu_rotary_head_layout import kernel_mishandles_heads

    if not kernel_mishandles_heads()[0]:
        pytest.skip(kernel_mishandles_heads()[1])
    write_jsonl(tmp_path / "data.jsonl", 3, seed=5)
    proc = run_cli(*extract_args(harness.tiny_model("deepseek"), tmp_path / "data.jsonl", tmp_path / "out"),
                   env_extra={"VLLM_COMPAT_DISABLE": "cpu_rotary_head_layout"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the forward vLLM runs here is not the model's" in proc.stderr
    assert re.search(r"RotaryEmbedding \(\S*rotary_emb\) on .*\(WRONG\)", proc.stderr)
    assert not data_files(tmp_path / "out")


def test_tensor_parallel_2_matches_hf(model, tmp_path):
    """TP=2 on vLLM's CPU backend: it needs one OpenMP core set per worker (VLLM_CPU_OMP_THREADS_BIND)."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    rows = write_jsonl(tmp_path / "data.jsonl", 6, seed=12)
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--tp-size", "2"),
                   env_extra={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = [torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True) for i in range(6)]
    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [int(x) for x in LAYERS])
    for sample, ref in zip(saved, reference):
        for got, want in zip(sample["hidden_states"], ref):
            assert float(relative_errors(got, want).max()) < harness.TOLERANCE


def test_default_layer_ids_give_speculators_trainer_its_four_states(model, tmp_path):
    """The 6-layer model's default is speculators' own [2, 3, 3, 5] (it was [2, 3, 5], and the
    trainer, which fuses all entries but the last, then failed): layer 3 captured once, written twice."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    rows = write_jsonl(tmp_path / "data.jsonl", 6, seed=13)
    args = extract_args(model, tmp_path / "data.jsonl", tmp_path / "out")
    at = args.index("--layer-ids")
    del args[at:at + 1 + len(LAYERS)]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "data_config.json").read_text())["layer_ids"] == [2, 3, 3, 5]
    saved = [torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True) for i in range(6)]
    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [2, 3, 5])
    for sample, (two, three, five) in zip(saved, reference):
        assert len(sample["hidden_states"]) == 4
        assert torch.equal(sample["hidden_states"][1], sample["hidden_states"][2])
        for got, want in zip(sample["hidden_states"], (two, three, three, five)):
            assert float(relative_errors(got, want).max()) < harness.TOLERANCE

    sys.path.insert(0, str(harness.speculators_path(SPECULATORS)))
    import vllm_compat

    vllm_compat.apply()
    from speculators.train.data import Eagle3SampleFileDataset

    item = Eagle3SampleFileDataset(max_len=2048, datapath=str(tmp_path / "out"))[0]
    assert item["hidden_states"].shape[-1] == 3 * 128 and item["verifier_last_hidden_states"].shape[-1] == 128


@pytest.mark.parametrize("speculators", [SPECULATORS, None], ids=["speculators-0.3.0", "no-speculators"])
def test_a_run_that_names_no_backend_gets_vllm_engine_said_first_and_matches_hf(model, tmp_path, speculators):
    """No --backend: ``plan`` says on its first line that vllm-engine was chosen and why (the measured
    rates with speculators 0.3 installed, the one exact path without it: the generator, the old
    default, refused such a run), and ``extract`` runs it: its rows HF's. Without speculators only the
    plan runs here (its own capture's extract is test_backends.py's, named; an engine start is a
    minute of CI)."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    rows = write_jsonl(tmp_path / "data.jsonl", 6, seed=14)
    args = extract_args(model, tmp_path / "data.jsonl", tmp_path / "out")
    at = args.index("--backend")
    del args[at:at + 2]
    path = {} if speculators else {"PYTHONPATH": ROOT}  # extract_runs.cli puts speculators 0.3.0 first otherwise
    command, env = cli(*args, env_extra=path)
    command[command.index("extract")] = "plan"
    plan = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr[-3000:]
    first = plan.stdout.splitlines()[1]
    why = ("speculators 0.3.0, CPU: 46,483 tokens/s against the generator's 21,466" if speculators else
           "no speculators, CPU: its own capture, the one exact path here")
    assert first.startswith(f"  backend: vllm-engine (default here: {why}"), plan.stdout
    assert "settings: --backend vllm-engine " in plan.stdout and "audit ok for --backend vllm-engine" in plan.stdout
    if not speculators:
        return
    proc = run_cli(*args, env_extra=path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[hidden-states] {first.strip()}" in proc.stderr and "starting the vllm-engine backend" in proc.stderr
    config = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert config["settings"]["backend"] == "vllm-engine"
    assert config["capture"] == "speculators", config.get("capture")
    saved = [torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True) for i in range(6)]
    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [int(x) for x in LAYERS])
    for sample, ref in zip(saved, reference):
        for got, want in zip(sample["hidden_states"], ref):
            assert float(relative_errors(got, want).max()) < harness.TOLERANCE
