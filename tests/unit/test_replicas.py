"""The Ray driver's hand-out and fault handling (``replicas.driver.RayReplicas``), on a small in-process stand-in
for Ray that runs each call at once (fake_ray.py), and the fake backend (fakes.py); real Ray and vLLM
run in tests/e2e/test_data_parallel.py."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hidden_states.replicas import driver  # noqa: E402
from hidden_states.extract.command import Extraction
from hidden_states.run.summary import ExtractionFailed  # noqa: E402
from hidden_states.errors import UsageError  # noqa: E402
from tests.unit.fake_ray import FakeRay  # noqa: E402
from tests.unit.fakes import quiet  # noqa: E402


@pytest.fixture
def ray_job(job, monkeypatch):
    def use(faults):
        fake = FakeRay(faults)
        monkeypatch.setattr(driver, "import_ray", lambda: fake)
        return fake

    return replace(job, batch_size=1, data_parallel_size=2), use


def ledgers(out: Path) -> dict[str, list[int]]:
    return {p.name: [json.loads(line)["index"] for line in p.read_text().splitlines()] for p in out.glob("done*.jsonl")}


def test_two_replicas_share_the_batches_and_write_the_single_runs_files(ray_job):
    settings, use = ray_job
    use({})
    summary = Extraction(settings, log=quiet).run()
    out = Path(settings.output_dir)
    assert summary.extracted == 6
    shares = ledgers(out)
    assert sorted(shares) == ["done.replica-0.jsonl", "done.replica-1.jsonl"] and all(shares.values())
    assert sorted(i for indices in shares.values() for i in indices) == list(range(6))
    assert json.loads((out / "sample_lengths.json").read_text()) == {str(i): i + 3 for i in range(6)}
    assert Extraction(settings, log=quiet).run().skipped == 6  # a single run resumes it: nothing left


def test_a_dead_replicas_batches_go_to_the_other_and_no_file_is_written_twice(ray_job):
    settings, use = ray_job
    use({1: ("die", 2)})
    said = []
    summary = Extraction(settings, log=said.append).run()
    out = Path(settings.output_dir)
    assert sorted(int(p.stem.split("_")[1]) for p in out.glob("data_*.pt")) == list(range(6))
    written = [i for indices in ledgers(out).values() for i in indices]
    assert sorted(written) == list(range(6)), ledgers(out)  # each exactly once
    assert summary.extracted == 6
    died = [line for line in said if line.startswith("replica 1 died on samples")]
    assert died and "The actor died unexpectedly" in died[0]
    assert json.loads((out / "sample_lengths.json").read_text()) == {str(i): i + 3 for i in range(6)}


def test_when_every_replica_fails_the_run_says_which_samples_and_why(ray_job):
    settings, use = ray_job
    use({0: ("raise", 1), 1: ("raise", 1)})
    with pytest.raises(ExtractionFailed) as failed:
        Extraction(settings, log=quiet).run()
    message = str(failed.value)
    assert "ValueError: boom" in message and "replica 0 failed" in message
    assert not list(Path(settings.output_dir).glob("data_*.pt"))


def test_a_batch_failing_on_two_replicas_is_given_up_and_the_rest_is_extracted(ray_job):
    settings, use = ray_job
    settings = replace(settings, data_parallel_size=3)
    use({"every": ("poison", 2)})  # sample 2 fails wherever it goes: two replicas, then given up
    with pytest.raises(ExtractionFailed) as failed:
        Extraction(settings, log=quiet).run()
    message = str(failed.value)
    assert message.startswith("1 samples were not extracted") and message.count("ValueError: boom") == 2
    assert [int(index) for index in re.findall(r"(\d+) \(line \d+\)", message)] == [2]
    done = sorted(int(p.stem.split("_")[1]) for p in Path(settings.output_dir).glob("data_*.pt"))
    assert done == [0, 1, 3, 4, 5]
    assert json.loads((Path(settings.output_dir) / "sample_lengths.json").read_text()) == {
        str(i): i + 3 for i in done}


def test_a_replica_asks_ray_for_every_pipeline_stages_gpus(ray_job):
    settings, use = ray_job
    fake = use({})
    fake.cluster_resources = lambda: {"CPU": 4.0, "GPU": 6.0}
    with pytest.raises(UsageError) as refused:
        Extraction(replace(settings, tp_size=2, pp_size=2), log=quiet).run()
    assert str(refused.value) == ("--data-parallel-size 2: the Ray cluster has 6 GPUs, 8 needed (4 GPUs (--tp-size x "
                                  "--pp-size) per replica)")
