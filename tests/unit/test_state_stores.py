"""Where the engine backends keep states between vLLM's worker and the writer: vllm-engine's regions
in /dev/shm where it has room, else on disk; vllm-native's connector files in the temp dir, or the
directory VLLM_COMPAT_NATIVE_STORE names."""
import os
from types import SimpleNamespace

import pytest

from hidden_states.backends import regions, vllm_native
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
