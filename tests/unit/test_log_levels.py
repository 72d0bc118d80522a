"""What the terminal shows of a run's output at each --log-level (hidden_states/log_levels.py), and
that the whole output, children's included, reaches the log file (hidden_states/run_log.py)."""
import logging
import subprocess
import sys

import pytest

from hidden_states import log_levels, run_log
from hidden_states.cli import build_parser
from hidden_states.log_levels import TerminalFilter

# a run's output as the parent reads it: ours, vLLM's (parent and worker), Gloo's, torch's, Python's
RUN = [
    "[hidden-states] starting the speculators backend: vLLM loads the model",
    "INFO 12-03 12:19:15 [model.py:531] Resolved architecture: LlamaForCausalLM",
    "WARNING 12-03 12:19:15 [cpu.py:159] VLLM_CPU_KVCACHE_SPACE not set. Using 11.77 GiB for KV cache.",
    "WARNING 12-03 12:19:15 [vllm.py:781] Enforce eager set, disabling torch.compile and CUDAGraphs.",
    "W1203 12:19:11.505000 29712 torch/utils/cpp_extension.py:118] No CUDA runtime is found",
    "DEBUG [vllm-compat] vllm-compat: capture_transport: applied - vllm 0.17.0: collective_rpc pickles",
    "INFO [vllm-compat] vllm-compat (parent, pid 100): vllm 0.17.0: 2 applied, 18 armed",
    "/x/speculators/models/mlp.py:9: UserWarning: Field name \"torch_dtype\" shadows an attribute",
    "  class MLPSpeculatorConfig(SpeculatorModelConfig):",
    "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0",
    "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0",
    "(Worker pid=201) INFO [vllm-compat] vllm-compat (vllm process, pid 201): vllm 0.17.0: 8 armed",
    "(Worker pid=202) INFO [vllm-compat] vllm-compat (vllm process, pid 202): vllm 0.17.0: 8 armed",
    "/x/speculators/models/mlp.py:9: UserWarning: Field name \"torch_dtype\" shadows an attribute",
    "  class MLPSpeculatorConfig(SpeculatorModelConfig):",
    "(Worker pid=201) (Worker pid=201) ",
    "(Worker pid=201) INFO 12-03 12:19:26 [cpu_worker.py:90] OMP threads binding of Process 201:",
    "(Worker pid=201) INFO 12-03 12:19:26 [cpu_worker.py:90] \tOMP tid: 201, core 0\r",  # vLLM ends some with \r
    "[hidden-states] warning: 2 samples longer than --max-seq-len were truncated",
    "[hidden-states] 24/24 samples, 9,397 tokens, 35,976 tok/s, ETA 0:00:00",
    "(EngineCore_DP0 pid=300) ERROR 12-03 12:20:00 [core.py:700] EngineCore failed to start.",
    "(Worker pid=201) Traceback (most recent call last):",
    '(Worker pid=201)   File "x.py", line 1, in <module>',
    "(Worker pid=201) ",
    "(Worker pid=201) RuntimeError: boom",
    "terminate called after throwing an instance of 'c10::Error'",
    "  what():  CUDA error: out of memory",
    "[hidden-states] done: 24 samples extracted, 0 already finished, 9,397 tokens in 0.3 s",
]
ERRORS = RUN[20:27]


def shown(level, cuda=False, lines=RUN):
    terminal = TerminalFilter(level, cuda=cuda)
    return [line for line in lines if terminal.shows(line)]


def test_default_shows_our_lines_and_third_party_warnings_each_once():
    got = shown(logging.INFO)
    assert got == [RUN[0], RUN[2], RUN[6], RUN[7], RUN[8], RUN[11], RUN[18], RUN[19], *ERRORS, RUN[-1]]


def test_debug_shows_everything_but_a_repeat_of_our_own_lines():
    got = shown(logging.DEBUG)
    assert RUN[12] not in got  # the same report from a second worker
    assert [line for line in RUN if line not in got] == [RUN[12]]


def test_warning_leaves_out_our_info_lines_but_not_warnings_and_the_summary():
    got = shown(logging.WARNING)
    assert got == [RUN[2], RUN[7], RUN[8], RUN[18], *ERRORS, RUN[-1]]


def test_quiet_is_errors_and_the_summary():
    assert shown(logging.ERROR) == [*ERRORS, RUN[-1]]
    args = build_parser().parse_args(["convert", "a", "b", "--to", "speculators-0.5", "--quiet"])
    assert log_levels.level_of(args) == logging.ERROR


@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR])
def test_every_error_is_shown_at_every_level_even_repeated(level):
    twice = ["(Worker pid=1) RuntimeError: boom", "(Worker pid=2) RuntimeError: boom",
             "hidden-states: failed: RuntimeError: boom", "Segmentation fault (core dumped)"]
    assert shown(level, lines=twice) == twice


def test_cuda_only_warnings_are_shown_only_where_there_is_cuda():
    assert RUN[3] not in shown(logging.INFO, cuda=False) and RUN[4] not in shown(logging.INFO, cuda=False)
    assert RUN[3] in shown(logging.INFO, cuda=True) and RUN[4] in shown(logging.INFO, cuda=True)


def test_the_summary_line_is_recognised():
    from hidden_states.run.summary import Summary

    for interrupted in (None, 2):
        summary = Summary()
        summary.interrupted = interrupted
        assert log_levels.SUMMARY.search(f"[hidden-states] {summary.line()}")


def test_extract_takes_log_level_and_quiet_but_not_both():
    parser = build_parser()
    base = ["extract", "--model-path", "m", "--data", "d", "--output-dir", "o"]
    assert log_levels.level_of(parser.parse_args(base)) == logging.INFO
    assert log_levels.level_of(parser.parse_args([*base, "--log-level", "debug"])) == logging.DEBUG
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--log-level", "debug", "--quiet"])


CHILD = ("import sys, os; print('[Gloo] Rank 0 is connected to 0 peer ranks', flush=True); "
         "os.write(2, b'WARNING 12-03 12:00:00 [x.py:1] from a child\\n')")


def test_the_log_file_has_everything_children_included_and_the_terminal_its_share(tmp_path):
    """Run in a subprocess: the capture redirects this process's fds 1 and 2. The output directory is
    claimed mid-run (as an extraction claims it after its checks): the lines before it are in the file too."""
    script = f"""
import logging, subprocess, sys, time
from pathlib import Path
from hidden_states import run_log
out = Path({str(tmp_path / 'out')!r})
with run_log.captured(out / 'hidden-states.log', logging.INFO, cuda=False):
    print('[hidden-states] extracting', file=sys.stderr, flush=True)
    time.sleep(0.2)  # read before the run claimed the directory: held for the file
    out.mkdir()
    run_log.directory_claimed()
    print('INFO 12-03 12:00:00 [x.py:1] parent chatter')
    logging.getLogger('vllm_compat').debug('vllm-compat: a detail')
    logging.getLogger('vllm_compat').info('vllm-compat (parent, pid 1): summary')
    subprocess.run([sys.executable, '-c', {CHILD!r}])
    print('[hidden-states] done: 1 samples extracted', file=sys.stderr)
print('after', file=sys.stderr)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=str(__import__("tests.conftest").conftest.ROOT))
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "out" / "hidden-states.log").read_text()
    for line in ("[hidden-states] extracting", "parent chatter", "DEBUG [vllm-compat] vllm-compat: a detail",
                 "[Gloo] Rank 0", "from a child", "[hidden-states] done"):
        assert line in log, log
    assert log.index("[hidden-states] extracting") < log.index("parent chatter")
    assert proc.stderr.splitlines() == [
        "[hidden-states] extracting", f"[hidden-states] full log: {tmp_path / 'out' / 'hidden-states.log'}",
        "INFO [vllm-compat] vllm-compat (parent, pid 1): summary", "WARNING 12-03 12:00:00 [x.py:1] from a child",
        "[hidden-states] done: 1 samples extracted", "after"]
    assert proc.stdout == ""
    assert run_log.log_path("o", "shard-0-of-2").name == "hidden-states.shard-0-of-2.log"


def test_a_line_ending_in_a_carriage_return_keeps_its_own_level():
    """vLLM's CPU worker ends some INFO lines with '\\r': read as blank, they continued the warning before."""
    lines = ["[W1203 12:23:08.507 utils.cpp:103] Warning: NUMA binding: Using MEMBIND policy",
             "(Worker pid=810) INFO 12-03 12:23:08 [cpu_worker.py:90] OMP threads binding of Process 810:\r"]
    assert shown(logging.INFO, lines=lines) == lines[:1]


def test_a_warning_logged_in_a_loop_is_shown_once():
    """vLLM 0.32's CPU loader warns once per weight from one line of its code."""
    loop = [f"(Worker pid=9) WARNING 12-03 12:25:55 [utils.py:333] Attempted to load weight layers.{i}.w with dtype "
            f"torch.float32 into parameter with dtype torch.bfloat16" for i in range(6)]
    other = "(Worker pid=9) WARNING 12-03 12:25:55 [cpu.py:159] VLLM_CPU_KVCACHE_SPACE not set."
    assert shown(logging.INFO, lines=[*loop, other]) == [loop[0], other]
    assert shown(logging.DEBUG, lines=loop) == loop


def test_our_debug_lines_go_to_the_file_unless_debug_is_asked():
    detail = "[hidden-states] debug: settings: --backend speculators --batch-size 8"
    assert log_levels.classify(detail) == (logging.DEBUG, True)
    assert not TerminalFilter(logging.INFO).shows(detail)
    assert TerminalFilter(logging.DEBUG).shows(detail)
    assert TerminalFilter(logging.INFO).shows("[hidden-states] time: about 72 s")


def test_a_run_that_never_claims_the_directory_writes_no_log_there(tmp_path):
    """A run refused before it owns the directory (another extraction's, which it must not touch)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "hidden-states.log").write_text("the other run's log\n")
    script = f"""
import logging, sys
from pathlib import Path
from hidden_states import run_log
with run_log.captured(Path({str(out / 'hidden-states.log')!r}), logging.INFO, cuda=False):
    print('hidden-states: error: holds another extraction', file=sys.stderr, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=str(__import__("tests.conftest").conftest.ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["hidden-states: error: holds another extraction"]
    assert (out / "hidden-states.log").read_text() == "the other run's log\n"


def test_serves_last_summary_is_shown_at_every_level():
    line = "[hidden-states] stopped after 12 s: 40 requests served (5,000 tokens in 9 batches), 0 refused"
    assert log_levels.SUMMARY.search(line)
    assert shown(logging.ERROR, lines=[line]) == [line]


def test_a_line_of_ours_after_another_process_output_without_a_newline_is_its_own(tmp_path):
    """A library's report at a process's exit may end without a newline (nanobind's leak report did):
    the run's summary written next is split from it, shown, and filed as a line of its own; a line of
    ours behind a process prefix is one line, as before."""
    script = f"""
import logging, os, sys
from pathlib import Path
from hidden_states import run_log
out = Path({str(tmp_path / 'out')!r})
out.mkdir()
with run_log.captured(out / 'hidden-states.log', logging.INFO, cuda=False):
    run_log.directory_claimed()
    os.write(2, b'See https://nanobind.readthedocs.io/en/latest/refleaks.html')
    print('[hidden-states] done: 1 samples extracted', file=sys.stderr, flush=True)
    print('(Worker pid=9) [hidden-states] from a worker', file=sys.stderr, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=str(__import__("tests.conftest").conftest.ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "[hidden-states] done: 1 samples extracted" in proc.stderr.splitlines(), proc.stderr
    log = (tmp_path / "out" / "hidden-states.log").read_text().splitlines()
    assert "See https://nanobind.readthedocs.io/en/latest/refleaks.html" in log
    assert "[hidden-states] done: 1 samples extracted" in log
    assert "(Worker pid=9) [hidden-states] from a worker" in log
