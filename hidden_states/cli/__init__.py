"""``python -m hidden_states`` / ``hidden-states``: turn tokenized data into hidden-state files.

    python -m hidden_states plan --model-path M --data conversations.jsonl --output-dir OUT   # seconds
    python -m hidden_states extract --model-path M --data conversations.jsonl --output-dir OUT \\
        [--config run.toml] [--preset blackwell-tp8] [--batch-size 4] [--max-seq-len 2048] [--tp-size 8] \\
        [--gpu-memory-utilization 0.80] [--layer-ids 2 30 58 60] [--format speculators-0.5] ...
    python -m hidden_states prepare --model-path M --data conversations.jsonl --output prepared.jsonl
    python -m hidden_states convert SRC DST --to speculators-0.5     # or back: --to speculators-0.3
    python -m hidden_states extract ... --data-parallel-size 2 [--ray-address auto]   # Ray replicas
    python -m hidden_states extract ... --shard 0/4                                   # static shard
    python -m hidden_states serve --model-path M [--port 8000]       # speculators >= 0.9's client and trainer
    python -m hidden_states generate --model-path M --data conversations.jsonl --output-dir OUT \
        [--temperature 0.6 --top-p 0.95 --max-new-tokens 1024 --seed 0]   # on-policy rows in one pass
    python -m hidden_states generate ... --data-parallel-size 2 | --shard 0/4   # as extract's
    python -m hidden_states status OUT
    python -m hidden_states demo [--output-dir demo-output]
    python -m hidden_states --version

Exit codes: 0 done; 1 an unexpected failure (full traceback printed), or one of vLLM's processes died
(the last line names it, how it ended and the likely cause); 2 bad input or arguments (one line
naming the file, line or flag); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (rerun the same
command to resume). serve: 0 after a SIGTERM/SIGINT's drain; 1 when vLLM's engine died (the last line
names the process); 143/130 after a second SIGTERM/SIGINT while draining (vLLM's processes killed).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from vllm_compat.extractor_api import __version__

from .. import log_levels, shards
from ..config_file import config_path, flags_from
from ..errors import ExtractError
from ..output.formats import FORMATS
from ..settings import default
from .flags import EXAMPLES, GENERATE_EXAMPLES, SERVE_EXAMPLES, add_run_arguments, add_serve_arguments, at_least
from .runs import extract_command, generate_command, plan_command
from .serve_command import serve_command
from .tools import convert_command, demo_command, prepare_command

RUN_COMMANDS = ("extract", "plan")
CONFIG_COMMANDS = {**dict.fromkeys(RUN_COMMANDS, lambda parser: add_run_arguments(parser)),
                   "serve": lambda parser: add_serve_arguments(parser)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hidden-states", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("extract", "extract hidden states for every sample of a tokenized dataset (prints the "
                                    "plan first)"),
                        ("plan", "what extract would do, checked and estimated in seconds, without loading the "
                                 "model or writing anything: audit, memory per rank, disk, layer ids, time")):
        add_run_arguments(sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))
    serve_help = ("load the model once and serve hidden states to speculators >= 0.9's client and trainer "
                  "(the OpenAI-compatible calls they make to vLLM: /v1/models, /v1/completions)")
    add_serve_arguments(sub.add_parser("serve", help=serve_help, description=serve_help, epilog=SERVE_EXAMPLES,
                                       formatter_class=argparse.RawDescriptionHelpFormatter))
    # hidden-states generate: extract's flags, the sampling flags (hidden_states/generate/)
    generate_help = ("regenerate the assistant turns with the model and write the rows of the regenerated "
                     "conversations with the states the generation computed (on-policy data in one pass; "
                     "--backend vllm-engine)")
    generate = sub.add_parser("generate", help=generate_help, description=generate_help, epilog=GENERATE_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(generate)
    # extract's flag, another unit here: a batch's conversations are all in the engine at once
    next(action for action in generate._actions if action.dest == "batch_size").help = (
        f"conversations generated together (default {default('batch_size')}; on a GPU give it hundreds, e.g. 256: "
        f"decoding runs at vLLM's speed only with many sequences in the engine)")
    sampling = generate.add_argument_group("sampling (vLLM's SamplingParams)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--max-new-tokens", type=at_least(1), default=1024, metavar="N",
                          help="the most tokens of one reply (vLLM's max_tokens; default 1024)")
    sampling.add_argument("--seed", type=int, help="each request's own seed: its replies do not depend on its batch")
    sampling.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens whatever is sampled "
                                                                     "(benchmarks)")
    prepare = sub.add_parser("prepare", help="tokenize conversations as --format's trainer expects (no model "
                                             "load) into a JSONL of input_ids and loss_mask, and token_freq.pt")
    prepare.add_argument("--model-path", required=True,
                         help="the checkpoint whose tokenizer and chat template to use (a directory, or a model id "
                              "in the local Hugging Face cache)")
    prepare.add_argument("--data", required=True, metavar="PATH",
                         help="conversations: JSONL, JSON, Parquet or a saved dataset directory")
    prepare.add_argument("--output", required=True, metavar="FILE", help="the JSONL to write")
    prepare.add_argument("--max-seq-len", type=at_least(1), default=default("max_seq_len"),
                         help=f"rows are truncated to this many tokens (default {default('max_seq_len')})")
    prepare.add_argument("--format", choices=sorted(FORMATS),
                         help="the trainer: speculators-0.3 (0.3/0.4: one row per conversation) or speculators-0.5 "
                              "(>= 0.5: one row per assistant turn); default: what the installed speculators reads")
    prepare.add_argument("--token-freq", metavar="FILE", help="where token_freq.pt goes (default: beside --output)")
    prepare.add_argument("--trust-remote-code", action="store_true", help="allow a tokenizer that needs remote code")
    prepare.add_argument("--strict", action="store_true",
                         help="refuse a conversation longer than --max-seq-len, or with a turn whose role is unknown "
                              "(default: truncated; the role skipped or taken as assistant as --format's trainer does)")
    prepare.add_argument("--start-over", action="store_true",
                         help="replace a token_freq.pt that another prepare's rows left in the way")
    convert = sub.add_parser("convert", help="convert an extraction to the other layout (no model, no GPU; a "
                                             "rerun resumes)")
    convert.add_argument("src", help="a finished extraction's output directory")
    convert.add_argument("dst", help="where the converted extraction goes")
    convert.add_argument("--to", required=True, choices=sorted(FORMATS), help="the layout to write")
    log_levels.add_flags(convert)
    verify = sub.add_parser("verify", help="check every row's certificate again, from the checkpoint's final norm "
                                           "and LM head alone (no vLLM, no GPU); exit 1 naming the rows that fail")
    verify.add_argument("output_dir", help="an extraction's output directory")
    verify.add_argument("--model-path", metavar="DIR", help="the checkpoint (default: the one data_config.json names)")
    verify.add_argument("--engine", action="store_true",
                        help="certify the rows written without a certificate (--backend speculators or vllm-native, "
                             "--no-certificates) on a vLLM engine started on the checkpoint with the run's settings, "
                             "and write each certificate into its row's file (its states untouched)")
    log_levels.add_flags(verify, log_file=None)  # what the terminal shows of vLLM's output (--engine)
    status = sub.add_parser("status", help="what an output directory holds, across shards and replicas")
    status.add_argument("output_dir")
    demo = sub.add_parser("demo", help="extract a few samples with a tiny local model on CPU and compare with HF")
    demo.add_argument("--output-dir", default="demo-output")
    demo.add_argument("--samples", type=int, default=24)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, a ``--config`` file's flags (extract, plan, serve) first so that the command line's win."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    path = config_path(argv)
    if argv and argv[0] in CONFIG_COMMANDS and path is not None:
        checker = argparse.ArgumentParser(add_help=False)
        CONFIG_COMMANDS[argv[0]](checker)
        flags = flags_from(path, checker)
        argv = [argv[0], *flags, *argv[1:]]
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except ExtractError as exc:  # a --config file's bad key or value
        print(f"hidden-states: error: {exc}", file=sys.stderr)
        return exc.exit_code
    with _output_captured(args):
        code = _run(args)
    if getattr(args, "exit_now", False):  # serve's second signal: what the interpreter's exit would wait on
        os._exit(code)  # (vLLM's killed engine's threads and finalizers) is not waited for
    return code


def console(argv: list[str] | None = None, _exit=os._exit):
    """The entry point of ``hidden-states`` and ``python -m hidden_states``: :func:`main`, then an exit
    that leaves out the interpreter's teardown, which frees every object and module one at a time and
    then runs the native libraries' destructors: about 2 s on a 2-core host once vLLM and torch are
    imported, after the run has ended. Only where nothing is left for the teardown to wait on: with a
    thread still running that is not a daemon (a normal exit first tells concurrent.futures' idle
    workers to stop, then joins every such thread), the exit is the usual one. Otherwise every exit
    handler runs first (logging's flush, multiprocessing's joins of children, ``weakref.finalize``),
    and stdout and stderr are flushed. An exception from ``main`` (a traceback, argparse's exit)
    leaves the usual way."""
    import atexit
    import threading

    code = main(argv)
    if any(thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
           for thread in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what a normal exit would also fail to write
            pass
    _exit(code)


def _output_captured(args):
    """extract, generate and convert: the full output to a log file in the output directory, the terminal's
    share at --log-level (hidden_states/run_log.py); serve: the terminal's share (it has no output directory)."""
    import contextlib

    from .. import run_log

    if args.command in ("extract", "generate"):
        try:
            shard = shards.from_environment(args.shard)
        except ExtractError:  # reported by the run itself
            shard = None
        return run_log.captured(run_log.log_path(args.output_dir, shard.tag if shard else None),
                                log_levels.level_of(args))
    if args.command == "convert":
        return run_log.captured(run_log.log_path(args.dst), log_levels.level_of(args))
    if args.command == "serve" or getattr(args, "engine", False):  # verify --engine: vLLM's output filtered
        return run_log.captured(None, log_levels.level_of(args))
    return contextlib.nullcontext()


def _run(args) -> int:
    try:
        if args.command == "verify":
            from ..verify_engine import open_engine
            from ..progress import log_to_stderr
            from ..verify import verify

            return verify(args.output_dir, log_to_stderr, model_path=args.model_path,
                          engine=open_engine if args.engine else None)
        if args.command == "status":
            from ..status import status

            print(status(args.output_dir))
            return 0
        return {"extract": extract_command, "plan": plan_command, "prepare": prepare_command,
                "convert": convert_command, "serve": serve_command, "demo": demo_command,
                "generate": generate_command}[args.command](args)
    except ExtractError as exc:
        print(f"hidden-states: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a second signal, or one while the model loaded
        print("hidden-states: aborted; finished samples are kept, rerun to resume", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except Exception as exc:  # everything else: the whole story, never an empty message
        traceback.print_exc()
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        print(f"hidden-states: failed: {type(exc).__name__}: {exc or '(no message)'}"
              + (f" (caused by {type(cause).__name__}: {cause or '(no message)'})" if cause is not exc else ""),
              file=sys.stderr)
        return 1
