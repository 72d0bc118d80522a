"""Both output layouts end to end on CPU vLLM, proven with the real trainers that read them.

One tiny extraction per layout (same samples, same layers: speculators-0.3 ids 0 2 3 5 are
speculators-0.5 ids 1 3 4 6), then: the 0.5 layout's layer k against HF's state after k layers;
the two layouts tensor for tensor; ``convert`` both ways against the directly written ones;
speculators 0.9.0's own ``ArrowDataset`` and trainer on the 0.5 layout, speculators 0.3.0's own
dataset and trainer on the 0.3 layout, each for a few EAGLE-3 steps with a falling loss; the 0.5
layout with FP8 states (``--state-dtype fp8``) against the bf16 files and HF, read by speculators
0.9.0's own FP8 transfer, dataset and collate.

speculators 0.9.0 needs Python >= 3.11 and transformers >= 5 (the vLLM 0.32.0 venv); 0.3.0's trainer
builds pydantic configs that transformers 5 cannot (``'Eagle3SpeculatorConfig' object has no
attribute '__pydantic_fields_set__'``), so it trains in the vLLM 0.17.0 venv (transformers 4.57), as
its users did. Marked ``formats``: run on vLLM 0.32.0 only.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.extract_runs import run_cli
from tests.e2e.trainers import run_trainer, speculators_09, transformers_4_python
from vllm_compat.consumer import TRAINER_PROOF_RELEASES

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.formats]

IDS_03 = [0, 2, 3, 5]
IDS_05 = [1, 3, 4, 6]  # the same layers, counted as layers done
SAMPLES = 12


def write_jsonl(path: Path, n: int, seed: int) -> list[dict]:
    """Short samples (the trainers run on CPU), every other one with a loss mask."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randrange(16, 200)
        row = {"input_ids": [rng.randrange(4, 512) for _ in range(length)]}
        if i % 2 == 0:
            row["loss_mask"] = [0] * (length // 3) + [1] * (length - length // 3)
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def layout_args(model, data, out, fmt, ids):
    """A run into ``fmt``'s layout by the unmodified generator (named: the default backend is chosen per
    environment), unless a ``--backend`` given after these names another."""
    return ["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out), "--preset",
            "cpu-tiny", "--format", fmt, "--layer-ids", *map(str, ids), "--progress-interval", "1",
            "--backend", "speculators"]


def with_datasets() -> dict:
    """speculators 0.3.0 (the generator), then the 0.9.0 folder, which brings ``datasets`` for the 0.5
    layout's dataset index."""
    return {"PYTHONPATH": os.pathsep.join([str(harness.speculators_path(TRAINER_PROOF_RELEASES["speculators-0.3"])),
                                           str(speculators_09()), ROOT])}


@pytest.fixture(scope="module")
def both(model, tmp_path_factory):
    """The same samples extracted into each layout (speculators 0.3.0 runs the generator; the 0.9.0
    folder, after it on the path, brings ``datasets`` for the 0.5 layout's dataset index), and into
    the 0.5 layout with FP8 states by ``--backend vllm-engine``, which quantizes in vLLM's worker; and
    the 0.3 layout by ``--backend vllm-engine`` too, whose rows carry their certificates."""
    root = tmp_path_factory.mktemp("formats")
    rows = write_jsonl(root / "data.jsonl", SAMPLES, seed=21)
    for fmt, ids, out, extra in (("speculators-0.3", IDS_03, "out03", ()), ("speculators-0.5", IDS_05, "out05", ()),
                                 ("speculators-0.5", IDS_05, "fp8", ("--state-dtype", "fp8", "--backend", "vllm-engine")),
                                 ("speculators-0.3", IDS_03, "certified03", ("--backend", "vllm-engine"))):
        proc = run_cli(*layout_args(model, root / "data.jsonl", root / out, fmt, ids), *extra,
                       env_extra=with_datasets())
        assert proc.returncode == 0, proc.stderr[-4000:]
    return root, rows


def load_05(out: Path, index: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "hidden_states" / f"hs_{index}.safetensors"))


def test_the_05_layout_and_its_record_of_the_convention(both):
    root, rows = both
    out = root / "out05"
    config = json.loads((out / "data_config.json").read_text())
    assert config["layer_ids"] == IDS_05 and config["format"]["name"] == "speculators-0.5"
    assert "after k decoder layers" in config["layer_convention"]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(SAMPLES))
    for i, row in enumerate(rows):
        sample = load_05(out, i)
        n = len(row["input_ids"])
        assert tuple(sample["hidden_states"].shape) == (n, len(IDS_05), 128)
        assert sample["token_ids"].tolist() == row["input_ids"]
        assert sample["loss_mask"].tolist() == row.get("loss_mask", [1] * n)


def test_05_layer_k_is_hfs_state_after_k_layers(both, model):
    """HF's ``hidden_states[k]`` is the state after k layers for k < N; for k = N HF applies the final
    norm, so the last layer is taken before it (a hook on decoder layer N-1)."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    root, rows = both
    hf = load_model(model)
    n_layers = hf.config.num_hidden_layers
    last = decoder_layer_outputs(hf, [r["input_ids"] for r in rows], [n_layers - 1])
    for i, row in enumerate(rows):
        got = load_05(root / "out05", i)["hidden_states"]
        with torch.no_grad():
            after = hf(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        for j, k in enumerate(IDS_05):
            want = last[i][0] if k == n_layers else after[k][0]
            assert float(relative_errors(got[:, j], want).max()) < harness.TOLERANCE, f"sample {i} layer {k}"


def test_the_two_layouts_hold_the_same_tensors(both):
    import torch

    root, _ = both
    for i in range(SAMPLES):
        old = torch.load(root / "out03" / f"data_{i}.pt", weights_only=True)
        new = load_05(root / "out05", i)
        assert torch.equal(old["input_ids"], new["token_ids"]) and torch.equal(old["loss_mask"], new["loss_mask"])
        for j in range(len(IDS_03)):  # our L is their L + 1: same order
            assert torch.equal(old["hidden_states"][j], new["hidden_states"][:, j]), f"sample {i} layer {IDS_03[j]}"


def test_05_rerun_redoes_only_a_cut_short_file_and_rewrites_the_index(both, model, tmp_path):
    """The shared resume path under the 0.5 layout: a sample file cut short (a crash before it reached
    the disk) is found, removed and redone; the others are not touched; the dataset index is rewritten."""
    import shutil

    import torch

    from hidden_states.fixtures.reference import relative_errors

    root, _ = both
    out = tmp_path / "out05"
    shutil.copytree(root / "out05", out)
    cut = out / "hidden_states" / "hs_5.safetensors"
    cut.write_bytes(cut.read_bytes()[:-100])
    (out / "state.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir() if p != cut}
    env = {"PYTHONPATH": os.pathsep.join([str(harness.speculators_path(TRAINER_PROOF_RELEASES["speculators-0.3"])), str(speculators_09()), ROOT])}
    proc = run_cli(*layout_args(model, root / "data.jsonl", out, "speculators-0.5", IDS_05), env_extra=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 files in" in proc.stderr and "hidden_states/hs_5.safetensors" in proc.stderr
    assert f"1 samples extracted, {SAMPLES - 1} already finished" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir() if p != cut} == before
    redone, original = load_05(out, 5), load_05(root / "out05", 5)
    assert torch.equal(redone["token_ids"], original["token_ids"]) and torch.equal(redone["loss_mask"],
                                                                                   original["loss_mask"])
    # extracted alone this time, not in a batch of 8: vLLM's bf16 sums may round differently
    for j in range(len(IDS_05)):
        assert float(relative_errors(redone["hidden_states"][:, j], original["hidden_states"][:, j]).max()) < 0.05
    assert (out / "state.json").exists()


def convert(src, dst, to):
    return subprocess.run([sys.executable, "-m", "hidden_states", "convert", str(src), str(dst), "--to", to],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(speculators_09()), ROOT])})


def test_converted_equals_directly_written_both_ways(both):
    import torch

    root, _ = both
    to05, to03 = root / "conv05", root / "conv03"
    for src, dst, to in ((root / "out03", to05, "speculators-0.5"), (root / "out05", to03, "speculators-0.3")):
        proc = convert(src, dst, to)
        assert proc.returncode == 0, proc.stderr[-3000:]
    again = convert(root / "out03", to05, "speculators-0.5")
    assert again.returncode == 0 and f"{SAMPLES} already converted, 0 to go" in again.stderr
    assert json.loads((to05 / "data_config.json").read_text())["layer_ids"] == IDS_05
    assert json.loads((to03 / "data_config.json").read_text())["layer_ids"] == IDS_03
    for i in range(SAMPLES):
        direct, converted = load_05(root / "out05", i), load_05(to05, i)
        assert direct.keys() == converted.keys()
        assert all(torch.equal(direct[key], converted[key]) for key in direct)
        direct, converted = (torch.load(d / f"data_{i}.pt", weights_only=True) for d in (root / "out03", to03))
        assert torch.equal(direct["input_ids"], converted["input_ids"])
        assert all(torch.equal(a, b) for a, b in zip(direct["hidden_states"], converted["hidden_states"], strict=True))
    assert json.loads((to03 / "sample_lengths.json").read_text()) == json.loads(
        (root / "out03" / "sample_lengths.json").read_text())
    for converted in (to05, to03):
        assert_finished(converted, SAMPLES)


def status_of(out: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "status", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def assert_finished(out: Path, samples: int) -> None:
    """``status`` on a converted directory: every sample finished, counted as its extraction made them."""
    said = status_of(out)
    assert f"{samples} sample files whole" in said and f": {samples} samples; every one finished" in said, said
    assert "not finished" not in said and "converted from" in said, said


def test_status_counts_a_converted_conversation_extraction_as_its_extraction_made_the_rows(tmp_path):
    """Conversations (one with two replies) extracted in the 0.3 layout (a row per conversation),
    converted to 0.5 (whose own tokenization makes a row per reply) and from there back to 0.3: each
    directory's rows are counted as the extraction made them, so ``status`` says every one finished. It
    counted them in the directory's own layout: "6 samples; 1 not finished" after the first conversion.
    The second (its source a converted 0.5 directory) rules out counting in the source's layout."""
    from tests.e2e import generate_runs as generate

    chats = [chat for chat in generate.CONVERSATIONS if chat != generate.CONVERSATIONS[3]]  # each with a reply
    model, data = generate.conversations_in(tmp_path, chats)
    source, to05, back03 = tmp_path / "extracted03", tmp_path / "converted05", tmp_path / "back03"
    proc = run_cli("--model-path", str(model), "--data", str(data), "--output-dir", str(source), "--preset",
                   "cpu-tiny", "--format", "speculators-0.3", "--layer-ids", *map(str, IDS_03), env_extra=with_datasets())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f": {len(chats)} samples; every one finished" in status_of(source)
    for src, dst, to in ((source, to05, "speculators-0.5"), (to05, back03, "speculators-0.3")):
        proc = convert(src, dst, to)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert_finished(dst, len(chats))


def test_convert_refuses_a_mixed_or_incomplete_source(both, tmp_path):
    import shutil

    root, _ = both
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "out05", mixed)
    shutil.copy(root / "out03" / "data_0.pt", mixed / "data_0.pt")
    proc = convert(mixed, tmp_path / "a", "speculators-0.3")
    assert proc.returncode == 2 and "holds samples of both speculators-0.3 and speculators-0.5" in proc.stderr

    gappy = tmp_path / "gappy"
    shutil.copytree(root / "out03", gappy)
    (gappy / "data_4.pt").unlink()
    cut = gappy / "data_7.pt"
    cut.write_bytes(cut.read_bytes()[:1000])
    proc = convert(gappy, tmp_path / "b", "speculators-0.5")
    assert proc.returncode == 2 and "samples 7 cut short" in proc.stderr, proc.stderr[-2000:]
    cut.unlink()
    proc = convert(gappy, tmp_path / "b", "speculators-0.5")
    assert proc.returncode == 2 and "samples 4, 7 missing" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "b").exists()


def ids_of(layout: str) -> list[int]:
    return IDS_03 if layout == "speculators-0.3" else IDS_05


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_rerun_in_the_other_format_is_refused_before_the_load_and_keeps_every_file(both, model):
    """The reported loss: extract with the other --format into a directory of finished samples took it
    over and removed them (their files are not the new format's pattern). Both ways, with each
    layout's own files on disk: refused before the model loads (and by plan), every file as it was."""
    root, _ = both
    for out, held, fmt, ids in ((root / "out03", "speculators-0.3", "speculators-0.5", IDS_05),
                                (root / "out05", "speculators-0.5", "speculators-0.3", IDS_03)):
        before = tree_bytes(out)
        # the first difference named is the layer ids (each format counts them its own way)
        refused = f"holds another extraction (layer_ids {ids_of(held)}, this run {ids}) with {SAMPLES} finished samples"
        proc = run_cli(*layout_args(model, root / "data.jsonl", out, fmt, ids), env_extra=with_datasets())
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert refused in last and last.endswith("or --start-over to remove its files and extract this one"), last
        assert "starting the" not in proc.stderr  # no model load
        assert tree_bytes(out) == before
    plan = subprocess.run([sys.executable, "-m", "hidden_states", "plan",
                           *layout_args(model, root / "data.jsonl", root / "out03", "speculators-0.5", IDS_05)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **with_datasets()})
    assert plan.returncode == 2 and "to extract" not in plan.stdout + plan.stderr, plan.stderr[-3000:]
    assert f"holds another extraction (layer_ids {IDS_03}, this run {IDS_05}) with {SAMPLES} finished" in plan.stderr


def test_convert_into_a_directory_holding_another_layouts_extraction_is_refused(both, tmp_path):
    """convert --to speculators-0.3 into a directory of speculators-0.5 files (the FP8 extraction's):
    none of them is a 0.3 file, yet they are finished work: refused, kept."""
    import shutil

    root, _ = both
    dst = tmp_path / "fp8"
    shutil.copytree(root / "fp8", dst)
    before = tree_bytes(dst)
    proc = convert(root / "out05", dst, "speculators-0.3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{dst} holds another extraction (" in proc.stderr and f"with {SAMPLES} finished samples" in proc.stderr
    assert tree_bytes(dst) == before


def test_speculators_09_dataset_reads_the_05_layout(both):
    """speculators 0.9.0's own ArrowDataset over the output (``--on-missing raise``: a sample it could
    not load would fail, not be generated)."""
    root, rows = both
    script = (
        "import json, sys, torch\n"
        "from speculators.train.data import ArrowDataset\n"
        "ds = ArrowDataset(max_len=2048, datapath=sys.argv[1], on_missing='raise')\n"
        "out = [{k: list(v.shape) for k, v in ds[i].items()} for i in range(len(ds))]\n"
        "print(json.dumps({'n': len(ds), 'lengths': ds.approx_lengths, 'shapes': out}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(root / "out05")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(speculators_09())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    lengths = [len(r["input_ids"]) for r in rows]
    assert seen["n"] == SAMPLES and seen["lengths"] == lengths
    for n, shapes in zip(lengths, seen["shapes"]):
        # the three auxiliary layers fused, the last one the verifier's own final state
        assert shapes["hidden_states"] == [n, 3 * 128] and shapes["verifier_last_hidden_states"] == [n, 128]
        assert shapes["input_ids"] == [n] and shapes["loss_mask"] == [n]


def test_speculators_09_trainer_learns_from_the_05_layout(both, model, tmp_path):
    root, _ = both
    losses = run_trainer(sys.executable, speculators_09(), ["--speculator-type", "eagle3",
        "--verifier-name-or-path", str(model), "--data-path", str(root / "out05"),
        "--target-layer-ids", *map(str, IDS_05[:-1]), "--num-layers", "1", "--total-seq-len", "512",
        "--epochs", "4", "--train-data-ratio", "0.75", "--save-path", str(tmp_path / "checkpoints"),
        "--num-workers", "0", "--on-missing", "raise", "--lr", "3e-3", "--log-freq", "1", "--logger", "",
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--scheduler-type", "none"], tmp_path)
    assert len(losses) >= 4, losses
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("out", ["out03", "certified03"])
def test_speculators_03_trainer_learns_from_the_03_layout(both, model, tmp_path, out):
    """Also from rows that carry their certificates (tensors beside the states, which it does not read)."""
    import torch

    root, _ = both
    certified = "certificate.positions" in torch.load(root / out / "data_0.pt", weights_only=True)
    assert certified == (out == "certified03"), out
    losses = run_trainer(transformers_4_python(), harness.speculators_path(TRAINER_PROOF_RELEASES["speculators-0.3"]),
                         ["--data-path", str(root / out), "--verifier-name-or-path", str(model), "--epochs", "3",
                          "--total-seq-len", "512", "--lr", "3e-3", "--save-path", str(tmp_path / "checkpoints")],
                         tmp_path)
    assert len(losses) >= 4, losses
    assert losses[-1] < losses[0], losses


def test_the_native_backend_writes_the_05_layout_too(both, model, tmp_path):
    """--backend vllm-native (vLLM's own extract_hidden_states) into the 0.5 layout: the same files,
    ids and masks, states within the two backends' bf16 difference of the generator's."""
    root, rows = both
    proc = run_cli(*layout_args(model, root / "data.jsonl", tmp_path / "native", "speculators-0.5", IDS_05),
                   "--backend", "vllm-native", env_extra=with_datasets())
    assert proc.returncode == 0, proc.stderr[-4000:]
    import torch

    from hidden_states.fixtures.reference import relative_errors

    for i in range(SAMPLES):
        native, generator = load_05(tmp_path / "native", i), load_05(root / "out05", i)
        assert torch.equal(native["token_ids"], generator["token_ids"])
        assert torch.equal(native["loss_mask"], generator["loss_mask"])
        assert native["hidden_states"].shape == generator["hidden_states"].shape
        assert float(relative_errors(native["hidden_states"], generator["hidden_states"]).max()) < harness.paths_agree()
    assert (tmp_path / "native" / "state.json").is_file()  # the dataset index the trainer opens


# FP8 states (``--state-dtype fp8``). e4m3fn keeps 3 mantissa bits: a value rounds to within 2^-4 of
# itself (6.25 %), so a token's relative L2 error grows by at most that over bf16's; below 2^-6 of
# its token's scale a value is subnormal and is off by up to 2^-10 of the scale instead, which the
# per-token bound covers as long as a token's layers are of one magnitude (this model's are).
FP8_STEP = 2.0 ** -4


def test_fp8_files_hold_speculators_09s_fp8_layout_quantized_in_the_worker(both):
    """vllm-engine's worker quantized each row (one scale per token over its layers): speculators
    0.9's layout, each token's largest state at e4m3fn's largest value, the ids and masks of the bf16
    run, and the bf16 run's states (the generator's) within the two backends' bf16 difference (2 %,
    tests/e2e/test_backends.py) plus e4m3's step."""
    import torch

    from hidden_states import fp8_states

    root, rows = both
    config = json.loads((root / "fp8" / "data_config.json").read_text())
    assert config["state_dtype"] == "fp8" and config["format"]["state_dtype"] == "fp8"
    assert config["backend"] == "vllm-engine" and config["format"]["train_with"].endswith("--hidden-states-backend fp8")
    for i in range(SAMPLES):
        fp8, bf16 = load_05(root / "fp8", i), load_05(root / "out05", i)
        assert "certificate.positions" in fp8 and "certificate.positions" not in bf16  # what the 0.9 readers below skip
        n = len(rows[i]["input_ids"])
        assert fp8["hidden_states"].dtype == torch.float8_e4m3fn and fp8["hidden_states_scales"].dtype == torch.float32
        assert tuple(fp8["hidden_states"].shape) == (n, len(IDS_05), 128)
        assert tuple(fp8["hidden_states_scales"].shape) == (n, 1, 1)
        assert torch.equal(fp8["token_ids"], bf16["token_ids"]) and torch.equal(fp8["loss_mask"], bf16["loss_mask"])
        assert torch.equal(fp8["hidden_states"].float().abs().amax(dim=(1, 2)), torch.full((n,), fp8_states.FP8_MAX))
        restored = fp8_states.dequantize(fp8["hidden_states"], fp8["hidden_states_scales"])
        want = bf16["hidden_states"].float()
        assert float(((restored - want).norm(dim=-1) / want.norm(dim=-1)).max()) <= 0.02 + FP8_STEP, f"sample {i}"
    sizes = {name: sum(p.stat().st_size for p in (root / name / "hidden_states").iterdir()) for name in ("fp8", "out05")}
    # hidden 128 over 4 layers: 512 bytes of FP8 + 4 of scale + 16 of ids against 1024 + 16 per token
    assert sizes["fp8"] / sizes["out05"] <= 0.52, sizes


def test_fp8_states_against_hf_within_bf16s_tolerance_plus_e4m3s_step(both, model):
    """Against HF fp32, token by token, layer by layer: within bf16's bound plus FP8's rounding
    (2^-4 per token), each layer's mean within bf16's mean bound plus e4m3's rms rounding (2^-4/sqrt 3)."""
    import torch

    from hidden_states import fp8_states
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    root, rows = both
    hf = load_model(model)
    n_layers = hf.config.num_hidden_layers
    last = decoder_layer_outputs(hf, [r["input_ids"] for r in rows], [n_layers - 1])
    worst = {"fp8": [0.0] * len(IDS_05), "out05": [0.0] * len(IDS_05)}
    errors = {"fp8": [[] for _ in IDS_05], "out05": [[] for _ in IDS_05]}
    for i, row in enumerate(rows):
        with torch.no_grad():
            after = hf(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        for name in worst:
            sample = load_05(root / name, i)
            got = sample["hidden_states"] if name == "out05" else fp8_states.dequantize(
                sample["hidden_states"], sample["hidden_states_scales"])
            for j, k in enumerate(IDS_05):
                token_errors = relative_errors(got[:, j], last[i][0] if k == n_layers else after[k][0])
                worst[name][j] = max(worst[name][j], float(token_errors.max()))
                errors[name][j].append(token_errors)
    means = {name: [float(torch.cat(e).mean()) for e in per_layer] for name, per_layer in errors.items()}
    print(f"worst per layer {IDS_05}: fp8 {worst['fp8']}, bf16 {worst['out05']}; mean: fp8 {means['fp8']}, "
          f"bf16 {means['out05']}")
    assert max(worst["fp8"]) < harness.TOLERANCE + FP8_STEP, worst
    assert max(means["fp8"]) < harness.MEAN_TOLERANCE + FP8_STEP / 3 ** 0.5, means


def test_speculators_09s_fp8_transfer_dataset_and_collate_read_the_fp8_files(both):
    """speculators 0.9.0's own ``FP8Transfer`` (its ``--hidden-states-backend fp8``), ``ArrowDataset``
    and ``CollateFn`` over the FP8 output: the batch it trains on holds the bf16 files' states within
    e4m3's step (the dequantized values, cast to bf16 by 0.9's transfer)."""
    root, rows = both
    script = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from hs_connectors.transfer import FP8Transfer\n"
        "from speculators.train.data import ArrowDataset, CollateFn\n"
        "fp8, bf16 = sys.argv[1], sys.argv[2]\n"
        "a = ArrowDataset(max_len=2048, datapath=fp8, on_missing='raise',\n"
        "                 transfer=FP8Transfer(Path(fp8) / 'hidden_states'))\n"
        "b = ArrowDataset(max_len=2048, datapath=bf16, on_missing='raise')\n"
        "collate = CollateFn(max_len=2048, hidden_size=128, num_target_layers=3)\n"
        "got, want = collate([a[i] for i in range(len(a))]), collate([b[i] for i in range(len(b))])\n"
        "out = {'n': len(a), 'keys': sorted(got), 'dtype': str(got['hidden_states'].dtype)}\n"
        "for key in ('hidden_states', 'verifier_last_hidden_states'):\n"
        "    g, w = got[key][0].float(), want[key][0].float()\n"
        "    rows = w.norm(dim=-1) > 0\n"
        "    out[key] = float(((g - w).norm(dim=-1)[rows] / w.norm(dim=-1)[rows]).max())\n"
        "for key in ('input_ids', 'loss_mask', 'position_ids'):\n"
        "    out[key + '_equal'] = bool(torch.equal(got[key], want[key])) if key in got else None\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(root / "fp8"), str(root / "out05")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(speculators_09())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["n"] == SAMPLES and seen["dtype"] == "torch.bfloat16"
    assert seen["input_ids_equal"] and seen["loss_mask_equal"], seen
    # e4m3's step, plus bf16's rounding of the dequantized value (2^-9) in 0.9's transfer
    assert 0 < seen["hidden_states"] <= FP8_STEP + 2.0 ** -8 and 0 < seen["verifier_last_hidden_states"] <= FP8_STEP + 2.0 ** -8, seen


def test_convert_refuses_fp8_states_to_the_03_layout(both, tmp_path):
    root, _ = both
    proc = convert(root / "fp8", tmp_path / "to03", "speculators-0.3")
    assert proc.returncode == 2 and "holds fp8 states, which speculators-0.3's trainer cannot read" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "to03").exists()


@pytest.mark.parametrize("state_dtype", ["model", "fp8"])
def test_generate_streams_05_files_that_hf_and_speculators_09_read(tmp_path, state_dtype):
    """``generate --format speculators-0.5``: the file of a row prefilled in its reply's region is begun
    while the reply is generated (its states first, written as the region counts them; the rows its
    prefill computed again, the ids, FP8's scales and the header at its end), with the marker model of
    tests/e2e/generate_runs.py, whose rows go on from their whole reply. Every file streamed is one
    prefilled in place (the log's counts), holds the states first (its header), and is HF's row, layer
    by layer, token by token (FP8: within e4m3's step more); speculators 0.9.0's own dataset reads the
    directory. The negative of the judge: tests/unit/test_streamed_files.py (stale rows kept fail)."""
    import re

    from hidden_states.inputs.conversations import MESSAGES, Record
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.output.formats.speculators_05 import safetensors_header
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer
    from tests.e2e import generate_runs as generate

    # a system prompt, a one-turn and a two-turn conversation: four rows, one per reply
    conversations = [generate.CONVERSATIONS[3], generate.CONVERSATIONS[0], generate.CONVERSATIONS[2]]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    model = generate.marker_model(tmp_path)
    out = tmp_path / "out"
    extra = ("--state-dtype", "fp8") if state_dtype == "fp8" else ()
    proc = generate.run_generate(model, data, out, *extra, layout="speculators-0.5", layers=IDS_05, new_tokens=64,
                                 pythonpath=(speculators_09(), ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    in_place = int(re.search(r"(\d+) prefilled in their reply's region", proc.stderr).group(1))
    said = re.search(r"(\d+) streamed to their files during generation \(([\d,]+) token rows", proc.stderr)
    assert said, proc.stderr[-3000:]
    assert int(said.group(1)) == in_place >= 1 and int(said.group(2).replace(",", "")) > 0, said.group(0)
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.5", 1024)
    hf = load_model(model)
    states_first, worst = 0, 0.0
    for line in (out / "regenerated.jsonl").read_text().splitlines():
        line = json.loads(line)
        rows = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)
        assert len(rows) == len(line["sample_indices"])
        for index, row in zip(line["sample_indices"], rows):
            path = out / "hidden_states" / f"hs_{index}.safetensors"
            states_first += safetensors_header(path)["hidden_states"]["data_offsets"][0] == 0
            saved = load_05(out, index)
            assert saved["token_ids"].tolist() == row.input_ids and saved["loss_mask"].tolist() == row.loss_mask
            got = saved["hidden_states"].float()
            if state_dtype == "fp8":
                got = got * saved["hidden_states_scales"]
            reference = decoder_layer_outputs(hf, [row.input_ids], [layer - 1 for layer in IDS_05])[0]
            for j, ref in enumerate(reference):
                errors = relative_errors(got[:, j, :], ref)
                bound = harness.TOLERANCE + (FP8_STEP if state_dtype == "fp8" else 0)
                assert float(errors.max()) <= bound, f"sample {index} layer {IDS_05[j]}: {float(errors.max()):.3f}"
                worst = max(worst, float(errors.max()))
    assert states_first == in_place  # every streamed file, and no other, lays its states out first
    segment = json.loads((out / "data_config.json").read_text())["states_segment"]  # recorded for the GPU runs
    assert segment["bytes"] > 0 and Path(segment["in"]).is_dir(), segment
    print(f"generate {state_dtype}: {in_place} files streamed ({said.group(2)} rows during generation), worst "
          f"token {worst:.4f} of HF")
    script = ("import json, sys\n"
              "from speculators.train.data import ArrowDataset\n"
              + ("from pathlib import Path\nfrom hs_connectors.transfer import FP8Transfer\n"
                 "t = FP8Transfer(Path(sys.argv[1]) / 'hidden_states')\n" if state_dtype == "fp8" else "t = None\n")
              + "kw = {'transfer': t} if t else {}\n"
              "ds = ArrowDataset(max_len=2048, datapath=sys.argv[1], on_missing='raise', **kw)\n"
              "print(json.dumps([list(ds[i]['hidden_states'].shape) for i in range(len(ds))]))\n")
    read = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(speculators_09())})
    assert read.returncode == 0, read.stderr[-3000:]
    shapes = json.loads(read.stdout.strip().splitlines()[-1])
    assert len(shapes) == 4 and all(shape[1] == 3 * 128 for shape in shapes), shapes
