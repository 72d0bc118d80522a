"""FP8 states (``--state-dtype fp8``): the quantizer's error bound and scales, the speculators-0.5
file it writes (speculators 0.9's FP8 hs-connector layout), the bytes it saves, and the refusals
where a trainer cannot read FP8 (speculators 0.3/0.4's layout, ``convert`` to it)."""
import json

import pytest

from hidden_states import fp8_states
from hidden_states.output import formats
from hidden_states.cli import main
from hidden_states.inputs.identity import difference
from hidden_states.inputs.streams import Sample

torch = pytest.importorskip("torch")

# e4m3fn: 3 mantissa bits, so a normal value rounds to within half its step, 2^-4 of itself; below
# 2^-6 (in units of the scale) the values are subnormal, spaced 2^-9 apart: within 2^-10 of the scale.
RELATIVE_STEP = 2.0 ** -4
SUBNORMAL_HALF_STEP = 2.0 ** -10


def layers_of(tokens=64, hidden=256, count=4, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    # per-token magnitudes over four decades, and one layer 100x smaller than the others (its token
    # scale is set by the others: the case a per-layer scale would do better on)
    magnitude = 10.0 ** torch.empty(tokens, 1).uniform_(-2, 2, generator=generator)
    made = [torch.randn(tokens, hidden, generator=generator) * magnitude for _ in range(count)]
    made[1] = made[1] / 100
    return [layer.to(dtype) for layer in made]


def test_round_trip_is_within_e4m3s_rounding_of_every_value():
    layers = layers_of()
    quantized, scales = fp8_states.quantize(layers)
    restored = fp8_states.dequantize(torch.stack(quantized, dim=1), scales)
    original = torch.stack(layers, dim=1).float()
    bound = original.abs() * RELATIVE_STEP + scales * SUBNORMAL_HALF_STEP
    assert bool(((restored - original).abs() <= bound).all())
    # per token over each layer (the e2e tests' measure): the large layers well within 2^-4 ...
    errors = (restored - original).norm(dim=-1) / original.norm(dim=-1)
    assert float(errors[:, [0, 2, 3]].max()) < 0.04
    # ... the 100x smaller layer, on the others' scale, loses more, still bounded by its subnormal step
    assert 0.01 < float(errors[:, 1].mean()) < 0.2


def test_one_scale_per_token_from_its_largest_state_over_all_layers():
    layers = layers_of(tokens=8, hidden=16)
    quantized, scales = fp8_states.quantize(layers)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (8, 1, 1)
    amax = torch.stack([layer.float().abs().amax(dim=-1) for layer in layers]).amax(dim=0)
    assert torch.equal(scales.view(-1), amax / fp8_states.FP8_MAX)
    stacked = torch.stack(quantized, dim=1).float()
    # each token's largest state lands on e4m3fn's largest value: no range is wasted, none clips
    assert torch.equal(stacked.abs().amax(dim=(1, 2)), torch.full((8,), fp8_states.FP8_MAX))
    assert all(layer.dtype == torch.float8_e4m3fn for layer in quantized)


def test_an_all_zero_token_keeps_zeros_and_a_finite_scale():
    layers = [torch.zeros(3, 4), torch.ones(3, 4)]
    layers[0][1], layers[1][1] = 0, 0
    quantized, scales = fp8_states.quantize(layers)
    assert float(scales[1]) == pytest.approx(fp8_states.SMALLEST_SCALE)
    restored = fp8_states.dequantize(torch.stack(quantized, dim=1), scales)
    assert torch.equal(restored, torch.stack(layers, dim=1))


def sample_file(tmp_path, state_dtype, hidden=8, tokens=5, layer_count=3):
    layout = formats.create("speculators-0.5", tmp_path, formats.Layers(list(range(layer_count)), 6, hidden),
                            log=lambda line: None, state_dtype=state_dtype)
    layers = layers_of(tokens, hidden, layer_count)
    record = layout.record(Sample(0, 1, list(range(tokens)), None), layers)
    path = tmp_path / f"{state_dtype}.safetensors"
    with open(path, "wb") as handle:
        layout.save(record, handle)
    return layout, layers, path


def test_the_05_file_holds_speculators_09s_fp8_layout(tmp_path):
    from safetensors import safe_open

    from hidden_states.output.formats.speculators_05 import safetensors_header

    layout, layers, path = sample_file(tmp_path, "fp8")
    header = safetensors_header(path)
    assert header["hidden_states"]["dtype"] == "F8_E4M3" and header["hidden_states"]["shape"] == [5, 3, 8]
    assert header["hidden_states_scales"] == {**header["hidden_states_scales"], "dtype": "F32", "shape": [5, 1, 1]}
    assert header["token_ids"]["dtype"] == "I64" and header["loss_mask"]["dtype"] == "I64"
    with safe_open(str(path), framework="pt") as handle:
        states, scales = handle.get_tensor("hidden_states"), handle.get_tensor("hidden_states_scales")
    expected, expected_scales = fp8_states.quantize(layers)
    assert torch.equal(states.view(torch.uint8), torch.stack(expected, dim=1).view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    described = layout.describe()
    assert described["state_dtype"] == "fp8" and described["hidden_states"].startswith("float8_e4m3fn [seq_len, 3, 8]")
    assert described["train_with"].endswith("--hidden-states-backend fp8") and "hidden_states_scales" in described


def test_fp8_files_take_about_half_of_bf16s_bytes_per_token(tmp_path):
    """A Llama-3-8B-shaped sample (4 layers of 4096): the target is <= 0.52x bf16's bytes per token."""
    _, _, bf16 = sample_file(tmp_path, "model", hidden=4096, tokens=64, layer_count=4)
    _, _, fp8 = sample_file(tmp_path, "fp8", hidden=4096, tokens=64, layer_count=4)
    ratio = fp8.stat().st_size / bf16.stat().st_size
    assert 0.49 < ratio <= 0.52, ratio


def test_the_model_dtype_file_is_unchanged(tmp_path):
    from hidden_states.output.formats.speculators_05 import safetensors_header

    layout, layers, path = sample_file(tmp_path, "model")
    header = safetensors_header(path)
    assert header["hidden_states"]["dtype"] == "BF16" and "hidden_states_scales" not in header
    assert layout.describe()["state_dtype"] == "model" and "fp8" not in layout.describe()["train_with"]


def test_the_03_layout_refuses_fp8():
    with pytest.raises(ValueError, match="stores states as model, not fp8"):
        formats.create("speculators-0.3", "unused", state_dtype="fp8")


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 512,
                                                  "torch_dtype": "float32"}))
    return path


def test_extract_refuses_fp8_for_the_03_layout_in_one_line(model, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir",
                 str(tmp_path / "out"), "--format", "speculators-0.3", "--state-dtype", "fp8"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert ("hidden-states: error: --state-dtype fp8: --format speculators-0.3's trainer reads model states only "
            "(speculators 0.3/0.4 have no FP8 reader)") in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_fp8_states_to_the_03_layout(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "data_config.json").write_text(json.dumps({"format": {"name": "speculators-0.5", "state_dtype": "fp8"},
                                                      "layer_ids": [1, 3]}))
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "speculators-0.3"]) == 2
    err = capsys.readouterr().err
    assert f"hidden-states: error: {src} holds fp8 states, which speculators-0.3's trainer cannot read" in err
    assert not (tmp_path / "dst").exists()


def test_status_says_how_fp8_states_are_trained_on(tmp_path):
    from hidden_states.status import status

    (tmp_path / "data_config.json").write_text(json.dumps({"format": {"name": "speculators-0.5",
                                                                      "state_dtype": "fp8"}}))
    assert status(tmp_path).splitlines()[0] == (f"{tmp_path}: 0 sample files whole (FP8 states with per-token "
                                                f"scales: train with --hidden-states-backend fp8)")


def test_a_rerun_in_the_other_state_dtype_is_another_extraction():
    recorded = {"model": "m", "layer_ids": [1], "format": "speculators-0.5", "input": {}, "tokenization": {}}
    now = {**recorded, "state_dtype": "fp8"}
    assert difference(recorded, now) == "state_dtype 'model', this run 'fp8'"
    assert difference({**recorded, "state_dtype": "fp8"}, now) is None


def test_states_a_backend_quantized_are_written_as_they_are(tmp_path):
    """vllm-engine's worker quantizes on the device: the format neither quantizes them again nor
    defers them to the writer thread; the extraction's layer pick keeps their scales."""
    from safetensors.torch import load_file

    layout = formats.create("speculators-0.5", tmp_path, formats.Layers([0, 1], 6, 8), log=lambda line: None,
                            state_dtype="fp8")
    quantized, scales = fp8_states.quantize(layers_of(4, 8, 2))
    states = fp8_states.pick(fp8_states.Quantized(quantized, scales), [0, 1])
    record = layout.record(Sample(0, 1, [1, 2, 3, 4], None), states)
    assert set(record) == {"hidden_states", "hidden_states_scales", "token_ids", "loss_mask"}
    with open(tmp_path / "q.safetensors", "wb") as handle:
        layout.save(record, handle)
    written = load_file(str(tmp_path / "q.safetensors"))
    assert torch.equal(written["hidden_states"].view(torch.uint8), torch.stack(quantized, dim=1).view(torch.uint8))
    assert torch.equal(written["hidden_states_scales"], scales)


def test_host_states_are_quantized_on_the_writer_thread_not_in_record(tmp_path):
    layout = formats.create("speculators-0.5", tmp_path, formats.Layers([0, 1], 6, 8), log=lambda line: None,
                            state_dtype="fp8")
    layers = layers_of(4, 8, 2)
    record = layout.record(Sample(0, 1, [1, 2, 3, 4], None), layers)
    assert "hidden_states" not in record and layout.length(record) == 4


def test_the_plans_disk_estimate_counts_one_byte_a_state_and_a_scale_a_token(model, tmp_path):
    from hidden_states.plan.preflight import model_facts
    from hidden_states.plan.run_checks import check_disk

    facts = model_facts(str(model))
    assert check_disk(tmp_path, 40, facts, [0, 2], "fp8") == int(40 * (2 * 128 + 4) * 1.05)
    assert check_disk(tmp_path, 40, facts, [0, 2]) == int(40 * 2 * 128 * 2 * 1.05)


def test_the_bytes_are_speculators_09s_quantizers():
    """The same bytes and scales as speculators 0.9's own FP8 quantizer (hs_connectors.fp8_utils),
    where its release folder is cached (the formats e2e suite builds it)."""
    import sys

    from tests.conftest import CACHE

    folder = f"{CACHE}/speculators/0.9.0"
    sys.path.insert(0, folder)
    try:
        fp8_utils = pytest.importorskip("hs_connectors.fp8_utils")
    finally:
        sys.path.remove(folder)
    layers = layers_of()
    ours, scales = fp8_states.quantize(layers)
    theirs, their_scales = fp8_utils.quantize_tensor_to_fp8(torch.stack(layers, dim=1))
    assert torch.equal(torch.stack(ours, dim=1).view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(scales, their_scales)


def test_a_served_rows_fp8_states_are_its_carriers_first_rows_with_their_scales():
    """A row served from a longer row's states (shared prefixes) takes its first tokens' FP8 values
    and their scales: the same as quantizing that row alone (a token's scale is its own)."""
    torch.manual_seed(0)
    layers = [torch.randn(6, 8) for _ in range(3)]
    carrier = fp8_states.Quantized(*fp8_states.quantize(layers))
    served = fp8_states.first_rows(carrier, 4)
    alone, alone_scales = fp8_states.quantize([layer[:4] for layer in layers])
    assert isinstance(served, fp8_states.Quantized) and torch.equal(served.scales, alone_scales)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(served, alone))
    assert [l.shape for l in fp8_states.first_rows(layers, 2)] == [(2, 8)] * 3
