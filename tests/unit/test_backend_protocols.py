"""Every backend meets the interfaces the runs call it through (``backends.Backend``, and for
``hidden-states generate`` ``backends.Replying``): its own members written, the optional ones
inherited with their declared defaults, so that no caller probes a backend with ``getattr``."""
from __future__ import annotations

import ast
import inspect
from concurrent.futures import Future
from pathlib import Path

import pytest

from hidden_states import backends
from hidden_states.backends.engine_base import EngineBackend
from hidden_states.backends.speculators_generator import SpeculatorsBackend
from hidden_states.backends.vllm_engine import VllmEngineBackend
from hidden_states.backends.vllm_native import VllmNativeBackend
from tests.unit.fakes import FakeBackend, FakeGenerating

SETTINGS = backends.BackendSettings("m", [0, 2], 8, 1, 0.1)
ROOT = Path(__file__).resolve().parents[2]


def declared_members(protocol) -> set[str]:
    """The members ``protocol`` declares: its annotated attributes and its methods and properties."""
    written = {name for name, value in vars(protocol).items() if callable(value) or isinstance(value, property)}
    return set(protocol.__annotations__) | {name for name in written if not name.startswith("_")}


def unmet(backend, protocol) -> list[str]:
    """The members of ``protocol`` that ``backend`` (an instance: an abstract one left unwritten
    keeps its class from making any) lacks."""
    return sorted(name for name in declared_members(protocol) if not hasattr(backend, name))


def every_backend():
    """An instance of each backend class the extractor creates, and the unit tests' stand-ins."""
    made = {name: backends.create(name, SETTINGS) for name in backends.BACKENDS}
    return {**made, "FakeBackend": FakeBackend(SETTINGS), "FakeGenerating": FakeGenerating(SETTINGS, tokenizer=None)}


def test_the_backends_named_are_the_classes_checked_here():
    assert {type(backend) for backend in every_backend().values()} == {
        SpeculatorsBackend, VllmNativeBackend, VllmEngineBackend, FakeBackend, FakeGenerating}


@pytest.mark.parametrize("name", sorted(every_backend()))
def test_every_backend_meets_the_backend_interface_with_its_defaults(name):
    backend = every_backend()[name]
    assert isinstance(backend, backends.Backend) and unmet(backend, backends.Backend) == []
    # the optional members: declared once, each backend without its own takes the default
    assert isinstance(backend.cached_tokens, int) and isinstance(backend.engine_alive(), bool)
    assert backend.closing_line is None or isinstance(backend.closing_line, str)


@pytest.mark.parametrize("name", ["vllm-engine", "FakeGenerating"])
def test_the_generating_backends_meet_the_reply_interface(name):
    backend = every_backend()[name]
    assert isinstance(backend, backends.Replying) and unmet(backend, backends.Replying) == []


class Planted(backends.OneBatchAtATime):
    """A backend with every member written but ``name`` (planted for the checks to find)."""

    def __init__(self, settings=None):
        self.settings = settings

    def start(self):
        return {}

    def extract(self, batch):
        return []

    def check_forward(self, probe):
        return []

    def close(self):
        pass


def test_a_backend_missing_a_member_is_named():
    # isinstance alone passes a subclass of the protocol whatever it lacks: the member check does not
    assert isinstance(Planted(SETTINGS), backends.Backend) and unmet(Planted(SETTINGS), backends.Backend) == ["name"]

    class NoClose(Planted):
        name = "no-close"
        close = backends.Backend.close  # the declared, abstract one: not written

    with pytest.raises(TypeError, match="close"):
        NoClose()  # an abstract member left out: the class cannot even be made


def test_a_backend_without_the_base_gets_no_defaults():
    class Undeclared:  # all the work, none of the declared members' defaults
        name, settings, tokens_ahead, tokens_per_submit = "undeclared", None, 1, None

        def start(self):
            return {}

        def extract(self, batch):
            return []

        def submit(self, batch):
            return Future()

        def check_forward(self, probe):
            return []

        def close(self):
            pass

    assert not isinstance(Undeclared(), backends.Backend)
    assert unmet(Undeclared(), backends.Backend) == ["cached_tokens", "certifies", "closing_line", "engine_alive",
                                                     "prefix_hit_tokens", "submit_certified"]


def test_a_generating_backend_missing_a_member_is_named():
    class NoRelease(FakeBackend):  # planted: replies, but generate could not give their regions back
        reply_rows_reused = rows_from_replies = rows_in_place = 0

        def answer(self, prompt, sampling, stream=None, certified=False):
            return Future()

        def row_states(self, rows, sources, certified=False):
            return Future()

    backend = NoRelease(SETTINGS)
    assert not isinstance(backend, backends.Replying) and unmet(backend, backends.Replying) == ["release_replies"]
    assert not isinstance(FakeBackend(SETTINGS), backends.Replying)  # extract's stand-in: no replies


def test_no_caller_probes_a_backend_member():
    """``getattr(<...>backend, ...)`` / ``hasattr(<...>backend, ...)`` anywhere in the extractor: a
    member the interfaces should declare instead."""
    probes = []
    for path in sorted((ROOT / "hidden_states").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and "backend" in ast.unparse(node.args[0]).lower()):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert probes == []


def test_the_protocols_name_their_members():
    assert {"name", "settings", "tokens_ahead", "tokens_per_submit", "cached_tokens", "closing_line", "start",
            "extract", "submit", "check_forward", "close", "engine_alive", "certifies",
            "prefix_hit_tokens", "submit_certified"} == declared_members(backends.Backend)
    assert {"reply_rows_reused", "rows_from_replies", "rows_in_place", "answer", "row_states", "release_replies"} == \
        declared_members(backends.Replying)
    assert inspect.isabstract(backends.OneBatchAtATime) and not inspect.isabstract(EngineBackend)
