"""scripts/demo.py shows its own lines once and keeps third-party noise in the log file only."""
import importlib.util
import io

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("demo_script", f"{ROOT}/scripts/demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

LINES = [
    "INFO 11-30 22:01:02 [model.py:123] Resolved architecture: LlamaForCausalLM\n",
    "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0\n",
    "WARNING 11-30 22:01:03 [_custom_ops.py:20] Failed to import from vllm._C_AVX2\n",
    "/x/speculators/__init__.py:3: UserWarning: something\n",
    "INFO [vllm-compat] vllm-compat (vllm process, pid 101): vllm 0.32.0: 18 applied\n",
    "INFO [vllm-compat] vllm-compat (vllm process, pid 101): vllm 0.32.0: 18 applied\n",
    "[hidden-states] starting the speculators backend: vLLM loads the model\n",
    "[hidden-states] 8/24 samples, 3,000 tokens, 100 tok/s, ETA 0:00:10\n",
    "Traceback (most recent call last):\n",
    '  File "x.py", line 1, in <module>\n',
    "RuntimeError: boom\n",
]


def shown(capsys, verbose):
    log = io.StringIO()
    demo.show_ours(iter(LINES), log, verbose)
    assert log.getvalue() == "".join(LINES)  # the log keeps everything
    return capsys.readouterr().out.splitlines()


def test_our_lines_once_and_errors_in_full(capsys):
    out = shown(capsys, verbose=False)
    assert out == [
        "INFO [vllm-compat] vllm-compat (vllm process, pid 101): vllm 0.32.0: 18 applied",
        "[hidden-states] starting the speculators backend: vLLM loads the model",
        "[hidden-states] 8/24 samples, 3,000 tokens, 100 tok/s, ETA 0:00:10",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: boom",
    ]


def test_verbose_shows_everything(capsys):
    assert shown(capsys, verbose=True) == [line.rstrip("\n") for line in LINES]


def run_demo_script(tmp_path, *args):
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_COMPAT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, f"{ROOT}/scripts/demo.py", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_help_and_a_wrong_flag_are_answered_before_anything_is_built(tmp_path):
    helped = run_demo_script(tmp_path, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: python3 scripts/demo.py") and "--samples" in helped.stdout
    assert "[demo] preparing" not in helped.stdout
    wrong = run_demo_script(tmp_path, "--sample-count", "3")
    assert wrong.returncode == 2 and "unrecognized arguments: --sample-count 3" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "cache").exists()  # no venv, no speculators, no download


def test_next_steps_name_each_speculators_lines_trainer(tmp_path):
    said = demo.next_steps("/venv/bin/python", "/spec", tmp_path / "demo-output")
    assert "plan --model-path MODEL_DIR" in said and "extract --model-path MODEL_DIR" in said
    assert f"{tmp_path / 'demo-output' / 'hidden_states'} are what speculators 0.3/0.4's trainer reads" in said
    assert "--format speculators-0.5" in said and "docs/guides/serve.md" in said
