"""What the terminal shows of a run's output at each ``--log-level``: a filter over its lines.

Everything a run prints (ours, vLLM's, speculators', Ray's, Gloo's, in the parent and in every
worker) reaches the parent as text (``run_log``), so a line's level is read from the line itself:
the level word of a Python logging format (vLLM's ``INFO 12-03 ...``, ``INFO [vllm-compat] ...``,
Ray's ``... INFO worker.py:1 -- ...``), glog's ``W1203 ...`` (torch, Gloo's C++), a Python warning
(``file.py:9: UserWarning: ...``), a traceback or an exception line. A line that starts with
whitespace continues the one before it (a traceback's frames, a warning's source line) and is
shown with it. Lines without a level are INFO (Gloo's ``[Gloo] Rank 0 is connected ...``, tqdm).

Levels: ``debug`` shows everything; ``info`` (the default) our lines and third-party warnings and
errors; ``warning`` warnings and errors; ``error`` (``--quiet``) errors only. Errors are shown at
every level, and so is the run's final summary. Our lines (``[hidden-states] ...``, vllm-compat's)
are shown once each, whichever process printed them; so is a third-party warning that several
processes print, or that one place in a library's code prints in a loop (vLLM's "Attempted to load
weight ..." once per weight): its first line stands for the rest. On a host without a CUDA device, third-party warnings about CUDA-only mechanisms
(CUDA graphs, the CUDA runtime, Triton's GPU drivers, NCCL) go to the log file only.
"""
from __future__ import annotations

import logging
import re

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
DEFAULT = "info"

# a vLLM process's prefix on each line of its output, once or more: "(Worker pid=12) (Worker pid=12) "
OUR_PREFIX = "[hidden-states] "  # how each line the extractor logs begins
_PROCESS_PREFIX = re.compile(r"^(?:\((?:[\w.:-]+ )*(?:pid|rank)=\d+[^)]*\)\s?)+")
_OURS = re.compile(r"^\[hidden-states\] |^hidden-states: |vllm-compat[ :(]")
_OUR_LEVEL = re.compile(r"^\[hidden-states\] (debug|warning|error):|^hidden-states: (error|failed|aborted)")
# the run's last line: the summary an extraction, a conversion or a server ends with
SUMMARY = re.compile(r"^\[hidden-states\] (done|interrupted|stopped|converted): |rerun the same command to resume|"
                     r"^\[hidden-states\] stopped after \d")
_LEVEL_WORD = re.compile(r"\b(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_GLOG = re.compile(r"^\[?([DIWEF])\d{4} \d\d:\d\d:\d\d")
_GLOG_LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
_ERROR_TEXT = re.compile(r"^Traceback \(most recent call last\)|^During handling of the above exception|"
                         r"^The above exception was the direct cause|^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception"
                         r"|Interrupt|Exit)(?:: |$)|Segmentation fault|core dumped|^terminate called|^Fatal Python error")
_CUDA_ONLY = re.compile(r"CUDA|cudagraph|Triton|NCCL|cuDNN|NVML", re.IGNORECASE)
# where in a library's code a line was logged: vLLM's "[utils.py:333]", glog's "utils.cpp:103]", Python warnings' "mlp.py:9:"
_SOURCE_LINE = re.compile(r"[\w./-]+\.(?:py|cpp|cc|cu|h|hpp):\d+\b")
# what differs between the same line from two processes: pids, ranks, timestamps
_VARIES = re.compile(r"pid[= ]\d+|\d{2,4}-\d\d(?:-\d\d)?[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?|^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d\S*")


def add_flags(parser, log_file: str | None = "hidden-states.log in the output directory") -> None:
    """``--log-level`` and ``--quiet`` on a subcommand's parser (``log_file``: where the full log goes,
    None: nowhere)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--log-level", choices=list(LEVELS), default=DEFAULT,
                       help="what the terminal shows: debug everything; info our lines and third-party warnings "
                            "(default); warning; error. Errors and the final summary are always shown"
                            + (f"; the full log goes to {log_file}" if log_file else ""))
    group.add_argument("--quiet", action="store_true", help="errors and the final summary only (= --log-level error)")


def level_of(args) -> int:
    """The threshold the parsed flags ask for."""
    return logging.ERROR if getattr(args, "quiet", False) else LEVELS[getattr(args, "log_level", DEFAULT)]


def classify(text: str, *, cuda: bool = True) -> tuple[int | None, bool]:
    """``(level, ours)`` of one line (its process prefix included); level None: it continues the
    line before it."""
    body = _body(text)
    if not body.strip() or body[:1].isspace():
        return None, False
    ours = bool(_OURS.search(body))
    if ours and body.startswith((OUR_PREFIX, "hidden-states: ")):
        found = _OUR_LEVEL.match(body)
        if found is None:
            return logging.INFO, True
        return {"debug": logging.DEBUG, "warning": logging.WARNING}.get(found.group(1), logging.ERROR), True
    level = _level_word(body)
    if level is None and _ERROR_TEXT.search(body):
        level = logging.ERROR
    if level is None:
        level = logging.WARNING if _PY_WARNING.match(body) else logging.INFO
    if level == logging.WARNING and not ours and not cuda and _CUDA_ONLY.search(body):
        level = logging.INFO  # a CUDA-only mechanism, on a host without CUDA: the log file only
    return level, ours


def prefix_only(text: str) -> bool:
    """Whether ``text`` holds nothing but blanks and a process prefix (``(Worker pid=9) ``): what may
    stand before a line of ours."""
    return not _PROCESS_PREFIX.sub("", text).strip()


def _body(text: str) -> str:
    """What a terminal would show of the line (the last of its carriage-return redraws), less the
    process prefix."""
    return _PROCESS_PREFIX.sub("", text.rstrip("\r").rsplit("\r", 1)[-1])


def _level_word(body: str) -> int | None:
    glog = _GLOG.match(body)
    if glog:
        return _GLOG_LEVELS[glog.group(1)]
    word = _LEVEL_WORD.search(body[:48])  # a logging format's level sits in its header
    if word is None:
        return None
    name = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(word.group(1), word.group(1))
    return getattr(logging, name)


class TerminalFilter:
    """Which lines of a run's output the terminal shows (:meth:`shows`, called once per line, in order).

    Args:
        level: the threshold (``logging.DEBUG`` ... ``logging.ERROR``).
        cuda: whether this host has a CUDA device (else CUDA-only warnings are not shown).
    """

    def __init__(self, level: int, *, cuda: bool = True):
        self.level = level
        self.cuda = cuda
        self._seen: set[str] = set()
        self._showing = False  # the decision for the current line and the lines continuing it
        self._error = False  # whether that line is an error (a blank line is shown only inside one)

    def shows(self, text: str) -> bool:
        level, ours = classify(text, cuda=self.cuda)
        if level is None:
            blank = not _body(text).strip()
            return self._showing and (self._error or not blank or self.level <= logging.DEBUG)
        self._showing = self._decide(text, level, ours)
        self._error = level >= logging.ERROR
        return self._showing

    def _decide(self, text: str, level: int, ours: bool) -> bool:
        if level >= logging.ERROR or SUMMARY.search(text):
            return True
        threshold = self.level if ours or self.level <= logging.DEBUG else max(self.level, logging.WARNING)
        if level < threshold:
            return False
        key = _VARIES.sub("", _body(text)).strip()
        if not ours:  # a warning logged in a loop (one per weight, per layer): its first line stands for all
            key = next((m.group(0) for m in _SOURCE_LINE.finditer(key[:80])), key)
        if (ours or self.level > logging.DEBUG) and key in self._seen:
            return False
        self._seen.add(key)
        return True
