"""scripts/pins.py: an exact pin the index lacks is relaxed by one rule (the newest release of the
same minor, else the nearest above, else the nearest below), on small fakes and on pip's real answer
for the pin vLLM 0.34.0 ships (``flashinfer-python==0.7.3``)."""
import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_script", f"{ROOT}/scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


pins = load("pins")


@pytest.mark.parametrize("available, expected", [
    (["0.7.4", "0.7.2.post1", "0.7.2", "0.6.18"], ("0.7.4", pins.SAME_MINOR)),       # vLLM 0.34.0's case
    (["0.8.0", "0.7.2.post1", "0.7.1"], ("0.7.2.post1", pins.SAME_MINOR)),           # same minor beats a nearer line
    (["0.7.10", "0.7.4", "0.7.2"], ("0.7.10", pins.SAME_MINOR)),                     # compared as versions, not text
    (["0.9.0", "0.8.1", "0.6.9"], ("0.8.1", pins.NEXT_ABOVE)),
    (["0.6.2", "0.5.0"], ("0.6.2", pins.NEXT_BELOW)),
    (["0.7.5rc1", "0.7.2"], ("0.7.2", pins.SAME_MINOR)),                             # no pre-release for a final pin
    (["0.7.5rc1", "0.7.5.dev3"], None),
    ([], None),
])
def test_rule(available, expected):
    assert pins.nearest_available("0.7.3", available) == expected


def test_a_pre_release_pin_may_become_a_pre_release():
    assert pins.nearest_available("0.8.0rc2", ["0.8.0rc1", "0.8.0rc3", "0.7.9"]) == ("0.8.0rc3", pins.SAME_MINOR)


def test_only_missing_pins_whose_marker_holds_are_relaxed():
    served = {"flashinfer-python": ["0.7.4", "0.7.2.post1"], "nvidia-cutlass-dsl": ["4.9.1", "4.7.0"],
              "tilelang": ["0.1.12"], "tokenspeed-mla": ["2.0.3"]}
    asked = []

    def versions_of(name):
        asked.append(name)
        return served[name]

    requirements = [
        "flashinfer-python==0.7.3",
        "nvidia-cutlass-dsl[cu13]==4.8.0",
        "tilelang==0.1.12",                                  # served: kept
        'tokenspeed-mla==2.0.3; platform_system == "Linux"',  # marker holds, served: kept
        'protobuf==7.36.1; platform_machine == "s390x"',      # marker fails here: never asked
        "transformers<5.23.0,>=5.16.1",                      # a range: the resolver's job
        "apache-tvm-ffi==0.1.*",                             # a wildcard is a range too
    ]
    out, relaxed = pins.relax_unavailable(requirements, versions_of, "3.11")
    assert sorted(asked) == ["flashinfer-python", "nvidia-cutlass-dsl", "tilelang", "tokenspeed-mla"]
    assert out == ["flashinfer-python==0.7.4", "nvidia-cutlass-dsl[cu13]==4.9.1", *requirements[2:]]
    assert [(r.name, r.pinned, r.chosen, r.rule) for r in relaxed] == [
        ("flashinfer-python", "0.7.3", "0.7.4", pins.SAME_MINOR),
        ("nvidia-cutlass-dsl", "4.8.0", "4.9.1", pins.NEXT_ABOVE)]
    assert relaxed[0].line() == ("relaxed pin flashinfer-python==0.7.3 -> flashinfer-python==0.7.4 "
                                 "(the index has no 0.7.3; rule: the newest release of the same minor)")


def test_a_marker_is_kept_on_the_relaxed_pin():
    out, _ = pins.relax_unavailable(['tokenspeed-mla==2.0.3; platform_system == "Linux"'],
                                    lambda name: ["2.0.4"], "3.11")
    assert out == ['tokenspeed-mla==2.0.4; platform_system == "Linux"']


def test_a_pin_the_index_says_nothing_about_is_left_to_the_installer():
    assert pins.relax_unavailable(["flashinfer-python==0.7.3"], lambda name: [], "3.11") == (
        ["flashinfer-python==0.7.3"], [])


def test_a_pin_with_no_candidate_stops_the_build():
    with pytest.raises(SystemExit, match="flashinfer-python==0.7.3 is pinned; the index lacks it"):
        pins.relax_unavailable(["flashinfer-python==0.7.3"], lambda name: ["0.8.0rc1"], "3.11")


def test_the_real_index_lacks_vllm_0_34s_flashinfer_pin_and_it_is_relaxed_within_0_7():
    """pip's own answer (configured index and find-links), as scripts/vllm_venv.py asks it."""
    vllm_venv = load("vllm_venv")
    served = pins.index_versions(vllm_venv.pip_python(), "flashinfer-python", vllm_venv.PYTHON)
    if not served:
        pytest.skip("the package index did not answer pip (no network here)")
    out, relaxed = pins.relax_unavailable(
        ["flashinfer-python==0.7.3"], lambda name: served, vllm_venv.PYTHON)
    assert "0.7.3" not in served and "0.7.4" in served
    newest_0_7 = max((v for v in served if v.startswith("0.7.") and not pins.Version(v).is_prerelease), key=pins.Version)
    assert out == [f"flashinfer-python=={newest_0_7}"]
    assert [(r.pinned, r.chosen, r.rule) for r in relaxed] == [("0.7.3", newest_0_7, pins.SAME_MINOR)]


def test_a_folder_is_byte_compiled_once_for_an_interpreter(tmp_path):
    """scripts/vllm_venv.py's compile_bytecode: the matrix runs with PYTHONDONTWRITEBYTECODE=1 over venvs
    uv installed without bytecode; each module is compiled once, a file that does not compile is left,
    and a second call (the marker there) compiles nothing."""
    vllm_venv = load("vllm_venv")
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "module.py").write_text("VALUE = 1\n")
    (tmp_path / "template.py").write_text("{% if x %}\n")
    vllm_venv.compile_bytecode(sys.executable, tmp_path)
    tag = sys.implementation.cache_tag
    compiled = tmp_path / "package" / "__pycache__" / f"module.{tag}.pyc"
    assert compiled.is_file() and (tmp_path / f".bytecode-{tag}").is_file()
    assert not (tmp_path / "__pycache__" / f"template.{tag}.pyc").exists()
    compiled.unlink()
    vllm_venv.compile_bytecode(sys.executable, tmp_path)
    assert not compiled.exists()
