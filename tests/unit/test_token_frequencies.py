"""``token_freq.pt`` (the trained tokens' frequencies, which speculators 0.9 reads at
``<data-path>/token_freq.pt`` for ``--draft-vocab-size``) lies only where the layout's trainer reads
it: an extraction of conversations into speculators-0.5 writes it, one into speculators-0.3 writes no
file but its samples whose name ends in "pt" (speculators 0.3/0.4's dataset, given the directory,
loads every such file as a sample); ``convert`` to speculators-0.5 writes the one the rows it converts
make, once every row is converted.

The dataset index of speculators-0.5 needs ``datasets``: where it is missing the index is not
written (the sample files and ``token_freq.pt`` are, as with it).
"""
import importlib.util
import json
import shutil

import pytest

from hidden_states.cli import main
from hidden_states.plan import planner
from tests.unit.fakes import fake_backends

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")

# the extractor's layers 1 and 3: speculators-0.5 counts layers done
LAYERS = {"speculators-0.3": ["1", "3"], "speculators-0.5": ["2", "4"]}
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris is the capital."}]},
    {"conversations": [{"from": "human", "value": "Write a short poem about the sea."},
                       {"from": "gpt", "value": "Waves on the sea, the sea in the waves."}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Add 17 and 42."}, {"role": "assistant", "content": "59"},
                  {"role": "user", "content": "And the weather?"}, {"role": "assistant", "content": "Sunny."}]},
]


def zero_states(ids, layer_ids):
    return [torch.zeros(len(ids), 8) for _ in layer_ids]


@pytest.fixture
def run(monkeypatch, capsys):
    """``extract`` with a fake backend, and ``convert``; the speculators-0.5 index left out where
    ``datasets`` is missing."""
    from hidden_states import extras
    from hidden_states.output.formats import speculators_05

    if importlib.util.find_spec("datasets") is None:
        monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
        monkeypatch.setattr(speculators_05, "write_dataset", lambda directory, count: None)
    fake_backends(monkeypatch, states=zero_states)
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched=None, speculators=True: "audit: not run")

    def cli(*argv) -> str:
        code = main(list(argv))
        err = capsys.readouterr().err
        assert code == 0, err
        return err

    def extract(model, data, out, layout, *extra) -> str:
        return cli("extract", "--model-path", str(model), "--data", str(data), "--output-dir", str(out), "--format",
                   layout, "--layer-ids", *LAYERS[layout], "--backend", "speculators", "--skip-forward-check",
                   "--no-shared-prefix", *extra)

    def convert(src, dst) -> str:
        return cli("convert", str(src), str(dst), "--to", "speculators-0.5")

    return extract, convert


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def model_with(chat_model, family, tmp_path):
    """``chat_model`` with the chat tokenizer of ``family`` (``fixtures.chat_templates``)."""
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = tmp_path / f"model-{family}"
    shutil.copytree(chat_model, model)
    build_tokenizer(family, model)
    return model


def pt_files(out):
    """Every file under ``out`` whose name ends in "pt", as speculators 0.3/0.4's ``list_files`` finds them."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name.endswith("pt"))


def rows_05(out):
    """(token_ids, loss_mask) of every sample file of a speculators-0.5 directory, by index."""
    from hidden_states.output.formats.speculators_05 import read_sample

    files = sorted(out.glob("hidden_states/hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    return [(s["token_ids"].tolist(), s["loss_mask"].tolist()) for s in map(read_sample, files)]


def freq(path):
    return torch.load(path, weights_only=True)


def test_a_speculators_03_extraction_of_conversations_writes_no_pt_file_but_its_samples(chat_model, tmp_path, run):
    extract, _ = run
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)
    out = tmp_path / "out"

    extract(chat_model, data, out, "speculators-0.3")

    assert pt_files(out) == sorted(f"data_{i}.pt" for i in range(3))
    # one an older version wrote there is finished work: a rerun leaves it as it is
    (out / "token_freq.pt").write_bytes(b"older")
    extract(chat_model, data, out, "speculators-0.3")
    assert (out / "token_freq.pt").read_bytes() == b"older"


def test_a_speculators_05_extraction_writes_prepares_token_frequencies_and_a_resumed_run_the_same(
        chat_model, tmp_path, run):
    """The file ``prepare --format speculators-0.5`` writes, to the order of its ids; a resumed run
    counts the finished samples too; a run with nothing left to do writes it again; a run over part
    of the input writes none."""
    extract, _ = run
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)
    assert main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output",
                 str(tmp_path / "prepared" / "rows.jsonl"), "--format", "speculators-0.5"]) == 0
    prepared = freq(tmp_path / "prepared" / "token_freq.pt")
    out = tmp_path / "out"

    extract(chat_model, data, out, "speculators-0.5")

    written = freq(out / "token_freq.pt")
    assert written == prepared and list(written) == list(prepared)
    assert all(isinstance(k, int) and isinstance(v, int) for k, v in written.items())
    (out / "token_freq.pt").unlink()
    (out / "hidden_states" / "hs_1.safetensors").unlink()
    extract(chat_model, data, out, "speculators-0.5")
    assert list(freq(out / "token_freq.pt").items()) == list(prepared.items())
    (out / "token_freq.pt").unlink()
    extract(chat_model, data, out, "speculators-0.5")
    assert freq(out / "token_freq.pt") == prepared
    extract(chat_model, data, tmp_path / "part", "speculators-0.5", "--max-samples", "2")
    assert not (tmp_path / "part" / "token_freq.pt").exists()


def test_fp8_states_get_the_token_frequencies_too(chat_model, tmp_path, run):
    extract, _ = run
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)

    extract(chat_model, data, tmp_path / "out", "speculators-0.5", "--state-dtype", "fp8")
    extract(chat_model, data, tmp_path / "model", "speculators-0.5")

    assert freq(tmp_path / "out" / "token_freq.pt") == freq(tmp_path / "model" / "token_freq.pt")


def test_convert_to_05_writes_what_a_direct_05_extraction_of_the_same_rows_writes(chat_model, tmp_path, run):
    """With generation markers in the template the two layouts train the same tokens of a
    conversation (speculators-0.3 in one row, speculators-0.5 one row per reply): the single-reply
    conversations' rows are the same, and the token frequencies of the whole input are. The
    converted file is also the count of the converted rows themselves."""
    from hidden_states.inputs.tokenization import token_frequencies

    extract, convert = run
    model = model_with(chat_model, "llama3_generation", tmp_path)
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)
    extract(model, data, tmp_path / "o3", "speculators-0.3")
    extract(model, data, tmp_path / "direct", "speculators-0.5")
    assert not (tmp_path / "o3" / "token_freq.pt").exists()

    convert(tmp_path / "o3", tmp_path / "o5")

    direct, converted = rows_05(tmp_path / "direct"), rows_05(tmp_path / "o5")
    assert converted[:2] == direct[:2] and len(converted) == 3 and len(direct) == 4
    assert freq(tmp_path / "o5" / "token_freq.pt") == freq(tmp_path / "direct" / "token_freq.pt") == \
        token_frequencies(converted)


def test_a_convert_stopped_part_way_writes_none_and_its_rerun_the_whole_inputs(chat_model, tmp_path, run,
                                                                               monkeypatch):
    from hidden_states import convert as convert_module

    extract, convert = run
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)
    extract(chat_model, data, tmp_path / "o3", "speculators-0.3")
    convert(tmp_path / "o3", tmp_path / "whole")
    expected = freq(tmp_path / "whole" / "token_freq.pt")
    real = convert_module.read_sample

    def stop_at_the_last(name, path):
        if path.name == "data_2.pt":
            raise KeyboardInterrupt
        return real(name, path)

    monkeypatch.setattr(convert_module, "read_sample", stop_at_the_last)
    assert main(["convert", str(tmp_path / "o3"), str(tmp_path / "o5"), "--to", "speculators-0.5"]) != 0
    assert (tmp_path / "o5" / "hidden_states" / "hs_1.safetensors").is_file()
    assert not (tmp_path / "o5" / "token_freq.pt").exists()

    monkeypatch.setattr(convert_module, "read_sample", real)
    assert "2 already converted, 1 to go" in convert(tmp_path / "o3", tmp_path / "o5")
    assert list(freq(tmp_path / "o5" / "token_freq.pt").items()) == list(expected.items())


def test_convert_checks_the_token_frequencies_an_older_version_left_in_the_source(chat_model, tmp_path, run):
    from hidden_states.inputs.tokenization import save_token_frequencies

    extract, convert = run
    data = write(tmp_path / "chats.jsonl", CONVERSATIONS)
    extract(chat_model, data, tmp_path / "o3", "speculators-0.3")
    convert(tmp_path / "o3", tmp_path / "o5")
    counted = freq(tmp_path / "o5" / "token_freq.pt")

    save_token_frequencies(counted, tmp_path / "o3" / "token_freq.pt")  # what an older version wrote
    assert "warning" not in convert(tmp_path / "o3", tmp_path / "o5")
    save_token_frequencies({1: 1}, tmp_path / "o3" / "token_freq.pt")
    err = convert(tmp_path / "o3", tmp_path / "o5")
    assert f"warning: {tmp_path / 'o3' / 'token_freq.pt'} does not hold the trained tokens' frequencies" in err
    assert freq(tmp_path / "o5" / "token_freq.pt") == counted


def test_convert_of_tokenized_rows_writes_none_and_of_a_directory_without_the_record_goes_by_the_masks(
        chat_model, tmp_path, run):
    """A tokenized input gets no token frequencies from extract, nor from convert; a directory that
    does not record its kind of rows (written before the record) is taken for conversations' where a
    row leaves a token untrained."""
    extract, convert = run
    tokenized = write(tmp_path / "rows.jsonl", [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
                                               {"input_ids": [9, 10, 11]}])
    extract(chat_model, tokenized, tmp_path / "t3", "speculators-0.3")
    convert(tmp_path / "t3", tmp_path / "t5")
    assert not (tmp_path / "t5" / "token_freq.pt").exists()

    for source, masked in (("t3", True), ("all-ones", False)):
        if not masked:
            extract(chat_model, write(tmp_path / "ones.jsonl", [{"input_ids": [5, 6, 7]}]), tmp_path / source,
                    "speculators-0.3")
        config_file = tmp_path / source / "data_config.json"
        config = json.loads(config_file.read_text())
        config["tokenization"].pop("rows")
        config_file.write_text(json.dumps(config))
        convert(tmp_path / source, tmp_path / f"{source}-unrecorded")
        assert (tmp_path / f"{source}-unrecorded" / "token_freq.pt").exists() == masked
    assert freq(tmp_path / "t3-unrecorded" / "token_freq.pt") == {7: 1, 8: 1, 9: 1, 10: 1, 11: 1}
