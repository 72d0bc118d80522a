"""``--pp-size`` before the load: the stages' layers as vLLM splits them (``plan/pipeline.py``), the
plan's line of which stage captures which layer, bad values and the backends that cannot run
pipeline stages refused in one line each (exit 2). No model is loaded here."""
import json

import pytest

from hidden_states import cli
from hidden_states.backends import vllm_native
from hidden_states.errors import UsageError
from hidden_states.plan import planner
from hidden_states.plan.pipeline import PARTITION_ENV, pp_partition, pipeline_line, stage_of
from hidden_states.settings import ModelSettings

AUDIT = "audit ok (a stand-in)"


@pytest.fixture
def no_audit(monkeypatch):
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: AUDIT)


def plan(model, tmp_path, *flags) -> int:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    return cli.main(["plan", "--model-path", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                     "--format", "speculators-0.3", *flags])


@pytest.mark.parametrize("layers, stages, expected", [
    (6, 2, [(0, 3), (3, 6)]),
    (61, 2, [(0, 31), (31, 61)]),  # the remainder to the stages before the last
    (62, 4, [(0, 15), (15, 31), (31, 47), (47, 62)]),
    (6, 4, [(0, 1), (1, 3), (3, 5), (5, 6)]),
    (94, 3, [(0, 31), (31, 63), (63, 94)]),
])
def test_the_stages_split_the_layers_as_vllm_does(layers, stages, expected):
    assert pp_partition(layers, stages, {}) == expected


def test_the_partition_variable_chooses_the_stages_and_may_leave_one_empty():
    assert pp_partition(6, 2, {PARTITION_ENV: "4,2"}) == [(0, 4), (4, 6)]
    assert pp_partition(6, 2, {PARTITION_ENV: "0,6"}) == [(0, 0), (0, 6)]


@pytest.mark.parametrize("value, said", [("4,x", "not a comma-separated list"), ("3,3,0", "3 stages, but --pp-size 2"),
                                         ("4,4", "8 layers, but the model has 6"), ("7,-1", "negative"),
                                         ("", "not a comma-separated list")])
def test_a_partition_vllm_refuses_is_one_line_naming_the_variable(value, said):
    with pytest.raises(UsageError) as raised:
        pp_partition(6, 2, {PARTITION_ENV: value})
    assert str(raised.value).startswith(f"{PARTITION_ENV}={value!r}: ") and said in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_plan_says_which_stage_captures_each_layer():
    stages = pp_partition(6, 2, {})
    assert [stage_of(layer, stages) for layer in (0, 2, 3, 5)] == [0, 0, 1, 1]
    assert pipeline_line(stages, [5, 0, 3, 2]) == ("pipeline: 2 stages, layers 0-2 and 3-5; captured 0 2 on stage 0, "
                                                   "3 5 on stage 1 (stage 1 is the last: LM head, certificates)")
    assert pipeline_line(pp_partition(6, 2, {PARTITION_ENV: "1,5"}), [3, 5]).startswith(
        "pipeline: 2 stages, layers 0 and 1-5; captured 3 5 on stage 1")


@pytest.mark.parametrize("command", ["extract", "generate", "serve", "plan"])
def test_every_command_that_loads_the_model_takes_pp_size_and_refuses_less_than_one(command, capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main([command, "--pp-size", "0", "--model-path", "m", "--data", "d", "--output-dir", "o"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "--pp-size" in err and "must be at least 1" in err


def test_more_stages_than_decoder_layers_is_refused_naming_the_flag(fake_model, tmp_path, no_audit, capsys):
    assert plan(fake_model, tmp_path, "--backend", "vllm-engine", "--pp-size", "5", "--layer-ids", "0") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--pp-size 5: more stages than the model's 4 decoder layers")


def test_the_plan_shows_pp_size_and_the_stages_only_when_it_is_more_than_one(fake_model, tmp_path, no_audit, capsys):
    assert plan(fake_model, tmp_path, "--backend", "vllm-engine", "--pp-size", "2", "--layer-ids", "0", "3") == 0
    said = capsys.readouterr().out
    assert "--tp-size 1 --pp-size 2 --gpu-memory-utilization" in said
    assert "pipeline: 2 stages, layers 0-1 and 2-3; captured 0 on stage 0, 3 on stage 1" in said
    assert plan(fake_model, tmp_path, "--backend", "vllm-engine", "--layer-ids", "0", "3") == 0
    said = capsys.readouterr().out
    assert "--pp-size" not in said and "pipeline:" not in said


def test_the_speculators_backend_with_stages_is_refused_saying_why_and_what_runs_it(fake_model, tmp_path, no_audit,
                                                                                   capsys):
    assert plan(fake_model, tmp_path, "--backend", "speculators", "--pp-size", "2") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--pp-size 2: --backend speculators" in line and "tensor_parallel_size only" in line
    assert "last pipeline stage only" in line and "use --backend vllm-engine" in line


def fake_vllm(tmp_path, gate: bool):
    root = tmp_path / "vllm"
    where = root.joinpath(*vllm_native.AUX_GATE)
    where.parent.mkdir(parents=True)
    where.write_text(f"getattr(inner, '{vllm_native.AUX_OVER_PP}', False)" if gate else "")
    return root


@pytest.mark.parametrize("device, gate, v1", [("cpu", True, None), ("cuda", False, None), ("cuda", True, "0")])
def test_vllm_native_with_stages_on_the_v1_runner_is_refused(fake_model, tmp_path, monkeypatch, device, gate, v1):
    if v1 is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v1)
    monkeypatch.setattr(vllm_native.extractor_api, "package_dir", lambda name: fake_vllm(tmp_path, gate))
    with pytest.raises(UsageError) as raised:
        vllm_native.refuse_pipeline(str(fake_model), 2, "0.32.0", device)
    said = str(raised.value)
    assert said.startswith("--pp-size 2: --backend vllm-native: vLLM 0.32.0's V1 model runner")
    assert "last pipeline stage only" in said and "--backend vllm-engine runs it" in said


@pytest.mark.parametrize("declared, refused", [(True, False), (False, True), (None, True)])
def test_vllm_native_with_stages_on_a_gpu_follows_vllms_gate_for_the_family(fake_model, tmp_path, monkeypatch,
                                                                            declared, refused):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = json.loads((fake_model / "config.json").read_text())
    (fake_model / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    monkeypatch.setattr(vllm_native.extractor_api, "package_dir", lambda name: fake_vllm(tmp_path, True))
    monkeypatch.setattr(vllm_native, "decoder_supports_aux_over_pp", lambda architecture: declared)
    if not refused:
        vllm_native.refuse_pipeline(str(fake_model), 2, "0.34.0", "cuda")
        return
    with pytest.raises(UsageError) as raised:
        vllm_native.refuse_pipeline(str(fake_model), 2, "0.34.0", "cuda")
    said = str(raised.value)
    assert said.startswith("--pp-size 2: --backend vllm-native: vLLM 0.34.0 refuses it after the load")
    assert ("DeepseekV3ForCausalLM does not support extract_hidden_states with pipeline parallelism" in said
            if declared is False else "not in its registry" in said)
    assert "--backend vllm-engine runs it" in said


def test_one_stage_is_never_refused(fake_model):
    vllm_native.refuse_pipeline(str(fake_model), 1, "0.32.0", "cpu")
    assert ModelSettings("m").pp_size == 1


@pytest.mark.parametrize("preset", ["kimi-k2-int4-2x8h100", "deepseek-v3-bf16-2x8h200"])
def test_the_two_host_presets_are_refused_on_one_eight_gpu_host_saying_why(preset):
    from hidden_states.plan.pipeline import check_one_host
    from hidden_states.presets import PRESETS

    chosen = PRESETS[preset]
    assert (chosen["tp_size"], chosen["pp_size"]) == (8, 2)
    with pytest.raises(UsageError) as raised:
        check_one_host(chosen["tp_size"], chosen["pp_size"], 8)
    assert str(raised.value) == ("--pp-size 2: --tp-size 8 x --pp-size 2 needs 16 GPUs on this host, which has 8; "
                                 "stages on other hosts: --ray-address (vLLM's Ray executor)")
    assert check_one_host(8, 2, 16) == "GPUs: 16 of this host's 16 (--tp-size 8 x --pp-size 2)"
    assert check_one_host(8, 2, None) is None


def test_the_gpus_here_are_the_visible_ones_when_chosen():
    from hidden_states.plan.pipeline import gpus_here

    assert gpus_here({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert gpus_here({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_the_presets_before_pipelines_keep_one_stage():
    from hidden_states.presets import PRESETS

    assert [name for name, chosen in PRESETS.items() if chosen.get("pp_size", 1) > 1] == [
        "kimi-k2-int4-2x8h100", "deepseek-v3-bf16-2x8h200"]
    assert ModelSettings.tuned("vllm-engine", PRESETS["h200"], model_path="m").pp_size == 1

