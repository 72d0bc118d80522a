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

Exit codes: 0 done; 1 an unexpected failure (full traceback printed), or one of vLLM's processes died
(the last line names it, how it ended and the likely cause); 2 bad input or arguments (one line
naming the file, line or flag); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (rerun the same
command to resume). serve: 0 after a SIGTERM/SIGINT's drain; 1 when vLLM's engine died (the last line
names the process); 143/130 after a second SIGTERM/SIGINT while draining (vLLM's processes killed).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
from pathlib import Path

from . import log_levels, model_ids, shards
from .backends import BACKENDS
from .config_file import config_path, flags_from
from .errors import ExtractError, UsageError
from .output.formats import FORMATS
from .fp8_states import STATE_DTYPES
from .presets import PRESETS
from .settings import (ENGINE_STEPS_HELD, SERVE_DEFAULTS, WRITER_THREADS_CAP, ModelSettings, ServeSettings, Settings,
                       default)

TUNABLE = ("tp_size", "gpu_memory_utilization", "batch_size", "max_seq_len", "writer_threads", "max_writer_threads")
RUN_COMMANDS = ("extract", "plan")
CONFIG_COMMANDS = {**dict.fromkeys(RUN_COMMANDS, lambda parser: add_run_arguments(parser)),
                   "serve": lambda parser: add_serve_arguments(parser)}


def serve_default(name: str):
    """The default of ``ServeSettings.name``."""
    return ServeSettings.__dataclass_fields__[name].default


def at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (argparse names the flag when it refuses)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def share(text: str) -> float:
    """An argparse type: a share of device memory, 0 < x <= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value}: must be more than 0 and at most 1 (a share of device memory)")
    return value


EXAMPLES = """examples:
  hidden-states plan --model-path /models/llama-8b --data chats.jsonl --output-dir out   # seconds, no model load
  hidden-states extract --model-path /models/llama-8b --data chats.jsonl --output-dir out
  hidden-states extract --model-path meta-llama/Llama-3.1-8B-Instruct --data rows.jsonl --output-dir out --preset h200
  hidden-states extract --config run.toml --batch-size 16      # flags over the file's settings
  hidden-states extract --config run.toml --data-parallel-size 2 --ray-address auto

run.toml holds the same flags without their dashes:
  model-path = "/models/llama-8b"
  data = "chats.jsonl"
  output-dir = "out"
  layer-ids = [2, 16, 29, 31]
  strict = true
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``extract`` and ``plan``, in groups."""
    parser.add_argument("--config", metavar="FILE",
                        help="a TOML file of these flags (names without the dashes); flags given here override it")
    given = parser.add_argument_group("input")
    given.add_argument("--data", "--prepared-data", dest="prepared_data", required=True, metavar="PATH",
                       help="conversations (ShareGPT, OpenAI messages, text; tokenized with the model's chat "
                            "template) or tokenized rows (input_ids, loss_mask): JSONL, JSON, Parquet or a saved "
                            "dataset directory")
    given.add_argument("--max-samples", type=at_least(1), metavar="N", help="extract at most this many samples")
    given.add_argument("--start-index", type=at_least(0), metavar="N", default=default("start_index"),
                       help="skip samples before this index")
    given.add_argument("--max-seq-len", type=at_least(1), metavar="TOKENS",
                       help=f"longer samples are truncated (or refused with --strict) "
                            f"(default {default('max_seq_len')})")
    given.add_argument("--strict", action="store_true", help="refuse samples longer than --max-seq-len, and "
                       "conversation turns whose role is unknown (default: skipped or taken as assistant, as "
                       "--format's trainer does)")
    model = parser.add_argument_group("model")
    add_model_flags(model)
    model.add_argument("--backend", choices=BACKENDS, default=default("backend"),
                       help="how states are computed: speculators (the unmodified speculators generator, the "
                            "default), vllm-engine (speculators' capture on vLLM's own engine; the fastest on a "
                            "GPU), vllm-native (vLLM's own extract_hidden_states)")
    model.add_argument("--layer-ids", type=int, nargs="+", metavar="ID",
                       help="layers to capture, counted as --format's trainer counts them: speculators-0.3 "
                            "the output of layer L (default 2, N/2, N-3, N-1), speculators-0.5 the state "
                            "after k layers (default 2, N/2, N-3, N)")
    add_forward_check_flag(model)
    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", required=True, metavar="DIR",
                        help="where the sample files go (a rerun resumes)")
    output.add_argument("--start-over", action="store_true",
                        help="when --output-dir holds another extraction (other model, layers, format, input or "
                             "tokenization), remove its files and extract this one (refused otherwise)")
    output.add_argument("--format", choices=sorted(FORMATS),
                        help="output format: what the installed speculators trains on (speculators-0.3 for "
                             "0.3/0.4, speculators-0.5 for 0.5 and later or none installed)")
    add_state_dtype_flag(output, "speculators-0.5 only, ")
    output.add_argument("--progress-interval", type=float, metavar="SECONDS", default=default("progress_interval"),
                        help="seconds between log lines")
    # The tunable flags default to None here so that a preset's value stands unless a flag is given.
    speed = parser.add_argument_group("performance")
    add_speed_flags(speed, batch_help=f"sequences per batch: one generator call with --backend speculators; the engine "
                                      f"backends run a batch in groups of one engine step (default "
                                      f"{default('batch_size')})",
                    writer_help=f"threads writing files (default {default('writer_threads')}; "
                                f"{default('writer_threads', 'vllm-native')} with --backend vllm-native)")
    speed.add_argument("--max-writer-threads", type=at_least(1), metavar="N",
                       help=f"threads the writer may grow to while the run waits on it (default: half the cores, "
                            f"at most {WRITER_THREADS_CAP}; 1 with --backend vllm-native; --writer-threads N "
                            f"--max-writer-threads N: a fixed number)")
    speed.add_argument("--no-overlap", action="store_true",
                       help="one batch at a time: the next batch's forward does not run while this batch's "
                            "states are copied out (the speculators backend overlaps them by default)")
    speed.add_argument("--no-shared-prefix", action="store_true",
                       help="extract every row whole: by default a row that is an exact prefix of another row of "
                            "its batch (per-turn rows of one conversation) is written from that row's states")
    speed.add_argument("--cuda-graphs", action="store_true",
                       help="run vLLM compiled, with its CUDA graphs on a GPU (decode, where generate spends its "
                            "time), the capture's copies traced into them; --backend vllm-engine only (default: "
                            "vLLM eager, whose forward runs the capture's hooks)")
    scale = parser.add_argument_group("scale-out")
    scale.add_argument("--data-parallel-size", type=at_least(1), metavar="N", default=default("data_parallel_size"),
                       help="replicas of the model, each a Ray actor owning --tp-size devices; batches go to "
                            "whichever is free (needs vllm-compat[ray])")
    scale.add_argument("--ray-address", metavar="ADDRESS", default=default("ray_address"),
                       help="the Ray cluster to start the replicas on ('auto', or host:port); default: a local one")
    scale.add_argument("--shard", metavar="I/N",
                       help="this process is static shard I of N (every N-th batch, its own ledger); default "
                            "from RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS when set")
    log_levels.add_flags(parser.add_argument_group("log"))


def add_model_flags(group) -> None:
    """--model-path and --trust-remote-code (extract, plan, serve)."""
    group.add_argument("--model-path", required=True, metavar="DIR_OR_ID",
                       help="a local checkpoint directory, or a model id (org/name[@revision]) already in the "
                            "local Hugging Face cache (nothing is downloaded)")
    group.add_argument("--trust-remote-code", action="store_true", help="allow models that need remote code")


def add_forward_check_flag(group) -> None:
    group.add_argument("--skip-forward-check", action="store_true",
                       help="skip the self-test of the model's kernels after the load (see docs/extractor.md)")


def add_state_dtype_flag(group, where: str = "") -> None:
    group.add_argument("--state-dtype", choices=STATE_DTYPES, default=default("state_dtype"),
                       help=f"how states are stored: model (as the model computes them, the default) or fp8 "
                            f"(float8_e4m3fn with one scale per token, as speculators 0.9's FP8 hs-connector "
                            f"writes them: about half the bytes; {where}trained with --hidden-states-backend fp8)")


def add_speed_flags(group, *, batch_help: str, writer_help: str) -> None:
    """--preset, --batch-size, --tp-size, --gpu-memory-utilization, --writer-threads. The tunable flags
    default to None here so that a preset's value stands unless a flag is given."""
    group.add_argument("--preset", choices=sorted(PRESETS), help="named settings; explicit flags override them")
    group.add_argument("--batch-size", type=at_least(1), metavar="N", help=batch_help)
    group.add_argument("--tp-size", type=at_least(1), metavar="N",
                       help=f"tensor parallel size (default {default('tp_size')})")
    group.add_argument("--gpu-memory-utilization", type=share, metavar="SHARE",
                       help=f"share of device memory vLLM may use (default {default('gpu_memory_utilization')}; on "
                            f"CPU the KV cache is sized from the plan's estimate unless VLLM_CPU_KVCACHE_SPACE is set)")
    group.add_argument("--writer-threads", type=at_least(1), metavar="N", help=writer_help)


GENERATE_EXAMPLES = """examples:
  hidden-states generate --model-path /models/llama-8b --data chats.jsonl --output-dir out   # greedy
  hidden-states generate --model-path /models/llama-8b --data chats.jsonl --output-dir out \\
      --temperature 0.6 --top-p 0.95 --max-new-tokens 2048 --seed 0
  hidden-states generate ... --data-parallel-size 4          # Ray replicas: whole conversations to whichever is free
  hidden-states generate ... --shard 0/4                     # static shard 0 of 4: every 4th batch of conversations
the regenerated conversations: out/regenerated.jsonl (a shard's: out/regenerated.shard-I-of-N.jsonl, merged
into regenerated.jsonl as each shard ends); the rows and their states: as extract writes them
"""

SERVE_EXAMPLES = """examples:
  hidden-states serve --model-path meta-llama/Llama-3.1-8B-Instruct --port 8000
  speculators generate-offline-data --endpoint http://localhost:8000/v1 --preprocessed-data prepared \\
      --output prepared/hidden_states --concurrency 64 --validate-outputs
  speculators train ... --verifier-name-or-path meta-llama/Llama-3.1-8B-Instruct --on-missing generate \\
      --vllm-endpoint http://localhost:8000/v1
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``serve``, in groups (the model's and the performance flags as extract's)."""
    parser.add_argument("--config", metavar="FILE",
                        help="a TOML file of these flags (names without the dashes); flags given here override it")
    model = parser.add_argument_group("model")
    add_model_flags(model)
    model.add_argument("--served-model-name", metavar="NAME",
                       help="the model id /v1/models lists, which speculators' trainer compares with its "
                            "--verifier-name-or-path (default: a model id as given, a directory's name: never "
                            "its path)")
    model.add_argument("--layer-ids", type=int, nargs="+", metavar="ID",
                       help="layers each file holds, speculators 0.9's convention: the state after k layers, "
                            "ascending (default 2, N/2, N-3, N: the trainer's --target-layer-ids and its "
                            "verifier's last state)")
    model.add_argument("--max-seq-len", type=at_least(1), metavar="TOKENS",
                       help=f"the longest prompt served; a longer one is refused (400) (default "
                            f"{default('max_seq_len')})")
    add_forward_check_flag(model)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=serve_default("host"), help=f"where to listen (default {serve_default('host')})")
    server.add_argument("--port", type=at_least(0), default=serve_default("port"),
                        help=f"the port (default {serve_default('port')}; 0: a free one, said at start)")
    server.add_argument("--states-dir", metavar="DIR",
                        help="where each request's file waits for its client, which moves or deletes it; best on "
                             "the filesystem of the client's output; must be this user's and writable by no one "
                             "else, made 0700 if missing (default $XDG_RUNTIME_DIR/hidden-states, else "
                             "<tmp>/hidden-states-<uid>)")
    server.add_argument("--api-key", metavar="KEY",
                        help="the key every request but /health must carry: Authorization: Bearer KEY, or KEY as "
                             "the password of the URL (http://any:KEY@host:port/v1, for speculators 0.9's client, "
                             "which sends no key of its own) (default $VLLM_API_KEY, as vllm serve; best there: "
                             "a flag shows in the process list)")
    server.add_argument("--keep-alive-timeout", type=float, default=serve_default("keep_alive_timeout"),
                        metavar="SECONDS",
                        help=f"a connection idle, or stalled mid-request, this long is closed (default "
                             f"{serve_default('keep_alive_timeout'):g}, as vllm serve)")
    server.add_argument("--max-connections", type=at_least(1), default=serve_default("max_connections"),
                        metavar="N",
                        help=f"connections open at once; one more takes the place of one idle between requests, "
                             f"else is answered 503 and closed (default "
                             f"{serve_default('max_connections')}; at most half the process's file descriptor "
                             f"limit)")
    server.add_argument("--sweep-after", type=float, default=serve_default("sweep_after"), metavar="SECONDS",
                        help=f"a file no client collected is removed after this long (default "
                             f"{serve_default('sweep_after'):g})")
    add_state_dtype_flag(server, "")
    speed = parser.add_argument_group("performance")
    add_speed_flags(speed, batch_help=f"most requests gathered into one submit to the engine; the engine holds "
                                      f"three of them and the writers' rows before requests wait (default "
                                      f"{SERVE_DEFAULTS['batch_size']})",
                    writer_help=f"threads writing files (default {SERVE_DEFAULTS['writer_threads']})")
    speed.add_argument("--gather-ms", type=float, metavar="MS", default=1000 * serve_default("gather_window"),
                       help=f"milliseconds the server waits for more requests after the first of a batch "
                            f"(default {1000 * serve_default('gather_window'):g})")
    speed.add_argument("--engine-tokens", type=int, metavar="N", default=None,
                       help=f"most tokens of requests in vLLM's engine at once, the rest waiting in the server's "
                            f"queue (default {ENGINE_STEPS_HELD} engine steps' worth; 0: as many as the regions "
                            f"hold)")
    speed.add_argument("--no-shared-prefix", action="store_true",
                       help="vLLM's prefix cache off: by default requests gathered into one batch share the "
                            "states of their common first tokens")
    log_levels.add_flags(parser.add_argument_group("log"), log_file=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hidden-states", description=__doc__.split("\n\n")[0])
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
    generate.set_defaults(backend="vllm-engine")
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


def settings_from(args) -> Settings:
    """Settings from parsed flags: each tunable from its flag, else the backend's own setting, else
    the preset, else its default; a model id resolved to its directory in the local cache."""
    given = {name: getattr(args, name) for name in TUNABLE if getattr(args, name) is not None}
    return Settings.tuned(args.backend, PRESETS.get(args.preset), given,
                          model_path=model_ids.resolve(args.model_path), prepared_data=args.prepared_data,
                          output_dir=args.output_dir,
                          layer_ids=args.layer_ids, trust_remote_code=args.trust_remote_code,
                          max_samples=args.max_samples, start_index=args.start_index, strict=args.strict,
                          format=args.format, state_dtype=args.state_dtype, progress_interval=args.progress_interval,
                          forward_check=not args.skip_forward_check, overlap=not args.no_overlap,
                          share_prefixes=not args.no_shared_prefix, cuda_graphs=args.cuda_graphs,
                          shard=shards.from_environment(args.shard), data_parallel_size=args.data_parallel_size,
                          ray_address=args.ray_address, start_over=args.start_over,
                          config_file=str(Path(args.config).resolve()) if args.config else None)


def extraction_for(settings: Settings, sampling=None, **kwargs):
    """The run ``settings`` ask for: ``extract``'s, or ``generate``'s with ``sampling``
    (``backends.Sampling``); each runs on Ray replicas or in this process as its settings say."""
    if sampling is not None:
        from .generate.command import Generation

        return Generation(settings, sampling, **kwargs)
    from .extract.command import Extraction

    return Extraction(settings, **kwargs)


def _plan(args) -> int:
    from . import run_log

    # What planning prints besides the plan (a library's lines, our warnings) reaches the terminal as
    # extract's does at --log-level (no log file: plan writes nothing); the plan, the command's
    # result, is printed whole at every level, as extract's summary is.
    with run_log.captured(None, log_levels.level_of(args)):
        planned = extraction_for(settings_from(args))
        planned.plan()
    print("plan (no model loaded, nothing written):\n  " + "\n  ".join(planned.plan_lines))
    return 0


def _extract(args, sampling=None) -> int:
    """``extract``, and ``generate`` (``sampling``: its sampling flags)."""
    from .progress import log_to_stderr as log

    settings = settings_from(args)
    if settings.shard is not None:
        log(str(settings.shard))
        devices = shards.leave_torchrun(tp_size=settings.tp_size)
        if devices is not None:
            log(f"torchrun rank: devices {devices}")
    summary = extraction_for(settings, sampling, log=log).run()
    log(summary.line())
    if summary.shared_rows or summary.cached_tokens:
        log(summary.shared_line())
    if summary.interrupted is not None:
        log(summary.next_step)
        return 128 + summary.interrupted
    return 0


def serve_settings_from(args) -> tuple[ModelSettings, ServeSettings]:
    """The model's settings and the server's from ``serve``'s flags: each tunable from its flag,
    else the preset, else the server's default (``SERVE_DEFAULTS``), else the extractor's. No input,
    no output directory: rows come from clients, states go to files (``serve.state_files``)."""
    from .serve.model import BACKEND

    # the tunables serve has (its writer threads are a fixed pool: no --max-writer-threads)
    given = {name: getattr(args, name) for name in TUNABLE if getattr(args, name, None) is not None}
    tuned = ModelSettings.tuned(BACKEND, {**SERVE_DEFAULTS, **PRESETS.get(args.preset, {})}, given,
                                model_path=model_ids.resolve(args.model_path), layer_ids=args.layer_ids,
                                trust_remote_code=args.trust_remote_code, state_dtype=args.state_dtype,
                                forward_check=not args.skip_forward_check, share_prefixes=not args.no_shared_prefix)
    # serve's writers are a fixed pool (serve.batching): as many as it starts with
    settings = dataclasses.replace(tuned, max_writer_threads=tuned.writer_threads)
    if args.sweep_after <= 0:
        raise UsageError(f"--sweep-after {args.sweep_after:g}: must be more than 0 seconds")
    if args.gather_ms < 0:
        raise UsageError(f"--gather-ms {args.gather_ms:g}: must be at least 0")
    if args.engine_tokens is not None and args.engine_tokens < 0:
        raise UsageError(f"--engine-tokens {args.engine_tokens}: must be at least 0")
    if args.keep_alive_timeout <= 0:
        raise UsageError(f"--keep-alive-timeout {args.keep_alive_timeout:g}: must be more than 0 seconds")
    api_key = args.api_key if args.api_key is not None else os.environ.get("VLLM_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key: empty; give the key, or leave the flag out for none")
    return settings, ServeSettings(host=args.host, port=args.port,
                                   served_model_name=args.served_model_name or model_ids.served_name(args.model_path),
                                   states_dir=args.states_dir, sweep_after=args.sweep_after,
                                   gather_window=args.gather_ms / 1000, engine_tokens=args.engine_tokens,
                                   api_key=api_key, keep_alive_timeout=args.keep_alive_timeout,
                                   max_connections=args.max_connections)


def _serve(args) -> int:
    from .progress import log_to_stderr as log
    from .serve import Aborted, serve

    try:
        return serve(*serve_settings_from(args), log)
    except Aborted as exc:  # a second signal: said as the last line, the exit code the signal's
        print(f"hidden-states: aborted: {exc}", file=sys.stderr)
        args.exit_now = True
        return 128 + exc.signum


def _convert(args) -> int:
    from .convert import convert
    from .progress import log_to_stderr as log

    written = convert(args.src, args.dst, args.to, log=log)
    log(f"converted: {written} samples written to {args.dst}")
    return 0


def _prepare(args) -> int:
    from .layer_conventions import default_format
    from .prepare import prepare
    from .inputs.tokenization import ChatSettings

    chat = ChatSettings(model_ids.resolve(args.model_path), args.format or default_format(), args.max_seq_len,
                        args.trust_remote_code, args.strict)
    prepare(chat, args.data, args.output, args.token_freq, start_over=args.start_over)
    return 0


def _generate(args) -> int:
    from .generate.command import sampling_from

    return _extract(args, sampling_from(args))


def _demo(args) -> int:
    from .fixtures.demo import run_demo

    return run_demo(args.output_dir, args.samples)


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


def _output_captured(args):
    """extract, generate and convert: the full output to a log file in the output directory, the terminal's
    share at --log-level (hidden_states/run_log.py); serve: the terminal's share (it has no output directory)."""
    import contextlib

    from . import run_log

    if args.command in ("extract", "generate"):
        try:
            shard = shards.from_environment(args.shard)
        except ExtractError:  # reported by the run itself
            shard = None
        return run_log.captured(run_log.log_path(args.output_dir, shard.tag if shard else None),
                                log_levels.level_of(args))
    if args.command == "convert":
        return run_log.captured(run_log.log_path(args.dst), log_levels.level_of(args))
    if args.command == "serve":
        return run_log.captured(None, log_levels.level_of(args))
    return contextlib.nullcontext()


def _run(args) -> int:
    try:
        if args.command == "status":
            from .status import status

            print(status(args.output_dir))
            return 0
        return {"extract": _extract, "plan": _plan, "prepare": _prepare, "convert": _convert, "serve": _serve,
                "demo": _demo, "generate": _generate}[args.command](args)
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
