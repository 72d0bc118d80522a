"""``hidden-states verify OUT``: every row's certificate checked again, offline, from the checkpoint's final
norm and LM head alone (no vLLM, no model load, the CPU): the written last-layer state against the
engine's logprobs the certificate keeps, and every written layer against its sketch. Prints a line per
layer and one per failing row; exits 1 naming exactly the rows that fail (or when no row is certified).
With ``--engine``, the rows written without a certificate are certified on a vLLM engine first
(``verify_engine``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from . import layer_conventions
from .certify.certificate import agreement, roundings, sketch_mismatch
from .certify.certifier import Certifier
from .certify.head import FinalHead, Uncertifiable, model_config
from .errors import UsageError
from .files import read_json
from .output import formats
from .output.names import CONFIG, format_name
from .output.sample_rows import read_row
from .verify_engine import certify_rows, engine_settings


@dataclass
class Findings:
    """What ``verify`` found, row by row."""

    rows: int = 0
    certified: int = 0
    positions: int = 0
    worst: float = 0.0
    failing: dict[int, list[str]] = field(default_factory=dict)  # row -> what fails in it
    layer_mismatch: dict[int, list[int]] = field(default_factory=dict)  # written layer index -> rows
    uncertified: list[int] = field(default_factory=list)


def verify(directory: str | Path, log, model_path: str | None = None, engine=None) -> int:
    """Check every row of the extraction in ``directory``; 0 when every row is certified and holds, else 1.
    ``engine``: opens a vLLM engine on ``BackendSettings`` (``verify_engine.open_engine``), which
    certifies the rows written without a certificate (None: they are counted, not certified)."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise UsageError(f"{directory}: no {CONFIG}: not an extraction")
    config = read_json(directory / CONFIG, UsageError)
    name = format_name(config)
    model = model_path or config.get("model")
    if not model:
        raise UsageError(f"{directory / CONFIG}: names no model: pass --model-path")
    try:
        num_layers = int(model_config(Path(model))["num_hidden_layers"])
        head = FinalHead.load(model)
    except (Uncertifiable, KeyError, ValueError) as exc:
        raise UsageError(f"--model-path {model}: {exc}") from None
    written = layer_conventions.to_extractor(name, config["layer_ids"], num_layers)
    if num_layers - 1 not in written:
        raise UsageError(f"{directory}: the last decoder layer ({num_layers - 1}) is not among the written layers "
                         f"{written}: no row of it can be certified")
    last = written.index(num_layers - 1)
    files = formats.sample_files(name, directory)
    log(f"verify {directory}: {len(files)} rows ({name}, layers {config['layer_ids']}), the final norm and LM head "
        f"of {model}")
    found = Findings()
    for index in sorted(files):
        found.rows += 1
        _check_row(index, files[index], name, head, written, last, found)
    if engine is not None and found.uncertified:
        _certify_on_engine(found, {i: files[i] for i in found.uncertified}, name, Certifier(head, last),
                           lambda: engine(engine_settings(config, model)), log)
    return _report(found, written, last, log)


def _certify_on_engine(found: Findings, files: dict[int, Path], name: str, certifier, open_engine, log) -> None:
    """The rows of ``files`` (none carries a certificate) certified on the engine ``open_engine`` starts,
    counted among ``found``'s certified rows."""
    from .backends.engine_base import shut_down

    started = time.monotonic()
    log(f"  {len(files)} rows carry no certificate: the engine certifies them (vLLM on the checkpoint, its logprobs "
        f"at each row's last position and one inside it)")
    llm = open_engine()
    try:
        held = certify_rows(files, name, certifier, llm)
    finally:
        shut_down(llm)
    log(f"  the engine: {len(held.held)} of {len(files)} rows hold, their certificates written into their files "
        f"({time.monotonic() - started:.0f} s with the engine's start)")
    found.certified += len(files)
    found.positions += held.positions
    found.worst = max(found.worst, held.worst)
    found.failing.update({index: [problem] for index, problem in held.failing.items()})
    found.uncertified = []


def _check_row(index: int, path: Path, name: str, head, written: list[int], last: int, found: Findings) -> None:
    try:
        layers, scales, certificate = read_row(name, path)
    except Exception as exc:  # noqa: BLE001 - a file cut short or not a sample's: that row fails
        found.failing[index] = [f"{path.name}: unreadable ({type(exc).__name__}: {exc})"]
        return
    if certificate is None:
        found.uncertified.append(index)
        return
    found.certified += 1
    positions = certificate.positions
    if len(positions) and int(positions.max()) >= len(layers[0]):
        found.failing[index] = [f"{path.name}: certified position {int(positions.max())} past its {len(layers[0])} rows"]
        return
    rows = [layer[positions] for layer in layers]
    problems = []
    for layer in sketch_mismatch(rows, certificate):
        found.layer_mismatch.setdefault(layer, []).append(index)
        problems.append(f"{layer_name(written, layer)}: not the states its certificate was made with")
    unit, engine, floor = roundings(layers[0].dtype, scales.reshape(-1)[positions] if scales is not None else None)
    agreed = agreement(head, rows[last], certificate.token_ids, certificate.logprobs, state_unit=unit,
                       engine_unit=engine, state_floor=floor, slack=certificate.slack)
    found.positions += len(positions)
    found.worst = max(found.worst, agreed.worst)
    for i in agreed.failing:
        problems.append(f"position {int(positions[i])}: |our logprob - the engine's| {float(agreed.error[i]):.3g} > "
                        f"{float(agreed.bound[i]):.3g} ({float(agreed.error[i] / agreed.bound[i]):.0f}x)")
    if problems:
        found.failing[index] = [f"{path.name}: {problem}" for problem in problems]


def layer_name(written: list[int], index: int) -> str:
    """The written layer at ``index`` as the lines name it: by its id, and by where it is written
    when the id is written twice (``--layer-ids 2,3,3,5``: two lines would say "layer 3")."""
    layer = written[index]
    return f"layer {layer}" + (f" (written {index})" if written.count(layer) > 1 else "")


def _report(found: Findings, written: list[int], last: int, log) -> int:
    checked = found.certified
    for i in range(len(written)):
        differs = found.layer_mismatch.get(i, [])
        line = f"  {layer_name(written, i)}: {checked - len(differs)} of {checked} certified rows hold the states certified"
        if differs:
            line += f"; differs in rows {', '.join(map(str, differs[:20]))}{' ...' if len(differs) > 20 else ''}"
        if i == last:
            line += (f"; the engine's logprobs at {found.positions} positions, the largest disagreement "
                     f"{found.worst:.2f} of what rounding explains")
        log(line)
    for index, problems in sorted(found.failing.items()):
        for problem in problems:
            log(f"  row {index}: {problem}")
    if found.uncertified:
        log(f"  {len(found.uncertified)} rows carry no certificate (written with --no-certificates, or by a backend "
            f"that does not certify): {', '.join(map(str, found.uncertified[:20]))}"
            f"{' ...' if len(found.uncertified) > 20 else ''}")
    if found.failing:
        log(f"verify: {len(found.failing)} of {found.rows} rows fail: {', '.join(map(str, sorted(found.failing)))}")
        return 1
    if not checked:
        log(f"verify: none of the {found.rows} rows carries a certificate: nothing is proven")
        return 1
    log(f"verify: ok: {checked} certified rows hold the engine's states"
        + (f" ({len(found.uncertified)} rows uncertified)" if found.uncertified else ""))
    return 0
