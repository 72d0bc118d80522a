"""``--cuda-graphs``' capture (hidden_states/backends/shared/graph_store.py, worker/graph_capture.py) with a small
torch stack standing in for vLLM's decoder, compiled as vLLM compiles it (torch.compile, its guards
dropped: the compiled code runs whatever changed on the modules afterwards): the buffers, the
step's real rows (not the padding a CUDA graph runs), the copies inside the compiled forward, and
the negative (hooks put on after the compile never run). Real vLLM runs it in
tests/e2e/test_graph_capture.py; the refusals of ``--cuda-graphs`` where it cannot run are here."""
import json
from types import SimpleNamespace

import pytest
import torch

from hidden_states.backends import BackendSettings
from hidden_states.backends.worker import graph_capture, own_capture
from hidden_states.backends.shared.graph_store import LAYERS_ENV, GraphStore, buffer_rows, report_line
from hidden_states.backends.vllm_engine import (CAPTURE_ENV, GRAPH_EXTENSION, OWN, VllmEngineBackend,
                                                graph_capture_environment)
from hidden_states.cli import main
from tests.unit.decoder_stack import HIDDEN, Layer, extract_through_the_worker

LAYER_IDS = [0, 2]
ROWS = 16  # the buffers' rows: the most tokens one forward holds
PADDED = 8  # the batch the compiled forward runs (a CUDA graph's size): the step's tokens, then padding


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, HIDDEN)
        torch.nn.init.normal_(self.embed_tokens.weight, generator=torch.Generator().manual_seed(3))
        self.layers = torch.nn.ModuleList(Layer(1.0 + i) for i in range(layers))
        self.start_layer, self.end_layer = 0, layers

    def forward(self, input_ids, positions):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states + residual


def reference(stack: Stack, input_ids, positions) -> list[torch.Tensor]:
    """Each captured layer's output (hidden_states + residual), from an eager forward without hooks."""
    outputs = []
    with torch.no_grad():
        hidden_states, residual = stack.embed_tokens(input_ids), None
        for index, layer in enumerate(stack.layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
            if index in LAYER_IDS:
                outputs.append((hidden_states + residual).clone())
    return outputs


def compiled(stack: Stack):
    """``stack``'s forward compiled as vLLM compiles it: its ``forward`` traced once, its guards
    dropped (vLLM's ``guard_filter_fn``), so that nothing changed on the modules afterwards is seen."""
    torch._dynamo.reset()
    return torch.compile(stack.forward, backend="aot_eager", dynamic=True,
                         options={"guard_filter_fn": lambda entries: [False] * len(entries)})


def padded(ids: list[int], positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's token ids and positions (default: one prompt's) padded to ``PADDED`` rows, as a CUDA
    graph's batch is."""
    pad = PADDED - len(ids)
    positions = list(range(len(ids))) if positions is None else positions
    return torch.tensor(ids + [0] * pad), torch.tensor(positions + [0] * pad)


# -- the buffers


def test_taken_rows_are_the_steps_tokens_not_the_padding():
    store = GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu")
    store.keep_layer(1, torch.ones(PADDED, HIDDEN))
    store.keep_ids(torch.arange(PADDED))
    store.keep_positions(torch.arange(PADDED) + 100)
    layers, ids, positions = store.taken(5, clone=False)
    assert [tuple(layer.shape) for layer in layers] == [(5, HIDDEN), (5, HIDDEN)]
    assert torch.equal(layers[1], torch.ones(5, HIDDEN)) and not layers[0].any()
    assert ids.tolist() == [0, 1, 2, 3, 4] and positions.tolist() == [100, 101, 102, 103, 104]
    assert not store.layers[1][PADDED:].any()  # a step writes its own rows, nothing past them


def test_cloned_rows_outlive_the_next_step_views_do_not():
    """On a GPU the next step's replay overwrites the buffers while the host copies of this step's
    rows still run on their own stream: those copies read clones."""
    store = GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu")
    store.keep_layer(0, torch.full((3, HIDDEN), 7.0))
    (cloned,), _, _ = (lambda t: (t[0][:1], t[1], t[2]))(store.taken(3, clone=True))
    (viewed,), _, _ = (lambda t: (t[0][:1], t[1], t[2]))(store.taken(3, clone=False))
    store.keep_layer(0, torch.zeros(3, HIDDEN))  # the next step
    assert torch.equal(cloned, torch.full((3, HIDDEN), 7.0)) and not viewed.any()


@pytest.mark.parametrize("num_tokens", [0, ROWS + 1])
def test_a_step_the_buffers_cannot_hold_is_refused(num_tokens):
    store = GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=f"a step of {num_tokens} tokens, the capture's buffers hold {ROWS}"):
        store.taken(num_tokens, clone=False)


@pytest.mark.parametrize("budget, sizes, tp, rows", [
    (8192, [1, 2, 4, 512], 1, 8192),  # the token budget holds every graph
    (256, [1, 2, 4, 512], 1, 512),  # a graph padded past the budget
    (8191, [], 2, 8192),  # sequence-parallel padding to a multiple of the ranks
])
def test_the_buffers_hold_the_largest_forward(budget, sizes, tp, rows):
    assert buffer_rows(budget, sizes, tp) == rows


def test_the_layers_reach_the_workers_and_the_compile_cache_is_off():
    environ = {"VLLM_DISABLE_COMPILE_CACHE": "0"}
    graph_capture_environment([5, 2, 2], environ)
    assert environ == {LAYERS_ENV: "2,5", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    assert graph_capture.layers_from_environment(environ) == [2, 5]
    with pytest.raises(RuntimeError, match=f"{LAYERS_ENV}='2,x': expected the decoder layer ids"):
        graph_capture.layers_from_environment({LAYERS_ENV: "2,x"})


# -- the copies inside the compiled forward


def test_the_copies_run_inside_the_compiled_forward():
    stack = Stack()
    store = GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu")
    graph_capture.install_copies(stack, store)
    forward = compiled(stack)
    for ids in ([5, 6, 7, 8, 9], [11, 12, 13]):  # the second run: the compiled code, not a new trace
        input_ids, positions = padded(ids)
        with torch.no_grad():
            forward(input_ids, positions)
        layers, kept_ids, kept_positions = store.taken(len(ids), clone=False)
        assert kept_ids.tolist() == ids and kept_positions.tolist() == list(range(len(ids)))
        for got, want in zip(layers, reference(stack, input_ids, positions), strict=True):
            assert torch.allclose(got, want[:len(ids)])


def test_negative_hooks_put_on_after_the_compile_never_run():
    """The eager capture's hooks, put on once vLLM has compiled (as ``own_capture`` does after the
    engine starts): the compiled forward runs without them, nothing is handed over."""
    stack, stored = Stack(), []
    forward = compiled(stack)
    input_ids, positions = padded([5, 6, 7])
    with torch.no_grad():
        forward(input_ids, positions)
    own_capture.capture_layers(stack, LAYER_IDS, stored.append)
    with torch.no_grad():
        forward(input_ids, positions)
    assert stored == []


def test_the_count_of_python_forwards_tells_an_eager_forward_from_the_compiled_one():
    """What the run's end reports: the eager forward runs the copies as Python hooks and is counted;
    the compiled forward runs them (their rows land) and counts nothing."""
    stack = Stack()
    store = GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu")
    graph_capture.install_copies(stack, store)
    input_ids, positions = padded([5, 6, 7])
    with torch.no_grad():
        stack(input_ids, positions)
    assert store.python_forwards == 1
    forward = compiled(stack)
    for ids in ([8, 9], [10, 11, 12, 13]):
        with torch.no_grad():
            forward(*padded(ids))
        assert store.taken(len(ids), clone=False)[1].tolist() == ids
    assert (store.python_forwards, store.steps) == (1, 2)


def test_the_report_says_where_the_copies_ran():
    assert report_line({"steps": 7, "python_forwards": 0}) == (
        "--cuda-graphs: the capture ran inside vLLM's compiled forward (7 engine steps, no forward ran its copies "
        "as Python)")
    eager = report_line({"steps": 7, "python_forwards": 9})
    assert eager.startswith("warning: --cuda-graphs: 9 forwards ran the capture's copies as Python hooks")
    assert "inside vLLM's compiled forward" not in eager
    assert report_line({"steps": 0, "python_forwards": 0}) is None and report_line(None) is None


def test_copies_need_the_stacks_layers_and_its_embedding():
    store = GraphStore([0, 3], ROWS, HIDDEN, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"layers \[3\] are not among this worker's decoder layers 0-2"):
        graph_capture.install_copies(Stack(), store)
    stack = Stack()
    del stack.embed_tokens
    with pytest.raises(RuntimeError, match="no token embedding"):
        graph_capture.install_copies(stack, GraphStore(LAYER_IDS, ROWS, HIDDEN, torch.float32, "cpu"))


class Worker(graph_capture.GraphStreamingCapture):
    """vLLM's worker in miniature: loads ``Stack`` (the copies installed then, before the compile),
    compiles it, and runs each step's tokens padded to ``PADDED`` rows."""

    def __init__(self, monkeypatch):
        monkeypatch.setenv(LAYERS_ENV, ",".join(map(str, LAYER_IDS)))
        stack = Stack()
        model = SimpleNamespace(model=stack, parameters=stack.parameters)
        self.model_runner = SimpleNamespace(model=model, get_model=lambda: model, device=torch.device("cpu"),
                                            input_batch=SimpleNamespace(req_ids=[]))
        self.model_config = SimpleNamespace(get_hidden_size=lambda: HIDDEN, dtype=torch.float32)
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=ROWS),
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, PADDED]),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self._hidden_states_install_copies()  # Worker.load_model's end (graph_capture.install_at_model_load)
        self.forward = compiled(stack)

    def execute_model(self, scheduler_output):
        prompts = {new.req_id: new.prompt_token_ids for new in scheduler_output.scheduled_new_reqs}
        self.model_runner.input_batch.req_ids = list(prompts)
        with torch.no_grad():
            self.forward(*padded([t for ids in prompts.values() for t in ids],
                                 [p for ids in prompts.values() for p in range(len(ids))]))


def test_rows_reach_each_requests_region_from_the_compiled_forward(monkeypatch):
    """One step of two requests, padded, through the compiled forward: each request's region holds
    its own rows of every captured layer (not the padding's), and its token ids pass the parent's check."""
    prompts = {"a": [11, 12, 13], "b": [21, 22]}
    workers = []

    def make_worker():
        workers.append(Worker(monkeypatch))
        return workers[-1]

    results = extract_through_the_worker(monkeypatch, list(prompts), list(prompts), prompts, make_worker)
    # what the run's end reports, before the eager reference forwards below run the hooks as Python
    assert workers[0]._hidden_states_graph_report() == {"steps": 1, "python_forwards": 0}
    stack = workers[0].model_runner.model.model
    for got, ids in zip(results, prompts.values(), strict=True):
        want = reference(stack, torch.tensor(ids), torch.arange(len(ids)))
        assert all(torch.allclose(g, w) for g, w in zip(got, want, strict=True)), got


def test_the_backend_starts_vllm_compiled_with_the_graph_capture(monkeypatch):
    """Its own capture even where speculators 0.4 is installed (whose capture is a patched forward)."""
    from packaging.version import Version

    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version", lambda: Version("0.4.0"))
    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    backend = VllmEngineBackend(BackendSettings("m", [3, 1], 8, 1, 0.1, cuda_graphs=True))
    facts = backend.prepare(None)
    assert facts["capture"] == OWN and backend.enforce_eager is False
    assert backend.llm_keywords() == {"worker_extension_cls": GRAPH_EXTENSION}
    import os

    assert os.environ[LAYERS_ENV] == "1,3" and os.environ["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    assert VllmEngineBackend(BackendSettings("m", [3], 8, 1, 0.1)).enforce_eager is True


def test_the_plan_says_the_flag():
    from hidden_states.plan.planner import settings_line
    from hidden_states.settings import Settings

    assert settings_line(Settings("m", "d", "o", backend="vllm-engine", cuda_graphs=True)).endswith(" --cuda-graphs")
    assert "--cuda-graphs" not in settings_line(Settings("m", "d", "o", backend="vllm-engine"))


# -- where --cuda-graphs cannot run: one line naming the flag, exit 2, before any model loads


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 512}))
    return path


@pytest.mark.parametrize("command, extra, environ, message", [
    ("extract", ("--backend", "speculators"), {},
     "--cuda-graphs: needs --backend vllm-engine (its own capture is the one traced into vLLM's compiled forward), "
     "not --backend speculators"),
    ("extract", ("--backend", "vllm-native"), {}, "--cuda-graphs: needs --backend vllm-engine"),
    ("plan", ("--backend", "vllm-native"), {}, "--cuda-graphs: needs --backend vllm-engine"),
    ("extract", ("--backend", "vllm-engine"), {CAPTURE_ENV: "speculators"},
     f"--cuda-graphs: runs the extractor's own capture, not speculators' ({CAPTURE_ENV}=speculators)"),
    ("generate", (), {CAPTURE_ENV: "speculators"}, "--cuda-graphs: runs the extractor's own capture"),
])
def test_cuda_graphs_where_they_cannot_run_is_one_line_and_exit_2(model, tmp_path, capsys, monkeypatch, command,
                                                                  extra, environ, message):
    monkeypatch.setattr("hidden_states.run.model_here.ModelHere.load", lambda self: pytest.fail("the model loaded"))
    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' if command == "generate"
                    else '{"input_ids": [5, 6, 7]}\n')
    code = main([command, "--model-path", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                 "--format", "speculators-0.3", "--layer-ids", "0", "2", "--cuda-graphs", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()
