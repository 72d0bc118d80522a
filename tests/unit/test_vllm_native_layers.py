"""vllm-native's layer ids: vLLM's count (the input of layer L) from the extractor's, checked against
the model's layer count the plan read (the backend reads no config itself)."""
import pytest
from packaging.version import Version

from hidden_states.backends import BackendSettings
from hidden_states.backends.vllm_native import LAST_LAYER_FROM, VllmNativeBackend
from hidden_states.errors import ExtractError


@pytest.fixture
def native():
    made = []

    def backend(layer_ids):
        # no model directory: the layer count comes from the settings alone
        made.append(VllmNativeBackend(BackendSettings("/no/model/here", layer_ids, 8, 1, 0.1, num_layers=4)))
        return made[-1]

    yield backend
    for backend in made:
        backend.close()


def test_vllm_ids_count_the_input_of_each_layer(native):
    assert native([0, 2]).vllm_layer_ids(Version("0.17.0")) == [1, 3]


def test_the_last_layers_output_before_its_release_is_refused_from_the_plans_layer_count(native):
    with pytest.raises(ExtractError, match=f"--layer-ids 3 .*needs vLLM >= {LAST_LAYER_FROM}"):
        native([3]).vllm_layer_ids(Version("0.17.0"))
    assert native([3]).vllm_layer_ids(LAST_LAYER_FROM) == [4]
