"""The command line's flags and their types, shared by the commands' parsers (``extract``, ``plan``,
``generate``, ``serve``): what ``build_parser`` (``cli/__init__.py``) puts together."""
from __future__ import annotations

import argparse

from .. import log_levels
from ..backends import BACKENDS
from ..output.formats import FORMATS
from ..fp8_states import STATE_DTYPES
from ..presets import PRESETS
from ..settings import ENGINE_STEPS_HELD, SERVE_DEFAULTS, WRITER_THREADS_CAP, ServeSettings, default

TUNABLE = ("tp_size", "pp_size", "gpu_memory_utilization", "batch_size", "max_seq_len", "writer_threads", "max_writer_threads")


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
                       help="how states are computed: vllm-engine (a capture on vLLM's own engine: speculators' "
                            "with 0.3/0.4 installed, else its own; the fastest measured, on a GPU and on CPU), "
                            "speculators (the unmodified speculators 0.3/0.4 generator), vllm-native (vLLM's own "
                            "extract_hidden_states). Default: chosen per environment, said on the plan's first line: "
                            "vllm-engine wherever the vllm-compat audit passes for it, else speculators")
    model.add_argument("--layer-ids", type=int, nargs="+", metavar="ID",
                       help="layers to capture, counted as --format's trainer counts them: speculators-0.3 "
                            "the output of layer L (default 2, N/2, N-3, N-1), speculators-0.5 the state "
                            "after k layers (default 2, N/2, N-3, N)")
    add_forward_check_flag(model)
    model.add_argument("--no-certificates", action="store_true",
                       help="write rows without their certificate (the engine's logprobs at a few positions, "
                            "checked against each row's written last-layer state: docs/certificates.md)")
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
                    writer_help=f"threads writing files (default {default('writer_threads')}, whichever backend is "
                                f"chosen by default; "
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
                       help="skip the self-test of the model's kernels after the load (see docs/explanation/capture.md)")


def add_state_dtype_flag(group, where: str = "") -> None:
    group.add_argument("--state-dtype", choices=STATE_DTYPES, default=default("state_dtype"),
                       help=f"how states are stored: model (as the model computes them, the default) or fp8 "
                            f"(float8_e4m3fn with one scale per token, as speculators 0.9's FP8 hs-connector "
                            f"writes them: about half the bytes; {where}trained with --hidden-states-backend fp8)")


def add_speed_flags(group, *, batch_help: str, writer_help: str) -> None:
    """--preset, --batch-size, --tp-size, --pp-size, --gpu-memory-utilization, --writer-threads. The tunable flags
    default to None here so that a preset's value stands unless a flag is given."""
    group.add_argument("--preset", choices=sorted(PRESETS), help="named settings; explicit flags override them")
    group.add_argument("--batch-size", type=at_least(1), metavar="N", help=batch_help)
    group.add_argument("--tp-size", type=at_least(1), metavar="N",
                       help=f"tensor parallel size (default {default('tp_size')})")
    group.add_argument("--pp-size", type=at_least(1), metavar="N",
                       help=f"pipeline parallel size: the decoder layers split into N stages, each on --tp-size "
                            f"devices of this host (--backend vllm-engine; default {default('pp_size')})")
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
