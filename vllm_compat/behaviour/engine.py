"""vLLM's engine steps against the generator's: each step vLLM's engine core makes that the generator
does not, and whether an adapter bridges it, the consumer declares it harmless, or it is a PROBLEM.

A step of vLLM's is made by the generator when the generator makes the same step (same id), or
runs every worker method that step runs (the generator calls ``collective_rpc("get_kv_cache_spec")``
where the engine core calls ``executor.get_kv_cache_specs()``, which runs exactly that). What it
lacks is

* **bridged** by an adapter found ``adapted`` that declares the step (``Adapter.bridges_steps``):
  it performs the step for the generator, or makes it unnecessary;
* **not needed** when :data:`vllm_compat.consumer.ENGINE_STEPS_NOT_NEEDED` says why it is harmless;
* a **PROBLEM** otherwise.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass

from ..adapter import Adapter
from ..callsites.signatures import VllmIndex
from ..consumer import SPECULATORS_GENERATOR, Generator
from ..probes.static import Found
from .steps import ClassSteps, Step

# vLLM's own engine: the class whose methods start and step it, phase -> its entry methods
ENGINE_CORE = "vllm.v1.engine.core:EngineCore"
ENGINE_PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (("start", ("__init__",)), ("step", ("step", "post_step")))
BRIDGED, NOT_NEEDED, PROBLEM = "bridged", "not needed", "PROBLEM"


@dataclass(frozen=True)
class StepFinding:
    """A step vLLM's engine core makes that the generator does not.

    Attributes:
        step: its id, ``role.name``.
        phase: ``start`` or ``step``.
        where: the engine core's call, ``file:line``.
        after: the step vLLM makes just before it ('' for the first).
        guard: the conditions vLLM makes it under, as written ('' for always).
        status: ``bridged``, ``not needed`` or ``PROBLEM``.
        by: the bridging adapter, or why it is not needed.
    """

    step: str
    phase: str
    where: str
    after: str
    guard: str
    status: str
    by: str = ""


def engine_steps(index: VllmIndex) -> list[Step] | None:
    """The steps of vLLM's engine core, in order; None when this vLLM has no such class."""
    found = index.resolve(ENGINE_CORE)
    if not isinstance(found, Found) or not isinstance(found.node, ast.ClassDef):
        return None
    tree = index.module(found.module)
    return ClassSteps(index, tree.node, found.node, found.module, found.file).steps(ENGINE_PHASES)


def generator_steps(index: VllmIndex, text: str, label: str,
                    generator: Generator = SPECULATORS_GENERATOR) -> list[Step] | None:
    """The steps of the ``generator`` (speculators' by default) whose module source is ``text``; None
    without its class."""
    try:
        tree = ast.parse(text, filename=label)
    except SyntaxError:
        return None
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == generator.klass), None)
    if klass is None:
        return None
    return ClassSteps(index, tree, klass, generator.module, label).steps(generator.phases)


def compare(engine: list[Step], generator: list[Step], adapted: list[Adapter],
            not_needed: Mapping[str, str] = SPECULATORS_GENERATOR.not_needed) -> list[StepFinding]:
    """Each step ``engine`` makes that ``generator`` does not (first call of each), in vLLM's order;
    ``not_needed``: the steps the generator does without, with why (speculators' by default)."""
    made = {s.id for s in generator}
    worker_methods = frozenset().union(*(s.rpcs for s in generator))
    findings, seen = [], set()
    for i, step in enumerate(engine):
        if step.id in made or step.id in seen or (step.rpcs and step.rpcs <= worker_methods):
            continue
        seen.add(step.id)
        before = [s.id for s in engine[:i] if s.phase == step.phase]
        by = next((a.id for a in adapted if step.id in a.bridges_steps), "")
        if by:
            status = BRIDGED
        elif step.id in not_needed:
            status, by = NOT_NEEDED, not_needed[step.id]
        else:
            status = PROBLEM
        findings.append(StepFinding(step.id, step.phase, step.where, before[-1] if before else "", step.guard,
                                    status, by))
    return findings
