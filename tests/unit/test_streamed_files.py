"""Sample files begun while their reply is generated (``formats.speculators_05.StreamedFile``, handed
out by the writer, ``BackgroundWriter.sink``, filled by ``backends.reply_streams.ReplyStreams``) and
finished by the writer (``BackgroundWriter.write``): the same tensors as a file
written at the end, whatever the stream got; written whole instead where it cannot be finished."""
import pytest
import torch
from safetensors.torch import load_file

from hidden_states import fp8_states
from hidden_states.backends.reply_streams import ReplyStreams
from hidden_states.output.formats import Layers
from hidden_states.output.formats.speculators_05 import RESERVED_HEADER, Speculators05, StreamedFile, safetensors_header
from hidden_states.inputs.streams import Sample
from hidden_states.output.writer import BackgroundWriter


def layers_of(tokens: int, hidden: int, count: int = 3, dtype=torch.bfloat16) -> list:
    return [(torch.arange(tokens * hidden, dtype=torch.float32).view(tokens, hidden) / 7 + 100 * layer).to(dtype)
            for layer in range(count)]


def token_major(states: list, start: int, stop: int):
    return torch.stack([layer[start:stop].contiguous().view(torch.uint8) for layer in states], dim=1)


def written(tmp_path, states, *, streamed: int | None, kept: int | None, state_dtype="model", stale=0):
    """The sample file of ``states`` as the writer leaves it: its first ``streamed`` rows streamed
    (the last ``stale`` of them wrong, as rows its prefill computes again), ``kept`` of them kept; None:
    written at the end."""
    tokens, hidden = states[0].shape
    form = Speculators05(tmp_path, Layers([1, 2, 3], 4, hidden))
    form.state_dtype = state_dtype
    (tmp_path / "hidden_states").mkdir(parents=True)
    writer = BackgroundWriter(tmp_path, format=form)
    sample = Sample(0, 1, list(range(tokens)), [0, 1] * (tokens // 2) + [1] * (tokens % 2))
    if streamed is None:
        assert writer.write(sample, states) is None
    else:
        stream = writer.sink(0)  # the writer hands out the file; the backend fills it
        assert stream.path == writer.temp_path(0) and stream.path.is_file()
        stream.append(token_major(states, 0, streamed - stale))
        if stale:
            stream.append(torch.zeros_like(token_major(states, 0, stale)))
        stream.kept = kept
        assert writer.write(sample, states) is stream
    writer.close()
    path = tmp_path / form.sample_file(0)
    assert safetensors_header(path) is not None and not list(tmp_path.glob(".tmp-*"))
    return load_file(str(path)), path


@pytest.mark.parametrize("streamed, kept, stale", [(20, 16, 4), (20, 20, 0), (0, 0, 0), (24, 24, 0), (9, 3, 6)])
def test_a_streamed_file_holds_what_a_file_written_at_the_end_holds(tmp_path, streamed, kept, stale):
    states = layers_of(24, 64)
    ended, _ = written(tmp_path / "end", states, streamed=None, kept=None)
    streamed_file, path = written(tmp_path / "streamed", states, streamed=streamed, kept=kept, stale=stale)
    assert streamed_file.keys() == ended.keys()
    for name in ended:
        assert torch.equal(streamed_file[name], ended[name]), name
    assert path.stat().st_size == RESERVED_HEADER + 24 * 3 * 64 * 2 + 2 * 24 * 8  # the states first, then the ids


def test_a_streamed_files_stale_rows_past_what_it_keeps_are_written_again(tmp_path):
    """The negative: told it keeps its stale rows, the file holds them (the check above can fail)."""
    states = layers_of(24, 64)
    ended, _ = written(tmp_path / "end", states, streamed=None, kept=None)
    wrong, _ = written(tmp_path / "wrong", states, streamed=20, kept=20, stale=4)
    assert not torch.equal(wrong["hidden_states"], ended["hidden_states"])
    assert torch.equal(wrong["hidden_states"][:16], ended["hidden_states"][:16])


def test_fp8_states_stream_and_their_scales_come_at_the_end(tmp_path):
    quantized, scales = fp8_states.quantize([layer.float() for layer in layers_of(10, 32)])
    states = fp8_states.Quantized(quantized, scales)
    ended, _ = written(tmp_path / "end", states, streamed=None, kept=None, state_dtype="fp8")
    streamed_file, _ = written(tmp_path / "streamed", states, streamed=8, kept=6, state_dtype="fp8", stale=2)
    assert streamed_file.keys() == ended.keys() == {"hidden_states", fp8_states.SCALES, "token_ids", "loss_mask"}
    for name in ended:
        assert torch.equal(streamed_file[name].view(torch.uint8) if name == "hidden_states" else streamed_file[name],
                           ended[name].view(torch.uint8) if name == "hidden_states" else ended[name]), name


@pytest.mark.parametrize("why", ["unaligned", "failed", "never the sample's"])
def test_a_stream_that_cannot_be_finished_leaves_a_file_written_whole(tmp_path, why):
    # 3 layers x 5 tokens x 3 wide x 2 bytes: the ids after the states would not start 8-byte aligned
    states = layers_of(5, 3) if why == "unaligned" else layers_of(12, 64)
    ended, _ = written(tmp_path / "end", states, streamed=None, kept=None)
    form = Speculators05(tmp_path / "s", Layers([1, 2, 3], 4, states[0].shape[1]))
    (tmp_path / "s" / "hidden_states").mkdir(parents=True)
    writer = BackgroundWriter(tmp_path / "s", format=form)
    stream = StreamedFile(writer.temp_path(0))
    stream.append(token_major(states, 0, 4))
    stream.kept = None if why == "never the sample's" else 4
    if why == "failed":
        stream.fail(OSError(28, "No space left on device"))
    sample = Sample(0, 1, list(range(len(states[0]))), None)
    writer.submit(0, form.streamed_record(sample, states, stream))
    writer.close()
    got = load_file(str(tmp_path / "s" / form.sample_file(0)))
    assert torch.equal(got["hidden_states"], ended["hidden_states"])
    header = safetensors_header(tmp_path / "s" / form.sample_file(0))
    assert header["token_ids"]["data_offsets"][0] == 0  # written at the end: the widest dtype first


class ListSink:
    def __init__(self, fail_on_append=False):
        self.rows, self.taken, self.error, self.fail_on_append = 0, [], None, fail_on_append

    def append(self, rows):
        if self.fail_on_append:
            raise OSError(28, "No space left on device")
        self.taken.append((self.rows, len(rows)))
        self.rows += len(rows)

    def fail(self, error):
        self.error = error


def test_reply_streams_copy_counted_rows_once_each_and_drop_a_sink_that_fails_or_a_region_from_a_cache():
    counts = {0: (3, 0), 100: (2, 0), 200: (4, 2)}  # offset -> (rows counted, first row stored)
    read = []
    streams = ReplyStreams(counts.__getitem__, lambda offset, capacity, start, stop: read.append(
        (offset, start, stop)) or torch.zeros(stop - start, 2, 4, dtype=torch.uint8), interval=60)
    good, failing, cached = ListSink(), ListSink(fail_on_append=True), ListSink()
    streams.follow(0, 5, good)
    streams.follow(100, 5, failing)
    streams.follow(200, 5, cached)
    streams.copy_round()
    counts[0] = (9, 0)  # past the region's capacity: its rows stop there
    streams.copy_round()
    streams.copy_round()
    assert good.taken == [(0, 3), (3, 2)] and good.error is None
    assert isinstance(failing.error, OSError) and isinstance(cached.error, RuntimeError)
    assert set(streams._followed) == {0} and streams.rows_copied == 5
    assert streams.stop(0) is good and streams.stop(0) is None and streams._followed == {}
    streams.close()


def test_streamed_files_hold_no_descriptor_between_appends(tmp_path):
    """Thousands of replies may be in flight: a begun file must not keep a descriptor open."""
    import os

    before = len(os.listdir("/proc/self/fd"))
    streams = [StreamedFile(tmp_path / f"s{i}") for i in range(64)]
    for stream in streams:
        stream.append(token_major(layers_of(4, 8), 0, 4))
    assert len(os.listdir("/proc/self/fd")) == before
    assert all(stream.path.stat().st_size == RESERVED_HEADER + 4 * 3 * 16 for stream in streams)


def test_a_sink_never_the_samples_is_removed_and_the_file_written_whole(tmp_path):
    """The writer finishes only a file that holds its sample's rows: one never told it does (a reply
    whose row took a region of its own) goes, and the sample's file is written whole."""
    states = layers_of(12, 64)
    form = Speculators05(tmp_path, Layers([1, 2, 3], 4, 64))
    (tmp_path / "hidden_states").mkdir(parents=True)
    writer = BackgroundWriter(tmp_path, format=form)
    stream = writer.sink(0)
    stream.append(token_major(states, 0, 4))
    assert writer.write(Sample(0, 1, list(range(12)), None), states) is None
    writer.close()
    assert not stream.path.exists()
    got = load_file(str(tmp_path / form.sample_file(0)))
    assert torch.equal(got["hidden_states"], torch.stack(states, dim=1))


def test_a_format_of_whole_files_hands_out_no_sink(tmp_path):
    from hidden_states.output.formats.speculators_03 import Speculators03

    form = Speculators03(tmp_path, Layers([1, 2], 4, 8))
    writer = BackgroundWriter(tmp_path, format=form)
    try:
        assert writer.sink(0) is None and not list(tmp_path.glob(".tmp-*"))
    finally:
        writer.close()
