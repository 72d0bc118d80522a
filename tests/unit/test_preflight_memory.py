"""The preflight's memory check: the weights read from safetensors headers (packed INT4 at its packed
size, sharded or not), a KV reserve, refused against the devices' memory with the numbers."""
import json
import types

import pytest

from hidden_states.errors import PreflightError
from hidden_states.plan.preflight import DeviceBudget, MemoryEstimate, check_memory, estimate_memory, model_facts
from hidden_states.sizes import human_size

torch = pytest.importorskip("torch")
save_file = pytest.importorskip("safetensors.torch").save_file

# 2 layers of 4 heads of 8 (hidden 32), 2 KV heads: 2 x 2 x 8 values of KV per token and layer
CONFIG = {"num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


def checkpoint(path, shards: dict[str, dict], config=CONFIG, index=False):
    """A checkpoint directory: each shard file holds its tensors; with ``index``, a
    model.safetensors.index.json maps every tensor to its file."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for name, tensors in shards.items():
        save_file(tensors, str(path / name))
    if index:
        weight_map = {tensor: name for name, tensors in shards.items() for tensor in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_facts(str(path))


def dense():
    return {"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),  # 4096 B
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32, dtype=torch.bfloat16),  # 2048 B
            "model.layers.0.input_layernorm.weight": torch.zeros(32, dtype=torch.bfloat16),  # 64 B
            "model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)}  # 64 B


def int4_expert():
    """compressed-tensors' pack-quantized layout of one 64 x 32 matrix: 8 INT4 values per int32,
    a bf16 scale per group of 32 inputs, the original shape."""
    return {"model.layers.1.mlp.experts.0.down_proj.weight_packed": torch.zeros(64, 4, dtype=torch.int32),  # 1024 B
            "model.layers.1.mlp.experts.0.down_proj.weight_scale": torch.zeros(64, 1, dtype=torch.bfloat16),  # 128 B
            "model.layers.1.mlp.experts.0.down_proj.weight_shape": torch.tensor([64, 32], dtype=torch.int32)}  # 8 B


def test_weights_are_the_stored_bytes_matrices_split_over_the_ranks_the_rest_whole(tmp_path):
    facts = checkpoint(tmp_path / "m", {"model.safetensors": dense()})
    estimate = estimate_memory(facts, tp_size=2, batch_size=1, max_seq_len=1)
    assert estimate.files == 1
    assert estimate.weights == 4096 + 2048 + 64 + 64
    assert estimate.weights_per_rank == (4096 + 2048) // 2 + 64 + 64
    assert estimate_memory(facts, 1, 1, 1).weights_per_rank == estimate.weights


def test_packed_int4_counts_at_its_packed_size(tmp_path):
    """A quarter of the same matrix in bf16 (4096 B), plus its scales and shape."""
    facts = checkpoint(tmp_path / "m", {"model.safetensors": int4_expert()})
    estimate = estimate_memory(facts, tp_size=4, batch_size=1, max_seq_len=1)
    assert estimate.weights == 1024 + 128 + 8
    assert estimate.weights_per_rank == (1024 + 128) // 4 + 8


def test_a_sharded_checkpoint_is_read_through_its_index_without_the_layers_vllm_skips(tmp_path):
    """Every shard the index names, once; a decoder layer past num_hidden_layers (DeepSeek-V3's MTP
    layer) is not loaded by vLLM and not counted; a file beside them that the index does not name
    is not either."""
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}
    path = tmp_path / "m"
    facts = checkpoint(path, {"model-00001-of-00002.safetensors": dense(),
                              "model-00002-of-00002.safetensors": {**int4_expert(), **mtp}}, index=True)
    save_file({"stray": torch.zeros(1000, 1000)}, str(path / "consolidated.safetensors"))
    estimate = estimate_memory(facts, tp_size=2, batch_size=1, max_seq_len=1)
    assert estimate.files == 2
    assert estimate.weights == (4096 + 2048 + 64 + 64) + (1024 + 128 + 8)


def test_a_shard_the_index_names_must_be_there_and_be_safetensors(tmp_path):
    path = tmp_path / "m"
    facts = checkpoint(path, {"model-00001-of-00002.safetensors": dense(),
                              "model-00002-of-00002.safetensors": int4_expert()}, index=True)
    missing = path / "model-00002-of-00002.safetensors"
    missing.unlink()
    with pytest.raises(PreflightError, match=f"{missing}: cannot read"):
        estimate_memory(facts, 1, 1, 1)
    missing.write_bytes(b"\xff" * 64)
    with pytest.raises(PreflightError, match=f"{missing}: not a safetensors file"):
        estimate_memory(facts, 1, 1, 1)


def test_an_index_without_a_weight_map_is_named(tmp_path):
    path = tmp_path / "m"
    facts = checkpoint(path, {"model.safetensors": dense()})
    (path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(PreflightError, match=f"{path / 'model.safetensors.index.json'}: no weight_map"):
        estimate_memory(facts, 1, 1, 1)


def test_no_safetensors_no_estimate(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    assert estimate_memory(model_facts(str(path)), 1, 1, 1) is None


def test_the_kv_reserve_is_one_batch_of_gqa_heads_per_rank_or_the_whole_mla_latent(tmp_path):
    gqa = checkpoint(tmp_path / "gqa", {"model.safetensors": dense()})
    # 2 (K and V) x KV heads on a rank x head_dim 8 x 2 layers x 2 bytes x 3 sequences of 100 tokens
    assert estimate_memory(gqa, 1, 3, 100).kv_per_rank == 2 * 2 * 8 * 2 * 2 * 300
    assert estimate_memory(gqa, 2, 3, 100).kv_per_rank == 2 * 1 * 8 * 2 * 2 * 300
    assert estimate_memory(gqa, 4, 3, 100).kv_per_rank == 2 * 1 * 8 * 2 * 2 * 300  # a KV head replicated
    mla = checkpoint(tmp_path / "mla", {"model.safetensors": dense()},
                     config={**CONFIG, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert estimate_memory(mla, 8, 3, 100).kv_per_rank == (512 + 64) * 2 * 2 * 300  # not split


# Kimi-K2-class on 8 Blackwell GPUs: the numbers the error must name
KIMI = MemoryEstimate(files=64, weights=594_000_000_000, weights_per_rank=74_500_000_000, kv_per_rank=576_000_000,
                      tp_size=8, batch_size=4, max_seq_len=2048)
BLACKWELL = 97_887 * 2**20


def test_a_model_that_fits_is_logged_in_one_line():
    line = check_memory("/models/kimi", KIMI, DeviceBudget(BLACKWELL, 0.80, shared=False))
    assert line == ("memory: weights 594.0 GB as stored in 64 files, about 74.5 GB per rank at --tp-size 8, + "
                    "576.0 MB KV cache for one batch (4 x 2048 tokens) = 75.1 GB per rank, within 82.1 GB per GPU "
                    "(102.6 GB x --gpu-memory-utilization 0.8)")


def test_a_model_that_cannot_fit_is_refused_with_the_numbers_and_what_to_change():
    with pytest.raises(PreflightError) as refused:
        check_memory("/models/kimi", KIMI, DeviceBudget(BLACKWELL, 0.70, shared=False))
    assert str(refused.value) == (
        "--model-path /models/kimi: the model does not fit: weights 594.0 GB as stored in 64 files, about 74.5 GB "
        "per rank at --tp-size 8, + 576.0 MB KV cache for one batch (4 x 2048 tokens) = 75.1 GB per rank, more than "
        "71.8 GB per GPU (102.6 GB x --gpu-memory-utilization 0.7). Use more GPUs (a larger --tp-size or --pp-size), or "
        "--gpu-memory-utilization 0.74 or more.")
    with pytest.raises(PreflightError, match=r"more than 57.6 GB per GPU \(64.0 GB x --gpu-memory-utilization 0.9\)"
                                             r"\. Even all of each GPU's memory is too little at --tp-size 8: use "
                                             r"more GPUs \(a larger --tp-size or --pp-size\)\.$"):
        check_memory("/models/kimi", KIMI, DeviceBudget(64 * 10**9, 0.90, shared=False))


def test_on_the_cpu_backend_the_ranks_add_up_in_host_memory():
    """Every rank holds its share in the one host memory; --gpu-memory-utilization does not bound it."""
    small = MemoryEstimate(1, 3_000_000_000, 1_600_000_000, 100_000_000, tp_size=2, batch_size=4, max_seq_len=2048)
    assert check_memory("m", small, DeviceBudget(4_000_000_000, None, shared=True)).endswith(
        "= 1.7 GB per rank, 3.4 GB for 2 ranks, within 4.0 GB of host memory available (vLLM's CPU backend holds "
        "every rank there)")
    with pytest.raises(PreflightError, match=r"3.4 GB for 2 ranks, more than 3.0 GB of host memory available .*"
                                             r"Free host memory, or run on GPUs\.$"):
        check_memory("m", small, DeviceBudget(3_000_000_000, None, shared=True))


def test_without_a_device_budget_the_estimate_is_logged_uncompared():
    line = check_memory("m", KIMI, "vLLM on xpu tells it only by starting the device's runtime in this process")
    assert line.endswith("= 75.1 GB per rank; not compared with device memory (vLLM on xpu tells it only by "
                         "starting the device's runtime in this process)")


def test_device_memory_is_asked_of_vllm_only_where_nvml_answers(monkeypatch):
    """vLLM's NVIDIA platform without NVML (and ROCm's fallback) answer from torch.cuda, which creates
    the CUDA context a forked worker cannot use: no answer there, and no call."""
    import sys

    import vllm.platforms

    from vllm_compat.host import device_total_memory

    class NvmlCudaPlatform:
        def is_cuda(self):
            return True

        def get_device_total_memory(self, device_id=0):
            return 141 * 10**9 if device_id == 0 else None

    class NonNvmlCudaPlatform:
        def is_cuda(self):
            return True

        def get_device_total_memory(self, device_id=0):
            raise AssertionError("asked torch.cuda for the memory")

    monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", types.SimpleNamespace(NvmlCudaPlatform=NvmlCudaPlatform))
    monkeypatch.setattr(vllm.platforms, "_current_platform", NvmlCudaPlatform())
    assert device_total_memory() == 141 * 10**9
    monkeypatch.setattr(vllm.platforms, "_current_platform", NonNvmlCudaPlatform())
    assert device_total_memory() is None


# -- the extractor's own path, on a real tiny checkpoint and vLLM's CPU platform

@pytest.mark.vllm
def test_the_extractor_plan_logs_the_estimate_of_a_real_checkpoint(tiny, tmp_path, monkeypatch):
    from safetensors import safe_open

    from hidden_states.plan import planner
    from hidden_states.extract.command import Extraction
    from hidden_states.settings import Settings
    from vllm_compat.host import vllm_device_type

    model, data = tiny
    with safe_open(str(model / "model.safetensors"), "pt") as stored:
        stored_bytes = sum(stored.get_tensor(name).nbytes for name in stored.keys())
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: "not run (no speculators here)")
    planned = Extraction(Settings(model_path=str(model), prepared_data=str(data),
                                             output_dir=str(tmp_path / "out"), format="speculators-0.3", batch_size=2,
                                             max_seq_len=64))
    planned.plan()
    lines = planned.prepared.plan_lines
    memory = [line for line in lines if line.startswith("memory: ")]
    assert len(memory) == 1, lines
    estimate = estimate_memory(model_facts(str(model)), 1, 2, 64)
    assert estimate.weights == estimate.weights_per_rank == stored_bytes  # tp 1: every byte on the one rank
    assert memory[0].startswith(f"memory: {estimate.line()}")
    if vllm_device_type() == "cpu":
        assert "of host memory available (vLLM's CPU backend holds every rank there)" in memory[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
def test_the_extractor_refuses_a_model_the_host_cannot_hold_before_anything_is_written(tiny, tmp_path, monkeypatch,
                                                                                        capsys):
    """Negative proof: the same run with the host's memory (or the GPU's, where there is one) made
    too small for the tiny model stops in the preflight, exit 2, naming the numbers."""
    import vllm_compat.extractor_api
    from hidden_states import backends
    from hidden_states.cli import main

    def load(name, settings):
        raise AssertionError("the preflight let the model load")

    model, data = tiny
    monkeypatch.setattr(backends, "create", load)
    monkeypatch.setattr(vllm_compat.extractor_api, "host_memory", lambda: (1_000_000, 2_000_000))
    monkeypatch.setattr(vllm_compat.extractor_api, "device_total_memory", lambda: 1_000_000)
    out = tmp_path / "out"
    assert main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
                 "--format", "speculators-0.3", "--tp-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"hidden-states: error: --model-path {model}: the model does not fit: weights 4.1 MB as stored in 1 file" \
           in err, err
    assert "per rank at --tp-size 2" in err and "1.0 MB" in err
    assert not out.exists()


def test_token_parameters_count_routed_experts_at_their_share_and_packed_int4_at_eight_per_int32(tmp_path):
    """What the plan's time estimate scales with: the decoder layers' values one token runs through."""
    tensors = {**dense(), **int4_expert(),
               "model.layers.1.mlp.shared_experts.down_proj.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}
    facts = checkpoint(tmp_path / "m", {"model.safetensors": tensors},
                       config={**CONFIG, "n_routed_experts": 4, "num_experts_per_tok": 1})
    assert facts.expert_share == 0.25
    estimate = estimate_memory(facts, tp_size=1, batch_size=1, max_seq_len=1)
    # layer 0: q_proj 32 x 32 + its norm 32; layer 1: the shared expert whole (64 x 32), the routed one
    # (64 x 4 int32 = 2048 INT4 values, 64 scales, a 2-value shape) at a quarter; embeddings and the
    # final norm are no decoder layer's
    assert estimate.token_parameters == int(1024 + 32 + 64 * 32 + (2048 + 64 + 2) / 4)


# -- pipeline stages: each holds its own layers, the embedding on the first, the norm and LM head on the last

STAGED = {**CONFIG, "num_hidden_layers": 4}


def four_layers(head: bool):
    tensors = {"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),  # 4096 B
               "model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)}  # 64 B
    for layer in range(4):
        tensors[f"model.layers.{layer}.mlp.weight"] = torch.zeros(32, 32 * (layer + 1), dtype=torch.bfloat16)
    if head:
        tensors["lm_head.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)  # 4096 B
    return tensors


def layer_bytes(layer: int) -> int:
    return 2048 * (layer + 1)


@pytest.mark.parametrize("head, tied", [(True, False), (False, True)])
def test_each_stage_holds_its_layers_the_first_the_embedding_the_last_the_head(tmp_path, head, tied):
    facts = checkpoint(tmp_path / "m", {"model-1.safetensors": four_layers(head)},
                       config={**STAGED, "tie_word_embeddings": tied}, index=True)
    kv_layer = 2 * 2 * 8 * 2 * 3 * 100  # 2 x 2 KV heads x head_dim 8 x 2 bytes, 3 x 100 tokens
    one = estimate_memory(facts, 1, 3, 100)
    assert one.weights_per_rank == 4096 + 64 + sum(map(layer_bytes, range(4))) + (4096 if head else 0)
    assert one.kv_per_rank == 4 * kv_layer
    two = estimate_memory(facts, 1, 3, 100, pp_size=2)  # layers 0-1 and 2-3: the second needs more
    assert two.weights == one.weights
    last = layer_bytes(2) + layer_bytes(3) + 64 + 4096  # its own head, or the tied embedding's copy
    assert (two.weights_per_rank, two.kv_per_rank) == (last, 2 * kv_layer)
    assert two.worst_stage == "stage 1 (layers 2-3 + LM head)"
    assert two.all_ranks == 4096 + layer_bytes(0) + layer_bytes(1) + last + 4 * kv_layer
    assert f"about {human_size(last)} per rank at --tp-size 1 --pp-size 2 (the most of any stage: stage 1 (layers 2-3 + LM " \
           "head))" in two.line()
    halved = estimate_memory(facts, 2, 3, 100, pp_size=2)
    assert halved.weights_per_rank == (layer_bytes(2) + layer_bytes(3) + 4096) // 2 + 64


def test_stages_on_the_cpu_backend_add_up_every_rank_of_every_stage(tmp_path):
    facts = checkpoint(tmp_path / "m", {"model.safetensors": four_layers(True)}, config=STAGED)
    two = estimate_memory(facts, 2, 1, 1, pp_size=2)
    line = check_memory("m", two, DeviceBudget(10**9, None, shared=True))
    assert f"{human_size(two.all_ranks)} for 4 ranks, within" in line
    assert two.all_ranks < 4 * two.per_rank  # the stages differ: their sum, not the worst four times


def test_a_layout_that_does_not_fit_names_the_pipeline_size_that_does(tmp_path):
    facts = checkpoint(tmp_path / "m", {"model.safetensors": four_layers(True)}, config=STAGED)
    whole = estimate_memory(facts, 1, 1, 1)
    budget = DeviceBudget(whole.per_rank * 6 // 10, 1.0, shared=False)  # a bit over half of the whole model
    with pytest.raises(PreflightError) as refused:
        check_memory("m", whole, budget)
    assert "Even all of each GPU's memory is too little at --tp-size 1: use more GPUs (--tp-size 1 --pp-size " in \
        str(refused.value)
    fits = int(str(refused.value).split("--pp-size ")[1].split(" ")[0])
    assert estimate_memory(facts, 1, 1, 1, pp_size=fits).per_rank <= budget.budget
    assert estimate_memory(facts, 1, 1, 1, pp_size=fits - 1).per_rank > budget.budget
