"""``python -m hidden_states.train``: speculators' EAGLE-3 trainer on what the extractor wrote, one
command on a GPU and on CPU (docs/guides/extract.md, "Training on the output").

* speculators 0.8 and 0.9 have their own command (``python -m speculators.train``): the flags are
  theirs and pass through unchanged. On a GPU nothing else happens. Where torch has no accelerator,
  two things change, because their trainer assumes one and no flag or variable says otherwise:
  ``Trainer`` puts the model on ``get_local_rank()``, an int (0.9.0 ``train/trainer.py:221``, used at
  ``:348``), which CPU-only torch refuses ("Cannot access accelerator device when none is available"),
  so it gets ``"cpu"``; and its step timer calls ``torch.accelerator.synchronize()`` on every logged
  step (``:80``, ``:92``), which raises the same where there is nothing to synchronize, so it is skipped.
  Where ``--data-path`` is the extractor's 0.5 layout and the command leaves them out, the flags its
  ``data_config.json`` says to train with are added (``flags_from_extraction``), with a line saying so.
* speculators 0.3 and 0.4 ship no command (their ``scripts/train.py`` is not in the wheel): the trainer
  is assembled as that script does, from the package's ``Eagle3SampleFileDataset``, multipack sampler,
  ``Eagle3DraftModel`` (one layer, the verifier's whole vocabulary) and ``Trainer``, from a few flags
  (``ASSEMBLED_FLAGS``). Their ``TrainerConfig`` takes the device. Off-GPU their attention, compiled
  ``flex_attention`` only (``models/eagle3/attention.py:141-173``), which CPU torch cannot differentiate
  ("FlexAttention does not support backward on CPU"), runs as SDPA over the dense form of the same
  block mask (their ``block_mask_to_dense_attention_mask``), with compilation off.

Other releases are refused (exit 2): each of these depends on the release's internals.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

PROG = "python -m hidden_states.train"
OWN_COMMAND = ("0.8", "0.9")


def has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()


def say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def speculators_release() -> str | None:
    """The installed speculators' release (its distribution's: 0.3.0's ``speculators.version`` says 0.2.0)."""
    from vllm_compat.extractor_api import speculators_version

    version = speculators_version()
    return None if version is None else str(version)


def train_with_own_command(argv: list[str]) -> int:
    """speculators >= 0.8's ``python -m speculators.train``, with the user's flags."""
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    from speculators.train.config import TrainConfig

    argv = [*argv, *flags_from_extraction(argv)]
    if not has_accelerator():
        import torch

        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        say("no accelerator here: the model trains on cpu; speculators' accelerator synchronize is skipped")
    sys.argv = ["speculators.train", *argv]
    cli.main(TrainConfig.resolve())
    return 0


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def flags_from_extraction(argv: list[str]) -> list[str]:
    """What the extraction at ``--data-path`` says to train with, where the command leaves it out:
    ``--target-layer-ids`` (its layers but the last, in the trainer's convention: speculators' own
    default, ``[2, n//2, n-3]``, matches only an extraction made with the default ids of a model of
    more than 6 layers) and, for FP8 states, ``--hidden-states-backend fp8``."""
    data = flag_value(argv, "--data-path")
    from .output.names import CONFIG

    config = os.path.join(data, CONFIG) if data else None
    if not config or not os.path.isfile(config):
        return []
    with open(config) as handle:
        described = json.load(handle).get("format") or {}
    if described.get("name") != "speculators-0.5":
        return []
    added = []
    if not any(a == "--target-layer-ids" or a.startswith("--target-layer-ids=") for a in argv):
        added += ["--target-layer-ids", *map(str, described["layer_ids"][:-1])]
    if described.get("state_dtype") == "fp8" and flag_value(argv, "--hidden-states-backend") is None:
        added += ["--hidden-states-backend", "fp8"]
    if added:
        say(f"from {config}: {' '.join(added)}")
    return added


ASSEMBLED_FLAGS = argparse.ArgumentParser(
    prog=PROG, description="speculators 0.3/0.4's EAGLE-3 trainer, assembled as its scripts/train.py does "
    "(one draft layer, the verifier's whole vocabulary, 3 speculative tokens)")
ASSEMBLED_FLAGS.add_argument("--data-path", required=True,
                             help="the extraction in the speculators-0.3 layout (its data_*.pt files)")
ASSEMBLED_FLAGS.add_argument("--verifier-name-or-path", required=True, help="the model the states came from")
ASSEMBLED_FLAGS.add_argument("--epochs", type=int, default=20)
ASSEMBLED_FLAGS.add_argument("--total-seq-len", type=int, default=8192,
                             help="tokens per packed batch, and the longest sample")
ASSEMBLED_FLAGS.add_argument("--save-path", default="./output/checkpoints")
ASSEMBLED_FLAGS.add_argument("--lr", type=float, default=1e-3)


def sample_files(data_path: str) -> list[str]:
    """The extraction's sample files in ``data_path`` (``data_{i}.pt``), by index. Given the directory,
    speculators 0.3/0.4's dataset loads every file whose name ends in "pt" under it as a sample. An
    extraction into speculators-0.3 writes no other such file, but one written by an older version of
    the extractor, from conversations, holds a ``token_freq.pt`` (for speculators 0.9), which would
    stop training with a KeyError; and a user's own ``.pt`` files may lie there too."""
    from .output import formats

    layout = formats.create("speculators-0.3", Path(data_path))
    indexed = [(layout.sample_index(name), name) for name in os.listdir(data_path)]
    return [os.path.join(data_path, name) for index, name in sorted((i, n) for i, n in indexed if i is not None)]


SPECULATORS_09_HERE = "docs/getting-started.md, \"4. Train a draft\""


def assembled_flags() -> str:
    """The assembled trainer's flags, as one line says them."""
    return " ".join("--" + action.dest.replace("_", "-") for action in ASSEMBLED_FLAGS._actions[1:])


def train_assembled(argv: list[str], release: str) -> int:
    """speculators 0.3/0.4's trainer, assembled from ``ASSEMBLED_FLAGS``."""
    args, unknown = ASSEMBLED_FLAGS.parse_known_args(argv)
    if unknown:  # most often speculators 0.9's command, run where 0.3/0.4 is installed
        flags = " ".join(flag for flag in unknown if flag.startswith("-"))
        say(f"{flags or ' '.join(unknown)}: not a flag of speculators {release}'s trainer, the speculators installed "
            f"here (its flags: {assembled_flags()}); "
            f"speculators 0.8/0.9's flags need an environment with speculators 0.9 ({SPECULATORS_09_HERE})")
        return 2
    if not os.path.isdir(args.data_path):
        say(f"--data-path {args.data_path}: no such directory")
        return 2
    files = sample_files(args.data_path)
    if not files:
        say(f"--data-path {args.data_path}: no sample files (data_<i>.pt) in it: an extraction with --format "
            f"speculators-0.3 writes them")
        return 2
    import torch
    from torch.utils.data import DataLoader

    from vllm_compat.extractor_api import apply

    apply()  # speculators 0.3/0.4 import under transformers 5 only so
    from transformers import AutoConfig, LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train import logger
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.trainer import Trainer, TrainerConfig

    logger.setup_root_logger()
    logger.setup_metric_logger([], "hidden-states-train", args.save_path)
    torch.manual_seed(0)
    verifier = AutoConfig.from_pretrained(args.verifier_name_or_path)
    length = args.total_seq_len
    dataset = Eagle3SampleFileDataset(file_list=files, max_len=length)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=length, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=create_collate_fn(length))
    layer = LlamaConfig(vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size,
                        intermediate_size=verifier.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=verifier.num_attention_heads,
                        num_key_value_heads=verifier.num_key_value_heads,
                        max_position_embeddings=length, rms_norm_eps=verifier.rms_norm_eps)
    layer._attn_implementation = "simple_flex_attention"  # the name speculators 0.3/0.4 register it under
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=verifier.vocab_size,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=args.verifier_name_or_path, architectures=verifier.architectures)))
    vocab = verifier.vocab_size  # every target token a draft token, at offset 0
    model = Eagle3DraftModel(config=config, t2d=torch.ones(vocab, dtype=torch.bool),
                             d2t=torch.zeros(vocab, dtype=torch.long))
    if has_accelerator():
        device = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        device = "cpu"
        cpu_attention()
        say("no accelerator here: the model trains on cpu; speculators' flex attention runs as SDPA over "
            "the same block mask, uncompiled")
    kwargs = {"use_off_policy_tokens": False, "ttt_steps": 3, "ttt_step_loss_decay": 1.0}
    trainer_config = TrainerConfig(lr=args.lr, num_epochs=args.epochs, save_path=args.save_path,
                                   local_rank=device, train_call_kwargs=kwargs, val_call_kwargs=kwargs,
                                   scheduler_type="none")
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    Trainer(model, trainer_config, loader, None).run_training()
    return 0


def cpu_attention() -> None:
    """speculators 0.3/0.4's attention as SDPA over the dense form of its block mask (see above)."""
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    release = speculators_release()
    if release is None:
        say("speculators is not installed here: pip install speculators (0.8/0.9, or 0.3/0.4)")
        return 2
    line = ".".join(release.split(".")[:2])
    if line in OWN_COMMAND:
        return train_with_own_command(argv)
    from .backends import in_process_generator

    if in_process_generator(release):  # 0.3/0.4: no command of their own
        return train_assembled(argv, release)
    say(f"speculators {release} is not supported: 0.8/0.9 (their own train flags) or 0.3/0.4 "
        f"({assembled_flags()})")
    return 2


if __name__ == "__main__":
    sys.exit(main())
