"""scripts/golden_outputs.py compare: two recordings of the extractor's outputs are the same only
when every file is (bytes, or tensor by tensor with ``torch.equal``), with the recording's own
paths and the allowed files set aside."""
import importlib.util
import io
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

spec = importlib.util.spec_from_file_location("golden_outputs", Path(ROOT) / "scripts" / "golden_outputs.py")
golden_outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden_outputs)


def recording(root: Path, *, states=None, pt=None, config=None, log="took 1.2 s", finished=(0, 1),
              generated_at="2026-01-02T03:04:05+00:00") -> Path:
    """A recording as ``record`` leaves one: a manifest, a case's files, a run log."""
    case = root / "cases" / "extract"
    (case / "hidden_states").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"root": str(root), "repo": f"{root}-checkout", "commit": "abc"}))
    (root / "logs").mkdir()
    (root / "logs" / "extract.txt").write_text(log)
    (case / "hidden-states.log").write_text(log)
    states = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7 if states is None else states
    safetensors_torch.save_file({"hidden_states": states.to(torch.bfloat16), "token_ids": torch.arange(3)},
                                str(case / "hidden_states" / "hs_0.safetensors"), metadata={"format": "pt"})
    torch.save(pt if pt is not None else {"input_ids": torch.arange(5), "hidden_states": [states.clone()]},
               case / "data_0.pt")
    (case / "data_config.json").write_text(config or json.dumps(
        {"model": f"{root}/inputs/model", "layer_ids": [1, 3], "generated_at": generated_at,
         "vllm_compat": {"pid": len(str(root))}}))
    (case / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                 "_fingerprint": f"{hash(str(root)) & 0xffff:04x}"}))
    (case / "done.jsonl").write_text("".join(json.dumps({"index": i, "length": 5}) + "\n" for i in finished))
    return root


def compared(a: Path, b: Path) -> tuple[int, str]:
    out = io.StringIO()
    return golden_outputs.compare(a, b, out=out), out.getvalue()


def test_two_recordings_of_the_same_outputs_are_the_same(tmp_path):
    """Their own paths, the time and pid in data_config.json, the dataset's fingerprint, the order of
    the ledger's lines, logs and run logs differ; nothing that counts does."""
    code, said = compared(recording(tmp_path / "a"), recording(tmp_path / "bb", log="took 3.4 s", finished=(1, 0),
                                                              generated_at="2026-01-02T03:04:09+00:00"))
    assert code == 0, said
    assert "5 of 5 files the same" in said and "DIFFERENT" not in said


def test_a_ledger_line_more_is_a_difference(tmp_path):
    code, said = compared(recording(tmp_path / "a"), recording(tmp_path / "b", finished=(0, 1, 2)))
    assert code == 1 and "DIFFERENT cases/extract/done.jsonl" in said


def test_other_bytes_in_a_file_are_a_difference(tmp_path):
    other = json.dumps({"model": f"{tmp_path / 'b'}/inputs/model", "layer_ids": [1, 4]})
    code, said = compared(recording(tmp_path / "a"), recording(tmp_path / "b", config=other))
    assert code == 1
    assert "DIFFERENT cases/extract/data_config.json" in said and "4 of 5 files the same" in said


def test_a_tensor_one_ulp_off_is_a_difference(tmp_path):
    states = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    off = states.clone()
    off[1, 2] = torch.nextafter(off[1, 2], torch.tensor(100.0))  # float32: the .pt file keeps it
    code, said = compared(recording(tmp_path / "a", states=states),
                          recording(tmp_path / "b", pt={"input_ids": torch.arange(5), "hidden_states": [off]}))
    assert code == 1
    assert "DIFFERENT cases/extract/data_0.pt" in said and "'hidden_states'[0]: float32[3, 4] values differ" in said
    # in a safetensors file (bf16 there: one ulp of bf16)
    bf16 = states.to(torch.bfloat16)
    bumped = bf16.clone()
    bumped[0, 1] = torch.nextafter(bumped[0, 1], torch.tensor(100.0, dtype=torch.bfloat16))
    code, said = compared(recording(tmp_path / "c", states=bf16), recording(tmp_path / "d", states=bumped))
    assert code == 1
    assert "DIFFERENT cases/extract/hidden_states/hs_0.safetensors" in said
    assert "'hidden_states': bfloat16[3, 4] values differ" in said


def test_another_dtype_or_tensor_name_is_a_difference(tmp_path):
    code, said = compared(recording(tmp_path / "a"),
                          recording(tmp_path / "b", pt={"input_ids": torch.arange(5).int(), "states": []}))
    assert code == 1
    assert "'input_ids': int64[5] != int32[5]" in said and "'hidden_states': only in A" in said


def test_a_missing_file_is_a_difference(tmp_path):
    a, b = recording(tmp_path / "a"), recording(tmp_path / "b")
    (b / "cases" / "extract" / "data_0.pt").unlink()
    code, said = compared(a, b)
    assert code == 1 and "DIFFERENT cases/extract/data_0.pt\n    missing in B" in said
    code, said = compared(b, a)
    assert code == 1 and "missing in A" in said


def test_an_empty_recording_is_no_proof(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert compared(tmp_path / "a", tmp_path / "b")[0] == 1
