import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture
def generator_module():
    """The speculators generator module, when the matrix put a speculators release on the path."""
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("no speculators on the path (the matrix runs this suite once per speculators release)")
    import speculators.data_generation.vllm_hidden_states_generator as module

    return module
