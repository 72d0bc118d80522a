"""When the engine dies between two submissions (a dead process: vLLM's engine loop has stopped),
the run's error names the samples it held: the groups submitted and not yet written, and the group
it was submitting; nothing was written for them."""
from concurrent.futures import Future

import pytest

from hidden_states.extract.rows import ExtractRows
from hidden_states.inputs.streams import Sample
from hidden_states.run.summary import ExtractionFailed, Summary


class DyingBackend:
    """Takes ``alive`` submissions (their futures never resolve: still in the engine), then raises as
    the engine feed does once vLLM's engine core is gone."""

    tokens_per_submit = None
    tokens_ahead = 10**9  # every group stays in flight: nothing is written before the death

    def __init__(self, alive: int):
        self.alive, self.submitted = alive, []

    def submit(self, batch):
        if len(self.submitted) == self.alive:
            raise RuntimeError("the engine loop has stopped: EngineCore encountered an issue")
        self.submitted.append(batch)
        return Future()


class Model:
    def __init__(self, backend):
        self.backend, self.writer, self.layer_order = backend, None, [0]


def samples(start: int, count: int) -> list[Sample]:
    return [Sample(i, i + 1, [5, 6, 7 + i], None) for i in range(start, start + count)]


def test_a_dead_engine_names_the_samples_in_flight_and_the_one_being_submitted():
    rows = ExtractRows(Model(DyingBackend(alive=2)), Summary(), share_prefixes=False)
    rows.hand_out(samples(0, 2))
    rows.hand_out(samples(2, 2))
    with pytest.raises(ExtractionFailed) as failed:
        rows.hand_out(samples(4, 2))
    assert str(failed.value) == ("extracting samples 0 (line 1), 1 (line 2), 2 (line 3), 3 (line 4), 4 (line 5), "
                                 "5 (line 6) failed: RuntimeError: the engine loop has stopped: EngineCore "
                                 "encountered an issue")
    assert isinstance(failed.value.__cause__, RuntimeError) and rows.summary.extracted == 0
