from types import SimpleNamespace

from tests.contract.base import AdapterContract

from vllm_compat.adapters.embed_input_ids_alias import alias_embedding


class Base:
    def embed_input_ids(self, ids):
        return ("embedded", ids)


class TestEmbedInputIdsAlias(AdapterContract):
    adapter_id = "embed_input_ids_alias"
    first_new = "0.11.1"
    negative = 'get_input_embeddings'

    def test_patched_call(self):
        base = Base()
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(model=base)))
        alias_embedding(lambda: None, worker, (), {})
        assert base.get_input_embeddings([1]) == ("embedded", [1])
