"""The audit CLI on bad input, and its JSON, without vLLM: synthetic wheels and trees."""
import json

from tests.unit.synthetic_wheels import VLLM_FILES, make_wheel
from vllm_compat.cli import main

def test_missing_path(capsys, tmp_path):
    assert main(["audit", "--vllm", str(tmp_path / "nope.whl")]) == 2
    assert capsys.readouterr().err.strip() == f"vllm-compat: error: {tmp_path / 'nope.whl'}: no such file or directory"


def test_not_a_wheel(capsys, tmp_path):
    bad = tmp_path / "vllm.whl"
    bad.write_bytes(b"not a zip")
    assert main(["audit", "--vllm", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vllm-compat: error: {bad}: not a wheel") and "Traceback" not in err


def test_truncated_wheel(capsys, tmp_path):
    good = make_wheel(tmp_path / "good.whl", VLLM_FILES)
    cut = tmp_path / "cut.whl"
    cut.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    assert main(["audit", "--vllm", str(cut)]) == 2
    assert "not a wheel" in capsys.readouterr().err


def test_wheel_of_another_package(capsys, tmp_path):
    other = make_wheel(tmp_path / "requests.whl", {"requests/__init__.py": ""})
    assert main(["audit", "--vllm", str(other)]) == 2
    assert "a wheel of another package (requests), not vLLM" in capsys.readouterr().err


def test_tree_without_vllm(capsys, tmp_path):
    assert main(["audit", "--vllm", str(tmp_path)]) == 2
    assert f"{tmp_path}: no vllm/ package in this directory" in capsys.readouterr().err


def test_unparsable_version(capsys, tmp_path):
    files = dict(VLLM_FILES, **{"vllm/_version.py": "__version__ = 'not.a.version!'\n"})
    assert main(["audit", "--vllm", str(make_wheel(tmp_path / "v.whl", files))]) == 2
    assert "cannot parse version 'not.a.version!'" in capsys.readouterr().err


def test_bad_consumer(capsys, tmp_path):
    assert main(["audit", "--vllm", str(make_wheel(tmp_path / "v.whl", VLLM_FILES)), "--consumer", "vllm==1"]) == 2
    assert "expected speculators==VERSION" in capsys.readouterr().err


def test_debug_shows_the_traceback_and_keeps_the_exit_code(capsys, tmp_path):
    bad = tmp_path / "vllm.whl"
    bad.write_bytes(b"not a zip")
    assert main(["audit", "--vllm", str(bad), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "AuditError" in err
    assert err.rstrip().splitlines()[-1].startswith(f"vllm-compat: error: {bad}: not a wheel")


def test_json_of_a_partial_tree_reports_missing_symbols(capsys, tmp_path):
    code = main(["audit", "--vllm", str(make_wheel(tmp_path / "v.whl", VLLM_FILES)), "--json",
                 "--consumer", "speculators==0.3.0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["schema"] == 6 and out["ok"] is False
    assert out["vllm_version"] == "0.17.0" and out["mode"] == "static"
    eos = next(f for f in out["findings"] if f["id"] == "request_eos_token_id")
    assert (eos["verdict"], eos["found"], eos["where"]) == ("adapted", "absent", "vllm/v1/request.py:2")
    assert {"id", "kind", "verdict", "checked", "old", "new", "found", "where", "scope", "summary"} <= set(eos)
    assert any(f["verdict"] == "missing" for f in out["findings"])


def test_a_consumer_without_in_process_generator_is_not_ok(capsys, tmp_path):
    """speculators 0.5+ talks to `vllm serve`: nothing here to check, and saying OK would mislead."""
    wheel = make_wheel(tmp_path / "v.whl", VLLM_FILES)
    code = main(["audit", "--vllm", str(wheel), "--consumer", "speculators==0.9.9"])
    captured = capsys.readouterr()
    assert code == 2 and "OK" not in captured.out
    assert "speculators 0.9.9 has no in-process generator" in captured.err
    assert "drives `vllm serve` with vLLM's own extract_hidden_states" in captured.err
