"""The layers of vllm_compat and of hidden_states, lowest first: what ``test_layers.py`` checks the
imports against and ``test_architecture_doc.py`` checks docs/architecture.md's two tables against.

A module's layer is found by its first name under its package (a subpackage counts as one name); it
may import from its own layer and the layers before it.
"""
from __future__ import annotations


def _layers(rows) -> tuple[tuple[str, frozenset[str]], ...]:
    return tuple((name, frozenset(parts)) for name, parts in rows)


LAYERS = _layers([
    ("foundation", {"errors", "report", "versions", "wheels", "environment"}),
    ("wrapping", {"wrapping"}),
    ("probes", {"probes"}),
    ("declarations", {"consumer", "consumer_tree", "adapter", "factories"}),
    ("runtime helpers", {"host", "transport", "batch_order", "_transformers_source", "process_exit"}),
    ("adapters", {"adapters"}),
    ("registry and audit", {"registry", "callsites", "behaviour", "hashes", "audit"}),
    ("public API", {"__init__", "__main__", "cli", "plugin", "extractor_api"}),
])

EXTRACTOR_LAYERS = _layers([
    # what a run is asked to do
    ("settings", {"__init__", "errors", "settings", "presets", "shards", "config_file", "model_ids"}),
    # one job each, knowing nothing of inputs, outputs or plans
    ("support", {"extras", "sizes", "files", "layer_conventions", "fp8_states", "forward_check", "log_levels",
                 "run_log", "progress", "processes", "stage_exits", "interrupts"}),
    # a row's certificate: the checkpoint's last step read alone, the engine's witness, the bound
    ("certificates", {"certify"}),
    # the input's rows to samples, and what they were made from
    ("inputs", {"inputs"}),
    # ways to run the model: below the output, so no format or output directory reaches a backend
    ("backends", {"backends"}),
    # the output directory, its writer and the formats
    ("output", {"output"}),
    # the checks and estimates before the model loads, the run plan, and the samples still to do
    ("plan", {"plan"}),
    # one run's parts every command composes: its plan and output prepared, its lifecycle, the model
    # here or on Ray replicas
    ("the run", {"run", "replicas"}),
    # one wing per command: extract's and generate's runs and loops; the one-module commands
    ("commands", {"extract", "generate", "convert", "status", "prepare", "verify", "verify_engine"}),
    # what a user calls: the command line, and serve's wing (its server, protocol, model, batching, files)
    ("entry points", {"cli", "__main__", "serve", "train"}),
    ("fixtures", {"fixtures"}),
])
# The one upward import the map allows: `hidden-states demo` runs the demo fixture (imported lazily).
EXTRACTOR_ALLOWED = frozenset({("hidden_states.cli.tools", "hidden_states.fixtures.demo")})
