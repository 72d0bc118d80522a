"""Fixtures the end-to-end tests share."""
import pytest

from tests.e2e import harness


@pytest.fixture(scope="module")
def model():
    """The tiny Llama checkpoint (``harness.tiny_model``, built once into the cache)."""
    return harness.tiny_model("llama")
