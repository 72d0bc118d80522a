"""vllm-native's strings (the speculative method ``extract_hidden_states``, the connector
``ExampleHiddenStatesConnector``) checked where vLLM resolves them, on the installed vLLM: read live
and statically, each check gives the same observation. The released wheels and the planted copies of
their source are read once, in tests/unit/test_string_touchpoints_wheels.py."""
import pytest
from packaging.version import Version

from vllm_compat import versions
from vllm_compat.probes import shapes
from vllm_compat.probes.live import LiveSource
from vllm_compat.probes.static import DirTree, StaticSource
from hidden_states.backends import touchpoints

BACKEND_TOUCHPOINTS = touchpoints()  # each backend's own declaration (hidden_states/backends)

pytestmark = pytest.mark.vllm

BY_STRING = [check for check, _ in BACKEND_TOUCHPOINTS["vllm-native"].checks if isinstance(check, shapes.ByString)]
# each site of a dispatch too: the installed release lacks some of them, and both readers must say so alike
CHECKS = BY_STRING + [site for check in BY_STRING if isinstance(check, shapes.Dispatched) for site in check.sites]


def test_the_string_checks_are_the_methods_validation_its_dispatch_and_the_connector():
    assert [type(check) for check in BY_STRING] == [shapes.LiteralMember, shapes.Dispatched, shapes.Registered]


@pytest.mark.parametrize("check", CHECKS, ids=[check.describe() for check in CHECKS])
def test_static_and_live_agree_on_the_installed_release(check):
    installed = versions.package_dir("vllm")
    static = check.observe(StaticSource(DirTree(installed.parent)))
    alive = check.observe(LiveSource())
    assert static.value == alive.value, (static, alive)
    if check in BY_STRING and versions.base(versions.vllm_version()) >= Version(BACKEND_TOUCHPOINTS["vllm-native"].first):
        assert static.value == shapes.PRESENT, static  # before its first release vllm-native is n/a
