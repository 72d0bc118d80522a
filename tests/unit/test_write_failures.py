"""A destination that cannot be written, for every command that writes: one line naming the path,
exit 2, never a traceback, and never "0 B free" for a directory that takes no file at all.

Two destinations that refuse writes even to root: a path under a regular file (always), and a
directory of a filesystem that takes no file (``/sys`` in a container; skipped where it takes one).
Small fakes stand in for vLLM (the states are zeros; nothing here loads a model).
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hidden_states import backends  # noqa: E402
from hidden_states.plan import planner  # noqa: E402
from hidden_states.cli import main  # noqa: E402
from tests.unit.fakes import FakeBackend  # noqa: E402

def refuses_files(directory: Path) -> bool:
    """Whether no file can be made in ``directory`` (tried: access() says yes to root)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory):
            return False
    except OSError:
        return True


CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris."}]}


@pytest.fixture
def chat_model(tmp_path):
    """config.json (4 layers, hidden 8) with the tiny Llama-3 chat tokenizer."""
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = build_tokenizer("llama3", tmp_path / "model")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 512}))
    return model


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    return path


@pytest.fixture
def refusing_dir() -> Path:
    """An existing directory in which root cannot create a file."""
    if not Path("/sys").is_dir() or not refuses_files(Path("/sys")):
        pytest.skip("no directory here refuses root's writes")
    return Path("/sys")


def under_a_file(tmp_path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    monkeypatch.setattr(planner, "check_vllm",
                        lambda backend, touched=None, speculators=True: "audit: not run (a fake backend)")
    monkeypatch.setattr(planner, "check_memory_here", lambda settings, facts, memory=None: planner.MemoryCheck([]))
    monkeypatch.setattr(planner, "states_in_flight_line", lambda settings, model, batches_held: "states: not checked (fake)")


def one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[hidden-states]")]
    assert len(lines) == 1 and lines[0].startswith("hidden-states: error: "), err
    assert "Traceback" not in err and "0 B free" not in err, err
    for words in expected:
        assert words in lines[0], err
    return lines[0]


@pytest.mark.parametrize("where", ["output under a file", "output in a refusing dir", "token-freq in a refusing dir"])
def test_prepare_to_an_unwritable_path_is_one_line(chat_model, chats, tmp_path, capsys, request, where):
    flags = {"output under a file": ["--output", str(under_a_file(tmp_path) / "rows.jsonl")],
             "output in a refusing dir": lambda: ["--output", str(request.getfixturevalue("refusing_dir") / "rows.jsonl")],
             "token-freq in a refusing dir": lambda: ["--output", str(tmp_path / "rows.jsonl"), "--token-freq",
                                                      str(request.getfixturevalue("refusing_dir") / "freq.pt")]}[where]
    flags = flags() if callable(flags) else flags

    code = main(["prepare", "--model-path", str(chat_model), "--data", str(chats), "--format", "speculators-0.3",
                 *flags])

    assert code == 2
    one_line_error(capsys, flags[-1])


@pytest.mark.parametrize("command", ["plan", "extract", "generate"])
def test_an_output_dir_that_takes_no_file_is_said_not_writable(chat_model, chats, refusing_dir, capsys, fake_vllm,
                                                               command):
    backend = ["--backend", "vllm-engine"] if command == "generate" else ["--backend", "speculators"]

    code = main([command, "--model-path", str(chat_model), "--data", str(chats), "--output-dir",
                 str(refusing_dir / "hidden-states-out"), "--format", "speculators-0.3", "--layer-ids", "1", "3",
                 *backend])

    assert code == 2
    one_line_error(capsys, f"{refusing_dir} is not writable")


def test_convert_to_an_unwritable_path_is_one_line(chat_model, chats, tmp_path, capsys, fake_vllm, monkeypatch):
    from hidden_states import extras

    # speculators-0.5's index needs 'datasets', asked for before the destination is made; the write
    # fails long before the index would be written
    monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
    src = tmp_path / "extracted"
    assert main(["extract", "--model-path", str(chat_model), "--data", str(chats), "--output-dir", str(src),
                 "--format", "speculators-0.3", "--layer-ids", "1", "3", "--backend", "speculators",
                 "--skip-forward-check"]) == 0
    capsys.readouterr()
    destinations = [under_a_file(tmp_path) / "converted"]
    if Path("/sys").is_dir() and refuses_files(Path("/sys")):
        destinations.append(Path("/sys/converted"))

    for dst in destinations:
        assert main(["convert", str(src), str(dst), "--to", "speculators-0.5"]) == 2
        one_line_error(capsys, str(dst))
