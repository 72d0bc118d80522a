"""``generate``'s certified rows: each reply carries vLLM's logprobs with every token it sampled (at the
position before it), a training row is witnessed at up to ``REPLY_POSITIONS`` of the reply positions it
shares, and a conversation's rows are certified in one pass before the writer (a failing one stops
them, the rows before it written)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from hidden_states.backends import Reply, Sampling  # noqa: E402
from hidden_states.backends.engine_replies import EngineReplies, PromptWork  # noqa: E402
from hidden_states.certify.certifier import CertificateFailed, Certifier  # noqa: E402
from hidden_states.certify.certificate import PROBE_SLACK, Certificate  # noqa: E402
from hidden_states.certify.head import FinalHead  # noqa: E402
from hidden_states.certify.witness import REPLY_POSITIONS, TOP, Witness, reply_witness, row_witness  # noqa: E402
from hidden_states.generate.continuous import ContinuousRegeneration  # noqa: E402
from hidden_states.inputs.streams import Sample  # noqa: E402
from tests.unit.certified_model import engine_logprobs, head_checkpoint, states  # noqa: E402

NOT_REWRITTEN = 10 ** 9


def generated_output(prompt, generated, ranked):
    """A finished reply as vLLM returns it asked with logprobs: per token, id -> ``Logprob``."""
    entries = [{token: SimpleNamespace(logprob=value) for token, value in one.items()} for one in ranked]
    return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[SimpleNamespace(token_ids=list(generated),
                                                                                     logprobs=entries)])


def test_a_replys_witness_is_the_engines_logprobs_at_the_position_before_each_token():
    prompt, generated = [1, 2, 3], [7, 8]
    output = generated_output(prompt, generated, [{7: -0.1, 5: -2.5}, {9: -0.3, 8: -1.0}])
    witness = reply_witness(output, len(prompt), NOT_REWRITTEN)
    # the prompt's last position gives the first token, the first token's position the second
    assert witness.positions == [2, 3] and witness.probed == ()
    assert witness.token_ids == [[7, 5], [9, 8]] and witness.logprobs == [[-0.1, -2.5], [-0.3, -1.0]]
    # a preempted request stored its rows from 3 on again: another forward than their logprobs'
    assert reply_witness(output, len(prompt), 3).probed == (3,)


def test_a_reply_missing_a_tokens_logprobs_fails():
    output = generated_output([1, 2], [7, 8], [{7: -0.1}])
    with pytest.raises(RuntimeError, match="logprobs for 1 of a reply's 2 tokens"):
        reply_witness(output, 2, NOT_REWRITTEN)


def reply_of(prompt_length, generated):
    positions = list(range(prompt_length - 1, prompt_length - 1 + generated))
    return Witness(positions, [[p] for p in positions], [[-1.0] for _ in positions])


def test_a_rows_witness_is_at_most_eight_shared_reply_positions_its_ends_and_seam_among_them():
    reply = reply_of(10, 40)  # positions 9 .. 48
    row = list(range(60))
    witness = row_witness(reply, row, shared=45, copied=32)  # the row differs from the reply from 45 on
    assert len(witness.positions) == REPLY_POSITIONS
    assert {9, 44, 31, 32} <= set(witness.positions) and max(witness.positions) < 45
    assert witness.probed == tuple(p for p in witness.positions if p >= 32)  # its own prefill's rows
    assert row_witness(reply, row, 45, 32) == witness  # drawn from the row's ids: the same on every run
    assert row_witness(reply, row, 12, 0).positions == [9, 10, 11]  # fewer shared than that: every one
    assert row_witness(reply, row, 8, 0).positions == []  # a row re-rendered inside its prompt: none


def test_each_row_takes_its_witness_from_its_own_reply():
    ids = list(range(20))
    reply = Reply(ids[:10], ids[10:14], "", "stop", 0, 64, 13, "salt", reply_of(10, 4))
    work = SimpleNamespace(ids=[ids[:12] + [99]], sources=[reply], copied=[8])
    witness, = EngineReplies.witnesses(work)
    assert witness.positions == [9, 10, 11] and witness.probed == (9, 10, 11)


@pytest.mark.parametrize("certified", [True, False])
def test_a_certified_reply_asks_vllm_for_its_logprobs(certified):
    pytest.importorskip("vllm")
    work = PromptWork([1, 2, 3], 0, Sampling(temperature=0.8, top_p=0.9, max_new_tokens=4), "salt", certified)
    params = EngineReplies(None).params(work, {"region": 1})
    assert params.logprobs == (TOP if certified else None) and params.temperature == 0.8


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return FinalHead.load(head_checkpoint(tmp_path_factory.mktemp("model")))


def witnessed_row(head, state, positions):
    ids, values = engine_logprobs(head, state, positions, TOP)
    return Witness(positions, ids.tolist(), values.tolist())


class Writer:
    def __init__(self):
        self.written = []

    def write(self, sample, layers, extra=None):
        self.written.append((sample.index, extra))


def loop_on(head, writer):
    model = SimpleNamespace(backend=None, writer=writer, layer_order=[0], certifier=Certifier(head, 0))
    summary = SimpleNamespace(extracted=0, tokens=0, computed_tokens=0)
    return ContinuousRegeneration(model, None, None, None, summary, streams=False)


def test_a_conversations_rows_are_certified_before_the_writer_and_a_failing_one_stops_them(head):
    rows = states(3, 12)
    positions = [3, 5, 9, 10]
    witnesses = [witnessed_row(head, state, positions) for state in rows]
    rows[1] = torch.roll(rows[1], 1, dims=0)  # planted: the second row's states one token late
    samples = [Sample(index, index + 1, list(range(12)), None) for index in range(3)]
    writer = Writer()
    loop = loop_on(head, writer)
    with pytest.raises(CertificateFailed, match=r"sample 1 \(line 2\): its written last-layer state is not"):
        loop._hand_rows(samples, [([state], witness) for state, witness in zip(rows, witnesses)])
    # the row before it written, with its certificate; the failing one and the one after not
    (index, extra), = writer.written
    certificate = Certificate.from_tensors(extra)
    assert index == 0 and certificate.positions.tolist() == positions and loop.certifier.rows == 3


def test_rows_whose_states_the_rows_prefill_computed_again_are_allowed_a_probes_slack(head):
    state, = states(1, 12)
    witness = witnessed_row(head, state, [3, 5, 9])
    writer = Writer()
    loop_on(head, writer)._hand_rows([Sample(0, 1, list(range(12)), None)],
                                     [([state], witness.picked({3, 5, 9}, 5))])
    (_, extra), = writer.written
    assert Certificate.from_tensors(extra).slack.tolist() == [1.0, PROBE_SLACK, PROBE_SLACK]
