"""``hidden-states verify`` on files the real formats wrote (both layouts, FP8 too), certified by the run's
certifier against an engine stand-in that rounds as vLLM's bfloat16 path does: right rows hold, and it
names exactly the rows that were changed after the fact."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hidden_states.certify.certifier import CertificateFailed, Certifier  # noqa: E402
from hidden_states.certify.head import FinalHead  # noqa: E402
from hidden_states.verify import verify  # noqa: E402
from hidden_states.inputs.streams import Sample  # noqa: E402
from hidden_states.output import formats  # noqa: E402
from tests.unit.certified_model import LAYERS, ROWS, head_checkpoint, states, witness, write_run  # noqa: E402


def checked(out):
    lines = []
    return verify(out, lines.append), lines


@pytest.mark.parametrize("name, state_dtype", [("speculators-0.3", "model"), ("speculators-0.5", "model"),
                                               ("speculators-0.5", "fp8")])
def test_right_rows_hold(tmp_path, name, state_dtype):
    code, lines = checked(write_run(tmp_path, name, state_dtype))
    assert code == 0, lines
    assert lines[-1] == f"verify: ok: {ROWS} certified rows hold the engine's states"


def test_a_shifted_row_and_a_layer_from_another_row_are_named(tmp_path):
    out = write_run(tmp_path, "speculators-0.3")
    record = torch.load(out / "data_2.pt", weights_only=True)
    record["hidden_states"] = [torch.roll(layer, 1, dims=0) for layer in record["hidden_states"]]
    torch.save(record, out / "data_2.pt")
    record, other = (torch.load(out / f"data_{i}.pt", weights_only=True) for i in (4, 5))
    record["hidden_states"][0] = other["hidden_states"][0][:len(record["input_ids"])]
    torch.save(record, out / "data_4.pt")
    code, lines = checked(out)
    assert code == 1
    assert lines[-1] == f"verify: 2 of {ROWS} rows fail: 2, 4"
    assert "  row 4: data_4.pt: layer 0: not the states its certificate was made with" in lines
    assert not any(line.startswith("  row 4: data_4.pt: position") for line in lines)  # its last layer is its own
    assert any(line.startswith("  row 2: data_2.pt: position") for line in lines)


def test_a_layer_written_twice_is_named_by_where_it_is_written(tmp_path):
    out = write_run(tmp_path, "speculators-0.3", layer_ids=[1, 1, 3])
    record, other = (torch.load(out / f"data_{i}.pt", weights_only=True) for i in (4, 5))
    record["hidden_states"][1] = other["hidden_states"][1][:len(record["input_ids"])]
    torch.save(record, out / "data_4.pt")
    code, lines = checked(out)
    assert code == 1 and "  row 4: data_4.pt: layer 1 (written 1): not the states its certificate was made with" in lines
    assert f"  layer 1 (written 0): {ROWS} of {ROWS} certified rows hold the states certified" in lines
    assert f"  layer 1 (written 1): {ROWS - 1} of {ROWS} certified rows hold the states certified; differs in rows 4" in lines


def test_fp8_rows_changed_after_the_fact_fail(tmp_path):
    from safetensors.torch import load_file, save_file

    out = write_run(tmp_path, "speculators-0.5", "fp8")
    path = out / formats.create("speculators-0.5", out).sample_file(3)
    tensors = load_file(str(path))
    tensors["hidden_states_scales"] = tensors["hidden_states_scales"] * 1.01
    save_file(tensors, str(path))
    code, lines = checked(out)
    assert code == 1 and lines[-1] == f"verify: 1 of {ROWS} rows fail: 3", lines


def test_uncertified_rows_are_said_and_none_certified_fails(tmp_path):
    code, lines = checked(write_run(tmp_path / "some", "speculators-0.3", certified=[0, 1, 2]))
    assert code == 0 and "3 certified rows hold" in lines[-1] and "(3 rows uncertified)" in lines[-1]
    code, lines = checked(write_run(tmp_path / "none", "speculators-0.3", certified=[]))
    assert code == 1 and lines[-1] == f"verify: none of the {ROWS} rows carries a certificate: nothing is proven"


def test_a_row_the_engine_disagrees_with_is_refused_before_it_is_written(tmp_path):
    head = FinalHead.load(head_checkpoint(tmp_path / "model", num_hidden_layers=4))
    layers, other = states(len(LAYERS), 30, seed=1), states(len(LAYERS), 30, seed=2)
    with pytest.raises(CertificateFailed, match=r"^sample 7 \(line 8\): its written last-layer state is not the "
                                                r"engine's \(position 0: .* > .*; not written$"):
        Certifier(head, 2).certify(Sample(7, 8, list(range(30)), None), layers, witness(head, other[-1], 30))


def test_a_batch_certified_in_one_pass_gives_each_row_what_it_gets_alone(tmp_path):
    head = FinalHead.load(head_checkpoint(tmp_path / "model", num_hidden_layers=4))
    rows = []
    for index, length in enumerate([30, 17, 41]):
        layers = states(len(LAYERS), length, seed=10 + index)
        engine = states(len(LAYERS), length, seed=99)[-1] if index == 1 else layers[-1]  # row 1: another's states
        rows.append((Sample(index, index + 1, list(range(length)), None), layers, witness(head, engine, length)))
    together = Certifier(head, 2).certify_all(rows)
    assert isinstance(together[1], CertificateFailed) and str(together[1]).startswith("sample 1 (line 2): ")
    for index in (0, 2):
        alone = Certifier(head, 2).certify(*rows[index])
        for name, value in alone.tensors().items():  # the errors: float32 noise, summed in another order
            atol = 1e-5 if name.endswith("error") else 0
            assert torch.allclose(together[index].tensors()[name], value, rtol=1e-6, atol=atol), (index, name)


def test_converted_rows_keep_their_certificates(tmp_path):
    from hidden_states.convert import convert

    out = write_run(tmp_path, "speculators-0.5")
    converted = tmp_path / "converted"
    assert convert(out, converted, "speculators-0.3", log=lambda line: None) == ROWS
    code, lines = checked(converted)
    assert code == 0 and lines[-1] == f"verify: ok: {ROWS} certified rows hold the engine's states", lines
