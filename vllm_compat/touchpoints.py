"""Every other place the in-process speculators generators touch vLLM (beyond the adapters).

DRIFT.md lists these as unchanged from 0.11.0 to 0.32.0; the audit checks them anyway, so new
drift anywhere the generator or its worker extension reaches is caught before a model loads.
Each entry: (check, expected observation, speculators versions that touch it).
"""
from __future__ import annotations

from .shapes import OPTIONAL, PRESENT, REQUIRED, Attr, Check, Exists, FieldDefault, Param

BOTH = ">=0.3.0,<0.5"
ONLY_03 = ">=0.3.0,<0.4"
ONLY_04 = ">=0.4.0,<0.5"

TOUCHPOINTS: tuple[tuple[Check, frozenset[str], str], ...] = tuple(
    (check, frozenset(expected), consumers)
    for check, expected, consumers in [
        # imports of vllm_hidden_states_generator.py
        *[(Exists(f"vllm.config:{name}"), {PRESENT}, BOTH)
          for name in ("CacheConfig", "DeviceConfig", "LoadConfig", "ModelConfig", "ParallelConfig",
                       "SchedulerConfig", "VllmConfig")],
        (Exists("vllm.sampling_params:SamplingParams"), {PRESENT}, BOTH),
        (Exists("vllm.v1.core.kv_cache_utils:_get_kv_cache_groups_uniform_spec"), {PRESENT}, BOTH),
        (Exists("vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups"), {PRESENT}, BOTH),
        (Exists("vllm.v1.core.kv_cache_utils:unify_hybrid_kv_cache_specs"), {PRESENT}, BOTH),
        (Exists("vllm.v1.core.kv_cache_utils:get_request_block_hasher"), {PRESENT}, ONLY_04),
        (Exists("vllm.v1.core.kv_cache_utils:init_none_hash"), {PRESENT}, ONLY_04),
        (Exists("vllm.utils.hashing:get_hash_fn_by_name"), {PRESENT}, ONLY_04),
        (Exists("vllm.v1.core.sched.scheduler:Scheduler"), {PRESENT}, BOTH),
        (Exists("vllm.v1.executor.multiproc_executor:MultiprocExecutor"), {PRESENT}, BOTH),
        (Exists("vllm.v1.request:Request"), {PRESENT}, BOTH),
        (Attr("vllm.v1.request:RequestStatus", "FINISHED_ABORTED"), {PRESENT}, BOTH),
        (Param("vllm.v1.structured_output:StructuredOutputManager.__init__", "vllm_config"), {REQUIRED}, BOTH),
        # imports of custom_worker.py
        (Exists("vllm.distributed:get_pp_group"), {PRESENT}, BOTH),
        (Exists("vllm.distributed:get_tp_group"), {PRESENT}, BOTH),
        (Exists("vllm.model_executor.models.interfaces:supports_eagle3"), {PRESENT}, ONLY_03),
        (Exists("vllm.sequence:IntermediateTensors"), {PRESENT}, BOTH),
        # what the step loop calls
        (Attr("vllm.v1.core.sched.scheduler:Scheduler", "schedule"), {PRESENT}, BOTH),
        (Param("vllm.v1.core.sched.scheduler:Scheduler.add_request", "request"), {REQUIRED}, BOTH),
        (Param("vllm.v1.core.sched.scheduler:Scheduler.finish_requests", "finished_status"), {REQUIRED}, BOTH),
        (Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "execute_model"), {PRESENT}, BOTH),
        (Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "initialize_from_config"), {PRESENT}, BOTH),
        (Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "shutdown"), {PRESENT}, BOTH),
        (Param("vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc", "unique_reply_rank"),
         {OPTIONAL}, BOTH),
        (Param("vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc", "args"), {OPTIONAL}, BOTH),
        (FieldDefault("vllm.v1.core.sched.output:SchedulerOutput", "total_num_scheduled_tokens"), {REQUIRED}, BOTH),
        (FieldDefault("vllm.v1.core.sched.output:SchedulerOutput", "num_scheduled_tokens"), {REQUIRED}, BOTH),
        # what the worker extension relies on (the mechanism that injects it)
        (Attr("vllm.config:ParallelConfig", "worker_extension_cls"), {PRESENT}, BOTH),
        (Attr("vllm.v1.worker.gpu_worker:Worker", "execute_model"), {PRESENT}, BOTH),
    ]
)
