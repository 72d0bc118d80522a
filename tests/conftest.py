"""Shared test set-up. Tests that need a real vLLM are marked ``vllm``; in the matrix venvs
(``VLLM_COMPAT_REQUIRE_VLLM=1``) a missing vLLM is an error, never a silent skip."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("VLLM_COMPAT_CACHE", os.path.join(ROOT, ".cache"))


def pytest_collection_modifyitems(config, items):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    required = os.environ.get("VLLM_COMPAT_REQUIRE_VLLM") == "1"
    for item in items:
        if "vllm" in item.keywords:
            if required:
                raise pytest.UsageError("VLLM_COMPAT_REQUIRE_VLLM=1 but vLLM is not importable here")
            item.add_marker(pytest.mark.skip(reason="needs a real vLLM (run scripts/test_matrix.py)"))
