"""``hidden-states generate``'s parts with small fakes: the worker storing decode rows in a request's
region, the backend's replies and their rows (copied from the reply's region where vLLM's prefix
cache spared them), what is regenerated of a conversation, the rows matched with their replies
(re-rendered ones counted), and bad input (one line, exit 2). Real vLLM runs it in
tests/e2e/test_generate.py, compared with vLLM's own generation and with HF."""
import gc
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hidden_states.backends import BackendSettings, Reply, Sampling
from hidden_states.backends.engine_feed import EngineFeed
from hidden_states.backends.shared.regions import FIRST_ROW, HEADER, REGION, REWRITTEN, SECOND, RegionPool, layer_start
from hidden_states.backends.engine_replies import ROW_TAIL
from hidden_states.backends.vllm_engine import VllmEngineBackend
from hidden_states.cli import main
from hidden_states.inputs.conversations import Conversation
from hidden_states.generate.regeneration import NO_USER_TURN, TOOL_TURNS, Regeneration, RowSource, Tally, kept, row_source
from hidden_states.inputs.tokenization import common_prefix
from tests.unit.fakes import FakeGenerating
from tests.unit.multi_turn import fake_backends
from tests.unit.streaming_worker import HIDDEN, LAYERS, WAIT, rows_of, worker

pytestmark = pytest.mark.usefixtures("vllm_imported")

# -- the worker: decode rows land at their positions


def step(extension, order, tokens, starts, ids):
    """One forward: ``ids`` its input ids in ``order``; each layer's row = 1000 * layer + the id."""
    extension._hidden_states_step = (tokens, starts)
    extension._hidden_states_input_ids = torch.tensor(ids)
    extension._hidden_states_positions = torch.tensor([starts[r] + i for r in order for i in range(tokens[r])])
    extension._store_captured_states([torch.tensor([[1000.0 * layer + i] * HIDDEN for i in ids])
                                      for layer in range(LAYERS)])


def test_decode_rows_are_stored_at_their_positions_up_to_the_regions_length(capture):
    # r1: prompt of 3, region for 3 + 3 new tokens; r2: prompt of 2, region for 2 + 1
    prompts = {"r1": [11, 12, 13], "r2": [21, 22]}
    extension = worker(capture, {"r1": (0, 6), "r2": (2048, 3)}, order=["r1", "r2"])
    extension._hidden_states_prompts = dict(prompts)
    step(extension, ["r1", "r2"], {"r1": 3, "r2": 2}, {"r1": 0, "r2": 0}, [11, 12, 13, 21, 22])
    # decode steps: each feeds back the token sampled last (ids not in any prompt), rows in another
    # order than the runner's batch once
    step(extension, ["r1", "r2"], {"r1": 1, "r2": 1}, {"r1": 3, "r2": 2}, [14, 23])
    extension.model_runner.input_batch.req_ids = ["r2", "r1"]
    step(extension, ["r2", "r1"], {"r1": 1, "r2": 1}, {"r1": 4, "r2": 3}, [24, 15])  # r2's row is past its region
    stored, ids, data = rows_of(extension, capture, 0, 6)
    assert stored == 5 and ids[:5] == [11, 12, 13, 14, 15]
    assert data[1, :5, 0].tolist() == [1000.0 + i for i in (11, 12, 13, 14, 15)]
    stored, ids, data = rows_of(extension, capture, 2048, 3)
    assert stored == 3 and ids == [21, 22, 23]


def test_a_second_request_in_a_region_writes_its_own_counters(capture):
    """A training row prefilled in its reply's region (counters SECOND) counts there; the reply's
    counters keep what the reply's steps wrote."""
    extension = worker(capture, {"reply": (0, 6)}, order=["reply"])
    extension._hidden_states_prompts = {"reply": [11, 12, 13]}
    step(extension, ["reply"], {"reply": 3}, {"reply": 0}, [11, 12, 13])
    step(extension, ["reply"], {"reply": 1}, {"reply": 3}, [14])
    extension._hidden_states_regions["row"] = (0, 6, SECOND)
    extension._hidden_states_prompts["row"] = [11, 12, 13, 14, 15, 16]
    extension.model_runner.input_batch.req_ids = ["row"]
    step(extension, ["row"], {"row": 3}, {"row": 3}, [14, 15, 16])  # the cache held its first 3 rows
    host = extension._hidden_states_host
    assert host[0:16].view(torch.int64).tolist() == [4, 0]  # the reply's: 4 rows from position 0
    assert host[SECOND:SECOND + 16].view(torch.int64).tolist() == [6, 3]  # the row's: up to 6, from position 3
    stored, ids, data = rows_of(extension, capture, 0, 6)
    assert ids == [11, 12, 13, 14, 15, 16] and data[1, :, 0].tolist() == [1000.0 + i for i in range(11, 17)]


def test_order_by_rows_takes_a_decode_row_for_any_id_and_still_checks_prompt_rows(capture):
    prompts = {"r1": [1, 2], "r2": [5, 6, 7]}
    # r2 still in its prompt (position 2), r1 decoding at position 2
    assert capture.order_by_rows(["r1", "r2"], {"r1": 1, "r2": 1}, {"r1": 2, "r2": 2}, prompts, [7, 99], [2, 2]) \
        == ["r2", "r1"]
    with pytest.raises(RuntimeError, match="hold none of the scheduled requests"):
        capture.order_by_rows(["r1", "r2"], {"r1": 1, "r2": 1}, {"r1": 2, "r2": 2}, prompts, [8, 99], [2, 2])


# -- the backend: replies, then their rows

BLOCK = 4  # the fake prefix cache's block


class GenerationEngine:
    """vLLM's engine in miniature: a generation request gets ``replies[prompt]``, its worker storing
    every row but the last token's; a row request's prefix-cache hit is what its salt's generation
    computed, in whole blocks (``extra_hit`` more: a cache gone wrong). A row's state at layer l of
    token t at position p: 1000 * l + 10 * p + t."""

    def __init__(self, pool, row_bytes, replies, extra_hit=0, misattribute=False, rows_land=True):
        self.pool, self.row_bytes, self.replies = pool, row_bytes, replies
        self.extra_hit, self.misattribute = extra_hit, misattribute
        self.rows_land = rows_land  # False: a row request's count is never written (its copies never land)
        self.queue, self.computed, self.params = [], {}, []

    def add_request(self, request_id, prompt, params):
        self.params.append(params)
        self.queue.append((request_id, prompt["prompt_token_ids"], prompt.get("cache_salt"), params))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def write(self, offset, length, counters, ids, start, end, count=True):
        stored = self.pool.view(offset + HEADER, torch.int32, length)
        stored[start:end] = torch.tensor(ids[start:end])
        for layer in range(LAYERS):
            rows = self.pool.view(offset + layer_start(length, layer, self.row_bytes), torch.float32,
                                  length * HIDDEN).view(length, HIDDEN)
            for p in range(start, end):
                rows[p] = 1000.0 * layer + 10 * p + ids[p]
        self.pool.view(offset + counters + FIRST_ROW, torch.int64, 1).fill_(start)
        if count:
            self.pool.view(offset + counters, torch.int64, 1).fill_(end)

    def step(self):
        request_id, ids, salt, params = self.queue.pop(0)
        offset, length, counters = params.extra_args[REGION]
        if params.max_tokens > 1:
            generated = self.replies[tuple(ids)]
            full = ids + generated
            self.write(offset, length, counters, full, 0, len(full) - 1)
            if self.misattribute:
                self.pool.view(offset + HEADER, torch.int32, 1).fill_(-5)
            self.computed[salt] = full[:-1]
            completion = SimpleNamespace(token_ids=generated, text=f"reply {generated}", finish_reason="stop")
            return [SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=ids, outputs=[completion])]
        hit = common_prefix(ids, self.computed.get(salt, [])) // BLOCK * BLOCK + self.extra_hit
        self.write(offset, length, counters, ids, min(hit, len(ids) - 1), len(ids), count=self.rows_land)
        return [SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=ids, outputs=[])]


def generating_backend(replies, **engine_options):
    backend = VllmEngineBackend(BackendSettings(model_path="unused", layer_ids=[1, 3], max_seq_len=32, tp_size=1,
                                                gpu_memory_utilization=0.1, sequences_in_flight=8))
    backend._layout = {"dtype": "float32", "hidden_size": HIDDEN, "scales": False}
    backend.rows_timeout = 1.0
    backend.row_bytes = HIDDEN * 4
    backend.pool = RegionPool(8 * backend.region_bytes(32))
    engine = GenerationEngine(backend.pool, HIDDEN * 4, replies, **engine_options)
    backend._llm = SimpleNamespace(llm_engine=engine)
    backend._feed = EngineFeed(engine, backend.params, backend.finished, backend.failed)
    return backend, engine


def expected_rows(ids):
    return [[1000.0 * layer + 10 * p + t for p, t in enumerate(ids)] for layer in range(LAYERS)]


PROMPT, GENERATED = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 2]


def test_replies_hold_every_fed_row_and_their_rows_are_prefilled_in_place_or_copied_then_computed():
    backend, engine = generating_backend({tuple(PROMPT): GENERATED, (1, 2, 3): [4, 5, 2]})
    try:
        sampling = Sampling(temperature=0.0, max_new_tokens=8, seed=3)
        replies = [backend.answer(prompt, sampling).result(timeout=WAIT) for prompt in (PROMPT, [1, 2, 3])]
        assert [(r.generated, r.stored, r.capacity) for r in replies] == [(GENERATED, 12, 14 + ROW_TAIL),
                                                                           ([4, 5, 2], 5, 11 + ROW_TAIL)]
        assert engine.params[0].max_tokens == 8 and engine.params[0].seed == 3
        assert replies[0].salt != replies[1].salt  # a request's blocks are shared with its own rows only
        # the template reproduces the first reply (plus a token), re-renders the second from position 4
        rows = [PROMPT + GENERATED + [40], [1, 2, 3, 4, 6, 7]]
        states = backend.row_states(rows, replies).result(timeout=WAIT)
        for row, layers in zip(rows, states):
            assert [layer[:, 0].tolist() for layer in layers] == expected_rows(row)
        # the first row goes on from its whole reply: prefilled in the reply's region, its own counters
        assert tuple(engine.params[2].extra_args[REGION]) == (replies[0].offset, replies[0].capacity, SECOND)
        # the second was re-rendered: a region of its own, its first rows copied into it
        offset, length, counters = engine.params[3].extra_args[REGION]
        assert (length, counters) == (6, 0) and offset not in {reply.offset for reply in replies}
        # first row: 12 rows held, the cache's whole blocks (12) kept where they are; second: 4 shared, 4 copied
        assert backend.reply_rows_reused == 12 + 4
        backend.release_replies(replies)  # the first reply's region is its row's now: released with its states
        assert replies[0].offset in backend.pool._reserved and replies[1].offset not in backend.pool._reserved
        del states, layers
        gc.collect()
        assert backend.pool._reserved == {}
    finally:
        backend.close()


def test_rows_with_states_from_their_reply_are_counted_apart_from_rows_prefilled_again_whole():
    """The summary's one-pass rows: a row vLLM's prefix cache gives any of its reply's states, counted
    with its tokens; a row sharing less than a block with its reply gets none: prefilled again whole."""
    backend, engine = generating_backend({tuple(PROMPT): GENERATED, (1, 2, 3): [4, 5, 2]})
    try:
        sampling = Sampling(max_new_tokens=8)
        replies = [backend.answer(prompt, sampling).result(timeout=WAIT) for prompt in (PROMPT, [1, 2, 3])]
        rows = [PROMPT + GENERATED + [40], [1, 2, 9, 9, 9]]  # the second shares 2 tokens, under a block (4)
        states = backend.row_states(rows, replies).result(timeout=WAIT)
        assert (backend.rows_from_replies, backend.reply_rows_reused) == (1, 12)
        del states
        backend.release_replies(replies)
    finally:
        backend.close()


def test_a_late_count_of_a_reply_is_never_taken_for_the_row_prefilled_in_its_region():
    """A step vLLM scheduled for the reply before it finished writes the reply's count late; the row in
    its region waits for its own counters (here never written: its copies never land) and fails."""
    backend, _ = generating_backend({tuple(PROMPT): GENERATED}, rows_land=False)
    try:
        reply = backend.answer(PROMPT, Sampling(max_new_tokens=8)).result(timeout=WAIT)
        backend.pool.view(reply.offset, torch.int64, 1).fill_(len(reply.ids))  # the late count
        with pytest.raises(RuntimeError, match="the worker stored 0 of 13 rows for batch position 0"):
            backend.row_states([PROMPT + GENERATED], [reply]).result(timeout=WAIT)
    finally:
        backend.close()


@pytest.mark.parametrize("rows", [
    [PROMPT + GENERATED[:3]],  # ends within its reply: a step for the reply may still store past it
    [PROMPT + GENERATED + [40] * (ROW_TAIL + 2)],  # longer than its reply's region
    [PROMPT + GENERATED[:2], PROMPT + GENERATED + [40]],  # two rows of one reply
])
def test_a_row_that_cannot_take_its_replys_region_gets_its_own(rows):
    backend, engine = generating_backend({tuple(PROMPT): GENERATED})
    try:
        reply = backend.answer(PROMPT, Sampling(max_new_tokens=8)).result(timeout=WAIT)
        states = backend.row_states(rows, [reply] * len(rows)).result(timeout=WAIT)
        for row, layers in zip(rows, states):
            assert [layer[:, 0].tolist() for layer in layers] == expected_rows(row)
        assert [tuple(params.extra_args[REGION])[2] for params in engine.params[1:]] == [0] * len(rows)
        del states, layers
        backend.release_replies([reply])
        gc.collect()
        assert backend.pool._reserved == {}
    finally:
        backend.close()


class Sink:
    """A reply stream's sink that keeps what it is given (token-major rows as float32)."""

    def __init__(self):
        self.rows, self.kept, self.taken, self.discarded, self.error = 0, None, [], False, None

    def append(self, rows):
        self.taken.append(rows.view(torch.float32))
        self.rows += len(rows)

    def fail(self, error):
        self.error = error

    def discard(self):
        self.discarded = True


def streamed_rows(sink):
    return torch.cat(sink.taken)[:, :, 0].T.tolist()  # [layers, rows], each row's first value


@pytest.mark.parametrize("rewritten", [None, 5])
def test_a_replys_stream_takes_its_counted_rows_and_keeps_those_its_in_place_row_did_not_compute(rewritten):
    """The rows a reply's region counts go to its stream token-major; its row, prefilled in place,
    computes from the cache's last whole block on, and a row stored again (``REWRITTEN``, a preempted
    request recomputed) lowers what the stream keeps."""
    backend, _ = generating_backend({tuple(PROMPT): GENERATED})
    try:
        sink = Sink()
        reply = backend.answer(PROMPT, Sampling(max_new_tokens=8), stream=sink).result(timeout=WAIT)
        backend.replies.streams.copy_round()
        assert sink.rows == len(PROMPT + GENERATED) - 1 and streamed_rows(sink) == expected_rows(reply.ids[:-1])
        if rewritten is not None:
            backend.pool.view(reply.offset + REWRITTEN, torch.int64, 1).fill_(rewritten)
        states = backend.row_states([PROMPT + GENERATED + [40]], [reply]).result(timeout=WAIT)
        assert sink.kept == (12 if rewritten is None else rewritten) and not sink.discarded  # 12: 3 whole blocks
        backend.pool.view(reply.offset, torch.int64, 1).fill_(len(reply.ids))  # a late count of the reply's
        backend.replies.streams.copy_round()
        assert sink.rows == 12  # no copy after the row's prefill began
        del states
    finally:
        backend.close()


def test_a_replys_stream_is_discarded_when_its_row_takes_its_own_region_or_the_reply_is_given_back():
    backend, _ = generating_backend({tuple(PROMPT): GENERATED, (1, 2, 3): [4, 5, 2]})
    try:
        sinks = [Sink(), Sink()]
        replies = [backend.answer(prompt, Sampling(max_new_tokens=8), stream=sink).result(timeout=WAIT)
                   for prompt, sink in zip((PROMPT, [1, 2, 3]), sinks)]
        states = backend.row_states([PROMPT + GENERATED[:3]], [replies[0]]).result(timeout=WAIT)  # not in place
        assert sinks[0].discarded and sinks[0].kept is None
        backend.release_replies(replies)
        assert sinks[1].discarded and backend.replies.streams._followed == {}
        del states
    finally:
        backend.close()


def test_a_row_given_more_cached_tokens_than_its_reply_holds_fails():
    backend, _ = generating_backend({tuple(PROMPT): GENERATED}, extra_hit=BLOCK)
    try:
        replies = [backend.answer(PROMPT, Sampling(max_new_tokens=8)).result(timeout=WAIT)]
        with pytest.raises(RuntimeError, match="its first 7 tokens, and its reply's region holds 6 of them"):
            backend.row_states([PROMPT + [99, 98]], replies).result(timeout=WAIT)
    finally:
        backend.close()


def test_a_reply_whose_rows_hold_other_tokens_fails():
    backend, _ = generating_backend({tuple(PROMPT): GENERATED}, misattribute=True)
    try:
        with pytest.raises(RuntimeError, match="attributed rows to the wrong request"):
            backend.answer(PROMPT, Sampling(max_new_tokens=8)).result(timeout=WAIT)
    finally:
        backend.close()


# -- what is regenerated, and the rows


def test_system_and_user_turns_are_kept_assistant_turns_dropped():
    chat = Conversation([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "old"}, {"role": "user", "content": ""},
                         {"role": "user", "content": "and?"}, {"role": "assistant", "content": "old 2"}])
    what = kept(chat)
    assert what.turns == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "user", "content": "and?"}]
    assert what.replies == 2 and what.skip is None
    assert kept(Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                                 "tool_calls": [{}]}])).skip == TOOL_TURNS
    assert kept(Conversation([{"role": "system", "content": "s"}])).skip == NO_USER_TURN


def test_each_user_turn_is_answered_after_the_replies_before_it():
    regen = Regeneration(0, "f:1", 1, kept(Conversation([{"role": "system", "content": "s"},
                                                         {"role": "user", "content": "a"},
                                                         {"role": "user", "content": "b"}])))
    assert regen.next_prompt() == [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]
    regen.answered(SimpleNamespace(text="A"))
    assert regen.next_prompt()[-2:] == [{"role": "assistant", "content": "A"}, {"role": "user", "content": "b"}]
    regen.answered(SimpleNamespace(text="B"))
    assert regen.next_prompt() is None
    assert [m["role"] for m in regen.messages] == ["system", "user", "assistant", "user", "assistant"]


def reply(prompt, generated, stored=None):
    return Reply(prompt, generated, "", "stop", 0, 0, len(prompt) + len(generated) - 1 if stored is None else stored,
                 "salt")


def test_a_row_takes_the_reply_sharing_most_of_its_start():
    first, second = reply([1, 2], [3, 9]), reply([1, 2, 3, 9, 4], [5, 9])
    assert row_source([1, 2, 3, 9, 4, 5, 9], [first, second]) == RowSource(1, 6, False)  # the last token: not stored
    assert row_source([1, 2, 3, 9], [first, second]) == RowSource(0, 3, False)
    assert row_source([1, 2, 3, 7, 9], [first, second]) == RowSource(0, 3, True)  # the template rewrote the reply
    assert row_source([1, 2, 3], [first]) == RowSource(0, 3, False)  # a row cut by --max-seq-len within the reply


def test_a_per_turn_row_the_template_rerenders_takes_its_own_turns_reply():
    """The first turn's row renders its reply's last token otherwise ([3, 8]: generated [3, 9]); the
    second turn's prompt holds that rendering, so it shares more of the first row than the first
    reply does: the row is still the first reply's (its prompt begins the row, the second's does not)."""
    first, second = reply([1, 2], [3, 9]), reply([1, 2, 3, 8, 4], [5, 9])
    assert row_source([1, 2, 3, 8], [first, second]) == RowSource(0, 3, True)
    assert row_source([1, 2, 3, 8, 4, 5, 7], [first, second]) == RowSource(1, 6, True)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from hidden_states.fixtures.chat_templates import build_tokenizer
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer

    path = build_tokenizer("llama3", tmp_path_factory.mktemp("llama3"))
    return ChatTokenizer(load_tokenizer(str(path)), "speculators-0.3", 256)


def test_llama3_rows_reproduce_a_reply_unless_the_template_trims_it(llama3):
    """Llama-3's template renders a reply as its content (trimmed), then <|eot_id|>: a reply ending
    on the sampled <|eot_id|> is the row itself; one with spaces around it is re-rendered."""
    from hidden_states.inputs.conversations import MESSAGES, Record

    tokenizer = llama3.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "capital of France?"}]
    prompt = llama3.prompt_ids(messages)
    tally = Tally()
    for text, rerendered in (("Paris is the capital", False), ("  Paris  ", True)):
        generated = tokenizer(text, add_special_tokens=False)["input_ids"] + [eot]
        row = llama3.rows(Record("f:1", 1, {"messages": [*messages, {"role": "assistant", "content": text}]}),
                          MESSAGES)[0]
        source = row_source(row.input_ids, [reply(prompt, generated)])
        assert source.rerendered == rerendered
        tally.rows, tally.rerendered = tally.rows + 1, tally.rerendered + source.rerendered
        if not rerendered:
            assert row.input_ids == prompt + generated and source.reused == len(row.input_ids) - 1
        trained = [t for t, m in zip(row.input_ids, row.loss_mask) if m]
        assert tokenizer.decode(trained).strip() == text.strip()  # the reply's tokens, nothing of the prompt
        assert not any(row.loss_mask[:len(prompt)])
    tally.one_pass_rows = 1
    assert "2 rows, 1 re-rendered by the chat template, 0 prefilled in their reply's region; 1 of 2 rows from the " \
        "generation's own states (one pass), 1 prefilled again whole; 40 row tokens from the generation's states, " \
        "3 computed again" in tally.line(40, 3)


# -- bad input: one line, exit 2


def generate(model, data, out, *extra):
    return main(["generate", "--model-path", str(model), "--data", str(data), "--output-dir", str(out),
                 "--format", "speculators-0.3", "--layer-ids", "0", "2", *extra])


CHAT = '{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("lines, extra, message", [
    (['{"input_ids": [5, 6]}'], (), "data.jsonl:1: a tokenized row; generate regenerates conversations"),
    ([CHAT], ("--backend", "speculators"), "--backend speculators: generate runs on --backend vllm-engine"),
    ([CHAT], ("--backend", "vllm-native"), "--backend vllm-native: generate runs on --backend vllm-engine (under "
                                           "vLLM's extract_hidden_states, greedy replies"),
    ([CHAT], ("--max-new-tokens", "64", "--max-seq-len", "64"), "--max-new-tokens 64: must be below --max-seq-len 64"),
    ([CHAT], ("--shard", "2/2"), "--shard '2/2': needs 0 <= I < N"),
    ([CHAT], ("--temperature", "-0.5"), "--temperature -0.5: must be at least 0"),
    ([CHAT], ("--top-p", "0"), "--top-p 0.0: must be more than 0 and at most 1"),
    ([CHAT, '{"text": "plain"}'], ("--skip-forward-check",), "data.jsonl:2: a text row; generate regenerates"),
    ([], (), "data.jsonl: no conversations"),
])
def test_bad_input_is_one_line_and_exit_2(chat_model, tmp_path, capsys, monkeypatch, lines, extra, message):
    monkeypatch.setattr("hidden_states.run.model_here.ModelHere.load", lambda self: pytest.fail("the model loaded"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    assert generate(chat_model, data, tmp_path / "out", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


def test_the_sampling_is_part_of_the_output_directorys_identity():
    from hidden_states.inputs.identity import difference

    base = {"model": "m", "layer_ids": [1], "format": "f", "state_dtype": "model",
            "input": {"resolved": "x"}, "tokenization": {}}
    assert difference({**base, "generation": {"temperature": 0.0}}, {**base, "generation": {"temperature": 0.7}}) \
        == "generation {'temperature': 0.0}, this run {'temperature': 0.7}"
    assert difference({**base}, {**base, "generation": {"temperature": 0.0}}).startswith("generation None")
    assert difference(base, dict(base)) is None



# -- the run around a fake backend: rows, indices per layout, regenerated.jsonl, resume


@pytest.fixture
def fake_run(chat_model, tmp_path, monkeypatch):
    made = fake_backends(monkeypatch, chat_model, FakeGenerating)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in [
        {"messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": "one"},
                      {"role": "assistant", "content": "x"}, {"role": "user", "content": "two"}]},
        {"messages": [{"role": "user", "content": "tool?"}, {"role": "tool", "content": "{}"}]},
        {"conversations": [{"from": "human", "value": "three"}, {"from": "gpt", "value": "y"}]},
    ]) + "\n")
    return chat_model, data, made


def run_generation(model, data, out, layout, *extra):
    from hidden_states.generate.command import Generation
    from hidden_states.settings import Settings

    given = {"batch_size": 2, "layer_ids": [0, 2] if layout == "speculators-0.3" else [1, 3], **dict(extra)}
    settings = Settings(model_path=str(model), prepared_data=str(data), output_dir=str(out), backend="vllm-engine",
                        format=layout, max_seq_len=256, forward_check=False, **given)
    lines = []
    generation = Generation(settings, Sampling(max_new_tokens=16), log=lines.append)
    return generation.run(), generation, lines


def test_generate_opens_its_input_once_and_loads_the_tokenizer_once(fake_run, tmp_path, monkeypatch):
    """The plan's input stream is the one the conversations are read from, and its chat tokenizer
    the one the prompts, the rows and token_freq.pt use: one open of the input, one tokenizer load
    (the negative: each reader opening its own counts more); token_freq.pt is prepare's of the
    regenerated rows, after a conversation regenerated again too."""
    import importlib.util

    from hidden_states import extras
    from hidden_states.inputs import conversations, tokenization
    from hidden_states.output.formats import speculators_05

    model, data, _ = fake_run
    opened, loaded = [], []
    real_open, real_load = conversations.open_source, tokenization.load_tokenizer

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    def counting_load(*args, **kwargs):
        loaded.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(conversations, "open_source", counting_open)
    monkeypatch.setattr(tokenization, "load_tokenizer", counting_load)
    if importlib.util.find_spec("datasets") is None:  # the sample files and token_freq.pt are written all the same
        monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
        monkeypatch.setattr(speculators_05, "write_dataset", lambda directory, count: None)
    # speculators-0.5: the layout whose trainer reads token_freq.pt
    summary, _, _ = run_generation(model, data, tmp_path / "out", "speculators-0.5")
    assert summary.extracted == 3 and (tmp_path / "out" / "token_freq.pt").is_file()
    assert opened.count(data.name) == 1, opened
    assert len(loaded) == 1, loaded
    # the negative: prepare reading the regenerated rows with its own stream loads a tokenizer of its own
    assert main(["prepare", "--model-path", str(model), "--data", str(tmp_path / "out" / "regenerated.jsonl"),
                 "--output", str(tmp_path / "prepared" / "rows.jsonl"), "--format", "speculators-0.5",
                 "--max-seq-len", "256"]) == 0
    assert len(loaded) == 2
    prepared = torch.load(tmp_path / "prepared" / "token_freq.pt", weights_only=True)
    assert prepared and torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True) == prepared
    # a conversation regenerated again (its reply's file gone; the fake's new reply is another): prepare's
    # counts of the rows, the one conversation redone included
    (tmp_path / "out" / "hidden_states" / "hs_2.safetensors").unlink()
    summary, _, _ = run_generation(model, data, tmp_path / "out", "speculators-0.5")
    assert summary.extracted == 1
    assert main(["prepare", "--model-path", str(model), "--data", str(tmp_path / "out" / "regenerated.jsonl"),
                 "--output", str(tmp_path / "again" / "rows.jsonl"), "--format", "speculators-0.5",
                 "--max-seq-len", "256"]) == 0
    again = torch.load(tmp_path / "again" / "token_freq.pt", weights_only=True)
    assert again != prepared and torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True) == again


def test_a_run_writes_one_row_per_conversation_and_resumes(fake_run, tmp_path):
    model, data, made = fake_run
    out = tmp_path / "out"
    summary, generation, lines = run_generation(model, data, out, "speculators-0.3")
    assert summary.extracted == 2 and sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_2.pt"]
    regenerated = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample_indices"]) for r in regenerated] == [(0, [0]), (2, [2])]
    assert [m["content"] for m in regenerated[0]["messages"]] == ["brief", "one", "ok 1", "two", "ok 3"]
    saved = torch.load(out / "data_0.pt", weights_only=True)
    row = generation.chat.rows(__import__("hidden_states.inputs.conversations", fromlist=["Record"]).Record(
        "x", 1, {"messages": regenerated[0]["messages"]}), "messages")[0]
    assert saved["input_ids"].tolist() == row.input_ids and saved["loss_mask"].tolist() == row.loss_mask
    assert saved["hidden_states"][1][:, 0].tolist() == [2000.0 + p for p in range(len(row.input_ids))]
    assert len(made[0].released) == 3  # every reply's region given back
    said = next(line for line in lines if "conversations regenerated" in line)
    assert "2 conversations regenerated (3 replies" in said and "1 skipped: conversations with tool turns" in said
    assert "2 of 2 rows from the generation's own states (one pass), 0 prefilled again whole" in said, said
    # a rerun finds everything finished: no engine start
    summary, _, _ = run_generation(model, data, out, "speculators-0.3")
    assert (summary.extracted, summary.skipped, len(made)) == (0, 2, 1)
    # a line whose rows are not all finished is dropped, and the conversation regenerated
    (out / "data_2.pt").unlink()
    summary, _, _ = run_generation(model, data, out, "speculators-0.3")
    assert (summary.extracted, summary.skipped, len(made)) == (1, 1, 2)
    assert [json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()] == [0, 2]
    # no token_freq.pt (speculators 0.3/0.4 read none, and their dataset would load it as a sample):
    # no file but the samples has a name ending in "pt"
    assert sorted(p.name for p in out.rglob("*pt")) == ["data_0.pt", "data_2.pt"]


class TimedReplies(FakeGenerating):
    """Replies that take time, as the engine's do: one to a prompt that says ``long`` resolves on a
    thread of its own once every event of ``long_until`` has happened (none: at once), any other at
    once; one to ``broken`` fails (the backend's checks of a reply's rows). ``events``: ("asked",
    "answered" or "rows", the prompt's last user turn), in the order they happened.

    The long reply waits for the events a test is about rather than for a time, so that what the
    test asks (did the run go on while the reply ran?) has the same answer on a busy host; a run
    that would not go on keeps it waiting for WAIT s, then the test's order assertion fails."""

    TURNS = ("second", "first", "long", "broken")  # the test conversations' user turns, latest first
    long_until: tuple = ()

    def __init__(self, settings, tokenizer):
        super().__init__(settings, tokenizer)
        self.events, self.timers = [], []
        self._happened = threading.Condition()

    def _note(self, event):
        with self._happened:
            self.events.append(event)
            self._happened.notify_all()

    def _after_events(self, finish):
        with self._happened:
            self._happened.wait_for(lambda: all(event in self.events for event in self.long_until), WAIT)
        finish()

    def answer(self, ids, sampling, stream=None, certified=False):
        from concurrent.futures import Future

        reply = super().answer(ids, sampling).result()
        said = self.tokenizer.decode(ids)
        turn = next(word for word in self.TURNS if word in said)
        self._note(("asked", turn))
        future = Future()

        def finish():
            self._note(("answered", turn))
            if turn == "broken":
                future.set_exception(RuntimeError("the states stored for a reply come from other tokens' rows"))
            else:
                future.set_result(reply)

        if turn == "long":
            self.timers.append(threading.Thread(target=self._after_events, args=(finish,)))
            self.timers[-1].start()
        else:
            finish()
        return future

    def row_states(self, rows, sources, certified=False):
        self._note(("rows", next(word for word in self.TURNS if word in self.tokenizer.decode(rows[0]))))
        return super().row_states(rows, sources)


def timed_run(fake_run, tmp_path, monkeypatch, conversations, *extra, replies=None, long_until=()):
    """A run of ``conversations`` on :class:`TimedReplies` (or ``replies``, a subclass) whose long
    reply comes once the events ``long_until`` have happened: (its backend, what the run returned or
    raised)."""
    from hidden_states import backends, interrupts
    from hidden_states.inputs.tokenization import load_tokenizer

    model, _, _ = fake_run
    tokenizer, made = load_tokenizer(str(model)), []

    def create(name, settings):
        made.append((replies or TimedReplies)(settings, tokenizer))
        made[-1].long_until = long_until
        return made[-1]

    monkeypatch.setattr(backends, "create", create)
    handle = interrupts.Interrupt._handle

    def noting(self, signum, frame):  # the run's signal handler: an event once it took the signal
        handle(self, signum, frame)
        made[-1]._note(("interrupt", signal.Signals(signum).name))

    monkeypatch.setattr(interrupts.Interrupt, "_handle", noting)
    data = tmp_path / "timed.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in conversations))
    try:
        result = run_generation(model, data, tmp_path / "out", "speculators-0.3", *extra)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        result = exc
    for timer in made[0].timers:
        timer.join()
    return made[0], result


def test_a_conversations_next_turn_is_asked_while_another_reply_still_runs(fake_run, tmp_path, monkeypatch):
    """Conversation 0's first reply comes at once, conversation 1's only once 0's second turn is asked:
    that turn is asked before 1's reply is in (a run staged per turn asks it after). Each conversation's rows
    are written once the batch is done, every reply given back."""
    backend, (summary, _, lines) = timed_run(fake_run, tmp_path, monkeypatch, [
        [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
        [{"role": "user", "content": "long"}]], long_until=[("asked", "second")])
    events = backend.events
    assert events.index(("asked", "second")) < events.index(("answered", "long")), events
    assert summary.extracted == 2 and len(backend.released) == 3
    regenerated = [json.loads(line) for line in (tmp_path / "out" / "regenerated.jsonl").read_text().splitlines()]
    assert [[m["content"] for m in line["messages"]] for line in regenerated] == \
        [["first", "ok 1", "second", "ok 3"], ["long", "ok 2"]]
    assert "2 conversations regenerated (3 replies" in next(line for line in lines if "regenerated (" in line)


def test_a_conversation_starts_as_soon_as_another_is_done_and_its_rows_go_out_at_once(fake_run, tmp_path,
                                                                                      monkeypatch):
    """Two conversations at once (``--batch-size 2``), three in the input, the first one's reply coming
    only once the others went on: the second's rows go to the writer and the third starts while the first still runs (a
    run of batches would wait for the first batch's longest reply before either). The lines are in
    input order all the same."""
    backend, (summary, _, lines) = timed_run(fake_run, tmp_path, monkeypatch, [
        [{"role": "user", "content": "long"}], [{"role": "user", "content": "first"}],
        [{"role": "user", "content": "second"}]], long_until=[("rows", "first"), ("asked", "second")])
    events = backend.events
    assert events.index(("rows", "first")) < events.index(("answered", "long")), events
    assert events.index(("asked", "second")) < events.index(("answered", "long")), events
    assert summary.extracted == 3 and len(backend.released) == 3
    regenerated = [json.loads(line) for line in (tmp_path / "out" / "regenerated.jsonl").read_text().splitlines()]
    assert [line["index"] for line in regenerated] == [0, 1, 2]
    assert [line["messages"][0]["content"] for line in regenerated] == ["long", "first", "second"]


class InterruptedReplies(TimedReplies):
    """:class:`TimedReplies`, with Ctrl-C pressed as the long reply is asked for."""

    def answer(self, ids, sampling, stream=None, certified=False):
        future = super().answer(ids, sampling)
        if self.events[-1] == ("asked", "long"):
            os.kill(os.getpid(), signal.SIGINT)
        return future


def test_ctrl_c_starts_no_conversation_and_lets_those_in_the_engine_finish(fake_run, tmp_path, monkeypatch):
    """One conversation at a time, Ctrl-C while the first one's long reply runs: it finishes and is
    written, no other starts, the run says it was interrupted; the same command again does the rest."""
    conversations = [[{"role": "user", "content": "long"}], [{"role": "user", "content": "first"}],
                     [{"role": "user", "content": "second"}]]
    backend, (summary, _, lines) = timed_run(fake_run, tmp_path, monkeypatch, conversations, ("batch_size", 1),
                                             replies=InterruptedReplies, long_until=[("interrupt", "SIGINT")])
    assert summary.interrupted == signal.SIGINT and summary.extracted == 1
    assert [event for event in backend.events if event[0] == "asked"] == [("asked", "long")]
    out = tmp_path / "out"
    assert [json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()] == [0]
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt"]
    backend, (summary, _, _) = timed_run(fake_run, tmp_path, monkeypatch, conversations, ("batch_size", 1))
    assert (summary.interrupted, summary.extracted, summary.skipped) == (None, 2, 1)
    assert [json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_reply_still_running_when_its_batch_fails_is_given_back_as_it_finishes(fake_run, tmp_path, monkeypatch):
    """Conversation 1's reply fails at once: the batch fails while conversation 0's reply still
    runs, and that reply's region is given back once it comes."""
    backend, raised = timed_run(fake_run, tmp_path, monkeypatch, [
        [{"role": "user", "content": "long"}], [{"role": "user", "content": "broken"}]],
        long_until=[("answered", "broken")])
    assert isinstance(raised, RuntimeError) and "come from other tokens' rows" in str(raised), raised
    assert backend.events == [("asked", "long"), ("asked", "broken"), ("answered", "broken"), ("answered", "long")]
    assert [reply.text for reply in backend.released] == ["ok 1"]


def test_the_range_counts_conversations_and_ends_before_start_index_plus_max_samples(fake_run, tmp_path):
    model, data, _ = fake_run
    # conversations 0 and 1 (1: tool turns, skipped); 2 lies at the range's end, outside it
    summary, _, _ = run_generation(model, data, tmp_path / "first", "speculators-0.3",
                                   ("start_index", 0), ("max_samples", 2))
    assert (summary.extracted, sorted(p.name for p in (tmp_path / "first").glob("data_*.pt"))) == (1, ["data_0.pt"])
    summary, _, _ = run_generation(model, data, tmp_path / "last", "speculators-0.3",
                                   ("start_index", 2), ("max_samples", 5))
    assert (summary.extracted, sorted(p.name for p in (tmp_path / "last").glob("data_*.pt"))) == (1, ["data_2.pt"])


@pytest.mark.datasets
def test_per_turn_rows_are_numbered_by_their_reply(fake_run, tmp_path):
    model, data, _ = fake_run
    out = tmp_path / "out"
    summary, _, _ = run_generation(model, data, out, "speculators-0.5")
    # conversation 0: replies 0 and 1; conversation 1 (tool turns, skipped) none; conversation 2: 2
    assert summary.extracted == 3
    regenerated = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [r["sample_indices"] for r in regenerated] == [[0, 1], [2]]
    assert sorted(p.name for p in (out / "hidden_states").glob("hs_*.safetensors")) == \
        [f"hs_{i}.safetensors" for i in range(3)]


@pytest.mark.datasets
@pytest.mark.parametrize("streamed", [True, False])
def test_per_reply_files_begun_while_generating_end_as_files_written_at_the_end(fake_run, tmp_path, monkeypatch,
                                                                               streamed):
    """speculators-0.5: a reply's file is begun as its rows land; the writer takes the rows its row's
    prefill computed again (the fake's stale ones) from the final states and finishes the header.
    Both ways give the same tensors; the files streamed are counted."""
    from hidden_states.output.formats.speculators_05 import read_sample
    from hidden_states.generate.command import STREAM_ENV

    model, data, _ = fake_run
    out = tmp_path / "out"
    if not streamed:
        monkeypatch.setenv(STREAM_ENV, "0")
    summary, generation, lines = run_generation(model, data, out, "speculators-0.5")
    assert generation.tally.streamed == (3 if streamed else 0)
    assert ("3 streamed to their files during generation" in lines[-1]) == streamed
    for index in range(3):
        sample = read_sample(out / "hidden_states" / f"hs_{index}.safetensors")
        tokens = sample["token_ids"].shape[0]
        expected = torch.stack([torch.arange(tokens, dtype=torch.float32)[:, None].repeat(1, 8) + 1000 * layer
                                for layer in (0, 2)], dim=1)  # --layer-ids 1 3 of speculators-0.5
        assert torch.equal(sample["hidden_states"], expected), index
        assert sample["loss_mask"].shape == (tokens,)
    assert not list(out.glob(".tmp-*"))


@pytest.mark.datasets
def test_prompts_with_no_reply_yet_make_per_reply_rows(fake_run, tmp_path):
    """speculators-0.5 reads no sample in a conversation without an assistant turn (``extract``'s view
    of the input, which the plan reads): generate's rows are the regenerated replies', one each."""
    model, _, _ = fake_run
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": word}]}) + "\n"
                            for word in ("one", "two", "three")))
    summary, _, _ = run_generation(model, data, tmp_path / "out", "speculators-0.5")
    assert summary.extracted == 3
    assert sorted(p.name for p in (tmp_path / "out" / "hidden_states").glob("hs_*.safetensors")) == \
        [f"hs_{i}.safetensors" for i in range(3)]


@pytest.mark.parametrize("first, then", [("speculators-0.3", "speculators-0.5"), ("speculators-0.5", "speculators-0.3")])
def test_a_rerun_in_the_other_format_is_refused_and_every_finished_file_kept(fake_run, tmp_path, monkeypatch,
                                                                             first, then):
    """generate with the other --format into a directory of finished rows (the real files of the
    first layout): refused before the engine starts, nothing changed (it removed them all)."""
    import importlib.util

    from hidden_states import extras
    from hidden_states.errors import OutputError
    from hidden_states.output.formats import speculators_05

    if importlib.util.find_spec("datasets") is None:  # the sample files are written all the same; not the index
        monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
        monkeypatch.setattr(speculators_05, "write_dataset", lambda directory, count: None)
    model, data, made = fake_run
    out = tmp_path / "out"
    summary, _, _ = run_generation(model, data, out, first)
    assert summary.extracted >= 2
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(OutputError, match=f"holds another extraction \\(.+\\) with {summary.extracted} finished samples: "
                                          f"use another --output-dir, or --start-over"):
        run_generation(model, data, out, then)
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert len(made) == 1  # no engine for the refused run


def no_room_for(save, name: str):
    """``torch.save`` as a full disk leaves it for the file ``name`` alone: ENOSPC."""
    import errno

    def saving(obj, f, *args, **kwargs):
        if name in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, f, *args, **kwargs)

    return saving


def test_regenerated_holds_exactly_the_conversations_whose_files_were_written_in_input_order(fake_run, tmp_path,
                                                                                           monkeypatch):
    """The report: after a full disk, regenerated.jsonl held a line whose file was never written, went
    out of input order after the resume, and the summary counted 151 of 150. A line is written once
    its rows' files are whole; a resumed run leaves the file in input order; the counts add up."""
    model, data, _ = fake_run
    out = tmp_path / "out"
    real_save = torch.save
    monkeypatch.setattr(torch, "save", no_room_for(real_save, "data_2.pt"))
    with pytest.raises(Exception, match="no space left on device"):  # one conversation at a time: 0 is whole
        run_generation(model, data, out, "speculators-0.3", ("batch_size", 1))
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt"]
    assert [json.loads(line)["index"] for line in (out / "regenerated.jsonl").read_text().splitlines()] == [0]
    monkeypatch.setattr(torch, "save", real_save)
    summary, _, _ = run_generation(model, data, out, "speculators-0.3")
    assert (summary.extracted, summary.skipped) == (1, 1)
    # conversation 0's file lost: the rerun regenerates it, and its line goes back before 2's
    (out / "data_0.pt").unlink()
    summary, _, _ = run_generation(model, data, out, "speculators-0.3")
    assert (summary.extracted, summary.skipped) == (1, 1)
    regenerated = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert [line["index"] for line in regenerated] == [0, 2]


def test_a_failed_generate_counts_what_is_written_and_what_is_not_in_samples(fake_run, tmp_path, monkeypatch):
    """The stop summary's three counts are of samples, and make the range: the conversation whose file
    the disk refused is not extracted, once."""
    from hidden_states.generate.command import Generation
    from hidden_states.settings import Settings

    model, data, _ = fake_run
    real_save = torch.save
    monkeypatch.setattr(torch, "save", no_room_for(real_save, "data_2.pt"))
    settings = Settings(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                        backend="vllm-engine", format="speculators-0.3", max_seq_len=256, forward_check=False,
                        batch_size=1, layer_ids=[0, 2])
    said = []
    with pytest.raises(Exception, match="no space left on device"):
        Generation(settings, Sampling(max_new_tokens=16), log=said.append).run()
    assert said[-2].startswith("stopped: 1 samples extracted, 0 already finished, 1 samples not extracted, ")


# -- prompts against --max-seq-len, known before anything is generated


def test_the_plan_counts_multi_turn_conversations_that_may_be_skipped_and_the_max_seq_len_that_fits_all(
        chat_model, tmp_path, monkeypatch):
    """A later turn's prompt carries the earlier replies (up to --max-new-tokens each): the plan says how
    many multi-turn conversations may be skipped after generating, and the --max-seq-len that fits
    them all, which does (every reply here is --max-new-tokens long)."""
    import re

    from hidden_states.generate.regeneration import TOO_LONG
    from tests.unit import multi_turn

    multi_turn.fake_backends(monkeypatch, chat_model)
    data = multi_turn.write(tmp_path / "chats.jsonl", multi_turn.conversations(15))
    generation, lines = multi_turn.run_generation(chat_model, data, tmp_path / "short", 128, 32)
    planned = [line for line in lines if line.startswith("multi-turn:")]
    said = re.fullmatch(r"multi-turn: (\d+) of 10 multi-turn conversations may be skipped after generating \(a later "
                        r"turn carries the earlier replies, up to --max-new-tokens 32 each, and must fit --max-seq-len "
                        r"128\); --max-seq-len (\d+) fits all of them", planned[0] if planned else "")
    assert said and len(planned) == 1, lines
    may, fits = int(said.group(1)), int(said.group(2))
    assert 0 < generation.tally.skipped[TOO_LONG] <= may <= 10 and fits > 128
    assert generation.tally.conversations == 15 - generation.tally.skipped[TOO_LONG]
    summary = next(line for line in lines if "conversations regenerated" in line)
    assert f"{generation.tally.skipped[TOO_LONG]} skipped: {TOO_LONG}" in summary
    # the length it names: every conversation regenerated, nothing to say
    generation, lines = multi_turn.run_generation(chat_model, data, tmp_path / "fits", fits, 32)
    assert generation.tally.conversations == 15 and not generation.tally.skipped
    assert not any(line.startswith("multi-turn:") for line in lines), lines


def test_the_plan_refuses_conversations_whose_first_prompt_cannot_fit(chat_model, tmp_path, monkeypatch, capsys):
    """A first prompt plus --max-new-tokens over --max-seq-len could never be answered: refused before
    anything is loaded or written, one line naming the conversations and the smallest --max-seq-len
    that fits them, which then plans."""
    import re

    from tests.unit import multi_turn

    made = multi_turn.fake_backends(monkeypatch, chat_model)
    long_first = {"messages": [{"role": "user", "content": " ".join(multi_turn.WORDS * 4)}]}
    data = multi_turn.write(tmp_path / "data.jsonl", [*multi_turn.conversations(15), long_first, long_first])
    assert generate(chat_model, data, tmp_path / "out", "--max-seq-len", "128", "--max-new-tokens", "32",
                    "--backend", "vllm-engine") == 2
    err = capsys.readouterr().err.strip().splitlines()
    said = re.search(r"data\.jsonl:16 and 1 more \(2 of 17 conversations\): a first prompt \(up to (\d+) tokens\) plus "
                     r"--max-new-tokens 32 exceeds --max-seq-len 128, so it could never be answered: --max-seq-len "
                     r"(\d+) fits them, or leave them out of the input", err[-1])
    assert said, err
    assert int(said.group(2)) == int(said.group(1)) + 32 and not made and not (tmp_path / "out").exists()
    fits = int(said.group(2))
    assert generate(chat_model, data, tmp_path / "out", "--max-seq-len", str(fits - 1), "--max-new-tokens", "32",
                    "--backend", "vllm-engine") == 2
    assert f"--max-seq-len {fits} fits them" in capsys.readouterr().err and not made
    multi_turn.run_generation(chat_model, data, tmp_path / "fits", fits, 32)  # the two long ones answered
    lined = [json.loads(line)["index"] for line in (tmp_path / "fits" / "regenerated.jsonl").read_text().splitlines()]
    assert {15, 16} <= set(lined), lined
