"""``VLLM_CPU_OMP_THREADS_BIND`` against the engine's ranks (``--tp-size`` x ``--pp-size``), refused
before the load where vLLM's CPU worker would index past its core lists (``plan/cpu_threads.py``)."""
import json

import pytest

from hidden_states import cli
from hidden_states.errors import UsageError
from hidden_states.plan import planner
from hidden_states.plan.cpu_threads import THREADS_BIND_ENV, check_thread_binding, core_lists


@pytest.mark.parametrize("value, lists", [("auto", None), ("nobind", None), ("", None), ("0|1", ["0", "1"]),
                                          ("0-3|4-7|8", ["0-3", "4-7", "8"])])
def test_the_core_lists_are_the_variables_entries_and_vllms_own_choices_none(value, lists):
    assert core_lists(value) == lists


@pytest.mark.parametrize("tp, pp, value", [(2, 2, "0|1|0|1"), (2, 2, "0|1|0|1|0"), (1, 2, "0|1"), (8, 1, "auto"),
                                           (2, 2, "nobind"), (1, 1, "0")])
def test_a_core_list_per_rank_or_vllms_own_choice_passes(tp, pp, value):
    check_thread_binding(tp, pp, value)


def test_fewer_core_lists_than_ranks_is_one_line_naming_the_variable_the_ranks_and_a_value_that_runs():
    with pytest.raises(UsageError) as raised:
        check_thread_binding(2, 2, "0|1")
    assert str(raised.value) == (
        "VLLM_CPU_OMP_THREADS_BIND='0|1': 2 core lists for 4 ranks (--tp-size 2 x --pp-size 2); vLLM's CPU "
        "backend binds rank r to the r-th list (separated by '|'), so it needs 4, e.g. '0|1|0|1' (ranks may "
        "share cores)")


@pytest.fixture
def model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 64,
                                                   "num_attention_heads": 2, "num_key_value_heads": 2}))
    return model


def plan(model, tmp_path, *flags) -> int:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    return cli.main(["plan", "--model-path", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                     "--format", "speculators-0.3", "--backend", "vllm-engine", "--layer-ids", "0", "3", *flags])


@pytest.mark.parametrize("device, refused", [("cpu", True), ("cuda", False)])
def test_the_plan_refuses_too_few_core_lists_on_vllms_cpu_backend_only(model, tmp_path, monkeypatch, capsys,
                                                                      device, refused):
    import vllm_compat.extractor_api as extractor_api

    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: "audit ok (a stand-in)")
    monkeypatch.setattr(extractor_api, "vllm_device_type", lambda: device)
    monkeypatch.setenv(THREADS_BIND_ENV, "0|1")
    code = plan(model, tmp_path, "--tp-size", "2", "--pp-size", "2")
    err = capsys.readouterr().err
    if refused:
        assert code == 2
        assert err.strip().splitlines()[-1].endswith(
            "VLLM_CPU_OMP_THREADS_BIND='0|1': 2 core lists for 4 ranks (--tp-size 2 x --pp-size 2); vLLM's CPU "
            "backend binds rank r to the r-th list (separated by '|'), so it needs 4, e.g. '0|1|0|1' (ranks may "
            "share cores)"), err
    else:
        assert THREADS_BIND_ENV not in err, err
