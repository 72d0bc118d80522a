"""Stand-ins for vLLM shared by the unit tests (support module: tests import it, never each other)."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

from hidden_states import backends
from hidden_states.backends import Reply
from hidden_states.generate.regeneration import row_source
from hidden_states.inputs.tokenization import common_prefix


def quiet(message):
    """A run's log that says nothing."""


def layer_id_states(ids, layer_ids):
    """Each captured layer's state is the layer's id, 8 wide: a sample's file says which layer and how
    many tokens it holds."""
    import torch

    return [torch.full((len(ids), 8), float(layer)) for layer in layer_ids]


class FakeBackend(backends.OneBatchAtATime):
    """The unit tests' one stand-in for vLLM's backends; no model runs. Its behaviour is chosen by
    arguments:

    * ``states(ids, layer_ids)``: a row's states, one tensor per layer (default: ``layer_id_states``);
      ``settings.layer_ids`` are the layers, when there are settings (a served backend has none);
    * ``on_batch``: {n: what happens as the n-th batch runs (``interrupt``, ``fails(message)``)};
    * ``threaded``: ``submit`` resolves each batch on a thread of its own, as the engine feed does,
      after ``delay`` seconds, once ``gate`` (an Event) is set, with ``fail``'s RuntimeError if given;
      at most ``capacity`` rows are held between submit and their release (the region pool: ``submit``
      waits for room, and a row's states give it back when collected). Otherwise ``extract`` runs a
      batch at once (``OneBatchAtATime``).

    ``batches`` records each batch run, ``created`` counts the backends made, and ``most_held`` /
    ``most_unresolved`` the most rows held and tokens submitted but not yet resolved."""

    name = "fake"
    created = 0

    def __init__(self, settings=None, *, states=layer_id_states, on_batch=None, threaded=False, delay=0.0, gate=None,
                 capacity=None, fail=None, tokens_per_submit=None):
        self.settings, self.states, self.on_batch, self.threaded = settings, states, on_batch or {}, threaded
        self.delay, self.gate, self.fail = delay, gate, fail
        if tokens_per_submit is not None:  # else the class's (an engine-like subclass may set one)
            self.tokens_per_submit = tokens_per_submit
        self.batches: list[list[list[int]]] = []
        self.room = threading.Semaphore(capacity) if capacity else None
        self.held = self.most_held = 0
        self.unresolved = self.most_unresolved = 0  # tokens submitted, not yet resolved (in the engine)
        self.lock = threading.Lock()
        FakeBackend.created += 1

    def start(self):
        return {"backend": self.name}

    def layers_of(self, ids):
        return self.states(ids, self.settings.layer_ids if self.settings is not None else None)

    def extract(self, batch):
        self.batches.append(batch)
        happens = self.on_batch.get(len(self.batches))
        if happens is not None:
            happens()
        return [self.layers_of(ids) for ids in batch]

    def submit(self, batch):
        if not self.threaded:
            return super().submit(batch)
        if self.room is not None:
            for _ in batch:
                self.room.acquire()
        with self.lock:
            self.batches.append(batch)
            self.held += len(batch)
            self.most_held = max(self.most_held, self.held)
            self.unresolved += sum(map(len, batch))
            self.most_unresolved = max(self.most_unresolved, self.unresolved)
        future: Future = Future()

        def resolve():
            time.sleep(self.delay)
            if self.gate is not None:
                self.gate.wait()
            with self.lock:
                self.unresolved -= sum(map(len, batch))
            if self.fail:
                future.set_exception(RuntimeError(self.fail))
                self.release(len(batch))
            else:
                future.set_result([Released(self.layers_of(ids), self) for ids in batch])

        threading.Thread(target=resolve, daemon=True).start()
        return future

    def release(self, rows: int) -> None:
        with self.lock:
            self.held -= rows
        if self.room is not None:
            for _ in range(rows):
                self.room.release()

    def check_forward(self, probe):
        return []

    def close(self):
        pass


def interrupt():
    """Ctrl-C, as a user presses it during a batch."""
    os.kill(os.getpid(), signal.SIGINT)


def fails(message: str):
    """A batch that raises ``message`` (vLLM reporting a failed worker, say)."""
    def fail():
        raise RuntimeError(message)

    return fail


class Released(list):
    """A row's layers that give their room back when collected (the backend's regions do)."""

    def __init__(self, layers, backend):
        super().__init__(layers)
        self._backend = backend

    def __del__(self):
        self._backend.release(1)


def fake_backends(monkeypatch, **options) -> list[FakeBackend]:
    """Every backend a run makes is ``FakeBackend(settings, **options)``: the list of those made, in order."""
    made: list[FakeBackend] = []
    monkeypatch.setattr(backends, "create", lambda name, settings: made.append(FakeBackend(settings, **options))
                        or made[-1])
    return made


def rows_run(made: list[FakeBackend]) -> list[list[int]]:
    """The rows the backends ``made`` ran, in the order each ran them."""
    return [list(ids) for backend in made for batch in backend.batches for ids in batch]


def fake_rows(layer_ids, start, stop):
    """FakeGenerating's states of positions ``start .. stop`` token-major, as a stream takes them."""
    import torch

    rows = torch.stack([torch.arange(start, stop, dtype=torch.float32)[:, None].repeat(1, 8) + 1000 * layer
                        for layer in layer_ids], dim=1)
    return rows.view(torch.uint8)


STALE_ROWS = 2  # the last rows a FakeGenerating reply streams, which its row's prefill computes again


class FakeGenerating(FakeBackend):
    """``vllm-engine``'s generate interface in miniature: a reply is the words ``ok <n>``'s ids then
    <|eot_id|>; a row's states at layer l are ``l * 1000 + position`` (the same whoever computes them).
    A reply given a stream streams its fed rows, its last ``STALE_ROWS`` stale (-1, as a decode's
    state differs from the prefill's): its row, prefilled in place, keeps the rows before them."""

    name = "vllm-engine"
    tokens_ahead, tokens_per_submit = 1, None
    started_count = 0

    def __init__(self, settings, tokenizer):
        super().__init__(settings)
        self.tokenizer = tokenizer
        self.reply_rows_reused, self.rows_from_replies, self.rows_in_place, self.released, self.asked = 0, 0, 0, [], 0
        self.streams = {}  # reply offset -> its stream

    def start(self):
        FakeGenerating.started_count += 1
        return {"backend": self.name}

    def answer(self, ids, sampling, stream=None, certified=False):
        from concurrent.futures import Future

        import torch

        eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        self.asked += 1
        generated = self.tokenizer(f"ok {self.asked}", add_special_tokens=False)["input_ids"] + [eot]
        if stream is not None:
            fed = len(ids) + len(generated) - 1
            stream.append(fake_rows(self.settings.layer_ids, 0, fed - STALE_ROWS))  # counted in two rounds
            stream.append(torch.full((STALE_ROWS, len(self.settings.layer_ids), 8), -1.0).view(torch.uint8))
            self.streams[self.asked] = stream
        future = Future()
        future.set_result(Reply(ids, generated, f"ok {self.asked}", "stop", self.asked, 0,
                                len(ids) + len(generated) - 1, f"salt-{self.asked}"))
        return future

    def row_states(self, rows, sources, certified=False):
        from concurrent.futures import Future

        import torch

        for row, source in zip(rows, sources):
            reused = row_source(row, [source]).reused
            self.reply_rows_reused += reused
            self.rows_from_replies += reused > 0
            stream = self.streams.pop(source.offset, None)
            if stream is not None and common_prefix(row, source.ids) == len(source.ids):
                stream.kept = source.stored - STALE_ROWS
            elif stream is not None:
                stream.discard()
        future = Future()
        future.set_result([[torch.arange(len(row), dtype=torch.float32)[:, None].repeat(1, 8) + 1000 * layer
                            for layer in self.settings.layer_ids] for row in rows])
        return future

    def release_replies(self, replies):
        self.released += replies
