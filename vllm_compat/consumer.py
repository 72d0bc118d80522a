"""The consumer facts, in one place: which speculators releases the shim adapts, what code of theirs
it patches, and where they touch vLLM in ways no static reader of their source can follow.

Everyone reads these from here: the adapters (their ``speculators=`` ranges and targets), the audit,
the contract and end-to-end tests, and the scripts (``scripts/test_matrix.py``, ``vllm_venv.py``,
``compatibility.py``, which import this module with the repository on ``sys.path``: importing it
imports neither vLLM nor torch, only :mod:`vllm_compat.probes.shapes`).

Two kinds of speculators release meet vLLM differently:

* *generators* (0.3.x, 0.4.x) drive vLLM's internals in-process
  (``VllmHiddenStatesGenerator``): the adapters keep them working, the audit checks them;
* 0.5 and later drive ``vllm serve`` with vLLM's own ``extract_hidden_states`` method and need no
  shim (the extractor's ``--backend vllm-native`` is that path). Those that train on the
  extractor's output are consumers of its file format, not of this shim: their releases belong
  beside ``GENERATOR_RELEASES`` under their own name, never in the generator ranges below.
"""
from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .errors import VllmCompatError
from .probes.shapes import PRESENT, Attr, Check


def canonicalize_name(name: str) -> str:
    """A distribution's name as pip compares them (packaging's rule, imported when first needed: importing
    the shim imports no packaging)."""
    from packaging.utils import canonicalize_name as canonical

    return canonical(name)


# -- the generator releases ---------------------------------------------------------------------
# The releases the contract and end-to-end suites run (one speculators install each, see
# scripts/vllm_venv.py), oldest first.
GENERATOR_RELEASES = ("0.3.0", "0.4.0")
# speculators releases that drive vLLM internals in-process, and the two lines among them
IN_PROCESS_SPECULATORS = ">=0.3.0,<0.5"
SPECULATORS_03 = ">=0.3.0,<0.4"
SPECULATORS_04 = ">=0.4.0,<0.5"
# speculators releases that drive `vllm serve` instead: nothing in-process for the shim to check
SERVING_SPECULATORS = ">=0.5"

# -- the trainers that read the extractor's output ---------------------------------------------------
# Not generators: they read the files hidden_states writes (hidden_states.output.formats). speculators 0.5
# added the Arrow + hidden_states/hs_{i}.safetensors layout and 0.8 removed the reader of the old one.
# Per layout: the releases that train on it, and the release whose own trainer the e2e suite runs on
# it (tests/e2e/test_formats.py).
TRAINER_LAYOUTS = {"speculators-0.3": IN_PROCESS_SPECULATORS, "speculators-0.5": SERVING_SPECULATORS}
TRAINER_PROOF_RELEASES = {"speculators-0.3": "0.3.0", "speculators-0.5": "0.9.0"}

# -- the generator's code the adapters patch ------------------------------------------------------
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_EXTENSION = "speculators.data_generation.custom_worker:HiddenStatesWorkerExtension"


def generator_name(name: str) -> str:
    """A module-level name inside the generator module, e.g. the ``Scheduler`` it imported."""
    return f"{GENERATOR}:{name}"


# -- touch points the call-site audit cannot derive -----------------------------------------------
# Everything the generator's code imports, constructs, calls or reads on a vLLM object of known
# class is derived from its source by vllm_compat.callsites. What stays here is reached in ways no
# static reader of that source can follow; each entry says why.
# Each entry: (check, expected observation, speculators releases that touch it).
TOUCHPOINTS: tuple[tuple[Check, frozenset[str], str], ...] = tuple(
    (check, frozenset(expected), consumers)
    for check, expected, consumers in [
        # collective_rpc("get_kv_cache_spec") names a worker method by a string: the generator never
        # calls it as an attribute, and the worker class is chosen by vLLM at run time.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "get_kv_cache_spec"), {PRESENT}, IN_PROCESS_SPECULATORS),
        # The worker extension is mixed into vLLM's Worker by ParallelConfig(worker_extension_cls=...),
        # so its `self` is a Worker that the extension's own source never names; collective_rpc then
        # runs the extension's methods beside the Worker's execute_model.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "execute_model"), {PRESENT}, IN_PROCESS_SPECULATORS),
        # _patched_forward is bound onto whatever base model vLLM loaded (types.MethodType), so its
        # `self.embed_input_ids(...)` names no class; vLLM's Llama stands for the decoder models.
        # (0.3.0 calls get_input_embeddings: the embed_input_ids_alias adapter's own check.)
        (Attr("vllm.model_executor.models.llama:LlamaModel", "embed_input_ids"), {PRESENT}, SPECULATORS_04),
    ]
)


# -- touch points a consumer declares ---------------------------------------------------------------
# A consumer that reaches vLLM in ways the call-site audit cannot type (through an engine, a wrapped
# method, strings vLLM resolves, dicts of configuration) declares what it touches, as OpenTelemetry
# instrumentors declare theirs: an entry point in the group below whose value is a Touchpoints (or a
# zero-argument callable returning one). The entry point's name is its scope as the audit prints it;
# the bundled extractor declares its two backends there (pyproject.toml). The audit finds every
# declarer through importlib.metadata (:func:`declared`), never by a module name, and checks their
# touch points with the same rule as TOUCHPOINTS. Instance attributes set in __init__
# (Worker.model_runner, LLM.llm_engine) are in no class body: the end-to-end runs prove those.
TOUCHPOINTS_GROUP = "vllm_compat.touchpoints"


class Touchpoints(NamedTuple):
    """What one declared component (an extractor backend, a plugin) relies on in vLLM and in the shim.

    Attributes:
        first: the first vLLM release the component runs on (the audit checks it from there).
        checks: (check, expected observations) for each touch point.
        requires: adapters the component cannot run without (its start refuses when one is disabled),
            as an adapter's own ``requires``.
    """

    first: str
    checks: tuple[tuple[Check, frozenset[str]], ...]
    requires: tuple[str, ...] = ()


BackendTouchpoints = Touchpoints  # the name the extractor's backends declare theirs with


class DeclarationError(VllmCompatError):
    """An installed declarer whose entry point does not load to a Touchpoints: a broken install,
    which the audit names (exit 2) rather than checking nothing."""


def declared(distribution: str | None = None) -> dict[str, Touchpoints]:
    """Every installed declarer's touch points, by entry-point name ({} where none is installed);
    only ``distribution``'s with a name. Loading them imports the declaring modules, which import
    neither vLLM nor torch.

    Raises:
        DeclarationError: an entry point that does not load, or loads to something else; the
            message names it.
    """
    found: dict[str, Touchpoints] = {}
    for dist, point in _declarations():
        if distribution is not None and canonicalize_name(dist) != canonicalize_name(distribution):
            continue
        where = f"entry point {point.name!r} ({TOUCHPOINTS_GROUP} = {point.value}, from {dist or 'unknown'})"
        if point.name in found:
            raise DeclarationError(f"{where}: declared twice")
        try:
            value = point.load()
            if callable(value) and not isinstance(value, Touchpoints):
                value = value()
        except Exception as exc:  # noqa: BLE001 - any failure is a broken declarer, named below
            raise DeclarationError(f"{where} does not load: {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, Touchpoints):
            raise DeclarationError(f"{where} is a {type(value).__name__}, not vllm_compat Touchpoints")
        found[point.name] = value
    return found


def _declarations() -> list[tuple[str, importlib.metadata.EntryPoint]]:
    """(distribution name, entry point) of the group. Where this shim runs from a source checkout
    (editable, or on PYTHONPATH), its pyproject.toml's entries stand for its own: an installed
    dist-info keeps the entry points of the install, however the checkout changed since."""
    checkout = checkout_entry_points().get(TOUCHPOINTS_GROUP)
    points = []
    for point in importlib.metadata.entry_points(group=TOUCHPOINTS_GROUP):
        dist = point.dist.name if point.dist is not None else ""
        if checkout is not None and canonicalize_name(dist) == SELF:
            continue
        points.append((dist, point))
    for name, value in (checkout or {}).items():
        points.append((SELF, importlib.metadata.EntryPoint(name, value, TOUCHPOINTS_GROUP)))
    return points


SELF = "vllm-compat"


def checkout_entry_points(pyproject: Path | None = None) -> dict[str, dict[str, str]]:
    """{group: {name: value}} of a checkout's ``[project.entry-points]`` and ``[project.scripts]``
    (as ``console_scripts``), by default the checkout this package runs from; {} when it runs from an
    installed wheel."""
    path = pyproject or Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not path.is_file():
        return {}
    project = _toml(path.read_text()).get("project", {})
    if canonicalize_name(project.get("name", "")) != SELF and pyproject is None:
        return {}
    groups = {group: dict(points) for group, points in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        groups["console_scripts"] = dict(project["scripts"])
    return groups


def installed_entry_points(text: str) -> dict[str, dict[str, str]]:
    """{group: {name: value}} of a dist-info's ``entry_points.txt``."""
    groups: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1].strip(), {})
        elif current is not None and "=" in line:
            name, value = line.split("=", 1)
            current[name.strip()] = value.strip()
    return groups


def _toml(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the two tables of ``key = "value"`` lines read here
        return _small_toml(text)
    return tomllib.loads(text)


def _small_toml(text: str) -> dict:
    project: dict = {}
    table = None
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        header = re.fullmatch(r"\[(.+)\]", line)
        if header:
            parts = re.findall(r'"([^"]+)"|([^."]+)', header.group(1))
            path = [quoted or bare.strip() for quoted, bare in parts]
            table = None
            if path[:1] == ["project"]:
                table = project
                for key in path[1:]:
                    table = table.setdefault(key, {})
            continue
        pair = re.fullmatch(r'"?([^"=]+?)"?\s*=\s*"([^"]*)"', line)
        if table is not None and pair:
            table[pair.group(1).strip()] = pair.group(2)
    return {"project": project}


def source_declarations(tree, names) -> dict[str, str]:
    """A consumer read from source (a wheel, a directory), not installed: the entry points of its
    ``*.dist-info/entry_points.txt`` in this group, {name: value}. They are known, not loaded (its
    modules are never imported): the audit says "declared, read from source only"."""
    found: dict[str, str] = {}
    candidates = [n for n in names if n.endswith(".dist-info/entry_points.txt") and n.count("/") == 1]
    root = getattr(tree, "root", None)
    if root is not None and not candidates:
        candidates = [p.relative_to(root).as_posix() for p in sorted(Path(root).glob("*.dist-info/entry_points.txt"))]
    for name in sorted(candidates):
        text = tree.read(name)
        if text is not None:
            found.update(installed_entry_points(text).get(TOUCHPOINTS_GROUP, {}))
    return found


def declaration_note(label: str, tree, names) -> str | None:
    """One line for a consumer read from source that declares touch points, else None."""
    points = source_declarations(tree, names)
    if not points:
        return None
    return (f"{label}: touch points declared ({TOUCHPOINTS_GROUP}: {', '.join(sorted(points))}), "
            f"read from source only (not installed: its declaration is not loaded or checked)")


# -- the engine the generator builds by hand ------------------------------------------------------
# VllmHiddenStatesGenerator re-implements vLLM's engine start (its __init__) and step (generate).
# The audit reads the engine steps it makes there and compares them with those vLLM's own engine
# core makes (vllm_compat.behaviour): phase -> the generator's methods that make it.
GENERATOR_CLASS = "VllmHiddenStatesGenerator"
GENERATOR_PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (("start", ("__init__",)), ("step", ("generate",)))

# Steps vLLM's engine core makes that the generator does without, and why that is harmless. A step
# of vLLM's that the generator lacks, that no adapted adapter bridges (Adapter.bridges_steps) and
# that is not here, is an audit PROBLEM. Ids are `role.name` (docs/audit.md, "Behaviour drift:
# engine steps and config fields").
_NO_CONNECTOR = "only with a KV or encoder-cache connector, which the generator never configures"
_PREFIX_CACHING = ("block hashes serve prefix caching and connectors: the generator configures no connector and "
                   "builds its config with prefix caching off (speculators 0.4 passes enable_prefix_caching=False; "
                   "prefix_caching_default turns the default off for 0.3)")
_SPEC_DECODE = "only with speculative decoding, which the generator never configures"
ENGINE_STEPS_NOT_NEEDED: dict[str, str] = {
    # starting
    "executor.register_failure_callback": "vLLM's engine client passes one to hear of a dead executor; the generator "
                                          "calls the executor itself and sees its errors raise",
    "executor.determine_available_memory": "the generator sizes its KV cache itself, from the free device memory "
                                           "(gpu_memory_utilization x its CACHE_MEMORY_FRACTION)",
    "kv_cache.get_global_kv_cache_groups": "the generator groups the layers itself (_get_kv_cache_groups_uniform_spec "
                                           "over the first worker's specs)",
    "kv_cache.get_kv_cache_configs": "the generator plans one KV-cache config itself with get_kv_cache_config_from_groups "
                                     "and gives it to every worker",
    "kv_cache.generate_scheduler_kv_cache_config": "the generator's scheduler gets the same single config as its workers",
    "kv_cache.get_kv_cache_capacity": "capacity for the engine's log and its client's report only",
    "kv_cache.update_kv_cache_capacity": "records the capacity on the config for the engine's log and its client's "
                                         "report only",
    "kv_cache.resolve_cache_hit_alignment_tokens": "prefix-cache hit alignment: " + _PREFIX_CACHING,
    "rpc.initialize_cache": "tells the workers the block count, which on those releases only the FlexAttention backend "
                            "reads (vllm/v1/attention/backends/flex_attention.py:717 in 0.17.0), CUDA's last resort "
                            "after FlashAttention, FlashInfer and Triton; the generator's workers get the count in "
                            "their KV-cache config (initialize_from_config)",
    "rpc.update_max_model_len": "only when vLLM's own KV-cache planning shrank max_model_len to fit (auto-fit); the "
                                "generator's planning keeps the max_model_len it asked for",
    "executor.init_kv_output_aggregator": _NO_CONNECTOR,
    "executor.init_ec_output_aggregator": _NO_CONNECTOR,
    "scheduler.get_kv_connector": _NO_CONNECTOR,
    "executor.get_kv_connector_handshake_metadata": _NO_CONNECTOR,
    "executor.get_simple_cpu_offload_num_blocks": _NO_CONNECTOR,
    "kv_cache.init_none_hash": _PREFIX_CACHING,
    "kv_cache.get_request_block_hasher": _PREFIX_CACHING,
    # stepping
    "scheduler.has_requests": "the generator's loop ends on its own count of prefilled tokens and on a schedule() "
                              "with nothing to run",
    "scheduler.get_grammar_bitmask": "structured output only: the generator's requests carry no grammar",
    "scheduler.make_stats": "statistics for the engine's log and metrics only",
    "scheduler.update_from_output": "prefill only: the generator discards the sampled token, counts computed tokens "
                                    "itself and aborts its requests (finish_requests) instead of feeding outputs back",
    "executor.take_draft_token_ids": _SPEC_DECODE,
    "scheduler.update_draft_token_ids": _SPEC_DECODE,
}


# -- how the audit reads a consumer ---------------------------------------------------------------
@dataclass(frozen=True)
class Scan:
    """Which of a consumer's files hold its call sites into vLLM, and the rules they are judged by.

    Attributes:
        under: the package whose modules are read, dotted ('': every top-level package and module).
        depth: how deep below ``under`` modules are read (1: its own modules); None: any depth.
        contracts: check the classes it derives from vLLM's against what vLLM calls on them
            (:mod:`vllm_compat.callsites.contracts`).
        typing_warnings: a break in an import only type checkers run (``if TYPE_CHECKING:``) is a
            warning, not a problem.
    """

    under: str = ""
    depth: int | None = None
    contracts: bool = True
    typing_warnings: bool = True

    def reads(self, relpath: str, packages: tuple[str, ...]) -> bool:
        """Whether the ``.py`` file ``relpath`` (posix, from the consumer's root) is read."""
        if not relpath.endswith(".py"):
            return False
        if not self.under:
            return relpath.split("/", 1)[0] in packages or relpath in packages
        folder = self.under.replace(".", "/") + "/"
        rest = relpath.removeprefix(folder)
        return rest != relpath and (self.depth is None or rest.count("/") < self.depth)


@dataclass(frozen=True)
class Generator:
    """A consumer's capability: it builds vLLM's engine by hand, so the audit compares the engine
    steps it makes with those of vLLM's engine core, and lists the config fields added to the
    configs it builds (:mod:`vllm_compat.behaviour`).

    Attributes:
        module: the module holding the class, dotted.
        klass: the class that starts and steps the engine.
        phases: phase -> the class's methods that make it.
        not_needed: engine steps it does without, with why that is harmless.
    """

    module: str
    klass: str
    phases: tuple[tuple[str, tuple[str, ...]], ...]
    not_needed: Mapping[str, str]

    @property
    def file(self) -> str:
        return f"{self.module.replace('.', '/')}.py"


@dataclass(frozen=True)
class BuiltIn:
    """A consumer the audit knows by name: the facts it cannot read from the consumer's source.

    Attributes:
        package: its distribution and top-level package.
        releases: the releases the audit covers.
        refusals: (releases, why) for a release outside ``releases``, first match wins ('': any
            release); ``why`` is formatted with ``version`` and ``releases``.
        scan: which of its files are its call sites.
        touchpoints: (check, expected observation, its releases that touch it): what it reaches in
            vLLM that no static reader of its source can follow.
        generator: its hand-built engine, when it has one.
        shim: its users run ``vllm_compat.apply()``: adapted adapters bridge its breaks.
        gates_adapters: an adapter's ``speculators`` range says for which of its releases the adapter
            is used (an adapter outside it is n/a).
    """

    package: str
    releases: str
    refusals: tuple[tuple[str, str], ...]
    scan: Scan
    touchpoints: tuple[tuple[Check, frozenset[str], str], ...] = ()
    generator: Generator | None = None
    shim: bool = True
    gates_adapters: bool = False


SPECULATORS_GENERATOR = Generator(GENERATOR, GENERATOR_CLASS, GENERATOR_PHASES, ENGINE_STEPS_NOT_NEEDED)
# speculators' in-process generator releases: the adapters keep them working, and their users run
# apply(). Only data_generation's own modules drive vLLM (the rest of the package trains models).
SPECULATORS_AUDIT = BuiltIn(
    package="speculators",
    releases=IN_PROCESS_SPECULATORS,
    refusals=(
        (SERVING_SPECULATORS, "speculators {version} has no in-process generator for vllm-compat to check: it "
                              "drives `vllm serve` with vLLM's own extract_hidden_states method (no shim needed; "
                              "the extractor's --backend vllm-native is that path). The audit covers speculators "
                              "{releases}"),
        ("", "speculators {version} predates the hidden-states generator vllm-compat keeps working; the audit "
             "covers speculators {releases}"),
    ),
    scan=Scan(under="speculators.data_generation", depth=1, contracts=False, typing_warnings=False),
    touchpoints=TOUCHPOINTS,
    generator=SPECULATORS_GENERATOR,
    gates_adapters=True,
)
# the consumers the audit knows by name; the first is audited when no consumer is named
BUILTIN_CONSUMERS: dict[str, BuiltIn] = {SPECULATORS_AUDIT.package: SPECULATORS_AUDIT}
