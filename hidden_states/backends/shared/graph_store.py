"""Where ``--cuda-graphs``'s capture puts each forward's rows: persistent tensors, allocated once in
the worker, that the compiled forward writes into.

A Python forward hook runs only while vLLM's forward runs as Python: once vLLM has compiled the
model (torch.compile) and captured its CUDA graphs, a step replays kernels, and a hook registered
on the eager modules, or anything the hook would do on the host, is not part of them. What is part
of them is what was traced: so the capture's work in the forward is a single in-place ``copy_`` of
each captured layer's output into the first rows of a buffer that lives as long as the worker
(its address fixed, as a captured graph needs), traced into the compiled forward before vLLM
compiles it and replayed with every step. After the step the worker reads the first
``num_tokens`` rows, the step's real tokens (a CUDA graph runs a padded batch: the rows past them
are padding), and stores them as the eager capture stores its hook's rows
(``engine_capture.StreamingStates._store_captured_states``).

The forward's token ids and positions are kept the same way (the eager capture reads them off the
decoder stack's forward, which under a full CUDA graph runs no Python): ``engine_capture`` stores
each row's token id beside its states, which the parent checks against the request's tokens.
"""
from __future__ import annotations

# The layers the workers capture (comma-separated decoder layer ids): set by the parent
# (vllm_engine.graph_capture_environment), read in each worker at model load (graph_capture)
LAYERS_ENV = "VLLM_COMPAT_GRAPH_CAPTURE_LAYERS"


class GraphStore:
    """Per captured layer a ``[rows, hidden]`` buffer, and one ``[rows]`` buffer each for the
    forward's token ids and positions, on ``device``; ``rows`` is the most tokens one forward may
    hold (``buffer_rows``)."""

    def __init__(self, layer_ids: list[int], rows: int, hidden: int, dtype, device):
        import torch

        self.layer_ids = sorted(set(layer_ids))
        self.rows = rows
        # what the run's end reports (report_line): the engine steps whose rows were taken, and the
        # forwards that ran the copies as Python (eager: none once vLLM has compiled its forward)
        self.steps = 0
        self.python_forwards = 0
        self.layers = [torch.zeros(rows, hidden, dtype=dtype, device=device) for _ in self.layer_ids]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)

    def keep_layer(self, index: int, output) -> None:
        """In the forward (traced): layer ``self.layer_ids[index]``'s rows into its buffer's first rows."""
        write_rows(self.layers[index], output)

    def keep_ids(self, input_ids) -> None:
        """In the forward (traced): its token ids."""
        write_rows(self.input_ids, input_ids)

    def keep_positions(self, positions) -> None:
        """In the forward (traced): its positions."""
        write_rows(self.positions, positions)

    def taken(self, num_tokens: int, clone: bool) -> tuple[list, object, object]:
        """After a step whose forward held ``num_tokens`` real tokens: (each layer's rows, their token
        ids, their positions), the first ``num_tokens`` rows of each buffer. ``clone``: the layers'
        rows copied out of the buffers (on a GPU, on the compute stream: the next step's replay
        overwrites the buffers while the copies to the host still run on their own stream); else
        views of the buffers (on a CPU the host copies are done before the next step runs)."""
        if not 0 < num_tokens <= self.rows:
            raise RuntimeError(f"hidden-states vllm-engine graph capture: a step of {num_tokens} tokens, the "
                               f"capture's buffers hold {self.rows}")
        self.steps += 1
        layers = [layer[:num_tokens] for layer in self.layers]
        if clone:
            layers = [layer.clone() for layer in layers]
        return layers, self.input_ids[:num_tokens], self.positions[:num_tokens]


def write_rows(buffer, rows) -> None:
    """``buffer``'s first ``len(rows)`` rows := ``rows``, in place (the buffer's address never changes)."""
    buffer[:rows.shape[0]].copy_(rows)


def buffer_rows(max_num_batched_tokens: int, capture_sizes, tp_size: int) -> int:
    """The most tokens one forward of the engine may hold: the scheduler's token budget, or the
    largest CUDA-graph batch it is padded to where that is larger, rounded up to a multiple of the
    tensor-parallel size (vLLM pads a step's tokens to it where it splits the sequence across ranks)."""
    most = max([max_num_batched_tokens, *(capture_sizes or ())])
    return -(-most // tp_size) * tp_size


def report_line(report: dict | None) -> str | None:
    """The run's end, said by the parent from the capturing worker's ``report`` (``steps``,
    ``python_forwards``: :class:`GraphStore`'s counts): whether the copies ran inside vLLM's compiled
    forward; None where no step ran (or the worker could not be asked)."""
    if not report or not report["steps"]:
        return None
    steps, python = report["steps"], report["python_forwards"]
    if python:
        return (f"warning: --cuda-graphs: {python} forwards ran the capture's copies as Python hooks "
                f"({steps} engine steps): vLLM ran its forward eager, not compiled")
    return (f"--cuda-graphs: the capture ran inside vLLM's compiled forward ({steps} engine steps, no forward ran "
            f"its copies as Python)")
