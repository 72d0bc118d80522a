"""Named sets of extractor settings; flags given on the command line override them, and every
setting a preset leaves out keeps its default (``settings.Settings``). A preset names no backend:
the run's is chosen per environment (``backends.choose``) unless ``--backend`` is given."""

PRESETS: dict[str, dict] = {
    # 8x RTX PRO 6000 Blackwell 96 GB: the target deployment's TP=8 job (1T-parameter MoE class). The backend chosen
    # per environment; not measured on this hardware (its TP=8 rehearsal ran on CPU).
    "blackwell-tp8": {"tp_size": 8, "gpu_memory_utilization": 0.80, "batch_size": 4, "max_seq_len": 2048},
    # One H200 (139 GiB), 8B-class dense model, the backend chosen per environment (vllm-engine where its
    # audit passes). Batch 8: where vllm-engine was measured at 0.97-0.98x of vLLM's own prefill over
    # 2048-token rows (vLLM 0.33.0/0.34.0; the generator 0.90x at this batch), and a smaller batch leaves
    # less for the writer to finish after the last one; 4 writer threads keep up with the states there
    # (measured: docs/benchmarks.md, "`hidden-states extract`, GPU" and docs/performance.md, "The
    # extractor's defaults").
    "h200": {"tp_size": 1, "gpu_memory_utilization": 0.80, "batch_size": 8, "max_seq_len": 2048, "writer_threads": 4},
    # Two 8-GPU hosts, pipeline stages over them: tensor parallel in each host, the layers split in two
    # (61 layers: 31 and 30). Memory per GPU: as the plan prints it from the checkpoint's headers. Stages
    # on two hosts need Ray (several nodes), not supported yet: on one 8-GPU host the plan refuses these.
    "kimi-k2-int4-2x8h100": {"tp_size": 8, "pp_size": 2, "gpu_memory_utilization": 0.90, "batch_size": 4,
                             "max_seq_len": 2048},
    "deepseek-v3-bf16-2x8h200": {"tp_size": 8, "pp_size": 2, "gpu_memory_utilization": 0.90, "batch_size": 8,
                                 "max_seq_len": 2048},
    # The CPU demo and tests: vLLM's CPU backend, a tiny local model (the demo names --backend speculators,
    # the shim's showcase; a run that names none gets vllm-engine, 46,483 against 21,466 tokens/s there).
    "cpu-tiny": {"tp_size": 1, "gpu_memory_utilization": 0.02, "batch_size": 8, "max_seq_len": 1024},
}
