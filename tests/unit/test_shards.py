"""Static shards and the shared output directory's per-writer ledgers, with the small fake backend of
test_extraction_stages; the real vLLM runs in tests/e2e/test_data_parallel.py."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hidden_states import shards
from hidden_states.errors import UsageError
from hidden_states.shards import Shard

pytest.importorskip("torch")

from hidden_states.extract.command import Extraction  # noqa: E402
from hidden_states.status import status  # noqa: E402
from tests.unit.fakes import quiet  # noqa: E402


def test_the_flag_wins_then_torchrun_then_slurm_and_a_world_of_one_is_no_sharding():
    both = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert shards.from_environment("1/2", both) == Shard(1, 2, "--shard")
    assert shards.from_environment(None, both) == Shard(3, 4, "RANK/WORLD_SIZE")
    assert shards.from_environment(None, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == Shard(
        1, 2, "SLURM_PROCID/SLURM_NTASKS")
    assert shards.from_environment(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert shards.from_environment(None, {}) is None


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "1/0"])
def test_a_bad_shard_is_refused_naming_where_it_came_from(text):
    with pytest.raises(UsageError, match="--shard"):
        shards.parse(text)
    with pytest.raises(UsageError, match="RANK/WORLD_SIZE"):
        shards.parse(text, "RANK/WORLD_SIZE")


def test_a_shard_owns_every_nth_batch_of_the_range():
    shard = Shard(1, 3, "--shard")
    assert [i for i in range(10, 30) if shard.owns(i, start=10, batch_size=2)] == [12, 13, 18, 19, 24, 25]


def test_torchrun_ranks_get_their_own_devices_and_vllm_never_sees_the_launchers_variables():
    env = {"LOCAL_RANK": "2", "RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "TORCHELASTIC_RUN_ID": "x"}
    assert shards.leave_torchrun(env, tp_size=2) == "4,5"
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    chosen = {"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "7"}
    assert shards.leave_torchrun(chosen) is None and chosen == {"CUDA_VISIBLE_DEVICES": "7"}
    assert shards.leave_torchrun({"SLURM_PROCID": "1"}) is None


def test_two_shards_write_their_own_ledgers_and_the_last_index_lists_both(job):
    out = Path(job.output_dir)
    first = Extraction(replace(job, shard=Shard(0, 2, "--shard")), log=quiet).run()
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_1.pt", "data_4.pt", "data_5.pt"]
    assert first.extracted == 4
    second = Extraction(replace(job, shard=Shard(1, 2, "--shard")), log=quiet).run()
    assert second.extracted == 2
    assert sorted(p.name for p in out.glob("done*.jsonl")) == ["done.shard-0-of-2.jsonl", "done.shard-1-of-2.jsonl"]
    assert json.loads((out / "sample_lengths.json").read_text()) == {str(i): i + 3 for i in range(6)}
    # any mix resumes: a single run finds nothing left
    assert Extraction(job, log=quiet).run().skipped == 6
    said = status(out)
    assert "6 sample files whole" in said and "every one finished" in said
    assert "done.shard-1-of-2.jsonl: 2 files written" in said


def test_a_shard_starting_leaves_the_temporary_files_of_the_others_alone(job):
    out = Path(job.output_dir)
    out.mkdir()
    theirs, stale = out / ".tmp-shard-1-of-2.data_2.pt.77", out / ".tmp-shard-0-of-2.data_0.pt.66"
    theirs.write_bytes(b"half")
    stale.write_bytes(b"half")
    Extraction(replace(job, shard=Shard(0, 2, "--shard")), log=quiet).run()
    assert theirs.exists() and not stale.exists()
    assert "1 temporary files" in status(out) and "2 not finished: 2-3" in status(out)
