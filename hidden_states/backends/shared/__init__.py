"""What both sides of the backends import: the parent (``backends``, in the run's process) and the
worker (``backends.worker``, inside vLLM's processes). ``regions``: the shared-memory regions'
layout, which the worker writes and the parent reads (and the parent's pool of them);
``graph_store``: ``--cuda-graphs``' buffers in the worker, the layers variable the parent sets for
them and the line the parent makes of their report. It imports neither side."""
