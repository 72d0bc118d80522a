"""The worker side of the backends: code that runs inside vLLM's processes (its workers), imported
there by the dotted paths the parent side hands vLLM (``vllm_engine.EXTENSIONS``, ``GRAPH_EXTENSION``:
``worker_extension_cls``). It may import ``backends.shared``, never the parent side (``backends``' own
modules), which runs in the extractor's process."""
