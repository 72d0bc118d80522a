"""Run a released speculators trainer for a few EAGLE-3 steps on CPU and write each step's loss.

    python trainer_driver.py 0.9 RESULT.json -- <speculators.train flags>
    python trainer_driver.py 0.3 RESULT.json DATA_DIR VERIFIER STEPS

Run in a subprocess with one speculators release first on ``PYTHONPATH``. Both trainers are driven as
their users drive them; the one thing changed is the device, because both assume an accelerator:
``Trainer.setup_model`` does ``model.to(local_rank)`` with ``local_rank`` 0 (0.9.0
``train/trainer.py:348``, 0.3.0 ``train/trainer.py:110``), which CPU-only torch refuses ("Cannot
access accelerator device when none is available"), and 0.9.0's step timer calls
``torch.accelerator.synchronize()`` on every logged step (``train/trainer.py:80``), which raises the
same on CPU, where there is nothing to synchronize. speculators 0.3.0 also runs its attention only as
``flex_attention`` under ``torch.compile`` (``models/eagle3/attention.py:141-173``, ``core.py:282``),
which CPU torch cannot differentiate ("FlexAttention does not support backward on CPU"; compiled, an
inductor IndexError): on CPU its attention runs as SDPA over the dense form of its own block mask
(its ``block_mask_to_dense_attention_mask``), the same mask, and compilation is off. The losses are read from the trainer's own
metric logger (``speculators.metrics``), where its ``train_epoch`` reports every step.
"""
from __future__ import annotations

import json
import logging
import sys


class StepLosses(logging.Handler):
    """Collects ``{"train": {...}}`` records of the ``speculators.metrics`` logger."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.steps.append({k: float(v) for k, v in record.msg["train"].items() if isinstance(v, (int, float))})


def train_09(argv: list[str], losses: StepLosses) -> None:
    """speculators >= 0.8's own entry point (``python -m speculators.train``), flags as a user types them."""
    import torch

    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    setup = cli.setup_metric_logger

    def setup_then_listen(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(losses)

    cli.setup_metric_logger = setup_then_listen
    sys.argv = ["speculators.train", *argv]
    cli.main(TrainConfig.resolve())


def train_03(data_dir: str, verifier: str, steps: int, losses: StepLosses) -> None:
    """speculators 0.3.0's trainer as its ``scripts/train.py`` (not in the wheel) assembles it: the
    package's ``Eagle3SampleFileDataset``, collate function, multipack sampler, ``Eagle3DraftModel``
    and ``Trainer``, one EAGLE-3 draft layer, the verifier's full vocabulary."""
    import torch
    from torch.utils.data import DataLoader

    import vllm_compat

    vllm_compat.apply()  # speculators 0.3 imports only so under transformers 5
    from transformers import AutoConfig, LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.trainer import Trainer, TrainerConfig

    torch.manual_seed(0)
    verifier_config = AutoConfig.from_pretrained(verifier)
    total_seq_len = 512
    dataset = Eagle3SampleFileDataset(datapath=data_dir, max_len=total_seq_len)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=create_collate_fn(total_seq_len))
    layer = LlamaConfig(vocab_size=verifier_config.vocab_size, hidden_size=verifier_config.hidden_size,
                        intermediate_size=verifier_config.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=verifier_config.num_attention_heads,
                        num_key_value_heads=verifier_config.num_key_value_heads,
                        max_position_embeddings=total_seq_len, rms_norm_eps=verifier_config.rms_norm_eps)
    layer._attn_implementation = "simple_flex_attention"  # speculators 0.3.0 registers its attention under this name
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=verifier_config.vocab_size,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=verifier_config.architectures)))
    # the full vocabulary: every target token is a draft token, at offset 0
    vocab = verifier_config.vocab_size
    model = Eagle3DraftModel(config=config, t2d=torch.ones(vocab, dtype=torch.bool),
                             d2t=torch.zeros(vocab, dtype=torch.long))
    if not torch.cuda.is_available():
        cpu_attention()
    kwargs = {"use_off_policy_tokens": False, "ttt_steps": 3, "ttt_step_loss_decay": 1.0}
    trainer_config = TrainerConfig(lr=3e-3, num_epochs=steps, save_path=str(losses.save_path),
                                   local_rank="cpu", train_call_kwargs=kwargs, val_call_kwargs=kwargs,
                                   scheduler_type="none")
    logging.getLogger("speculators.metrics").addHandler(losses)
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    Trainer(model, trainer_config, loader, None).run_training()


def cpu_attention() -> None:
    """speculators 0.3.0's attention, as SDPA over the dense form of its block mask (see above)."""
    import torch
    import torch._dynamo

    from speculators.models.eagle3 import attention

    torch._dynamo.config.disable = True

    def dense_attention(module, query, key, value, attention_mask, scaling=None, **_kwargs):
        mask = attention.block_mask_to_dense_attention_mask(attention_mask, query.device, torch.bool)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None

    attention.ALL_ATTENTION_FUNCTIONS.register("simple_flex_attention", dense_attention)


def main() -> int:
    line, result = sys.argv[1], sys.argv[2]
    losses = StepLosses()
    if line == "0.9":
        train_09(sys.argv[sys.argv.index("--") + 1:], losses)
    else:
        data_dir, verifier, steps = sys.argv[3], sys.argv[4], int(sys.argv[5])
        losses.save_path = result + ".checkpoints"
        train_03(data_dir, verifier, steps, losses)
    with open(result, "w") as handle:
        json.dump(losses.steps, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
