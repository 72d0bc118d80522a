"""The registry against small fakes: decisions, idempotence, exact revert, deferral, env switches."""
import os
import sys
import types

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import vllm_compat
from vllm_compat import registry
from vllm_compat.adapter import Adapter, Expect, Patch, Scope
from vllm_compat.errors import UnknownDriftError
from vllm_compat.probes.shapes import ABSENT, OPTIONAL, REQUIRED, Param
from vllm_compat.wrapping import function_wrapper


def make_module(name, source):
    module = types.ModuleType(name)
    exec(source, module.__dict__)
    sys.modules[name] = module
    return module


@pytest.fixture
def fake_vllm(monkeypatch):
    module = make_module("fakevllm_core", (
        "def build(groups, memory):\n    return (groups, memory)\n"
        "class Base:\n    def run(self, x):\n        return ('base', x)\n"
        "class Child(Base):\n    pass\n"
    ))
    monkeypatch.setattr(registry, "vllm_version", lambda: Version("0.16.0"))
    monkeypatch.setattr(registry, "speculators_version", lambda: Version("0.3.0"))
    monkeypatch.delenv("VLLM_COMPAT_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_COMPAT_STRICT", raising=False)
    yield module
    vllm_compat.revert()
    for name in ("fakevllm_core", "fakeconsumer"):
        sys.modules.pop(name, None)


def drop_specs(wrapped, instance, args, kwargs):
    kwargs.pop("specs", None)
    return wrapped(*args, **kwargs)


def tagged(wrapped, instance, args, kwargs):
    return ("patched", wrapped(*args, **kwargs))


def adapter(id="drop_specs", old=(REQUIRED, OPTIONAL), new=(ABSENT,), vllm=">=0.12.0", **kw):
    defaults = dict(
        summary="test", drift="test drift", scope=Scope.GLOBAL, vllm=SpecifierSet(vllm),
        expect=Expect(Param("fakevllm_core:build", "specs"), old=set(old), new=set(new)),
        patches=(Patch("fakevllm_core:build", function_wrapper(drop_specs)),), verified_through="0.32.0",
    )
    defaults.update(kw)
    return Adapter(id=id, **defaults)


def use(monkeypatch, *adapters):
    monkeypatch.setattr(registry, "adapters", lambda: tuple(adapters))


def test_applies_when_probe_finds_new_shape_and_reverts_exactly(fake_vllm, monkeypatch):
    use(monkeypatch, adapter())
    original = fake_vllm.build
    report = vllm_compat.apply()
    assert report["drop_specs"].status == "applied"
    assert fake_vllm.build(1, specs={}, memory=2) == (1, 2)
    assert vllm_compat.apply() == report  # idempotent: same report, no second wrapper
    assert fake_vllm.build.__wrapped__ is original
    vllm_compat.revert()
    vllm_compat.revert()
    assert fake_vllm.build is original


def test_old_shape_is_native(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(old=(ABSENT,), new=(REQUIRED,), vllm=">=0.17.0"))
    report = vllm_compat.apply()
    assert report["drop_specs"].status == "not_needed"
    assert "native on vllm 0.16.0" in report["drop_specs"].reason


def test_release_in_range_with_old_shape_is_unknown_drift(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(old=(ABSENT,), new=(REQUIRED,), vllm=">=0.12.0"))
    report = vllm_compat.apply()
    assert report["drop_specs"].status == "unknown_drift"
    assert "expected the new shape" in report["drop_specs"].reason


def test_nightly_before_the_change_is_not_drift(fake_vllm, monkeypatch):
    monkeypatch.setattr(registry, "vllm_version", lambda: Version("0.12.0.dev3+gabc"))
    use(monkeypatch, adapter(old=(ABSENT,), new=(REQUIRED,), vllm=">=0.12.0"))
    assert vllm_compat.apply()["drop_specs"].status == "not_needed"


def test_neither_shape_is_unknown_drift_and_strict_raises(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(old=("something",), new=("else",)))
    with pytest.raises(UnknownDriftError, match="drop_specs"):
        vllm_compat.apply(strict=True)


def test_disable_by_env(fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_COMPAT_DISABLE", "other, drop_specs")
    use(monkeypatch, adapter(), adapter(id="other"))
    original = fake_vllm.build
    assert vllm_compat.apply()["drop_specs"].status == "disabled"
    assert fake_vllm.build is original


@pytest.mark.parametrize("where", ["env", "argument"])
def test_unknown_id_in_disable_names_it_and_the_known_ones(fake_vllm, monkeypatch, where):
    from vllm_compat.errors import AdapterNotApplicable

    use(monkeypatch, adapter(), adapter(id="other"))
    if where == "env":
        monkeypatch.setenv("VLLM_COMPAT_DISABLE", "drop_specs,dorp_specs")
    with pytest.raises(AdapterNotApplicable, match=r"'dorp_specs'; known: drop_specs, other"):
        vllm_compat.apply(disable=("dorp_specs",) if where == "argument" else ())
    assert not registry.is_active()


def test_revert_gives_the_environment_back(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(), adapter(id="other"))
    monkeypatch.delenv("VLLM_COMPAT_APPLY", raising=False)
    monkeypatch.setenv("VLLM_COMPAT_DISABLE", "other")
    vllm_compat.apply(disable=("drop_specs",), strict=True)
    assert os.environ["VLLM_COMPAT_DISABLE"] == "drop_specs,other" and os.environ["VLLM_COMPAT_STRICT"] == "1"
    assert os.environ["VLLM_COMPAT_APPLY"] == "1"
    vllm_compat.revert()
    assert os.environ["VLLM_COMPAT_DISABLE"] == "other"
    assert "VLLM_COMPAT_STRICT" not in os.environ and "VLLM_COMPAT_APPLY" not in os.environ
    vllm_compat.revert()  # a second revert changes nothing
    assert os.environ["VLLM_COMPAT_DISABLE"] == "other"
    vllm_compat.apply()
    monkeypatch.setenv("VLLM_COMPAT_APPLY", "set by someone else")
    vllm_compat.revert()
    assert os.environ["VLLM_COMPAT_APPLY"] == "set by someone else", "a value changed since apply() is kept"


def test_disabling_a_requirement_disables_its_dependents(fake_vllm, monkeypatch):
    needs = adapter(id="needs_drop_specs", expect=None, vllm=">=0.10.0", requires=("drop_specs",),
                    patches=(Patch("fakevllm_core:Base.run", function_wrapper(tagged)),))
    use(monkeypatch, *registry._in_application_order([needs, adapter()]))
    original = fake_vllm.Base.run
    report = vllm_compat.apply(disable=("drop_specs",))
    assert report["needs_drop_specs"].status == "disabled"
    assert "requires drop_specs, which is disabled" in report["needs_drop_specs"].reason
    assert fake_vllm.Base.run is original


def test_application_order_is_phase_then_requirements_then_id():
    from vllm_compat.adapter import Phase

    late = adapter(id="a_transport", phase=Phase.TRANSPORT)
    dependent = adapter(id="b_needs_c", requires=("c_base",))
    base = adapter(id="c_base")
    first = adapter(id="z_import", phase=Phase.IMPORT_FIX)
    order = registry._in_application_order([late, dependent, base, first])
    assert [a.id for a in order] == ["z_import", "c_base", "b_needs_c", "a_transport"]
    with pytest.raises(RuntimeError, match="unknown adapter 'nowhere'"):
        registry._in_application_order([adapter(id="x", requires=("nowhere",))])
    with pytest.raises(RuntimeError, match="cycle"):
        registry._in_application_order([adapter(id="x", requires=("y",)), adapter(id="y", requires=("x",))])
    with pytest.raises(RuntimeError, match="later phase"):
        registry._in_application_order([adapter(id="x", requires=("y",)), adapter(id="y", phase=Phase.TRANSPORT)])


def test_newer_vllm_than_verified_warns_and_strict_refuses(fake_vllm, monkeypatch):
    from vllm_compat.errors import NotVerifiedError

    use(monkeypatch, adapter(verified_through="0.15.0"), adapter(id="other", verified_through="0.16.0"))
    report = vllm_compat.apply()
    assert report["drop_specs"].unverified == "not verified on vllm 0.16.0 (verified through 0.15.0)"
    assert not report["other"].unverified and report.newest_verified == "0.15.0"
    assert "not verified on vllm 0.16.0" in str(report) and "newest verified: 0.15.0" in report.summary()
    vllm_compat.revert()
    with pytest.raises(NotVerifiedError, match="drop_specs"):
        vllm_compat.apply(strict=True)


def test_consumer_version_gates(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(speculators=SpecifierSet(">=0.4.0,<0.5")))
    result = vllm_compat.apply()["drop_specs"]
    assert result.status == "not_needed" and "speculators 0.3.0 does not need it" in result.reason


def test_inherited_method_patched_on_child_is_deleted_on_revert(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(id="child_run", expect=None, vllm=">=0.10.0",
                             patches=(Patch("fakevllm_core:Child.run", function_wrapper(tagged)),)))
    vllm_compat.apply()
    assert fake_vllm.Child().run(1) == ("patched", ("base", 1))
    assert fake_vllm.Base().run(1) == ("base", 1)
    vllm_compat.revert()
    assert "run" not in vars(fake_vllm.Child)


def test_patch_of_a_module_not_yet_imported_waits_for_it(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(patches=(Patch("fakevllm_core:build", function_wrapper(drop_specs)),
                                      Patch("fakeconsumer:build", function_wrapper(drop_specs)))))
    report = vllm_compat.apply()
    assert report["drop_specs"].status == "armed"
    # the consumer imports the (already patched) function by value
    consumer = make_module("fakeconsumer", "from fakevllm_core import build\n")
    import wrapt

    wrapt.importer.notify_module_loaded(consumer)
    assert vllm_compat.status()["drop_specs"].status == "applied"
    assert consumer.build is fake_vllm.build  # our wrapper reused, not wrapped twice
    original = fake_vllm.build.__wrapped__
    vllm_compat.revert()
    assert consumer.build is original and fake_vllm.build is original


def test_failed_patch_is_reported_and_undone(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(patches=(Patch("fakevllm_core:build", function_wrapper(drop_specs)),
                                      Patch("fakevllm_core:nothing_here", function_wrapper(drop_specs)))))
    original = fake_vllm.build
    result = vllm_compat.apply()["drop_specs"]
    assert result.status == "failed" and "nothing_here" in result.reason
    assert fake_vllm.build is original


def test_apply_arms_spawned_processes_and_revert_disarms(fake_vllm, monkeypatch):
    use(monkeypatch, adapter())
    monkeypatch.delenv("VLLM_COMPAT_APPLY", raising=False)
    vllm_compat.apply()
    import os

    assert os.environ["VLLM_COMPAT_APPLY"] == "1"
    vllm_compat.revert()
    assert "VLLM_COMPAT_APPLY" not in os.environ


def test_plugin_does_nothing_unless_asked(fake_vllm, monkeypatch):
    from vllm_compat import plugin

    use(monkeypatch, adapter(scope=Scope.WORKER))
    monkeypatch.delenv("VLLM_COMPAT_APPLY", raising=False)
    original = fake_vllm.build
    plugin.register()
    assert fake_vllm.build is original and not registry.is_active()
    monkeypatch.setenv("VLLM_COMPAT_APPLY", "1")
    plugin.register()
    assert fake_vllm.build is not original and registry.status().role == "vllm process"


def test_plugin_applies_only_worker_scope(fake_vllm, monkeypatch):
    from vllm_compat import plugin

    use(monkeypatch, adapter(id="global_one"), adapter(id="worker_one", scope=Scope.WORKER, expect=None,
                                                         vllm=">=0.10.0",
                                                         patches=(Patch("fakevllm_core:Base.run",
                                                                        function_wrapper(tagged)),)))
    monkeypatch.setenv("VLLM_COMPAT_APPLY", "1")
    plugin.register()
    assert [r.id for r in registry.status().results] == ["worker_one"]


def test_importing_vllm_compat_is_cheap():
    import subprocess

    # also what scripts/ import without a vLLM venv (the consumer facts) and the host facts' module
    code = ("import sys, vllm_compat, vllm_compat.consumer, vllm_compat.host; "
            "print(sorted(m for m in ('vllm', 'torch', 'wrapt', 'packaging') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_report_renders_one_line_per_adapter(fake_vllm, monkeypatch):
    use(monkeypatch, adapter(), adapter(id="second", expect=None, vllm="<0.1"))
    text = str(vllm_compat.apply())
    assert text.splitlines()[0].startswith("vllm-compat (parent, pid")
    assert "  drop_specs: applied - vllm 0.16.0: parameter 'specs' of fakevllm_core:build is absent" in text
    assert "  second: not_needed - vllm 0.16.0 is outside <0.1" in text


def test_factories_drop_default_and_alias(fake_vllm, monkeypatch):
    from vllm_compat.factories import alias_moved_names, default_keyword, drop_keyword

    make_module("fakevllm_planning", "def plan(groups, memory):\n    return ('planned', groups, memory)\n")
    make_module("fakevllm_defaults", "def build(*, mode):\n    return mode\n")
    declared = dict(summary="test", drift="test drift", scope=Scope.GLOBAL, vllm=SpecifierSet(">=0.12.0"),
                    verified_through="0.16.0")
    moved = alias_moved_names(id="moved", old_module="fakevllm_core", new_module="fakevllm_planning",
                              names=("plan",), **declared)
    dropped = drop_keyword(id="dropped", target="fakevllm_core:plan", keyword="specs", **declared)
    defaulted = default_keyword(id="defaulted", at="fakevllm_defaults:build", keyword="mode", value="off",
                                expect=None, **declared)
    use(monkeypatch, *registry._in_application_order([dropped, defaulted, moved]))
    report = vllm_compat.apply()
    assert [report[a].status for a in ("moved", "dropped", "defaulted")] == ["applied"] * 3
    import fakevllm_defaults
    import fakevllm_planning

    assert fake_vllm.plan.__wrapped__ is fakevllm_planning.plan  # the alias, wrapped after it
    assert fake_vllm.plan(1, specs={}, memory=2) == ("planned", 1, 2)
    assert fakevllm_defaults.build() == "off" and fakevllm_defaults.build(mode="on") == "on"
    vllm_compat.revert()
    assert not hasattr(fake_vllm, "plan") and fakevllm_defaults.build(mode="x") == "x"
    for name in ("fakevllm_planning", "fakevllm_defaults"):
        sys.modules.pop(name)


@pytest.mark.parametrize("installed, verified", [
    ("0.32.0", True), ("0.31.0", True), ("0.32.0+cpu", True),  # a local build of the release
    ("0.33.0", False), ("0.32.1.dev5+g1234abc", False),  # a newer release, a nightly after it
    ("0.32.0.dev3", False),  # a nightly before the verified release is not that release
])
def test_verified_on(installed, verified):
    assert adapter(verified_through="0.32.0").verified_on(Version(installed)) is verified


def test_the_summary_line_names_each_adapter_under_its_own_status(caplog):
    """'1 applied, 2 armed; applied: a, b, c' contradicted itself: armed ones are listed as armed."""
    import logging

    from vllm_compat.registry import _log
    from vllm_compat.report import AdapterResult, Report

    report = Report("0.32.0", "0.4.0", (AdapterResult("a", "applied", "r"), AdapterResult("b", "armed", "r"),
                                        AdapterResult("c", "armed", "r"), AdapterResult("d", "not_needed", "r")))
    with caplog.at_level(logging.INFO, logger="vllm_compat"):
        _log(report)
    line = caplog.records[-1].getMessage()
    assert line.endswith("1 applied, 2 armed, 1 not_needed; applied: a; armed: b, c"), line


# Each name several shipped adapters replace, its wrappers outermost first. Written out here, not
# derived: a change in the application order (a phase, a requirement, a renamed id) that changes how
# they nest must change this table too, on purpose.
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
EXTENSION = "speculators.data_generation.custom_worker:HiddenStatesWorkerExtension"
PINNED_STACKS = {
    "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups": ("kv_cache_specs_kwarg", "kv_cache_planning_names"),
    f"{GENERATOR}:CacheConfig": ("prefix_caching_default", "extensible_kv_cache", "cache_block_size"),
    f"{GENERATOR}:MultiprocExecutor": ("worker_spawn", "warm_up_after_init", "rpc_single_reply",
                                       "parent_copy_threads", "kv_cache_layout", "deferred_sampling"),
    f"{GENERATOR}:Scheduler": ("scheduler_block_size", "prefill_slot_release", "prefill_abort_deferral",
                               "finished_ids_delivery"),
    f"{EXTENSION}._store_captured_states": ("input_batch_view", "capture_attribution"),
    f"{EXTENSION}._get_captured_states": ("capture_transport", "capture_attribution"),
}


def test_shared_patch_targets_nest_in_the_pinned_order():
    assert registry.wrapper_stacks() == PINNED_STACKS


def test_the_declared_stack_is_the_live_chain(fake_vllm, monkeypatch):
    """Three adapters on one name, declared in an order their ids alone would not give (a phase and a
    requirement): the chain apply() leaves is the declared stack, revert() takes it off entirely."""
    from vllm_compat.adapter import Phase
    from vllm_compat.wrapping import stack

    def on_build(id, **kw):
        return adapter(id=id, expect=None, vllm=">=0.10.0",
                       patches=(Patch("fakevllm_core:build", function_wrapper(tagged)),), **kw)

    shipped = registry._in_application_order([
        on_build("a_outer", phase=Phase.TRANSPORT), on_build("b_first"), on_build("a_after", requires=("b_first",))])
    use(monkeypatch, *shipped)
    original = fake_vllm.build
    vllm_compat.apply()
    assert registry.wrapper_stacks() == {"fakevllm_core:build": ("a_outer", "a_after", "b_first")}
    assert stack("fakevllm_core:build") == ("a_outer", "a_after", "b_first")
    assert fake_vllm.build(1, 2) == ("patched", ("patched", ("patched", (1, 2))))
    vllm_compat.revert()
    assert stack("fakevllm_core:build") == () and fake_vllm.build is original


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "vllm_compat" and r.levelname == "WARNING"]


def test_second_apply_with_other_arguments_warns_once_naming_them(fake_vllm, monkeypatch, caplog):
    import logging

    use(monkeypatch, adapter(), adapter(id="second", expect=None, vllm="<0.1"))
    first = vllm_compat.apply()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_compat"):
        again = vllm_compat.apply(disable=("second",), strict=True)
    assert again == first  # nothing changed: the first call's adapters stay
    (message,) = _warnings(caplog)
    assert "disable () -> ('second',)" in message and "strict False -> True" in message, message
    assert "scopes" not in message and "role" not in message, message


def test_second_apply_with_the_same_arguments_is_silent(fake_vllm, monkeypatch, caplog):
    """The same arguments in effect: repeated literally, or already in force through the environment
    variables the first call set (the vLLM plugin's repeat in a process where apply() already ran)."""
    import logging

    use(monkeypatch, adapter(), adapter(id="second", expect=None, vllm="<0.1"))
    vllm_compat.apply(disable=("second",), strict=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_compat"):
        vllm_compat.apply(disable=("second",), strict=False)
        vllm_compat.apply()  # VLLM_COMPAT_DISABLE=second now, VLLM_COMPAT_STRICT unset
    assert _warnings(caplog) == []
    vllm_compat.revert()
    vllm_compat.apply()  # after revert() a call is a first call again: other arguments, no warning
    assert _warnings(caplog) == []
