"""Every shell block in README.md and the docs pages (docs/ and its folders: tests/docs_blocks.pages)
says whether it runs on CPU with the tiny models (```` ```console runnable ````, which
tests/e2e/test_docs_commands.py then runs) or why not (gpu, network, server, illustrative): a reader
can tell a command to paste from a sketch, and a new block cannot skip the docs test by saying nothing."""
from __future__ import annotations

import re

from tests.docs_blocks import NEEDS, ROOT, TAGS, shell_blocks

# what a block that runs as written cannot hold: an elision, an optional flag's synopsis, a placeholder path
NOT_AS_WRITTEN = re.compile(r"\.\.\.|\[--|/path/to")


def test_every_shell_block_is_tagged():
    untagged = [f"{b.where}: ```{b.language} {' '.join(b.words)}".rstrip() for b in shell_blocks() if b.tag is None]
    assert not untagged, ("shell blocks without a tag (```console TAG, TAG one of "
                          f"{', '.join(TAGS)}; docs/architecture.md, 'Shell blocks in the docs'):\n"
                          + "\n".join(untagged))


def test_runnable_blocks_run_as_written():
    wrong = []
    for block in shell_blocks():
        if block.tag != "runnable":
            continue
        if NOT_AS_WRITTEN.search(block.text):
            wrong.append(f"{block.where}: holds {NOT_AS_WRITTEN.search(block.text).group()!r}")
        unknown = [w for w in block.words[1:] if w not in NEEDS]
        if unknown:
            wrong.append(f"{block.where}: {unknown} (a runnable block's second word is one of {NEEDS})")
    assert not wrong, "\n".join(wrong)


def test_repeated_blocks_are_runnable_blocks_of_the_page_they_name():
    """A page may show again what another page runs (getting started's training steps are the extract
    guide's): tagged ``repeated PAGE``, the block must be, command for command, a runnable block of that
    page, needing the same speculators release, so the docs test's run there proves it."""
    runnable = {(b.page, b.commands().strip(), b.needs) for b in shell_blocks() if b.tag == "runnable"}
    wrong = []
    for block in shell_blocks():
        if block.tag != "repeated":
            continue
        if block.repeats is None:
            wrong.append(f"{block.where}: names no page (```console repeated docs/PAGE.md)")
        elif (block.repeats, block.commands().strip(), block.needs) not in runnable:
            wrong.append(f"{block.where}: not a runnable block of {block.repeats} (same commands, same needs)")
    assert not wrong, "\n".join(wrong)


def test_pages_with_runnable_blocks_say_their_variables():
    """A runnable block uses $MODEL, $DATA, $OUT, $PRESET: its page sets each (``NAME=``) above it."""
    missing = []
    for block in shell_blocks():
        if block.tag != "runnable":
            continue
        before = "\n".join((ROOT / block.page).read_text().splitlines()[:block.line - 1])
        for name in sorted(set(re.findall(r"\$\{?(MODEL|DATA|OUT|PRESET)\b", block.text))):
            if not re.search(rf"\b{name}=", before):
                missing.append(f"{block.where}: ${name}")
    assert not missing, "variables a runnable block uses that its page does not set above it:\n" + "\n".join(missing)
