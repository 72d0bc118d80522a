"""The repository speaks of the project alone: of vLLM, the adapters, the extractor and what was
measured with them, never of the circumstances the code was written in (working sessions, machines
lent for a while and their time budget, the paths of the host it was built on, the agents that wrote
it), and it cites no tracker it does not hold: an issue number comes with its upstream project named
right before it ("vLLM #44485", "speculators issue #279") or as a URL, anything else by what it is (a
docs section, in words).

Every tracked text file is read, except ``tests/unit/golden/`` (the audit's own output, compared
byte for byte by test_audit_golden.py: its text comes from the adapters' source, read here) and this
file (its patterns name what they look for). ``/tmp/...`` paths are not looked for: the ones here are
folders the scripts and examples choose to work in, a choice of the project, not of a host.
"""
from __future__ import annotations

import re
from pathlib import Path

from tests.tracked_files import tracked_texts as tracked_file_texts

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = ("tests/unit/golden/", "tests/unit/test_repository_speaks_of_itself.py")

_ = r"\s+"  # words of a phrase may break across lines
# Phrases of how and where the project was built, each with what it is; precise enough that the
# product's own words do not match: an HTTP or POSIX session ("a session of its own",
# ``start_new_session``), pytest's ``scope="session"`` and "test session starts", "one bash session
# per page" (how tests/e2e/test_docs_commands.py runs a page), a scheduler's token budget, the memory
# check's ``DeviceBudget``, replies "given back" to the pool.
CIRCUMSTANCES = {
    "a working session": re.compile(
        r"(?<![\"'])(?<!bash )(?<!test )\b[Ss]essions?\b(?!\s+of\s+its\s+own)(?![\"'])"),
    "a machine lent": re.compile(r"\b(?:lent|lending)\b"),
    "the device time budget": re.compile(
        rf"\bdevice{_}(?:budget|time)\b|\bbudget_left|\bbudget{_}(?:ended|ends|ran{_}out|is{_}spent|had{_}\d)"
        rf"|\bbudget's{_}end\b|\bcut{_}by{_}(?:the|its){_}budget\b|\buntil{_}the{_}budget\b"),
    "a machine given or taken back": re.compile(
        rf"\bmachines?{_}(?:was|were){_}(?:taken|given){_}back\b|\bgiven{_}back{_}while{_}idle\b"
        rf"|\brefused{_}starts?\b"),
    "the lending tool's words": re.compile(
        r"\bnvidia-h[12]00(?:-x\d)?\b|\bneeds_h200\b|\bgive_back\b|\bfiles_fetch\b|\bper_call_limit\b"
        r"|\bidle_release|\bcall-size\b"),
    "a path of the build host": re.compile(r"(?<![\w.~-])/(?:work|check)/|\.library/"),
    "an agent that wrote it": re.compile(
        rf"\bhelper{_}(?:agent|session)s?\b|\bhelper{_}[A-D]\b|\bsub-?agents?\b|\bthe{_}lead\b"),
    "the assignment": re.compile(r"\b[Mm]ission(?:'s)?\b"),
}

# "issue 13", "issues 31", "issue #6", "#44485"; a URL (".../issues/123", ".../pull/45") never matches
CITATION = re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w/&#])#\d+\b")
# ... and is fine right after its project's name, alone or in a list ("vLLM #46301, #46973; #44485")
PROJECTS = (r"vLLM|vllm|speculators|SpecForge|transformers|PyTorch|torch|Ray|NCCL|Triton|FlashInfer|"
            r"compressed-tensors|llm-compressor|sglang|SGLang|huggingface_hub|safetensors")
NAMED = re.compile(rf"\b(?:{PROJECTS})(?:'s)?\s+(?:(?:PR|pull\s+request|issue)s?\s+)?"
                   rf"(?:#?\d+\s*(?:[,;]|\band\b)\s*)*(?:(?:PR|issue)s?\s+)?$")

# Hits that are about the product, each with its reason: (path, the line's text stripped, reason).
ALLOWED: list[tuple[str, str, str]] = []


def tracked_texts():
    """Every tracked text file but those ``SKIPPED``."""
    return ((name, text) for name, text in tracked_file_texts() if not name.startswith(SKIPPED))


def _line(text: str, at: int) -> tuple[int, str]:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return text.count("\n", 0, at) + 1, text[start:end if end >= 0 else None].strip()


def hits() -> list[str]:
    """``path:line: what ('the words'): the line`` for each line and kind of hit (a raw log may repeat one)."""
    allowed = {(path, line) for path, line, _reason in ALLOWED}
    found: dict[tuple[str, int, str], str] = {}
    for name, text in tracked_texts():
        for what, pattern in CIRCUMSTANCES.items():
            for match in pattern.finditer(text):
                number, line = _line(text, match.start())
                if (name, line) not in allowed:
                    found.setdefault((name, number, what), f"{name}:{number}: {what} ({match.group(0)!r}): {line[:160]}")
        for match in CITATION.finditer(text):
            if NAMED.search(text[max(0, match.start() - 120):match.start()]):
                continue
            number, line = _line(text, match.start())
            if (name, line) not in allowed:
                found.setdefault((name, number, "citation"), f"{name}:{number}: a tracker the repository does not "
                                 f"hold ({match.group(0)!r}): {line[:160]}")
    return [found[key] for key in sorted(found)]


def test_the_repository_speaks_of_the_project_alone():
    found = hits()
    assert not found, (f"{len(found)} lines speak of how the project was built or cite an issue of a tracker "
                       "the repository does not hold (name its upstream project, or say what it is):\n"
                       + "\n".join(found))


def test_the_patterns_tell_the_project_from_its_circumstances():
    def flagged(text: str) -> bool:
        return (any(p.search(text) for p in CIRCUMSTANCES.values())
                or any(not NAMED.search(text[:m.start()]) for m in CITATION.finditer(text)))

    for circumstance in ("The fifth session ran it", "in this session", "on the lent GPU",
                         "the device budget ended first", "budget_left_s", "the machine was\n  taken back",
                         "`nvidia-h200-x2` was not", "/work/main/.cache", "helper A owns it",
                         "the mission's target", "(issue 13 step 2)", "Targets (issue #6)",
                         "vLLM computes no states for them, issue #44485", "(#12)"):
        assert flagged(circumstance), circumstance
    for product in ('@pytest.fixture(scope="session")', "start_new_session=True",
                    "one bash session per page", "Start the extractor in a session of its own",
                    "the scheduler's token budget", "DeviceBudget(total, 0.9)", "device_budget(0.9)",
                    "a reply given back", "vLLM issue #44485", "(vLLM #46301, #46973; #44485 is open)",
                    "speculators #279", "https://github.com/vllm-project/vllm/issues/44485",
                    "~/work/out", "===== test session starts ====="):
        assert not flagged(product), product
