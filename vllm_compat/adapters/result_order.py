"""speculators 0.4.0 returns results sorted by request-id *string*: put them back in input order.

Not a vLLM drift but the 0.4.0 generator's own defect: ``generate()`` builds its result list with
``for req_id in sorted(request_id_to_idx)`` over ids ``req_<call>_<index>``, which sorts
``req_0_10`` before ``req_0_2``. With 11 or more sequences in one call, ``results[i]`` is not the
states of ``token_ids[i]`` (each result carries its own ``input_ids``, so the pairing inside a
result is right, but callers that zip results with inputs pair the wrong ones).

What it does: reorders the returned list into input order (the permutation is the one the string
sort makes) and checks every result's ``input_ids`` against the input it now stands for.

Scope: consumer (``VllmHiddenStatesGenerator.generate`` of speculators 0.4.x). Disable:
``VLLM_COMPAT_DISABLE=result_order``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import SPECULATORS_04, generator_name
from ..wrapping import function_wrapper


def input_order(wrapped, generator, args, kwargs):
    results = wrapped(*args, **kwargs)
    # generate() named request i "req_<call>_<i>" and returned them in string-sorted order.
    string_sorted = sorted(range(len(results)), key=str)
    ordered = [None] * len(results)
    for position, index in enumerate(string_sorted):
        ordered[index] = results[position]
    token_ids = args[0] if args else kwargs["token_ids"]
    for index, (result, ids) in enumerate(zip(ordered, token_ids)):
        expected = list(ids)[: len(result["input_ids"])]
        if result["input_ids"].tolist() != [int(t) for t in expected]:
            raise RuntimeError(f"vllm-compat result_order: result {index} does not hold input {index}")
    return ordered


ADAPTER = Adapter(
    id="result_order",
    summary="return speculators 0.4's generate() results in input order",
    drift="speculators 0.4.0 returns results in string order of request ids (req_0_10 < req_0_2)",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(SPECULATORS_04),
    patches=(Patch(generator_name("VllmHiddenStatesGenerator.generate"), function_wrapper(input_order)),),
    verified_through="0.32.0",
    evidence="speculators 0.4.0 vllm_hidden_states_generator.py, generate(): sorted(request_id_to_idx.keys())",
)
