"""``hidden-states generate`` beyond one process, with small fakes: Ray replicas
(``generate`` on Ray replicas, on the in-process stand-in for Ray of test_replicas) and static shards
write what one process writes for the same data (sample files, their numbers, ``regenerated.jsonl``,
the summary and the tally), a dead replica loses nothing finished, a resume redoes nothing done, and
``status`` reads the shards together. Real Ray and vLLM run it in
tests/e2e/test_generate_data_parallel.py."""
import json
import re
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hidden_states import backends
from hidden_states.plan import planner
from hidden_states.extract.command import Extraction
from hidden_states.replicas import driver
from hidden_states.run.summary import ExtractionFailed
from hidden_states.backends import Reply, Sampling
from hidden_states.generate.command import Generation
from hidden_states.generate.regeneration import row_source
from hidden_states.settings import Settings
from hidden_states.shards import Shard
from hidden_states.status import status
from tests.unit.fake_ray import ActorDied, FakeRay
from tests.unit.fakes import FakeGenerating

# conversation 2 has tool turns (skipped: no rows, no sample numbers); 0 and 4 have two user turns
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": "one"},
                  {"role": "assistant", "content": "x"}, {"role": "user", "content": "two"}]},
    {"conversations": [{"from": "human", "value": "three"}, {"from": "gpt", "value": "y"}]},
    {"messages": [{"role": "user", "content": "tool?"}, {"role": "tool", "content": "{}"}]},
    {"messages": [{"role": "user", "content": "four"}]},
    {"messages": [{"role": "user", "content": "five"}, {"role": "assistant", "content": "z"},
                  {"role": "user", "content": "six"}]},
    {"messages": [{"role": "user", "content": "seven"}]},
    {"messages": [{"role": "user", "content": "eight"}]},
]
# speculators-0.5's sample numbers, a row per reply, counted on through the input
PER_REPLY = {0: [0, 1], 1: [2], 3: [3], 4: [4, 5], 5: [6], 6: [7]}


class PromptReplies(FakeGenerating):
    """test_generate's fake, its replies the same whoever runs them: a prompt's reply is ``ok
    <number>`` (its number from the prompt's ids) then <|eot_id|>; a row's state at layer l and
    position p is ``1000 l + p + (sum of its ids)/1000``."""

    def answer(self, ids, sampling, stream=None, certified=False):
        eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        text = f"ok {sum(ids) % 89}"
        generated = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eot]
        return done(Reply(ids, generated, text, "stop", 0, 0, len(ids) + len(generated) - 1, "salt"))

    def row_states(self, rows, sources, certified=False):
        for row, source in zip(rows, sources):
            reused = row_source(row, [source]).reused
            self.reply_rows_reused += reused
            self.rows_from_replies += reused > 0
        return done([[torch.arange(len(row), dtype=torch.float32)[:, None].repeat(1, 8) + 1000 * layer
                      + sum(row) / 1000 for layer in self.settings.layer_ids] for row in rows])


class SampledReplies(PromptReplies):
    """Replies that differ from one backend to the next (sampling without a seed): ``ok <number>
    <backend>``."""

    made = 0

    def __init__(self, settings, tokenizer):
        super().__init__(settings, tokenizer)
        SampledReplies.made += 1
        self.number = SampledReplies.made

    def answer(self, ids, sampling, stream=None, certified=False):
        text = f"{super().answer(ids, sampling).result().text} {self.number}"
        generated = self.tokenizer(text, add_special_tokens=False)["input_ids"] \
            + [self.tokenizer.convert_tokens_to_ids("<|eot_id|>")]
        return done(Reply(ids, generated, text, "stop", 0, 0, len(ids) + len(generated) - 1, "salt"))


DIED, RAISED = object(), object()


class WrappingRay(FakeRay):
    """FakeRay whose replicas' ``extract`` goes through :meth:`call` (``run``: the real one); a call
    that returns DIED is an actor's death, RAISED a batch that raised, when the driver gets it."""

    def call(self, replica_id, actor, run, batch, skip):
        return run(batch, skip)

    def remote(self, cls):
        actor_class, create = super().remote(cls), None

        def wrapped(plan, replica_id, env):
            actor = create(plan, replica_id, env)
            run = actor.instance.extract
            actor.instance.extract = lambda batch, skip: self.call(replica_id, actor, run, batch, skip)
            return actor

        create, actor_class.remote = actor_class.remote, staticmethod(wrapped)  # a class of this call's own
        return actor_class

    def get(self, ref, timeout=None):
        if ref.value is DIED:
            raise ActorDied("The actor died unexpectedly before finishing this task.")
        if ref.value is RAISED:
            raise RuntimeError("Traceback (most recent call last):\n  ...\nValueError: boom")
        return super().get(ref, timeout)


class DiesAfterRunning(WrappingRay):
    """Replica 1 runs its first batch whole (its files reach the disk) and dies before the call
    returns: the driver has its files on disk and no line of it."""

    def call(self, replica_id, actor, run, batch, skip):
        result = run(batch, skip)
        if replica_id != 1:
            return result
        actor.instance.work.model.writer.close()
        actor.dead = True
        return DIED


class PoisonedConversation(WrappingRay):
    """Conversation 3 raises wherever it goes."""

    def call(self, replica_id, actor, run, batch, skip):
        return RAISED if any(regen.index == 3 for regen, _ in batch) else run(batch, skip)


def done(value):
    future = Future()
    future.set_result(value)
    return future


class LastFirstRay(FakeRay):
    """Ray whose ``wait`` gives the newest call first: batches return out of hand-out order."""

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[-num_returns:], refs[:-num_returns]


@pytest.fixture
def scale(chat_model, tmp_path, monkeypatch):
    from hidden_states.inputs.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(chat_model))
    monkeypatch.setattr(backends, "create", lambda name, settings: PromptReplies(settings, tokenizer))
    monkeypatch.setattr(planner, "check_vllm", lambda *args: "not run (a fake backend)")
    monkeypatch.setattr(planner, "check_environment", lambda: [])
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))

    def settings(out, layout="speculators-0.3", **extra):
        return Settings(model_path=str(chat_model), prepared_data=str(data), output_dir=str(tmp_path / out),
                        layer_ids=[0, 2] if layout == "speculators-0.3" else [1, 3], backend="vllm-engine",
                        format=layout, max_seq_len=256, forward_check=False, **{"batch_size": 1, **extra})

    def use_ray(kind=FakeRay, faults=None):
        fake = kind(faults or {})
        monkeypatch.setattr(driver, "import_ray", lambda: fake)
        return fake

    return settings, use_ray


def run(settings):
    lines = []
    generation = Generation(settings, Sampling(max_new_tokens=16), log=lines.append)
    summary = generation.run()
    return summary, lines


def files(out: Path) -> dict[str, dict]:
    """Every sample file's tensors, by name (either layout)."""
    from safetensors.torch import load_file

    found = {p.name: torch.load(p, weights_only=True) for p in out.glob("data_*.pt")}
    found.update({p.name: load_file(str(p)) for p in out.glob("hidden_states/hs_*.safetensors")})
    return found


def assert_same_output(out: Path, reference: Path) -> None:
    got, want = files(out), files(reference)
    assert sorted(got) == sorted(want)
    for name, tensors in want.items():
        assert sorted(got[name]) == sorted(tensors)
        for key, value in tensors.items():
            pairs = zip(got[name][key], value) if isinstance(value, list) else [(got[name][key], value)]
            assert all(torch.equal(a, b) for a, b in pairs), (name, key)
    assert (out / "regenerated.jsonl").read_text() == (reference / "regenerated.jsonl").read_text()


def ledgers(out: Path) -> dict[str, list[int]]:
    return {p.name: [json.loads(line)["index"] for line in p.read_text().splitlines()] for p in out.glob("done*.jsonl")}


def counts(summary_line: str) -> str:
    """A summary line less its times and rates."""
    return re.sub(r" in [\d.]+ s \([^)]*\)", "", summary_line).split(", writer stall")[0]


def tally(lines: list[str]) -> str:
    """The ``generate:`` line less its times."""
    line = next(line for line in lines if line.startswith("generate: "))
    timed = re.fullmatch(r"(.*), replies [\d.]+ s, then the rows' states [\d.]+ s", line)
    assert timed, line
    return timed.group(1)


@pytest.mark.parametrize("layout", ["speculators-0.3", pytest.param("speculators-0.5", marks=pytest.mark.datasets)])
def test_two_replicas_write_what_one_process_writes_whatever_returns_first(scale, layout):
    settings, use_ray = scale
    reference, said = run(settings("single", layout))
    use_ray(LastFirstRay)
    summary, ray_said = run(replace(settings("ray", layout), data_parallel_size=2))
    out, single = Path(settings("ray").output_dir), Path(settings("single").output_dir)
    assert_same_output(out, single)
    assert counts(summary.line()) == counts(reference.line())
    assert tally(ray_said) == tally(said)
    shares = ledgers(out)
    assert sorted(shares) == ["done.replica-0.jsonl", "done.replica-1.jsonl"] and all(shares.values())
    written = sorted(i for indices in shares.values() for i in indices)
    lines = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    if layout == "speculators-0.5":  # numbered on through the input, whoever regenerated what
        assert {line["index"]: line["sample_indices"] for line in lines} == PER_REPLY
        assert written == list(range(8))
    else:
        assert [line["index"] for line in lines] == [0, 1, 3, 4, 5, 6] and written == [0, 1, 3, 4, 5, 6]


def test_a_dead_replica_loses_nothing_and_no_file_or_line_is_written_twice(scale):
    settings, use_ray = scale
    run(settings("single"))
    use_ray(faults={1: ("die", 2)})
    summary, said = run(replace(settings("ray"), data_parallel_size=2))
    out = Path(settings("ray").output_dir)
    assert any(line.startswith("replica 1 died on samples") for line in said)
    assert_same_output(out, Path(settings("single").output_dir))
    written = [i for indices in ledgers(out).values() for i in indices]
    assert sorted(written) == [0, 1, 3, 4, 5, 6], ledgers(out)  # each once
    assert summary.extracted == 6


def test_a_batch_lost_with_its_files_on_disk_is_regenerated_whole_and_its_files_match_its_line(scale, monkeypatch):
    """Replica 1 wrote its batch's files and died before returning the line: the batch is regenerated
    whole on replica 0, whose replies differ (sampling), and every file is rewritten from them: each
    file holds the rows of its conversation as ``regenerated.jsonl`` has it."""
    from hidden_states.inputs.conversations import MESSAGES, Record
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer

    settings, use_ray = scale
    tokenizer = load_tokenizer(settings("ray").model_path)
    monkeypatch.setattr(backends, "create", lambda name, given: SampledReplies(given, tokenizer))
    use_ray(DiesAfterRunning)
    summary, said = run(replace(settings("ray"), data_parallel_size=2))
    out = Path(settings("ray").output_dir)
    assert any(line.startswith("replica 1 died on samples [1]") for line in said), said
    lines = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 3, 4, 5, 6]
    chat = ChatTokenizer(tokenizer, "speculators-0.3", 256)
    for line in lines:
        saved = torch.load(out / f"data_{line['index']}.pt", weights_only=True)
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0]
        assert saved["input_ids"].tolist() == row.input_ids, line["index"]
    shares = ledgers(out)
    assert 1 in shares["done.replica-1.jsonl"] and 1 in shares["done.replica-0.jsonl"]  # written again
    assert summary.extracted == 6


def test_a_conversation_given_up_leaves_the_others_lines_and_files_and_says_so(scale):
    settings, use_ray = scale
    use_ray(PoisonedConversation)
    with pytest.raises(ExtractionFailed) as failed:
        run(replace(settings("ray"), data_parallel_size=3))
    message = str(failed.value)
    assert message.startswith("1 samples were not extracted") and message.count("ValueError: boom") == 2
    assert "samples [3] (" in message
    out = Path(settings("ray").output_dir)
    assert sorted(int(p.stem.split("_")[1]) for p in out.glob("data_*.pt")) == [0, 1, 4, 5, 6]
    # the lines after the batch given up are written too: their conversations are done
    assert [json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()] \
        == [0, 1, 4, 5, 6]


def test_a_batch_whose_call_raised_is_regenerated_whole_elsewhere(scale):
    settings, use_ray = scale
    run(settings("single"))
    use_ray(faults={0: ("raise", 2)})  # replica 0's second call and later raise: it is retired
    summary, said = run(replace(settings("ray"), data_parallel_size=2))
    assert any(line.startswith("replica 0 failed on samples") for line in said)
    assert_same_output(Path(settings("ray").output_dir), Path(settings("single").output_dir))
    assert summary.extracted == 6


def test_a_stopped_ray_run_resumes_without_redoing_anything(scale):
    settings, use_ray = scale
    run(settings("single"))
    use_ray()
    first, _ = run(replace(settings("ray"), data_parallel_size=2, max_samples=4))
    out = Path(settings("ray").output_dir)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("data_*.pt")}
    assert first.extracted == 3 and sorted(stamps) == ["data_0.pt", "data_1.pt", "data_3.pt"]
    use_ray()
    second, _ = run(replace(settings("ray"), data_parallel_size=2))
    assert (second.extracted, second.skipped) == (3, 3)
    assert all(p.stat().st_mtime_ns == stamps[p.name] for p in out.glob("data_*.pt") if p.name in stamps)
    assert_same_output(out, Path(settings("single").output_dir))


def test_a_conversation_whose_line_was_lost_is_regenerated(scale):
    """Files whole, line missing (a run killed between them, or a driver killed holding it): not done."""
    settings, _ = scale
    run(settings("single"))
    out = Path(settings("single").output_dir)
    lines = (out / "regenerated.jsonl").read_text().splitlines()
    (out / "regenerated.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["index"] != 3))
    summary, _ = run(settings("single"))
    assert (summary.extracted, summary.skipped) == (1, 5)
    assert sorted(json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()) \
        == [0, 1, 3, 4, 5, 6]


def test_static_shards_own_every_nth_batch_of_conversations_and_their_union_is_one_process(scale):
    settings, _ = scale
    run(settings("single", batch_size=2))
    single, out = Path(settings("single").output_dir), Path(settings("shards").output_dir)
    first, _ = run(settings("shards", batch_size=2, shard=Shard(0, 2, "--shard")))
    # conversations 0-1 and 4-5 (batches 0 and 2 of two; the tool-turn conversation 2 is in batch 1)
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_1.pt", "data_4.pt", "data_5.pt"]
    assert first.extracted == 4
    second, _ = run(settings("shards", batch_size=2, shard=Shard(1, 2, "--shard")))
    assert second.extracted == 2
    assert sorted(ledgers(out)) == ["done.shard-0-of-2.jsonl", "done.shard-1-of-2.jsonl"]
    parts = {p.name: [json.loads(line)["index"] for line in p.read_text().splitlines()]
             for p in out.glob("regenerated.shard-*.jsonl")}
    assert parts == {"regenerated.shard-0-of-2.jsonl": [0, 1, 4, 5], "regenerated.shard-1-of-2.jsonl": [3, 6]}
    assert_same_output(out, single)  # the shard that ended last merged every shard's lines
    said = status(out)
    assert "regenerated.shard-0-of-2.jsonl: 4 conversations" in said and "done.shard-1-of-2.jsonl: 2 files" in said
    assert "regenerated.jsonl: 6 conversations" in said
    # a run that is no shard finds everything done, folds the shards' files into regenerated.jsonl
    again, _ = run(settings("shards", batch_size=2))
    assert (again.extracted, again.skipped) == (0, 6)
    assert not list(out.glob("regenerated.shard-*.jsonl"))
    assert_same_output(out, single)


@pytest.mark.datasets
def test_shards_number_per_reply_rows_as_one_process_does(scale):
    settings, _ = scale
    run(settings("single", "speculators-0.5"))
    for index in range(3):
        run(settings("shards", "speculators-0.5", shard=Shard(index, 3, "--shard")))
    out = Path(settings("shards").output_dir)
    assert_same_output(out, Path(settings("single").output_dir))
    lines = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert {line["index"]: line["sample_indices"] for line in lines} == PER_REPLY


def test_generate_takes_the_scale_out_flags_as_extract_does(scale):
    """The CLI's door: ``--data-parallel-size`` and ``--ray-address`` give a generation on Ray replicas, ``--shard``
    a shard's Generation."""
    from hidden_states.cli import runs

    settings, use_ray = scale
    use_ray()
    sampling = Sampling()
    assert runs.extraction_for(replace(settings("a"), data_parallel_size=2), sampling).on_ray
    assert runs.extraction_for(replace(settings("a"), ray_address="auto"), sampling).on_ray
    shard = runs.extraction_for(replace(settings("a"), shard=Shard(1, 2, "--shard")), sampling)
    assert type(shard) is Generation and shard.source.tag == "shard-1-of-2" and not shard.on_ray
    assert type(runs.extraction_for(settings("a"))) is Extraction
