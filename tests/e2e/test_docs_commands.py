"""The guides' runnable shell blocks (```` ```console runnable ````, tests/docs_blocks.py) run as
written, on CPU vLLM with a tiny model: each page's blocks in page order in one bash session
(``set -e``), so a block may use what an earlier one wrote, with the variables the pages name set:
``MODEL`` the tiny Llama with a Llama-3 chat template, ``DATA`` a few ShareGPT conversations, ``OUT``
an output directory, ``PRESET=cpu-tiny``. A failing block is named by page and line.

Where each block runs (its tag's second word): the extractor's blocks with speculators 0.3.0 on the
path (this vLLM 0.32.0 venv; the default backend, vllm-engine, runs speculators' capture there); ``speculators-0.9`` blocks with
speculators 0.9.0 instead; ``speculators-0.3`` blocks in the vLLM 0.17.0 venv (transformers 4, where
speculators 0.3's draft model builds), as tests/e2e/test_formats.py trains them.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs_blocks import ROOT as DOCS_ROOT, blocks, pages
from tests.e2e import harness
from tests.e2e.trainers import speculators_09, transformers_4_python

pytestmark = pytest.mark.formats

PAGES = sorted({b.page for path in pages() for b in blocks(path) if b.tag == "runnable"})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from hidden_states.fixtures.demo import chat_model, write_conversations

    root = tmp_path_factory.mktemp("docs-inputs")
    data = root / "conversations.jsonl"
    write_conversations(data, 12)
    return chat_model(root), data


def environment(needs: str | None) -> tuple[str, str]:
    """(the venv's bin directory, PYTHONPATH) a block runs with."""
    if needs == "speculators-0.9":
        return str(Path(sys.executable).parent), os.pathsep.join([ROOT, str(speculators_09())])
    if needs == "speculators-0.3":
        return str(Path(transformers_4_python()).parent), os.pathsep.join([ROOT, str(harness.speculators_path("0.3.0"))])
    return str(Path(sys.executable).parent), os.pathsep.join([ROOT, str(harness.speculators_path("0.3.0"))])


def script(page_blocks, progress: Path) -> str:
    """One bash script: each block after the lines that set its environment and note where we are."""
    lines = ["set -eo pipefail", f"BASE_PATH={shlex.quote(os.environ['PATH'])}"]
    for block in page_blocks:
        bin_dir, python_path = environment(block.needs)
        lines += [f"echo {shlex.quote(block.where)} $SECONDS >> {shlex.quote(str(progress))}",
                  f"export PATH={shlex.quote(bin_dir)}:$BASE_PATH PYTHONPATH={shlex.quote(python_path)}",
                  block.commands()]
    lines.append(f"echo end $SECONDS >> {shlex.quote(str(progress))}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_runnable_blocks_run_as_written(page, inputs, tmp_path):
    model, data = inputs
    page_blocks = [b for b in blocks(DOCS_ROOT / page) if b.tag == "runnable"]
    progress = tmp_path / "progress"
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "MODEL": str(model), "DATA": str(data), "OUT": str(work / "out"), "PRESET": "cpu-tiny",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_COMPAT_APPLY", None)
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", script(page_blocks, progress)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1500)
    marks = progress.read_text().split("\n") if progress.exists() else []
    marks = [m.split() for m in marks if m]
    timings = ", ".join(f"{where} from {at}s" for where, at in marks)
    print(f"{page}: {time.monotonic() - started:.0f} s ({timings})")
    last = marks[-1][0] if marks else "(before the first block)"
    assert proc.returncode == 0, (f"{last}: the block failed (rc {proc.returncode}):\n"
                                  + proc.stdout[-2000:] + "\n" + proc.stderr[-5000:])
    assert last == "end", marks
