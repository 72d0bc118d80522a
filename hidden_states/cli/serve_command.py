"""``serve``: the model's settings and the server's from its flags, and the command."""
from __future__ import annotations

import dataclasses
import os
import sys

from .. import model_ids
from ..errors import UsageError
from ..presets import PRESETS
from ..settings import SERVE_DEFAULTS, ModelSettings, ServeSettings
from .flags import TUNABLE


def serve_settings_from(args) -> tuple[ModelSettings, ServeSettings]:
    """The model's settings and the server's from ``serve``'s flags: each tunable from its flag,
    else the preset, else the server's default (``SERVE_DEFAULTS``), else the extractor's. No input,
    no output directory: rows come from clients, states go to files (``serve.state_files``)."""
    from ..serve.model import BACKEND

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


def serve_command(args) -> int:
    from ..progress import log_to_stderr as log
    from ..serve import Aborted, serve

    try:
        return serve(*serve_settings_from(args), log)
    except Aborted as exc:  # a second signal: said as the last line, the exit code the signal's
        print(f"hidden-states: aborted: {exc}", file=sys.stderr)
        args.exit_now = True
        return 128 + exc.signum
