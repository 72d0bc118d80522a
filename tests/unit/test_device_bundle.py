"""The GPU bundles (bench/device/prepare.py, install.sh, torch_site.sh): what a release's bundle resolves
beside vLLM's requirements, that install.sh lays speculators 0.9.0 out so scripts/vllm_venv.py reuses it
with no index (the device has none), and that a release's stages get the carried torch only where the
release pins it."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = load("device_prepare", ROOT / "bench" / "device" / "prepare.py")


def cached_report(folder: Path, wanted: list[str], constraints: list[str], installed: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    (folder / "requirements.txt").write_text("\n".join(wanted) + "\n")
    (folder / "constraints.txt").write_text("".join(c + "\n" for c in constraints))
    (folder / "resolved.json").write_text(json.dumps(
        {"install": [{"metadata": {"name": n, "version": v}} for n, v in installed.items()]}))


def test_resolve_beside_keeps_only_what_neither_image_nor_site_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "device_packages", lambda: {"pyarrow", "pandas"})
    monkeypatch.setattr(prepare.subprocess, "run", lambda *a, **k: pytest.fail("the cached report was not reused"))
    site = ["dill==0.4.1", "huggingface-hub==2.4.0"]
    cached_report(tmp_path / "extra", ["datasets>=4"], site, {
        "datasets": "5.1.0", "dill": "0.4.1", "huggingface_hub": "2.4.0", "pyarrow": "26.0.1", "pandas": "3.1.1",
        "torch": "2.14.0", "nvidia-nccl-cu13": "2.30.7", "multiprocess": "0.70.19"})
    assert prepare.resolve_beside(["datasets>=4"], tmp_path / "extra", site, site) == [
        "datasets==5.1.0", "multiprocess==0.70.19"]


def test_resolve_leaves_out_cutlass_dsl_without_its_cuda13_flavour(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "device_packages", lambda: set())
    # vLLM 0.20.0 asks the DSL without [cu13]: only the CUDA 12 libraries come, which stay here
    cached_report(tmp_path / "r020", ["vllm-requirements"], [], {
        "nvidia-cutlass-dsl": "4.8.1", "nvidia-cutlass-dsl-libs-base": "4.8.1",
        "nvidia-cutlass-dsl-libs-core": "4.8.1", "nvidia-cutlass-dsl-libs-cu12": "4.8.1", "xgrammar": "0.2.1"})
    monkeypatch.setattr(prepare, "requirements", lambda wheel: ["vllm-requirements"])
    assert prepare.resolve(Path("vllm.whl"), tmp_path / "r020") == ["xgrammar==0.2.1"]
    # the negative: 0.34.0 asks [cu13], and the DSL travels with its CUDA 13 libraries
    cached_report(tmp_path / "r034", ["vllm-requirements"], [], {
        "nvidia-cutlass-dsl": "4.8.0", "nvidia-cutlass-dsl-libs-cu13": "4.8.0", "xgrammar": "0.2.1"})
    assert prepare.resolve(Path("vllm.whl"), tmp_path / "r034") == [
        "nvidia-cutlass-dsl==4.8.0", "nvidia-cutlass-dsl-libs-cu13==4.8.0", "xgrammar==0.2.1"]


def test_pip_report_resolves_again_when_the_request_changes(tmp_path, monkeypatch):
    cached_report(tmp_path / "r", ["datasets>=4"], [], {"datasets": "5.2.0"})
    asked = []

    def fake_pip(cmd, check):
        asked.append(cmd)
        (tmp_path / "r" / "resolved.json").write_text(json.dumps(
            {"install": [{"metadata": {"name": "datasets", "version": "5.1.0"}}]}))

    monkeypatch.setattr(prepare.subprocess, "run", fake_pip)
    assert prepare.pip_report(["datasets>=4"], tmp_path / "r") == [("datasets", "5.2.0")]
    assert not asked
    assert prepare.pip_report(["datasets>=4"], tmp_path / "r", ["datasets<=5.1.0"]) == [("datasets", "5.1.0")]
    assert len(asked) == 1 and (tmp_path / "r" / "constraints.txt").read_text() == "datasets<=5.1.0\n"


def test_the_extra_it_carries_is_pyprojects():
    assert prepare.extra_requirements("speculators-05") == ["datasets>=4"]
    assert prepare.requirement_name("datasets<=5.1.0,>=4.0.0") == "datasets"
    assert prepare.requirement_name("fsspec[http] (>=2023)") == "fsspec"


def make_wheel(folder: Path, name: str, version: str) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(n, text)
    return path


def test_install_lays_out_speculators_09_as_vllm_venv_reuses_it(tmp_path, monkeypatch):
    wheels = tmp_path / "built"
    wheels.mkdir()
    tar = tmp_path / "vllm-9.9.9.tar"
    with tarfile.open(tar, "w") as out:
        out.add(make_wheel(wheels, "datasets", "5.1.0"), "wheels/datasets-5.1.0-py3-none-any.whl")
        out.add(make_wheel(wheels, "speculators", "0.3.0"), "speculators/speculators-0.3.0-py3-none-any.whl")
        for name in ("speculators", "hs_connectors"):
            out.add(make_wheel(wheels, name, "0.9.0"),
                    f"speculators-with-requirements/0.9.0/{name}-0.9.0-py3-none-any.whl")
    received = tmp_path / "vw" / "vllm-9.9.9"
    received.mkdir(parents=True)
    shutil.copy(tar, received / "vllm-9.9.9.tar.01")
    (received / "vllm-9.9.9.parts").write_text("1\n")
    (received / "vllm-9.9.9.sha256").write_text(__import__("hashlib").sha256(tar.read_bytes()).hexdigest() + "\n")
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_venv

    # install.sh's python3 needs pip (the matrix venvs have none): the interpreter vllm_venv.py uses for pip
    env = {**os.environ, "PATH": f"{Path(vllm_venv.pip_python()).parent}{os.pathsep}{os.environ['PATH']}",
           "W": str(tmp_path / "vw"), "SITE": str(tmp_path / "site"), "SPEC_ROOT": str(tmp_path / "cache" / "speculators")}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device" / "install.sh"), "vllm-9.9.9"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "datasets" / "__init__.py").exists()
    spec09 = tmp_path / "cache" / "speculators" / "0.9.0"
    assert {p.name for p in spec09.iterdir()} >= {"speculators", "hs_connectors", ".complete"}
    assert (tmp_path / "cache" / "speculators" / "0.3.0" / ".complete").read_text() == "0.3.0\n"
    # the tests ask for the folder with their sys.executable: python3 -m pytest's on the device
    python = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], env=env,
                            capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(vllm_venv, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(vllm_venv, "run", lambda *cmd, **kw: pytest.fail(f"asked the index: {cmd}"))
    monkeypatch.setattr(vllm_venv, "missing_requirements", lambda *a: pytest.fail("resolved again"))
    assert vllm_venv.build_speculators("0.9.0", python) == spec09
    assert vllm_venv.build_speculators("0.3.0") == tmp_path / "cache" / "speculators" / "0.3.0"


def torch_site(site: Path, torch_site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "device" / "torch_site.sh"), str(site), str(torch_site_dir)],
                          capture_output=True, text=True)


def installed_vllm(root: Path, release: str, torch: str) -> Path:
    """A release site as install.sh leaves it: vLLM's dist-info with its torch pin."""
    info = root / f"site-{release}" / f"vllm-{release}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}\n"
                                   f"Requires-Dist: torch=={torch}\nRequires-Dist: torchvision==0.26.0\n")
    return info.parent


def test_the_carried_torch_goes_only_to_the_release_that_pins_it(tmp_path):
    carried = tmp_path / "torch-site"
    for info in ("torch-2.14.0.dist-info", "torchvision-0.29.0.dist-info"):
        (carried / info).mkdir(parents=True)
    # 0.34.0 pins the carried 2.14.0: its stages import it
    own = torch_site(installed_vllm(tmp_path, "0.34.0", "2.14.0"), carried)
    assert (own.returncode, own.stdout.strip(), own.stderr) == (0, str(carried), "")
    # 0.20.0 pins the image's 2.11.0: 2.14.0 on its path broke its kernels' import on the H200
    image = torch_site(installed_vllm(tmp_path, "0.20.0", "2.11.0"), carried)
    assert (image.returncode, image.stdout) == (0, "")
    assert "pins torch 2.11.0" in image.stderr and "holds 2.14.0" in image.stderr
    # no torch carried: nothing to choose, nothing said
    none = torch_site(tmp_path / "site-0.20.0", tmp_path / "no-torch-site")
    assert (none.returncode, none.stdout, none.stderr) == (0, "", "")


def test_torch_site_refuses_a_missing_release_site(tmp_path):
    proc = torch_site(tmp_path / "site-0.99.0", tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no release site" in proc.stderr
