"""Certified batches on an engine backend (``--backend vllm-engine``): each request asks vLLM for its
logprobs at its last position; once a batch's states are in it resolves to ``(layers, Future[Witness])``
per row, and its probes (``certify.witness``: the rows' first ``p + 1`` tokens, under the batch's cache
salt, no region) go into the engine; they resolve the witnesses. The caller has the states at once and
does not wait for the probes, which run behind the batches already queued: the engine never idles
waiting on a certificate. Everything here runs on the engine feed's thread."""
from __future__ import annotations

from concurrent.futures import Future

from vllm_compat.extractor_api import REQUIRED, FieldDefault

from ..certify.witness import TOP, Witness, first_token_logprobs
from .engine_feed import EngineBatch, present

# What a certified row touches in vLLM: the engine's logprobs with its one token, and the granularity of
# the prefix cache's hits, which the workers read for where probes fall (engine_capture; gone, a probe
# computes part of a block again, never a wrong row)
WITNESS_TOUCHPOINTS = [
    *present("vllm.sampling_params:SamplingParams", "logprobs"),
    (FieldDefault("vllm.outputs:CompletionOutput", "logprobs"), frozenset({REQUIRED})),
    *present("vllm.config:CacheConfig", "block_size"),
]


def params(region: dict | None = None):
    """A certified request's sampling parameters: one token, greedy (the certificate's ids are the same
    on every run of the same rows), with the engine's logprobs at its last position (and the worker's
    region, for a row whose states are captured)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, **({"extra_args": region} if region else {}))


class ProbeBatch(EngineBatch):
    """The probes of a certified batch ``parent`` whose states are handed out; they resolve its rows'
    ``witnesses`` (futures). It holds no states: their regions go back as the writer ends with them."""

    def __init__(self, parent: EngineBatch, witnesses: list[Future]):
        self.where = [(row, position) for row, positions in enumerate(probed(parent)) for position in positions]
        super().__init__([parent.ids[row][:position + 1] for row, position in self.where], parent.cache_salt)
        self.parent, self.witnesses = parent, witnesses
        self.future.add_done_callback(self._settle)

    def found(self) -> list[Witness]:
        return witnesses(self.parent, self)

    def _settle(self, future) -> None:
        settle(self.witnesses, future)
        self.parent = None  # the future keeps this callback, and so this probe, alive


def settle(witnesses: list[Future], found: Future) -> None:
    """Each row's witness future from ``found`` (a future of them all): its value, or its error."""
    exc = found.exception()
    for index, witness in enumerate(witnesses):
        if exc is not None:
            witness.set_exception(exc)
        else:
            witness.set_result(found.result()[index])


def probed(parent: EngineBatch) -> list[list[int]]:
    """Each row's positions to probe: those asked, and the last of the rows vLLM's prefix cache gave it
    (copied from another request's region: a copy from the wrong place shows there first)."""
    cached = parent.cached or [0] * len(parent.ids)
    return [sorted({*asked, *([first - 1] if 0 < first < len(ids) else [])})
            for asked, first, ids in zip(parent.probes, cached, parent.ids, strict=True)]


def resolve(parent: EngineBatch, states: list, put) -> None:
    """``parent``'s states are in: it resolves now, each row's states with the future of its witness,
    which resolves once the row's probes (``put`` into the engine) have run; at once where the batch
    probes nothing."""
    rows = [Future() for _ in parent.ids]
    if any(probed(parent)):
        put(ProbeBatch(parent, rows))
    else:
        now: Future = Future()
        fill(now, lambda: witnesses(parent, None))
        settle(rows, now)
    parent.future.set_result(list(zip(states, rows, strict=True)))


def finished(probe: ProbeBatch) -> None:
    """Every probe has run: its batch's witnesses, or the error that stops them."""
    fill(probe.future, probe.found)


def fill(future: Future, compute) -> None:
    """``future`` resolved with what ``compute()`` returns, or the error it raises (which the
    certified batch's rows hear of)."""
    try:
        found = compute()
    except Exception as exc:  # noqa: BLE001
        future.set_exception(exc)
    else:
        future.set_result(found)


def witnesses(parent: EngineBatch, probe: ProbeBatch | None) -> list[Witness]:
    """Each row's witness: its probes' log-probabilities, then its own request's at its last position."""
    found: list[list] = [[] for _ in parent.ids]
    for index, (row, position) in enumerate(probe.where if probe is not None else ()):
        output = probe.finished[index]
        if list(output.prompt_token_ids) != probe.ids[index]:
            raise RuntimeError(f"vLLM's probe of batch position {row} holds other token ids")
        found[row].append((position, *first_token_logprobs(output, row)))
    for row, ids in enumerate(parent.ids):
        found[row].append((len(ids) - 1, *first_token_logprobs(parent.finished[row], row)))
    return [Witness([p for p, _, _ in entries], [i for _, i, _ in entries], [v for _, _, v in entries],
                    tuple(p for p, _, _ in entries[:-1]))  # all but the last came from probes
            for entries in found]
