"""The config baseline (vllm_compat/behaviour/config_baseline.py) is what scripts/config_baseline.py
derives from the newest verified release's wheel and the generators' code: no field written by hand,
and regenerated when the newest verified release moves."""
import ast

import pytest

from tests.e2e.harness import speculators_path
from vllm_compat import wheels
from vllm_compat.behaviour import GENERATOR_FILE, config_baseline
from vllm_compat.behaviour.fields import baseline_table
from vllm_compat.callsites.signatures import VllmIndex
from vllm_compat.consumer import GENERATOR, GENERATOR_RELEASES
from vllm_compat.probes.static import StaticSource, WheelTree
from vllm_compat.registry import newest_verified


def test_baseline_is_the_newest_verified_release():
    assert config_baseline.RELEASE == str(newest_verified()), (
        "the newest verified release moved: run python3 scripts/config_baseline.py")


def test_baseline_matches_its_wheel():
    name = config_baseline.SOURCE.split("-")[0].replace("_", "-")
    try:
        wheel = wheels.fetch(f"{name}=={config_baseline.RELEASE}")
    except wheels.WheelError as exc:
        pytest.skip(f"the baseline's wheel cannot be fetched here: {exc}")
    assert wheel.name == config_baseline.SOURCE
    trees = [(ast.parse((speculators_path(r) / GENERATOR_FILE).read_text()), GENERATOR.rpartition(".")[0])
             for r in GENERATOR_RELEASES]
    assert baseline_table(VllmIndex(StaticSource(WheelTree(wheel))), trees) == config_baseline.FIELDS
    assert "vllm.config:CacheConfig" in config_baseline.FIELDS
