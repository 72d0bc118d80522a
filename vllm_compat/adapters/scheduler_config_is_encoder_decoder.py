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

from .._targets import generator_name
from .._wrapping import function_wrapper
from ..adapter import Adapter, Expect, Patch, Scope
from ..shapes import ABSENT, REQUIRED, FieldDefault


def default_is_encoder_decoder(wrapped, instance, args, kwargs):
    kwargs.setdefault("is_encoder_decoder", False)
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="scheduler_config_is_encoder_decoder",
    summary="pass SchedulerConfig(is_encoder_decoder=False) when the caller omits it",
    drift="is_encoder_decoder became a required SchedulerConfig InitVar in 0.12.0",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.12.0"),
    expect=Expect(FieldDefault("vllm.config:SchedulerConfig", "is_encoder_decoder"),
                  old={ABSENT, "False"}, new={REQUIRED}),
    speculators=SpecifierSet(">=0.3.0,<0.4"),  # 0.4 handles it itself
    patches=(Patch(generator_name("SchedulerConfig"), function_wrapper(default_is_encoder_decoder)),),
    evidence="DRIFT.md §3 C1: vllm/config/scheduler.py:31,37,144-153 (0.12.0)",
)
