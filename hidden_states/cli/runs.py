"""``extract``, ``plan`` and ``generate``: the settings from their flags, the run they ask for, and
what each command prints."""
from __future__ import annotations

from pathlib import Path

from .. import log_levels, model_ids, shards
from ..presets import PRESETS
from ..settings import Settings
from .flags import TUNABLE


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
                          forward_check=not args.skip_forward_check, certificates=not args.no_certificates,
                          overlap=not args.no_overlap,
                          share_prefixes=not args.no_shared_prefix, cuda_graphs=args.cuda_graphs,
                          shard=shards.from_environment(args.shard), data_parallel_size=args.data_parallel_size,
                          ray_address=args.ray_address, start_over=args.start_over,
                          config_file=str(Path(args.config).resolve()) if args.config else None)


def extraction_for(settings: Settings, sampling=None, **kwargs):
    """The run ``settings`` ask for: ``extract``'s, or ``generate``'s with ``sampling``
    (``backends.Sampling``); each runs on Ray replicas or in this process as its settings say."""
    if sampling is not None:
        from ..generate.command import Generation

        return Generation(settings, sampling, **kwargs)
    from ..extract.command import Extraction

    return Extraction(settings, **kwargs)


def plan_command(args) -> int:
    from .. import run_log

    # What planning prints besides the plan (a library's lines, our warnings) reaches the terminal as
    # extract's does at --log-level (no log file: plan writes nothing); the plan, the command's
    # result, is printed whole at every level, as extract's summary is.
    with run_log.captured(None, log_levels.level_of(args)):
        planned = extraction_for(settings_from(args))
        planned.plan()
    print("plan (no model loaded, nothing written):\n  " + "\n  ".join(planned.prepared.plan_lines))
    return 0


def extract_command(args, sampling=None) -> int:
    """``extract``, and ``generate`` (``sampling``: its sampling flags)."""
    from ..progress import log_to_stderr as log

    settings = settings_from(args)
    if settings.shard is not None:
        log(str(settings.shard))
        devices = shards.leave_torchrun(tp_size=settings.tp_size * settings.pp_size)
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


def generate_command(args) -> int:
    from ..generate.command import sampling_from

    return extract_command(args, sampling_from(args))
