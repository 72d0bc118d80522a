"""Both extractor backends on the same tiny model and samples: vllm-native (vLLM's own
extract_hidden_states, layer ids translated) must find the same hidden states as the speculators
generator through the shim, and both must match HF. Where the installed vLLM cannot run vllm-native,
the extractor must say so clearly (exit 2), never hang or crash."""
import torch
from packaging.version import Version

import pytest

from tests.e2e import harness
from tests.e2e.test_extractor import data_files, extract_args, run_cli, write_jsonl
from vllm_compat.versions import base, vllm_version

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.backends]

VERSION = base(vllm_version())


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    model = harness.tiny_model("llama")
    root = tmp_path_factory.mktemp("backends")
    rows = write_jsonl(root / "data.jsonl", 24, seed=11)
    runs = {backend: run_cli(*extract_args(model, root / "data.jsonl", root / backend, "--backend", backend))
            for backend in ("speculators", "vllm-native")}
    return model, root, rows, runs


def test_native_refuses_clearly_where_it_cannot_run(both):
    _, _, _, runs = both
    native = runs["vllm-native"]
    if VERSION < Version("0.17.0"):
        assert native.returncode == 2 and "--backend vllm-native needs vLLM >= 0.17.0" in native.stderr
    elif VERSION < Version("0.18.0"):  # the layers asked for include the last one
        assert native.returncode == 2 and "needs vLLM >= 0.18.0 with --backend vllm-native" in native.stderr
    else:
        assert native.returncode in (0, 2), native.stderr[-3000:]
        if native.returncode == 2:
            assert "CPU backend does not run speculative methods" in native.stderr


def test_same_states_from_both_backends(both):
    model, root, rows, runs = both
    if runs["vllm-native"].returncode != 0:
        pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here (checked above)")
    assert runs["speculators"].returncode == 0, runs["speculators"].stderr[-3000:]
    assert sorted(data_files(root / "vllm-native")) == sorted(data_files(root / "speculators")) == list(range(24))
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [0, 2, 3, 5])
    for i in range(24):
        native = torch.load(root / "vllm-native" / f"data_{i}.pt", weights_only=True)
        generator = torch.load(root / "speculators" / f"data_{i}.pt", weights_only=True)
        assert native["input_ids"].tolist() == generator["input_ids"].tolist() == rows[i]["input_ids"]
        for a, b, ref in zip(native["hidden_states"], generator["hidden_states"], reference[i]):
            assert float(relative_errors(a, b).max()) < 0.02  # the same model, the same bf16 kernels
            assert float(relative_errors(a, ref).max()) < harness.TOLERANCE


def test_native_on_this_host_needs_its_adapter(both, tmp_path):
    """Negative proof for native_connector_host_memory: without it, vLLM's connector asks for
    pinned memory on a host that has none, and the run fails (it must fail, not hang)."""
    model, root, _, runs = both
    if runs["vllm-native"].returncode != 0:
        pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here (checked above)")
    from vllm_compat.registry import get

    if not get("native_connector_host_memory").host_probe()[0]:
        pytest.skip("this host has an accelerator: pinned memory works")
    proc = run_cli(*extract_args(model, root / "data.jsonl", tmp_path / "out", "--backend", "vllm-native"),
                   env_extra={"VLLM_COMPAT_DISABLE": "native_connector_host_memory"}, timeout=900)
    assert proc.returncode == 1
    assert "pin_memory" in proc.stderr or "EngineDeadError" in proc.stderr
