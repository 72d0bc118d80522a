"""Shared contract for every adapter, run against the real installed vLLM (and speculators, when
the matrix puts one on the path). Subclass, set ``adapter_id`` and ``first_new`` (the first vLLM
release with the new shape, from docs/drift-atlas.md, written out here independently of the adapter's own
declaration), add ``test_patched_call`` exercising the patched object for real, and state the
adapter's negative proof (``negative`` or ``not_observable_on_cpu``, read from the contract test's
source by tests/contract/negative_proofs.py for tests/e2e/test_negative.py).
tests/unit/test_contracts_exist.py checks every adapter has one."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
from packaging.version import Version

import vllm_compat
from vllm_compat import registry, versions
from vllm_compat.audit import bridged
from vllm_compat.probes.live import LiveSource
from vllm_compat.probes.static import DirTree, StaticSource
from vllm_compat.probes.verdicts import ADAPTED, NATIVE, judge
from vllm_compat.wrapping import ABSENT, owner_of, resolve

pytestmark = pytest.mark.vllm


def installed_vllm() -> Version:
    return versions.base(versions.vllm_version())


def speculators() -> Version | None:
    return versions.speculators_version()


def host_vllm_config(**kwargs):
    """A ``VllmConfig`` for a test that works on host tensors, its device named (``cpu``) rather than
    inferred: inferring it fails where vLLM finds no device platform (its CUDA wheel on a host
    without a GPU, how releases without a CPU build are checked here), and on vLLM's CPU backend
    ``cpu`` is what it infers."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"), **kwargs)


def needs_vllm_kernels() -> None:
    """Skip a test that runs vLLM's own compiled kernels where none can run: vLLM found no device
    platform (its CUDA wheel on a host without a GPU), so its custom ops dispatch to
    ``forward_cuda``, and the CUDA build's kernel library (``vllm._C_stable_libtorch``) loads only
    beside the CUDA driver (``libcuda.so.1``)."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():
        pytest.skip("needs a GPU: vLLM found no device platform (CUDA wheel without a GPU), and the kernels "
                    "checked here load only beside the CUDA driver")


class AdapterContract:
    adapter_id: str = ""
    first_new: str = ""  # docs/drift-atlas.md: first release with the new shape ("" = every release)
    last_new: str = ""  # docs/drift-atlas.md: last release with it, when it went away again
    # The negative proof (tests/e2e/test_negative.py): with the adapter disabled, the generator run
    # fails with an error containing ``negative``, or any error (``"error"``), or gives wrong
    # numbers or an error (``"wrong"``). Or, where a CPU run cannot show the failure, why not
    # (``not_observable_on_cpu``; the failure is then proved elsewhere, named there).
    negative: str = ""
    not_observable_on_cpu: str = ""
    family: str = ""  # the tiny model family whose run shows the failure ("" = llama)
    negative_env: dict[str, str] = {}  # environment of the negative run
    not_called_by: frozenset[str] = frozenset()  # speculators releases that never make the bridged call
    same_value_on_cpu: frozenset[str] = frozenset()  # speculators releases passing the right value on CPU

    @property
    def adapter(self):
        return registry.get(self.adapter_id)

    def expected_verdict(self) -> str:
        v = installed_vllm()
        new = (not self.first_new or v >= Version(self.first_new)) and (not self.last_new or v <= Version(self.last_new))
        return ADAPTED if new else NATIVE

    def consumer_needs_it(self) -> bool:
        spec = speculators()
        return self.adapter.speculators is None or (spec is not None and versions.in_range(self.adapter.speculators, spec))

    @pytest.fixture(autouse=True)
    def _always_revert(self):
        yield
        vllm_compat.revert()

    def probe(self, source):
        """The adapter's verdict as apply() reaches it: after the adapters applied before it have
        put moved names back (on 0.33.0, kv_cache_specs_kwarg probes a name that moved)."""
        version = versions.vllm_version()
        return judge(self.adapter, bridged(source, version, before=self.adapter_id), version)

    def test_probe_matches_drift_atlas(self):
        assert self.probe(LiveSource()).verdict == self.expected_verdict()

    def test_static_audit_agrees_with_live_probe(self):
        where = versions.package_dir("vllm")
        static = self.probe(StaticSource(DirTree(where.parent)))
        alive = self.probe(LiveSource())
        assert (static.verdict, static.found) == (alive.verdict, alive.found)

    def _targets_now(self):
        # a sys.modules entry is always readable (absent is a value); other targets only once imported
        return {p.target: resolve(p.target)[2] for p in self.adapter.patches
                if p.module == "sys.modules" or (importlib.util.find_spec(p.module.split(".")[0]) and _imported(p.module))}

    def test_apply_twice_revert_twice_restores_identical_objects(self):
        for patch in self.adapter.patches:  # import what apply() would patch now, so we can compare
            if patch.module.split(".")[0] == "vllm" and versions.has_module(patch.module):
                importlib.import_module(patch.module)  # (a module this release does not have yet is skipped)
        before = self._targets_now()
        first = vllm_compat.apply()
        after_first = self._targets_now()
        second = vllm_compat.apply()
        assert second[self.adapter_id] == first[self.adapter_id]
        assert self._targets_now() == after_first, "a second apply() must not wrap again"
        status = first[self.adapter_id].status
        ours = {t: [o for o in [after_first[t], *_wrapped_chain(after_first[t])] if owner_of(o) == self.adapter_id]
                for t in before}
        if self.expected_verdict() == ADAPTED and self.consumer_needs_it() and status != "not_needed":
            assert status in ("applied", "armed"), first[self.adapter_id]
            patched = [t for t in before if ours[t]]
            assert patched, f"{self.adapter_id} reported {status} but patched nothing"
            for target in patched:  # other adapters may wrap the same name: the chain ends at the original
                created = before[target] is ABSENT  # an attribute the adapter adds (revert removes it)
                assert len(ours[target]) == 1 and (created or before[target] in _wrapped_chain(after_first[target]))
        else:
            assert status == "not_needed", first[self.adapter_id]
            assert not any(ours.values())
        vllm_compat.revert()
        vllm_compat.revert()
        restored = self._targets_now()
        assert all(restored[t] is before[t] for t in before), "revert() must restore the original objects"

    def test_disabled_adapter_is_left_alone(self, monkeypatch):
        monkeypatch.setenv("VLLM_COMPAT_DISABLE", self.adapter_id)
        report = vllm_compat.apply()
        assert report[self.adapter_id].status == "disabled"
        now = self._targets_now()
        assert not any(owner_of(o) == self.adapter_id for t in now for o in [now[t], *_wrapped_chain(now[t])])


def _wrapped_chain(obj) -> list:
    chain = []
    while hasattr(obj, "__wrapped__") and len(chain) < 16:
        obj = obj.__wrapped__
        chain.append(obj)
    return chain


def _imported(module: str) -> bool:
    import sys

    return module in sys.modules
