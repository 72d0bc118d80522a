"""The Ray driver's hand-out and fault handling (replicas.RayExtraction), on a small in-process stand-in
for Ray that runs each call at once, and the fake backend of test_extraction_stages; real Ray and vLLM
run in tests/e2e/test_data_parallel.py."""
import json
import pickle
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hidden_states import replicas  # noqa: E402
from hidden_states.extraction import Extraction, ExtractionFailed  # noqa: E402
from tests.unit.test_extraction_stages import job, quiet  # noqa: E402,F401  (job: a fixture)


class ActorDied(Exception):
    pass


class Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeActor:
    """Runs each call when it is made. ``fault``: (what, n) — at its n-th ``extract`` call the actor
    dies (its writer's files reach the disk first, as a killed process's renamed files do), or that
    call and every later one raises; ("poison", i): every call holding sample ``i`` raises."""

    def __init__(self, instance, fault):
        self.instance, self.fault, self.dead, self.extracts = instance, fault, False, 0

    def __getattr__(self, name):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                if actor.dead:
                    return Ref(error=ActorDied("The actor died unexpectedly before finishing this task."))
                if name == "extract":
                    actor.extracts += 1
                    what, n = actor.fault or (None, 0)
                    if what == "die" and actor.extracts == n:
                        actor.instance.extraction.writer.close()
                        actor.dead = True
                        return Ref(error=ActorDied("The actor died unexpectedly before finishing this task."))
                    poisoned = what == "poison" and any(sample.index == n for sample in args[0])
                    if poisoned or (what == "raise" and actor.extracts >= n):
                        return Ref(error=RuntimeError("Traceback (most recent call last):\n  ...\nValueError: boom"))
                return Ref(getattr(actor.instance, name)(*args))

        return Method


class FakeRay:
    __version__ = "fake"

    class exceptions:
        RayActorError = ActorDied

    def __init__(self, faults):
        self.faults, self.actors, self.up = faults, [], False

    def init(self, **kwargs):
        self.up = True

    def is_initialized(self):
        return self.up

    def shutdown(self):
        self.up = False

    def cluster_resources(self):
        return {"CPU": 4.0}

    def remote(self, cls):
        ray = self

        class ActorClass:
            @staticmethod
            def options(**kwargs):
                return ActorClass

            @staticmethod
            def remote(plan, replica_id, env):
                fault = ray.faults.get(replica_id, ray.faults.get("every"))
                actor = FakeActor(cls(pickle.loads(pickle.dumps(plan)), replica_id, env), fault)  # as Ray ships it
                ray.actors.append(actor)
                return actor

        return ActorClass

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def kill(self, actor):
        actor.dead = True


@pytest.fixture
def ray_job(job, monkeypatch):
    def use(faults):
        fake = FakeRay(faults)
        monkeypatch.setattr(replicas, "import_ray", lambda: fake)
        return fake

    return replace(job, batch_size=1, data_parallel_size=2), use


def ledgers(out: Path) -> dict[str, list[int]]:
    return {p.name: [json.loads(line)["index"] for line in p.read_text().splitlines()] for p in out.glob("done*.jsonl")}


def test_two_replicas_share_the_batches_and_write_the_single_runs_files(ray_job):
    settings, use = ray_job
    use({})
    summary = replicas.RayExtraction(settings, log=quiet).run()
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
    summary = replicas.RayExtraction(settings, log=said.append).run()
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
        replicas.RayExtraction(settings, log=quiet).run()
    message = str(failed.value)
    assert "ValueError: boom" in message and "replica 0 failed" in message
    assert not list(Path(settings.output_dir).glob("data_*.pt"))


def test_a_batch_failing_on_two_replicas_is_given_up_and_the_rest_is_extracted(ray_job):
    settings, use = ray_job
    settings = replace(settings, data_parallel_size=3)
    use({"every": ("poison", 2)})  # sample 2 fails wherever it goes: two replicas, then given up
    with pytest.raises(ExtractionFailed) as failed:
        replicas.RayExtraction(settings, log=quiet).run()
    message = str(failed.value)
    assert message.startswith("1 samples were not extracted") and message.count("ValueError: boom") == 2
    assert [int(index) for index in re.findall(r"(\d+) \(line \d+\)", message)] == [2]
    done = sorted(int(p.stem.split("_")[1]) for p in Path(settings.output_dir).glob("data_*.pt"))
    assert done == [0, 1, 3, 4, 5]
    assert json.loads((Path(settings.output_dir) / "sample_lengths.json").read_text()) == {
        str(i): i + 3 for i in done}
