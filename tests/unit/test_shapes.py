"""Static (ast) and live (import) evaluation of shape checks must agree, on a synthetic package."""
import importlib
import sys
import zipfile

import pytest

from vllm_compat.probes import shapes
from vllm_compat.probes.live import LiveSource
from vllm_compat.probes.static import DirTree, StaticSource, WheelTree

FILES = {
    "fakevllm/__init__.py": "",
    "fakevllm/config/__init__.py": "from fakevllm.config.cache import CacheConfig\nfrom .scheduler import *\n",
    "fakevllm/config/cache.py": (
        "from dataclasses import dataclass, field\n"
        "@dataclass\n"
        "class CacheConfig:\n"
        "    block_size: int = 16\n"
        "    enable_prefix_caching: bool = True\n"
        "    swap_space: float = field(default=4.0)\n"
        "    tags: list = field(default_factory=list)\n"
    ),
    "fakevllm/config/scheduler.py": (
        "from dataclasses import InitVar, dataclass\n"
        "__all__ = ['SchedulerConfig']\n"
        "@dataclass\n"
        "class SchedulerConfig:\n"
        "    max_model_len: InitVar[int]\n"
        "    is_encoder_decoder: InitVar[bool]\n"
        "    max_num_seqs: int = 128\n"
        "    def __post_init__(self, max_model_len, is_encoder_decoder):\n"
        "        pass\n"
    ),
    "fakevllm/executor/__init__.py": "",
    "fakevllm/executor/abstract.py": (
        "class Executor:\n"
        "    def sample_tokens(self, grammar_output, non_block=False):\n"
        "        return None\n"
        "    def collective_rpc(self, method, *, unique_reply_rank=None):\n"
        "        return [method]\n"
    ),
    "fakevllm/executor/multiproc.py": (
        "from fakevllm.executor import abstract\n"
        "from .abstract import Executor\n"
        "class MultiprocExecutor(Executor):\n"
        "    def collective_rpc(self, method, timeout=None, unique_reply_rank=None, kv_output_aggregator=None):\n"
        "        return method\n"
        "class Other(abstract.Executor):\n"
        "    pass\n"
    ),
    "fakevllm/output.py": (
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class NewRequestData:\n"
        "    req_id: str\n"
        "    num_computed_tokens: int\n"
        "class Resumed(NewRequestData):\n"
        "    pass\n"
    ),
    # strings vLLM resolves: a Literal it validates against, a registry filled by calls, a dict of
    # qualified names built by a helper (whose entry names a config naming the implementation in turn),
    # an if-chain that builds what it picks
    "fakevllm/spec.py": (
        "from typing import Literal\n"
        "Inner = Literal['mtp', 'extract_hidden_states']\n"
        "Method = Literal['ngram', Inner, Literal['suffix']]\n"
        "_PKG = 'fakevllm.impl'\n"
        "def _builtin(module, name):\n"
        "    return f'{_PKG}.{module}.{name}'\n"
        "CONFIGS = {\n"
        "    'extract_hidden_states': _builtin('configs', 'ExtractConfig'),\n"
        "    'ngram': 'fakevllm.impl.configs.' + 'NgramConfig',\n"
        "    'gone': _builtin('nowhere', 'Gone'),\n"
        "    'dangling': 'fakevllm.impl.configs.DanglingConfig',\n"
        "}\n"
        "class Factory:\n"
        "    _registry = {}\n"
        "    @classmethod\n"
        "    def register(cls, name, module_path, class_name):\n"
        "        def loader():\n"
        "            import importlib\n"
        "            return getattr(importlib.import_module(module_path), class_name)\n"
        "        cls._registry[name] = loader\n"
        "Factory.register('Hidden', 'fakevllm.impl.configs', 'Extract')\n"
        "Factory.register('Lost', 'fakevllm.impl.lost', 'Lost')\n"
    ),
    "fakevllm/impl/__init__.py": "",
    "fakevllm/impl/configs.py": (
        "class Extract:\n"
        "    pass\n"
        "class BaseConfig:\n"
        "    impl = None\n"
        "class ExtractConfig(BaseConfig):\n"
        "    impl = 'fakevllm.impl.configs.Extract'\n"
        "class NgramConfig(BaseConfig):\n"
        "    pass\n"
        "class DanglingConfig(BaseConfig):\n"
        "    impl = 'fakevllm.impl.lost.Lost'\n"
    ),
    "fakevllm/runner.py": (
        "from fakevllm.impl.configs import Extract as Proposer\n"
        "class Runner:\n"
        "    def __init__(self, method):\n"
        "        if method == 'ngram':\n"
        "            self.drafter = None\n"
        "        elif method in ('eagle', 'extract_hidden_states'):\n"
        "            self.drafter = Proposer(method)\n"
        "        elif method == 'local':\n"
        "            from fakevllm.impl.configs import NgramConfig\n"
        "            self.drafter = NgramConfig()\n"
        "        elif method == 'dangling':\n"
        "            self.drafter = NotImportedAnywhere()\n"
        "    def warm_up(self):\n"
        "        if self.config.mode == Mode.NONE:\n"
        "            return\n"
        "        if self.config.debug:\n"
        "            print('debug')\n"
        "        self.run()\n"
        "    def profile(self):\n"
        "        if self.config.mode == Mode.NONE:\n"
        "            self.run()\n"
        "        for step in range(2):\n"
        "            if step == Mode.SKIP:\n"
        "                return\n"
        "        return 1\n"
    ),
    "fakevllm/request.py": (
        "class Request:\n"
        "    def __init__(self, request_id, prompt_token_ids, eos_token_id, *, block_hasher=None, mode):\n"
        "        pass\n"
        "class Model:\n"
        "    def embed_input_ids(self, ids):\n"
        "        return ids\n"
    ),
}

CHECKS = [
    (shapes.Param("fakevllm.request:Request.__init__", "eos_token_id"), shapes.REQUIRED),
    (shapes.Param("fakevllm.request:Request.__init__", "block_hasher"), shapes.OPTIONAL),
    (shapes.Param("fakevllm.request:Request.__init__", "mode"), shapes.REQUIRED),
    (shapes.Param("fakevllm.request:Request.__init__", "arrival_time"), shapes.ABSENT),
    (shapes.Param("fakevllm.request:Gone.__init__", "x"), shapes.MISSING),
    (shapes.Param("fakevllm.executor.multiproc:MultiprocExecutor.collective_rpc", "kv_output_aggregator"),
     shapes.OPTIONAL),
    (shapes.Param("fakevllm.executor.multiproc:MultiprocExecutor.sample_tokens", "grammar_output"),
     shapes.REQUIRED),
    (shapes.Attr("fakevllm.executor.multiproc:MultiprocExecutor", "sample_tokens"), shapes.PRESENT),
    (shapes.Attr("fakevllm.executor.multiproc:Other", "sample_tokens"), shapes.PRESENT),
    (shapes.Attr("fakevllm.executor.multiproc:MultiprocExecutor", "execute_model"), shapes.ABSENT),
    # a field without a default is in no class __dict__, only in the annotations (live) / the body (static)
    (shapes.Attr("fakevllm.output:NewRequestData", "num_computed_tokens"), shapes.PRESENT),
    (shapes.Attr("fakevllm.output:Resumed", "req_id"), shapes.PRESENT),
    (shapes.Attr("fakevllm.output:Resumed", "num_tokens"), shapes.ABSENT),
    (shapes.WhichAttr("fakevllm.request:Model", old_name="get_input_embeddings", new_name="embed_input_ids"),
     "embed_input_ids"),
    (shapes.FieldDefault("fakevllm.config:CacheConfig", "enable_prefix_caching"), "True"),
    (shapes.FieldDefault("fakevllm.config:CacheConfig", "swap_space"), "4.0"),
    (shapes.FieldDefault("fakevllm.config:CacheConfig", "tags"), "<factory>"),
    (shapes.FieldDefault("fakevllm.config:CacheConfig", "nothing"), shapes.ABSENT),
    (shapes.FieldDefault("fakevllm.config:SchedulerConfig", "is_encoder_decoder"), shapes.REQUIRED),
    (shapes.FieldDefault("fakevllm.config:SchedulerConfig", "max_num_seqs"), "128"),
    (shapes.Exists("fakevllm.config:SchedulerConfig"), shapes.PRESENT),
    (shapes.Exists("fakevllm.config:Missing"), shapes.MISSING),
    (shapes.LiteralMember("fakevllm.spec:Method", "extract_hidden_states"), shapes.PRESENT),
    (shapes.LiteralMember("fakevllm.spec:Method", "suffix"), shapes.PRESENT),
    (shapes.LiteralMember("fakevllm.spec:Method", "medusa"), shapes.ABSENT),
    (shapes.LiteralMember("fakevllm.spec:Gone", "ngram"), shapes.MISSING),
    (shapes.Registered("fakevllm.spec:Factory._registry", "Hidden", via="register"), shapes.PRESENT),
    (shapes.Registered("fakevllm.spec:Factory._registry", "Lost", via="register"), shapes.UNRESOLVED),
    (shapes.Registered("fakevllm.spec:Factory._registry", "Other", via="register"), shapes.ABSENT),
    (shapes.Registered("fakevllm.spec:CONFIGS", "extract_hidden_states"), shapes.PRESENT),
    (shapes.Registered("fakevllm.spec:CONFIGS", "extract_hidden_states", then="impl"), shapes.PRESENT),
    (shapes.Registered("fakevllm.spec:CONFIGS", "ngram", then="impl"), shapes.ABSENT),  # names no implementation
    (shapes.Registered("fakevllm.spec:CONFIGS", "gone"), shapes.UNRESOLVED),
    (shapes.Registered("fakevllm.spec:CONFIGS", "dangling", then="impl"), shapes.UNRESOLVED),
    (shapes.Registered("fakevllm.spec:CONFIGS", "medusa"), shapes.ABSENT),
    (shapes.Registered("fakevllm.spec:NOTHING", "ngram"), shapes.MISSING),
    (shapes.Branch("fakevllm.runner:Runner.__init__", "extract_hidden_states"), shapes.PRESENT),
    (shapes.Branch("fakevllm.runner:Runner.__init__", "local"), shapes.PRESENT),
    (shapes.Branch("fakevllm.runner:Runner.__init__", "ngram"), shapes.ABSENT),  # builds nothing
    (shapes.Branch("fakevllm.runner:Runner.__init__", "medusa"), shapes.ABSENT),
    (shapes.Branch("fakevllm.runner:Runner.__init__", "dangling"), shapes.UNRESOLVED),
    (shapes.Branch("fakevllm.runner:Gone.__init__", "ngram"), shapes.MISSING),
    (shapes.ReturnsEarly("fakevllm.runner:Runner.warm_up", "NONE"), shapes.PRESENT),
    (shapes.ReturnsEarly("fakevllm.runner:Runner.warm_up", "debug"), shapes.ABSENT),  # its body does more
    (shapes.ReturnsEarly("fakevllm.runner:Runner.profile", "NONE"), shapes.ABSENT),  # runs, does not return
    (shapes.ReturnsEarly("fakevllm.runner:Runner.profile", "SKIP"), shapes.ABSENT),  # nested in a loop
    (shapes.ReturnsEarly("fakevllm.runner:Gone.warm_up", "NONE"), shapes.MISSING),
    # a site this release lacks is skipped; every site it has must resolve the string
    (shapes.Dispatched("fakevllm.spec:Config.method", "extract_hidden_states", sites=(
        shapes.Registered("fakevllm.spec:NOTHING", "extract_hidden_states"),
        shapes.Branch("fakevllm.runner:Runner.__init__", "extract_hidden_states"))), shapes.PRESENT),
    (shapes.Dispatched("fakevllm.spec:Config.method", "dangling", sites=(
        shapes.Registered("fakevllm.spec:CONFIGS", "dangling"),
        shapes.Branch("fakevllm.runner:Runner.__init__", "dangling"))), shapes.UNRESOLVED),
    (shapes.Dispatched("fakevllm.spec:Config.method", "local", sites=(
        shapes.Registered("fakevllm.spec:CONFIGS", "local"),
        shapes.Branch("fakevllm.runner:Runner.__init__", "local"))), shapes.ABSENT),
    (shapes.Dispatched("fakevllm.spec:Config.method", "ngram", sites=(
        shapes.Registered("fakevllm.spec:NOTHING", "ngram"),
        shapes.Branch("fakevllm.runner:Gone.__init__", "ngram"))), shapes.MISSING),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture(scope="module")
def wheel(tree, tmp_path_factory):
    path = tmp_path_factory.mktemp("wheel") / "fakevllm-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in FILES.items():
            zf.writestr(rel, text)
    return path


@pytest.fixture(scope="module")
def live(tree):
    sys.path.insert(0, str(tree))
    importlib.invalidate_caches()
    yield LiveSource()
    sys.path.remove(str(tree))
    for name in [m for m in sys.modules if m.split(".")[0] == "fakevllm"]:
        del sys.modules[name]


@pytest.mark.parametrize("check, expected", CHECKS, ids=[c.describe() for c, _ in CHECKS])
def test_static_live_and_wheel_agree(check, expected, tree, wheel, live):
    static = check.observe(StaticSource(DirTree(tree)))
    in_wheel = check.observe(StaticSource(WheelTree(wheel)))
    alive = check.observe(live)
    assert (static.value, in_wheel.value, alive.value) == (expected, expected, expected)


def test_static_where_names_file_and_line(tree):
    seen = shapes.Param("fakevllm.executor.multiproc:MultiprocExecutor.sample_tokens", "grammar_output").observe(
        StaticSource(DirTree(tree)))
    assert seen.where == "fakevllm/executor/abstract.py:2"


def test_live_source_sees_through_wrapt_proxies(live):
    import wrapt

    from fakevllm import request  # noqa: the synthetic package

    original = request.Request.__init__
    wrapt.wrap_function_wrapper(request, "Request.__init__", lambda w, i, a, k: w(*a, **k))
    try:
        assert shapes.Param("fakevllm.request:Request.__init__", "eos_token_id").observe(live).value == shapes.REQUIRED
    finally:
        request.Request.__init__ = original


def test_a_resolved_string_is_where_its_implementation_is_defined(tree, live):
    check = shapes.Registered("fakevllm.spec:CONFIGS", "extract_hidden_states", then="impl")
    static, alive = check.observe(StaticSource(DirTree(tree))), check.observe(live)
    assert static == (shapes.PRESENT, "fakevllm/impl/configs.py:1")
    assert alive.value == shapes.PRESENT and alive.where.endswith(static.where)  # live: the file's full path
    dangling = shapes.Branch("fakevllm.runner:Runner.__init__", "dangling").observe(StaticSource(DirTree(tree)))
    assert dangling == (shapes.UNRESOLVED, "fakevllm/runner.py:11")  # the branch that names it
