"""Shared test set-up.

Tests that need a real vLLM are marked ``vllm``; in the matrix venvs (``VLLM_COMPAT_REQUIRE_VLLM=1``)
a missing vLLM is an error, never a silent skip. Tests that need ``datasets`` / ``pyarrow`` (no vLLM
release requires them) are marked ``datasets``; the matrix runs them where the speculators 0.9.0
folder brings both (``VLLM_COMPAT_REQUIRE_DATASETS=1``: missing there is an error too).
"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("VLLM_COMPAT_CACHE", os.path.join(ROOT, ".cache"))
NEGATIVE = "tests/e2e/test_negative.py"


def pytest_addoption(parser):
    parser.addoption("--negative-only", default=None, metavar="NAMES",
                     help="comma-separated substrings: run only the negative-proof tests whose id has one "
                          "(the matrix runs all of them on one release, the new ones on later releases)")


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--negative-only")
    if wanted is not None:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        drop = [i for i in items if i.nodeid.startswith(NEGATIVE) and not any(n in i.nodeid for n in names)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [i for i in items if i not in drop]
    _needs(items, "vllm", ("vllm",), "VLLM_COMPAT_REQUIRE_VLLM", "run scripts/test_matrix.py")
    _needs(items, "datasets", ("datasets", "pyarrow"), "VLLM_COMPAT_REQUIRE_DATASETS",
           "the matrix's 'unit (datasets)' suite")


def _needs(items, marker: str, modules: tuple[str, ...], required_by: str, where: str) -> None:
    """Tests marked ``marker`` need ``modules``: where one is missing they skip, saying where they run,
    and where ``required_by=1`` (the matrix's venvs) the run stops instead."""
    marked = [item for item in items if marker in item.keywords]
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not marked or not missing:
        return
    if os.environ.get(required_by) == "1":
        raise pytest.UsageError(f"{required_by}=1 but {', '.join(missing)} is not importable here")
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)} ({where})"))
