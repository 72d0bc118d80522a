"""The bench's step timeline (bench/timeline_hook/step_events.py) wraps the extractor's own methods by
name: a rename here must fail this test, not a GPU stage after the model load."""
import importlib
import importlib.util

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("step_events", f"{ROOT}/bench/timeline_hook/step_events.py")
step_events = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_events)


def resolves(module: str, dotted: str) -> bool:
    target = importlib.import_module(module)
    for name in dotted.split("."):
        target = getattr(target, name, None)
        if target is None:
            return False
    return callable(target)


def test_what_the_step_timeline_wraps_exists():
    assert resolves("hidden_states.backends.vllm_engine", step_events.ENGINE_BACKEND_FINISHED)
    assert resolves("hidden_states.run.lifecycle", step_events.LIFECYCLE_FINISH)
