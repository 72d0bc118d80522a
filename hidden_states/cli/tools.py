"""``convert``, ``prepare`` and ``demo``: the commands that load no model of a run."""
from __future__ import annotations

from .. import model_ids


def convert_command(args) -> int:
    from ..convert import convert
    from ..progress import log_to_stderr as log

    written = convert(args.src, args.dst, args.to, log=log)
    log(f"converted: {written} samples written to {args.dst}")
    return 0


def prepare_command(args) -> int:
    from ..layer_conventions import default_format
    from ..prepare import prepare
    from ..inputs.tokenization import ChatSettings

    chat = ChatSettings(model_ids.resolve(args.model_path), args.format or default_format(), args.max_seq_len,
                        args.trust_remote_code, args.strict)
    prepare(chat, args.data, args.output, args.token_freq, start_over=args.start_over)
    return 0


def demo_command(args) -> int:
    from ..fixtures.demo import run_demo

    return run_demo(args.output_dir, args.samples)
