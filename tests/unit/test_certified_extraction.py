"""A certified extraction's loop (``extract/rows.py`` with ``extract/writes_aside.py``): it takes a
group's states as they come and goes on submitting while the group waits for its probes; the rows
are written certified, in order; a failing row stops the run with the rows before it written and
none after it (a fake certifying backend over the certificate's support model)."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from hidden_states.certify.certifier import CertificateFailed, Certifier  # noqa: E402
from hidden_states.certify.head import FinalHead  # noqa: E402
from hidden_states.extract.rows import ExtractRows  # noqa: E402
from hidden_states.extract.writes_aside import WritesAside  # noqa: E402
from hidden_states.inputs.streams import Sample  # noqa: E402
from hidden_states.run.summary import Summary  # noqa: E402
from tests.unit.certified_model import BACKEND_LAYERS as LAYERS, CertifyingBackend, head_checkpoint, states  # noqa: E402


class Writer:
    """Records each row written, with its certificate's tensors."""

    def __init__(self):
        self.rows: list[tuple[int, dict | None]] = []

    def write(self, row, layers, extra) -> None:
        self.rows.append((row.index, extra))


class Model:
    def __init__(self, backend, head):
        self.backend, self.writer, self.layer_order = backend, Writer(), list(range(LAYERS))
        self.certifier = Certifier(head, LAYERS - 1)


def samples(count: int, start: int = 0) -> list[Sample]:
    return [Sample(index, index + 1, [3 + index] + [(7 * index + k) % 500 for k in range(1, 12)], None)
            for index in range(start, start + count)]


@pytest.fixture
def head(tmp_path):
    return FinalHead.load(head_checkpoint(tmp_path / "model"))


def test_the_loop_goes_on_submitting_while_a_group_waits_for_its_probes(head):
    model = Model(CertifyingBackend(head, hold=True), head)
    rows = ExtractRows(model, Summary(), share_prefixes=False)
    loop = threading.Thread(target=lambda: [rows.hand_out(samples(2, start=start)) for start in (0, 2)], daemon=True)
    loop.start()  # the second hand_out takes the first group's states: its witnesses are still held
    loop.join(timeout=10)
    assert not loop.is_alive(), "the loop waited for a group's probes"
    assert len(model.backend.submitted) == 4 and model.writer.rows == []
    model.backend.run_probes()
    rows.drain()
    assert [index for index, _ in model.writer.rows] == [0, 1, 2, 3]
    assert all("certificate.logprobs" in extra for _, extra in model.writer.rows)
    assert rows.summary.extracted == 4 and model.certifier.rows == 4
    certifier = model.certifier  # its rows' own positions and its probes, each near its own bound
    assert 0 < certifier.worst_own < 1 and 0 < certifier.worst_probed < 1 / 8
    assert certifier.said() == (f"4 rows certified, the largest disagreement with the engine {certifier.worst:.2f} of "
                                f"what rounding explains ({certifier.worst_own:.2f} at rows' own positions, "
                                f"{certifier.worst_probed:.2f} at probes)")


def test_a_failing_row_stops_the_run_with_the_rows_before_it_written_and_none_after(head):
    wrong_from = 5  # rows whose first id is past it get another row's states in the engine's witness
    backend = CertifyingBackend(head, engine_states=lambda ids, layers: layers[-1] if ids[0] < wrong_from else
                                states(LAYERS, len(ids), seed=ids[0] + 1)[-1])
    model = Model(backend, head)
    rows = ExtractRows(model, Summary(), share_prefixes=False)
    with pytest.raises(CertificateFailed, match=r"sample 2 \(line 3\)"):
        for start in range(0, 6, 2):
            rows.hand_out(samples(2, start=start))
        rows.drain()
    assert [index for index, _ in model.writer.rows] == [0, 1]


def test_after_a_failure_no_later_work_runs_and_the_error_is_raised_again():
    aside, ran = WritesAside(), []
    gate = threading.Event()

    def failing():
        gate.wait(5)
        raise RuntimeError("row 7 failed")

    aside.hand(failing)
    aside.hand(lambda: ran.append("after"))
    gate.set()
    with pytest.raises(RuntimeError, match="row 7 failed"):
        aside.finish()
    with pytest.raises(RuntimeError, match="row 7 failed"):
        aside.hand(lambda: ran.append("later"))
    assert ran == []


def test_settle_waits_for_the_work_handed_and_raises_nothing():
    aside, ran = WritesAside(), []
    aside.hand(lambda: ran.append(1))
    aside.hand(lambda: (_ for _ in ()).throw(RuntimeError("a failing row")))
    aside.settle()
    assert ran == [1] and isinstance(aside.failure, RuntimeError)


@pytest.mark.parametrize("max_seq_len, length", [(16, 16), (4096, 48)])
def test_the_sequence_certified_at_load_is_no_longer_than_a_row(head, max_seq_len, length):
    """vLLM refuses a prompt longer than the model length the run gave it (--max-seq-len + 1); a check
    sequence of 48 tokens under --max-seq-len 40 was refused, and the run waited for it for good."""
    backend, lengths = CertifyingBackend(head), []
    submit = backend.submit_certified
    backend.submit_certified = lambda rows, probes: (lengths.extend(map(len, rows)), submit(rows, probes))[1]
    said = []
    Certifier(head, LAYERS - 1).check_at_load(backend, list(range(LAYERS)), 500, said.append, max_seq_len)
    assert lengths == [length] and said[0].startswith("certificates: on:")
