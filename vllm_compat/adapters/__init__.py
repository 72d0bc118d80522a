"""One module per adapter; each exports ``ADAPTER`` (a :class:`vllm_compat.adapter.Adapter`)."""
