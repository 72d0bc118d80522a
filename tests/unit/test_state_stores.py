"""Where the engine backends keep states between vLLM's worker and the writer: vllm-engine's regions
in /dev/shm where it has room, else on disk; vllm-native's connector files in the temp dir, or the
directory VLLM_COMPAT_NATIVE_STORE names."""
import multiprocessing
import os
import time
from types import SimpleNamespace

import pytest

from hidden_states.backends import vllm_native
from hidden_states.backends.shared import regions
from hidden_states.errors import ExtractError


def fake_statvfs(free_bytes):
    def statvfs(path):
        assert path == regions.SHM
        return SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096)
    return statvfs


def test_regions_in_shared_memory_when_it_has_room(monkeypatch):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 30))
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    assert regions.regions_root(8 << 30) == regions.SHM


def test_regions_on_disk_when_shared_memory_is_small_or_missing(monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 20))  # a container's default 64 MiB /dev/shm
    assert regions.regions_root(8 << 30) is None

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert regions.regions_root(1) is None


def test_connector_files_in_the_temp_dir_unless_the_environment_names_one(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 30))  # room in /dev/shm changes nothing
    monkeypatch.delenv(vllm_native.STORE_ENV, raising=False)
    assert vllm_native.store_root() is None
    monkeypatch.setenv(vllm_native.STORE_ENV, str(tmp_path))
    assert vllm_native.store_root() == str(tmp_path)


def test_a_store_that_is_not_a_directory_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_native.STORE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ExtractError, match="VLLM_COMPAT_NATIVE_STORE=.*missing: not a writable directory"):
        vllm_native.store_root()


def test_a_connector_file_that_a_dead_engine_never_writes_is_an_error_at_once(tmp_path):
    """vLLM's engine core can exit after a request's output reached the extractor and before its file
    was written (the connector's writer failing in a worker): the wait ends when the engine has, not
    after its 300 s timeout."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"vLLM's engine ended before it wrote .*hs-0-0\.safetensors \(no file\)"):
        vllm_native._wait_until_written(str(tmp_path / "hs-0-0.safetensors"), alive=lambda: False)
    assert time.monotonic() - started < 5


def test_a_connector_file_written_before_the_engine_ended_is_read(tmp_path):
    path = tmp_path / "hs-0-0.safetensors"
    path.write_bytes(b"states")
    (tmp_path / "hs-0-0.safetensors.lock").touch()  # its writer released the lock as it ended
    assert vllm_native._wait_until_written(str(path), alive=lambda: False) == str(path)


def test_the_wait_ends_soon_after_the_engine_does(tmp_path):
    """Alive while it waits, then ended: the error comes within a few looks, long before the timeout."""
    ends = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="vLLM's engine ended before it wrote"):
        vllm_native._wait_until_written(str(tmp_path / "hs-0-0.safetensors"), alive=lambda: time.monotonic() < ends,
                                        timeout=60)
    assert 0.5 <= time.monotonic() - started < 5


def test_the_engine_is_alive_while_the_processes_llm_started_run():
    """EngineBackend.engine_alive: the processes LLM() started in this process (its engine core),
    here a real child that exits with an error, as the engine core does when its worker fails."""
    context = multiprocessing.get_context("fork")
    go = context.Event()
    child = context.Process(target=_exit_when_told, args=(go,))
    child.start()
    backend = vllm_native.VllmNativeBackend(SimpleNamespace())
    assert backend.engine_alive()  # none recorded: vLLM's engine in this process
    backend._engine_processes = [child]
    assert backend.engine_alive()
    go.set()
    child.join(30)
    assert child.exitcode == 1 and not backend.engine_alive()
    backend.close()


def test_an_engine_another_waiter_reaped_is_not_alive():
    """An engine core reaped by another waiter before multiprocessing looks: the Process then says
    ``is_alive()`` for good. The kernel, asked without reaping, knows better, so closing waits 2 s
    for the feed, not 30."""
    context = multiprocessing.get_context("fork")
    go = context.Event()
    child = context.Process(target=_exit_when_told, args=(go,))
    child.start()
    backend = vllm_native.VllmNativeBackend(SimpleNamespace())
    backend._engine_processes = [child]
    go.set()
    os.waitpid(child.pid, 0)  # reaped behind multiprocessing's back
    assert child.is_alive()  # what multiprocessing alone would say
    assert not backend.engine_alive()
    backend.close()


def _exit_when_told(go) -> None:
    go.wait(30)
    os._exit(1)
