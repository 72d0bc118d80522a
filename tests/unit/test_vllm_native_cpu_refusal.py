"""``--backend vllm-native`` on vLLM's CPU backend: the runners that cannot run extract_hidden_states
are named before vLLM starts (exit 2 through ``ExtractError``), read from the CPU model runner's source
as each release ships it; the runners that can are let through."""
import pytest

from hidden_states.backends import vllm_native
from hidden_states.errors import ExtractError

# the shape of each release's vllm/v1/worker/cpu_model_runner.py, as far as the check reads it
REFUSES_SPEC_DECODE = "class CPUModelRunner:\n    def load_model(self):\n        ...\n" \
                      "assert not self.speculative_config, 'spec decode is not supported'\n"  # up to 0.18
NO_AUX_STATES = "class CPUModelRunner(GPUModelRunner):\n    def load_model(self, eep_scale_up=False):\n" \
                "        self.model = get_model(vllm_config=self.vllm_config)\n"  # 0.20.0
SETS_UP_AUX_STATES = NO_AUX_STATES + "        self._setup_eagle3_aux_hidden_state_outputs()\n"  # 0.26.0, 0.32.0
INHERITS_LOAD_MODEL = "class CPUModelRunner(GPUModelRunner):\n    def warming_up_model(self):\n        ...\n"


def runner_source(monkeypatch, tmp_path, text: str, device: str = "cpu") -> None:
    folder = tmp_path / "vllm" / "v1" / "worker"
    folder.mkdir(parents=True)
    (folder / "cpu_model_runner.py").write_text(text)
    monkeypatch.setattr(vllm_native.extractor_api, "package_dir", lambda name: tmp_path / name)
    monkeypatch.setattr(vllm_native.extractor_api, "vllm_device_type", lambda: device)


def test_a_runner_that_refuses_speculative_methods_is_named(monkeypatch, tmp_path):
    runner_source(monkeypatch, tmp_path, REFUSES_SPEC_DECODE)
    with pytest.raises(ExtractError, match="vLLM 0.17.0's CPU backend does not run speculative methods"):
        vllm_native._refuse_cpu_without_spec_decode("0.17.0")


def test_a_runner_that_loads_without_the_auxiliary_states_is_named(monkeypatch, tmp_path):
    runner_source(monkeypatch, tmp_path, NO_AUX_STATES)
    with pytest.raises(ExtractError, match=r"vLLM 0.20.0's CPU model runner loads the model without the auxiliary"):
        vllm_native._refuse_cpu_without_spec_decode("0.20.0")


@pytest.mark.parametrize("text", [SETS_UP_AUX_STATES, INHERITS_LOAD_MODEL])
def test_runners_that_can_run_it_pass(monkeypatch, tmp_path, text):
    runner_source(monkeypatch, tmp_path, text)
    vllm_native._refuse_cpu_without_spec_decode("0.26.0")


def test_a_gpu_is_never_refused_by_the_cpu_runner(monkeypatch, tmp_path):
    runner_source(monkeypatch, tmp_path, NO_AUX_STATES, device="cuda")
    vllm_native._refuse_cpu_without_spec_decode("0.20.0")
