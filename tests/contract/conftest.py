import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session", autouse=True)
def consumer_modules_imported():
    """Import speculators' generator and worker extension once, the way users must under
    transformers 5: after apply() (which lets them import), then revert. Every test then starts
    from the original objects, and the consumer's by-value imports have been given them back."""
    import vllm_compat
    from vllm_compat.consumer import GENERATOR, WORKER_EXTENSION

    if importlib.util.find_spec("speculators") is None:
        yield
        return
    vllm_compat.apply()
    try:
        importlib.import_module(GENERATOR)
        importlib.import_module(WORKER_EXTENSION.split(":")[0])
    finally:
        vllm_compat.revert()
    yield


@pytest.fixture
def generator_module():
    """The speculators generator module, when the matrix put a speculators release on the path."""
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("no speculators on the path (the matrix runs this suite once per speculators release)")
    import speculators.data_generation.vllm_hidden_states_generator as module

    return module
