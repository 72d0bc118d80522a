"""``hidden-states verify OUT --engine``: rows written without a certificate (``--backend speculators``,
``--backend vllm-native``, ``--no-certificates``) certified after the run, on a real vLLM engine.

For each such row the engine is asked what ``extract --backend vllm-engine`` asks it during a run: its
logprobs (``SamplingParams(max_tokens=1, temperature=0, logprobs=TOP)``) at the row's last position and
at the positions :func:`.certify.witness.probe_positions` draws from its ids, each a request for the row's first
``p + 1`` tokens. The rows go whole first, then their probes, so vLLM's prefix cache (on here) serves
each probe all but its last block. The run's :class:`.certify.certifier.Certifier` then holds the written
last-layer state (read as the trainer reads it) against them; a row that holds gets its certificate
written into its file (the file replaced whole, its states untouched), so a plain ``verify`` holds it
later.

Every position is allowed :data:`.certify.certificate.PROBE_SLACK` bounds: the logprobs come from another
forward than the one whose states were written (another engine, batch and order of sums), as a
probe's do during a run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .certify.certifier import CertificateFailed, Certifier
from .certify.witness import Witness, first_token_logprobs, probe_positions
from .errors import UsageError
from .output.sample_rows import file_tensors, row_of, write_certificate

ROWS_PER_PASS = 32  # rows read, asked and certified together: their files and witnesses held at once


@dataclass
class EnginePass:
    """What the engine's pass found, by row index.

    Attributes:
        failing: row -> why it does not hold.
        held: the rows that hold (their certificates written).
        positions: the engine's logprobs compared, over every row.
        worst: the largest disagreement as a share of what rounding explains.
    """

    failing: dict[int, str] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    positions: int = 0
    worst: float = 0.0


def engine_settings(config: dict, model: str):
    """The engine the run's ``data_config.json`` describes (its recorded settings; the extractor's
    defaults where it recorded none), on ``model``."""
    from .backends import BackendSettings
    from .settings import Settings

    recorded = config.get("settings") or {}

    def setting(name):
        value = recorded.get(name)
        return Settings.__dataclass_fields__[name].default if value is None else value

    return BackendSettings(model_path=model, layer_ids=[], max_seq_len=int(setting("max_seq_len")),
                           tp_size=int(setting("tp_size")),
                           gpu_memory_utilization=float(setting("gpu_memory_utilization")),
                           trust_remote_code=bool(setting("trust_remote_code")))


def open_engine(settings):
    """A ``vllm.LLM`` as the engine backends build it, its prefix cache on (a row's probes share its
    blocks) and eager (no compile: the pass is a few forwards per row)."""
    import importlib.util

    from .backends.engine_base import new_llm

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--engine: needs vLLM installed here (pip install vllm); verify without it checks the "
                         "certified rows only")
    return new_llm(settings, enforce_eager=True, prefix_caching=True)[0]


def certify_rows(files: dict[int, Path], name: str, certifier: Certifier, engine) -> EnginePass:
    """Each of ``files`` (format ``name``) certified against ``engine``'s logprobs (a ``vllm.LLM``, or
    what answers its ``generate`` so), in passes of :data:`ROWS_PER_PASS`; the certificate written into
    each row that holds."""
    found = EnginePass()
    indexes = sorted(files)
    for start in range(0, len(indexes), ROWS_PER_PASS):
        _certify_pass({i: files[i] for i in indexes[start:start + ROWS_PER_PASS]}, name, certifier, engine, found)
    found.worst = certifier.worst
    return found


def _certify_pass(files: dict[int, Path], name: str, certifier: Certifier, engine, found: EnginePass) -> None:
    tensors = {index: file_tensors(name, path) for index, path in files.items()}
    ids = {index: row_ids(held) for index, held in tensors.items()}
    layers = {index: row_of(name, held, dequantized=False)[0] for index, held in tensors.items()}
    for index in list(tensors):
        unfit = _unfit(ids[index], layers[index])
        if unfit:
            found.failing[index] = f"{files[index].name}: {unfit}: cannot be certified"
            del tensors[index]
    witnesses = witness_rows(engine, [ids[index] for index in tensors])
    results = certifier.certify_all([(files[index].name, layers[index], witness)
                                     for index, witness in zip(tensors, witnesses, strict=True)])
    for (index, held), witness, result in zip(tensors.items(), witnesses, results, strict=True):
        found.positions += len(witness.positions)
        if isinstance(result, CertificateFailed):
            found.failing[index] = str(result).removesuffix("; not written")
        else:
            write_certificate(name, files[index], held, result)
            found.held.append(index)


def _unfit(ids: list[int], layers) -> str:
    """Why a row's ids and states cannot be certified together ("": they can)."""
    if not ids:
        return "no tokens"
    if len(layers[0]) != len(ids):
        return f"{len(ids)} token ids, {len(layers[0])} states"
    return ""


def row_ids(tensors: dict) -> list[int]:
    """A sample file's token ids (0.3's ``input_ids``, 0.5's ``token_ids``)."""
    held = tensors.get("input_ids", tensors.get("token_ids"))
    return [] if held is None else [int(token) for token in held.reshape(-1).tolist()]


def witness_rows(engine, rows: list[list[int]]) -> list[Witness]:
    """Each row's witness from ``engine``: its last position from a request for the whole row, then its
    probes (:func:`.certify.witness.probe_positions`), whose first blocks the prefix cache holds by then; every
    position counted as probed (its logprobs from another forward than its states')."""
    probes = [(row, position) for row, ids in enumerate(rows) for position in probe_positions(ids)]
    asked = [(row, len(ids) - 1) for row, ids in enumerate(rows)] + probes
    outputs = _generate(engine, rows) + _generate(engine, [rows[row][:position + 1] for row, position in probes])
    found: list[dict] = [{} for _ in rows]
    for (row, position), output in zip(asked, outputs, strict=True):
        if list(output.prompt_token_ids) != rows[row][:position + 1]:
            raise RuntimeError(f"vLLM's answer for row {row}'s position {position} holds other token ids")
        found[row][position] = first_token_logprobs(output, row)
    return [Witness(sorted(entries), [entries[p][0] for p in sorted(entries)], [entries[p][1] for p in sorted(entries)],
                    tuple(sorted(entries))) for entries in found]


def _generate(engine, prompts: list[list[int]]) -> list:
    from .backends.witnessed import params

    if not prompts:
        return []
    return list(engine.generate([{"prompt_token_ids": ids} for ids in prompts], params(), use_tqdm=False))
