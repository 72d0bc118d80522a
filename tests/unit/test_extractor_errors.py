"""Bad input to the extractor: each case exits 2 with one line naming the file, line or flag, before
any model is loaded (these run without vLLM or torch)."""
import json

import pytest

from hidden_states.cli import main
from vllm_compat.environment import installer

CONFIG = {"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 512, "torch_dtype": "float32"}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def extract(model, data, out, *extra):
    return main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                 "--format", "speculators-0.3", "--layer-ids", "0", "2", *extra])


def jsonl(tmp_path, *lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = '{"input_ids": [5, 6, 7]}'


@pytest.mark.parametrize("bad_line, message", [
    ('{"input_ids": [5, 6', "not valid JSON (Expecting ',' delimiter at the end of the line)"),
    ('{"input_ids": [5, 6,, 7]}', "not valid JSON (Expecting value at column 21)"),
    ('{"tokens": [5, 6]}', "neither tokenized ('input_ids') nor a conversation ('conversations', 'messages' or 'text') (keys: tokens)"),
    ('{"input_ids": [5, 6.5]}', "input_ids[1] is 6.5, not an integer"),
    ('{"input_ids": [5, true]}', "input_ids[1] is True, not an integer"),
    ('{"input_ids": "5 6"}', "input_ids must be a list of integers, got str"),
    ('{"input_ids": [5, 512]}', "input_ids[1] = 512 is outside the model's vocabulary [0, 512)"),
    ('{"input_ids": [-1]}', "input_ids[0] = -1 is outside the model's vocabulary"),
    ('{"input_ids": []}', "empty sample (input_ids is [])"),
    ('{"input_ids": [5, 6], "loss_mask": [1]}', "loss_mask has 1 entries for 2 input_ids"),
    ('[5, 6]', "expected a JSON object, got list"),
])
def test_bad_sample_names_file_and_line(model, tmp_path, capsys, bad_line, message):
    data = jsonl(tmp_path, GOOD, "", bad_line)
    assert extract(model, data, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"hidden-states: error: {data}:3: {message}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("layers, message", [
    (["0", "6"], "--layer-ids: [6] outside [0, 5] (the model has 6 layers)"),
    (["2", "2"], "--layer-ids: [2] given more than once"),
])
def test_bad_layer_ids(model, tmp_path, capsys, layers, message):
    data = jsonl(tmp_path, GOOD)
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir",
                 str(tmp_path / "out"), "--format", "speculators-0.3", "--layer-ids", *layers])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("layers, message", [
    (["0", "3"], "--layer-ids: [0] outside [1, 6] for --format speculators-0.5, which counts layers done"),
    (["3", "7"], "--layer-ids: [7] outside [1, 6]"),
])
def test_05_layer_ids_are_checked_in_their_own_convention(model, tmp_path, capsys, layers, message):
    data = jsonl(tmp_path, GOOD)
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir",
                 str(tmp_path / "out"), "--format", "speculators-0.5", "--layer-ids", *layers])
    assert code == 2 and message in capsys.readouterr().err


def test_05_layout_without_datasets_is_refused_before_the_load(model, tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name, *a))
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(jsonl(tmp_path, GOOD)), "--output-dir",
                 str(tmp_path / "out"), "--format", "speculators-0.5", "--layer-ids", "1", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert ("--format speculators-0.5 (its dataset index, which the trainer reads) needs the 'datasets' package, "
            f'not installed here: {installer()} "datasets>=4" "transformers==') in err  # the venv's own, held
    assert not (tmp_path / "out").exists()


def test_missing_model_path(tmp_path, capsys):
    assert extract(tmp_path / "nope", jsonl(tmp_path, GOOD), tmp_path / "out") == 2
    assert f"--model-path {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_model_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert extract(tmp_path / "empty", jsonl(tmp_path, GOOD), tmp_path / "out") == 2
    assert "no config.json there" in capsys.readouterr().err


def test_remote_code_needs_the_flag(model, tmp_path, capsys):
    (model / "config.json").write_text(json.dumps({**CONFIG, "auto_map": {"AutoModel": "x.Y"}}))
    assert extract(model, jsonl(tmp_path, GOOD), tmp_path / "out") == 2
    assert "pass --trust-remote-code" in capsys.readouterr().err


def test_missing_input(model, tmp_path, capsys):
    assert extract(model, tmp_path / "none.jsonl", tmp_path / "out") == 2
    assert f"{tmp_path / 'none.jsonl'}: no such file or directory" in capsys.readouterr().err


def test_empty_input(model, tmp_path, capsys):
    assert extract(model, jsonl(tmp_path), tmp_path / "out") == 2
    assert "no samples" in capsys.readouterr().err


def test_output_dir_not_writable(model, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert extract(model, jsonl(tmp_path, GOOD), blocker / "out") == 2
    assert f"--output-dir {blocker / 'out'}" in capsys.readouterr().err


def test_output_dir_of_another_model_is_refused(model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "data_config.json").write_text(json.dumps({"model": "/elsewhere", "layer_ids": [0, 2]}))
    (out / "data_0.pt").write_bytes(b"x" * 8 + b"PK\x05\x06" + bytes(18))  # ends as a whole torch.save file does
    assert extract(model, jsonl(tmp_path, GOOD), out) == 2
    err = capsys.readouterr().err
    assert "holds another extraction (model '/elsewhere'" in err
    assert "with 1 finished samples: use another --output-dir, or --start-over" in err


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-size", "0", "argument --batch-size: 0: must be at least 1"),
    ("--writer-threads", "0", "argument --writer-threads: 0: must be at least 1"),
    ("--start-index", "-5", "argument --start-index: -5: must be at least 0"),
    ("--tp-size", "0", "argument --tp-size: 0: must be at least 1"),
    ("--gpu-memory-utilization", "1.5", "argument --gpu-memory-utilization: 1.5: must be more than 0 and at most 1"),
    ("--gpu-memory-utilization", "0", "argument --gpu-memory-utilization: 0.0: must be more than 0 and at most 1"),
])
def test_impossible_values_are_refused_at_parse_time(model, tmp_path, capsys, flag, value, message):
    """Refused before anything runs (--writer-threads 0 wrote nothing and hung on a full queue)."""
    with pytest.raises(SystemExit) as exited:
        extract(model, jsonl(tmp_path, GOOD), tmp_path / "out", flag, value)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("heads, kv_heads, tp, message", [
    (4, 4, "3", "--tp-size 3: the model's 4 attention heads do not divide evenly over 3 ranks"),
    (8, 3, "4", "--tp-size 4: the model's 3 KV heads can be neither split nor replicated evenly over 4 ranks"),
])
def test_tensor_parallel_size_is_checked_against_the_heads(model, tmp_path, capsys, heads, kv_heads, tp, message):
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_attention_heads": heads,
                                                   "num_key_value_heads": kv_heads}))
    assert extract(model, jsonl(tmp_path, GOOD), tmp_path / "out", "--tp-size", tp) == 2
    assert message in capsys.readouterr().err


def test_kv_heads_replicated_over_more_ranks_are_accepted():
    from hidden_states.plan.preflight import ModelFacts, check_tensor_parallel

    check_tensor_parallel(ModelFacts("m", 6, 128, 512, 2, False, num_heads=8, num_kv_heads=2), 8)


def test_strict_refuses_an_over_long_first_sample_before_the_load(model, tmp_path, capsys):
    data = jsonl(tmp_path, '{"input_ids": [5, 6, 7, 8, 9]}')
    assert extract(model, data, tmp_path / "out", "--strict", "--max-seq-len", "4") == 2
    assert f"hidden-states: error: {data}:1: 5 tokens, more than --max-seq-len 4 (--strict)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_dir_that_is_a_file(model, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert extract(model, jsonl(tmp_path, GOOD), blocker) == 2
    assert f"--output-dir {blocker}: is a file, not a directory" in capsys.readouterr().err


def test_disk_estimate_counts_16_bit_states_in_readable_units(model, tmp_path):
    """vLLM runs a float32 checkpoint in 16 bits: states are written in 2 bytes, not the config's 4."""
    from hidden_states.plan.preflight import model_facts
    from hidden_states.plan.run_checks import check_disk
    from hidden_states.sizes import human_size

    facts = model_facts(str(model))
    estimate = check_disk(tmp_path, 40, facts, [0, 2])
    assert estimate == int(40 * 2 * 128 * 2 * 1.05)
    assert [human_size(n) for n in (512, 21_504, 3_400_000, 2.5e9)] == ["512 B", "21.5 kB", "3.4 MB", "2.5 GB"]


def test_preset_values_and_flag_overrides():
    from hidden_states.cli import build_parser
    from hidden_states.cli.runs import settings_from

    args = build_parser().parse_args(["extract", "--model-path", "m", "--prepared-data", "d", "--output-dir", "o",
                                      "--preset", "blackwell-tp8", "--batch-size", "2"])
    settings = settings_from(args)
    assert (settings.tp_size, settings.gpu_memory_utilization, settings.max_seq_len, settings.batch_size) == (
        8, 0.80, 2048, 2)
    assert settings.trust_remote_code is False


def test_broken_json_files_are_named(model, tmp_path, capsys):
    """A model's config.json, an output directory's data_config.json, a convert or status source:
    one line naming the file, exit 2."""
    data = jsonl(tmp_path, GOOD)
    (model / "config.json").write_text("{not json")
    assert extract(model, data, tmp_path / "out") == 2
    assert f"hidden-states: error: {model / 'config.json'}: unreadable (" in capsys.readouterr().err
    (model / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    (out / "data_config.json").write_text("{")
    assert extract(model, data, out) == 2
    err = capsys.readouterr().err
    assert f"{out / 'data_config.json'}: unreadable (" in err and "; remove it or use another --output-dir" in err
    assert main(["convert", str(out), str(tmp_path / "dst"), "--to", "speculators-0.5"]) == 2
    assert f"{out / 'data_config.json'}: unreadable (" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere' / 'data_config.json'}: not an extraction's output directory (" in capsys.readouterr().err


def test_status_reads_the_05_layouts_own_folder(tmp_path):
    """speculators-0.5 keeps its sample files in hidden_states/: status counts them there."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from hidden_states.status import status

    (tmp_path / "data_config.json").write_text(json.dumps({"format": {"name": "speculators-0.5"}}))
    (tmp_path / "hidden_states").mkdir()
    save_file({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.arange(3)},
              str(tmp_path / "hidden_states" / "hs_0.safetensors"))
    (tmp_path / "hidden_states" / "hs_1.safetensors").write_bytes(b"cut")
    assert status(tmp_path).splitlines()[0] == f"{tmp_path}: 1 sample files whole, 1 cut short (redone by a rerun): 1"
