"""``SchedulerConfig`` requires ``is_encoder_decoder`` (vLLM 0.12.0).

Drift: the ``InitVar`` fields ``max_model_len`` and ``is_encoder_decoder`` gained defaults in
0.11.1 and lost them in 0.12.0 (``vllm/config/scheduler.py:31,37``), so constructing the config
without ``is_encoder_decoder`` raises ``TypeError``. speculators 0.3.0 never passes it. The value
vLLM's own ``SchedulerConfig.default_factory`` fills in is ``False``, the right one for the
decoder-only models the generator supports.

Scope: consumer (the ``SchedulerConfig`` name inside the speculators generator module).
Disable: ``VLLM_COMPAT_DISABLE=scheduler_config_is_encoder_decoder``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Expect, Scope
from ..consumer import SPECULATORS_03, generator_name
from ..factories import default_keyword
from ..probes.shapes import ABSENT, REQUIRED, FieldDefault

ADAPTER = default_keyword(
    id="scheduler_config_is_encoder_decoder",
    at=generator_name("SchedulerConfig"),
    keyword="is_encoder_decoder",
    value=False,
    expect=Expect(FieldDefault("vllm.config:SchedulerConfig", "is_encoder_decoder"),
                  old={ABSENT, "False"}, new={REQUIRED}),
    summary="pass SchedulerConfig(is_encoder_decoder=False) when the caller omits it",
    drift="is_encoder_decoder became a required SchedulerConfig InitVar in 0.12.0",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.12.0"),
    speculators=SpecifierSet(SPECULATORS_03),  # 0.4 handles it itself
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"`SchedulerConfig` needs `is_encoder_decoder` (0.12.0)\": "
             "vllm/config/scheduler.py:31,37,144-153 (0.12.0)",
)
