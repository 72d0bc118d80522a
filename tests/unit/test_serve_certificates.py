"""``hidden-states serve`` certifies each request's row before its file is written: a right row's
file carries its certificate, a wrong one is answered with the error and leaves no file (a fake
certifying backend over the certificate's support model; the real engine: tests/e2e/test_serve.py)."""
from __future__ import annotations

import os
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from hidden_states.certify.certificate import Certificate  # noqa: E402
from hidden_states.certify.certifier import CertificateFailed, Certifier  # noqa: E402
from hidden_states.certify.head import FinalHead  # noqa: E402
from hidden_states.serve.batching import Gatherer  # noqa: E402
from hidden_states.serve.state_files import StateFiles  # noqa: E402
from tests.unit.certified_model import BACKEND_LAYERS as LAYERS, CertifyingBackend, head_checkpoint, states  # noqa: E402


def gatherer(tmp_path, backend, head):
    files = StateFiles(tmp_path / "states", "model", sweep_after=600)
    return Gatherer(backend, files, list(range(LAYERS)), batch_size=1, window=0.0, writer_threads=1,
                    certifier=Certifier(head, LAYERS - 1))


def test_a_served_row_carries_its_certificate(tmp_path):
    head = FinalHead.load(head_checkpoint(tmp_path / "model"))
    backend = CertifyingBackend(head)
    served = gatherer(tmp_path, backend, head)
    try:
        path = served.submit(list(range(3, 43))).result(timeout=30)
    finally:
        served.drain(timeout=10)
    certificate = Certificate.from_tensors(load_file(path))
    assert certificate is not None and certificate.positions.tolist()[-1] == 39
    assert certificate.positions.tolist() == sorted({*backend.submitted[0], 39})  # a probe inside, then the last
    assert served.certifier.rows == 1 and 0 < served.certifier.worst < 1


def test_a_row_whose_states_are_not_the_engines_is_answered_with_the_error_and_no_file(tmp_path):
    head = FinalHead.load(head_checkpoint(tmp_path / "model"))
    wrong = CertifyingBackend(head, engine_states=lambda ids, layers: states(LAYERS, len(ids), seed=ids[0] + 1)[-1]
                              if ids[0] == 7 else layers[-1])
    served = gatherer(tmp_path, wrong, head)
    try:
        first = served.submit(list(range(3, 33))).result(timeout=30)
        with pytest.raises(CertificateFailed, match=r"^request 2 \(30 tokens\): its written last-layer state is not "
                                                    r"the engine's \(position .*; not written$"):
            served.submit(list(range(7, 37))).result(timeout=30)
    finally:
        served.drain(timeout=10)
    assert [p.name for p in (tmp_path / "states").iterdir()] == [os.path.basename(first)]
