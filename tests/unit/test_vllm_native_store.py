"""The vllm-native backend's connector store: in memory where /dev/shm has room, else on disk."""
import os
from types import SimpleNamespace

from hidden_states.backends import vllm_native


def fake_statvfs(free_bytes):
    def statvfs(path):
        assert path == vllm_native.SHM
        return SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096)
    return statvfs


def test_store_in_shared_memory_when_it_has_room(monkeypatch):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 30))
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    assert vllm_native.state_store_root(8 << 30) == vllm_native.SHM


def test_store_on_disk_when_shared_memory_is_small_or_missing(monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 20))  # a container's default 64 MiB /dev/shm
    assert vllm_native.state_store_root(8 << 30) is None

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert vllm_native.state_store_root(1) is None


def test_the_store_named_by_the_environment_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 30))
    monkeypatch.setenv(vllm_native.STORE_ENV, str(tmp_path))
    assert vllm_native.chosen_store_root(8 << 30) == str(tmp_path)
    monkeypatch.delenv(vllm_native.STORE_ENV)
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    assert vllm_native.chosen_store_root(8 << 30) == vllm_native.SHM


def test_a_store_that_is_not_a_directory_is_named(monkeypatch, tmp_path):
    import pytest

    from hidden_states.errors import ExtractError

    monkeypatch.setenv(vllm_native.STORE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ExtractError, match="VLLM_COMPAT_NATIVE_STORE=.*missing: not a writable directory"):
        vllm_native.chosen_store_root(1)
