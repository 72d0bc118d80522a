"""Behaviour drift, read from vLLM's source: what vLLM's own engine does that the generator does not.

Two readings, both with ``ast`` (nothing imported), both derived from the audited release's files
and the consumer's:

* **engine steps** (:mod:`.steps`, :mod:`.engine`): the executor, scheduler, worker and KV-cache
  planning calls vLLM's engine core makes when it starts and when it steps, against those the
  speculators generator makes in its hand-built start (``__init__``) and step (``generate``). A step
  the generator lacks is bridged (an adapted adapter declares it), not needed (the consumer says
  why, :data:`vllm_compat.consumer.ENGINE_STEPS_NOT_NEEDED`) or a PROBLEM.
* **config fields** (:mod:`.fields`): fields with a default added since the newest verified release
  to the configs the generator builds, listed for review (a warning: a default is not a break).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from packaging.version import Version

from ..adapter import Adapter
from ..callsites import adapted_index
from ..callsites.signatures import VllmIndex
from ..consumer import SPECULATORS_GENERATOR, Generator
from ..consumer_tree import Consumer
from ..probes.static import StaticSource
from ..versions import base
from . import config_baseline
from .engine import BRIDGED, NOT_NEEDED, PROBLEM, StepFinding, compare, engine_steps, generator_steps
from .fields import FieldFinding, added_fields, constructed_configs
from .names import ModuleNames

GENERATOR_FILE = SPECULATORS_GENERATOR.file  # where speculators' generator is, in its package


@dataclass(frozen=True)
class Behaviour:
    """What the behaviour-drift readings found.

    Attributes:
        steps: each engine step vLLM makes and the generator lacks.
        fields: config fields with a default added since ``baseline``.
        baseline: the release the config fields are compared with ('' when they were not compared).
        notes: what could not be read, each one line (the readings concerned are then empty).
    """

    steps: tuple[StepFinding, ...] = ()
    fields: tuple[FieldFinding, ...] = ()
    baseline: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def problems(self) -> list[StepFinding]:
        return [s for s in self.steps if s.status == PROBLEM]


def check(source: StaticSource, version: Version | None, adapted: list[Adapter], consumer: Consumer) -> Behaviour:
    """Engine steps and config fields of the vLLM ``source`` (release ``version``, None if unknown)
    against the generator of ``consumer`` (a consumer with one), read from its tree (its code may not
    have been found). ``adapted``: the adapters the audit found adapted."""
    generator = consumer.generator
    text = consumer.tree.read(generator.file) if consumer.tree is not None else None
    if text is None:
        return Behaviour(notes=("consumer code not found: engine steps and config fields not read",))
    index = adapted_index(source, adapted)
    notes = []
    engine = engine_steps(index)
    made = generator_steps(index, text, generator.file, generator)
    if engine is None:
        notes.append("vLLM's engine core (vllm.v1.engine.core:EngineCore) not found: engine steps not compared")
    if made is None:
        notes.append(f"{generator.file}: the generator class not found: engine steps not compared")
    steps = compare(engine, made, adapted, generator.not_needed) if engine is not None and made is not None else []
    fields, baseline = _fields(index, version, text, generator, notes)
    return Behaviour(tuple(steps), tuple(fields), baseline, tuple(notes))


def _fields(index: VllmIndex, version: Version | None, text: str, generator: Generator,
            notes: list[str]) -> tuple[list[FieldFinding], str]:
    """The config fields to review, and the baseline release they were compared with ('' if none)."""
    release = config_baseline.RELEASE
    if not release or not config_baseline.FIELDS:
        notes.append("no config baseline (scripts/config_baseline.py writes it): config fields not compared")
        return [], ""
    if version is None:
        notes.append("vLLM version unknown: config fields not compared")
        return [], release
    if base(version) <= Version(release):
        notes.append(f"vllm {version} is not newer than the config baseline ({release}): no config field to review")
        return [], ""
    tree = ast.parse(text)
    configs = constructed_configs(ModuleNames(index, tree, generator.module.rpartition(".")[0]), tree)
    found, uncovered = added_fields(index, configs, config_baseline.FIELDS)
    if uncovered:
        notes.append(f"no baseline for {', '.join(uncovered)} (scripts/config_baseline.py writes it)")
    return found, release


__all__ = ["BRIDGED", "NOT_NEEDED", "PROBLEM", "Behaviour", "FieldFinding", "StepFinding", "check"]
