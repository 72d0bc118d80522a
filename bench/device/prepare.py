#!/usr/bin/env python3
"""Prepare, on a machine with network, what a GPU host without network needs to run one vLLM release
and the extractor.

    python3 bench/device/prepare.py                      # vLLM 0.34.0 (the default release)
    python3 bench/device/prepare.py --vllm 0.33.0        # another release
    python3 bench/device/prepare.py --vllm 0.20.0 --ray  # ... and Ray, for the data-parallel stage
    python3 bench/device/prepare.py --triton             # ... and the Triton the release's torch pins
    python3 bench/device/prepare.py --image-packages FILE  # leave out what the host's image holds

The host this prepares for has Python 3.12, torch 2.11.0+cu130 (``DEVICE_TORCH``) and no network, and
its transport carries at most 64 MiB at a time. Everything travels as *bundles*: a bundle is an uncompressed tar of wheels (wheels
are already compressed) cut into parts of 56 MiB, ``.gpu/<bundle>/pN`` (``.gpu/`` is git-ignored): a part travels
beside the checkout itself (about 6 MiB), and the two must fit in the 64 MiB.
One transfer carries one part and copies it into ``/tmp/vw/<bundle>/``; ``install.sh`` joins the
parts, checks the tar's sha256 and installs the wheels with pip (no index, no dependencies).

Bundles for a release R:

* ``vllm-R``: vLLM's CUDA wheel without FlashAttention-2's kernels (Hopper runs FA3) and the Rust
  front end (``vllm-rs``, used only when asked for by an environment variable); every requirement
  the device image lacks or holds at another version than pip resolves for R (pip resolves
  ``vllm==R``'s requirements here, less what the extractor's path never imports: ``NOT_IMPORTED``;
  a pin the index lacks is relaxed by scripts/pins.py's rule and said); the extractor's
  ``[speculators-05]`` extra (``datasets``, for ``--format speculators-0.5``), resolved beside those
  pins, into the same site; speculators 0.3.0 and 0.4.0 (installed apart, one folder each, no
  requirements); speculators 0.9.0 in a folder of its own with what it needs that neither the image
  nor the site holds (as ``scripts/vllm_venv.py --speculators-only 0.9.0 --with-requirements-of``
  lays it out; the site's versions stand, its transformers above 0.9.0's cap included). A few MiB in
  all, and resolved per release, so they travel in this bundle rather than one of their own.
* ``torch-T``, only where R pins another torch than the image's: that torch, the torchvision R pins,
  and the NCCL that torch pins (a newer torch links NCCL functions the image's NCCL lacks, and
  Python loads extensions with every symbol bound). The CUDA 13 runtime libraries, cuDNN and
  cuSPARSELt stay the image's (same major versions; docs/benchmarks.md says what that leaves).
* ``triton-X`` with ``--triton``: the Triton that torch pins (the image's serves eager runs).
* ``ray`` with ``--ray``: Ray as the extractor's ``[ray]`` extra pins it, and msgpack.

bench/device/README.md gives the steps, in order.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu"
BUILD = ROOT / ".cache" / "gpu"
PART = 56 * 1024 * 1024
DEVICE_TORCH = "2.11.0"
PYTHON = "3.12"
LEFT_OUT = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
# vLLM requirements the extractor's path never imports (media decoders, kernels of models and formats
# it does not run, the torch family, which travels in the torch bundle). Everything else vLLM
# requires travels: on an H200 vLLM 0.34.0 imported xgrammar's apache-tvm-ffi, FlashInfer (its V2
# sampler) and CUTLASS's DSL (the FlashAttention backend, warm-up) on a plain Llama.
NOT_IMPORTED = {"pynvvideocodec", "torchcodec", "tilelang", "tokenspeed-mla", "tokenspeed-triton", "humming-kernels",
                "fastsafetensors", "instanttensor", "z3-solver", "nvidia-cutlass-dsl-libs-cu12", "torch", "torchaudio", "torchvision", "triton",
                "numba", "opencv-python-headless"}
# Requirements resolved anew even where the image has the package: the versions vLLM's own
# install would bring (the image's transformers 5.17 / huggingface_hub 1.x predate them).
ALWAYS = {"transformers", "huggingface-hub", "tokenizers"}
# What torch's own requirements bring (CUDA runtime libraries the image has at the same major versions;
# the NCCL torch pins travels in the torch bundle).
TORCH_BUNDLE = {"cuda-toolkit", "cuda-bindings", "cuda-pathfinder", "nvidia-cublas", "nvidia-cuda-cupti",
                "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile",
                "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-nccl-cu13",
                "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "nvidia-cuda-nvcc", "nvidia-cuda-crt",
                "nvidia-nvvm", "nvidia-cuda-cccl"}
SPECULATORS = ["speculators==0.3.0", "speculators==0.4.0"]
# speculators' trainer line, laid out with its requirements (tests/e2e/test_formats.py's TRAINER_PROOF_RELEASES)
TRAINER_SPECULATORS = ["speculators==0.9.0"]
EXTRA = ["loguru==0.7.3"]  # speculators' logger
RAY = ["ray==2.60.0", "msgpack==1.2.4"]
# every manylinux tag up to glibc 2.39 (the device's Python accepts them all; pip matches tags exactly)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                "manylinux1_x86_64"]
# the host image's packages (--image-packages): one name a line (`pip list --format=freeze` works) or one
# line `Packages: a, b, c.`; what it lists does not travel, unless ALWAYS or pinned otherwise
IMAGE_PACKAGES: Path | None = None


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def requirement_name(requirement: str) -> str:
    return norm(re.split(r"[\s<>=!~;\[(]", requirement.strip())[0])


def pip_target_args() -> list[str]:
    args = ["--python-version", PYTHON, "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def fetch(folder: Path, requirement: str) -> Path:
    """The wheel of ``name==version`` in ``folder``, downloaded first when it is not there yet."""
    name, version = requirement.split("==")

    def present() -> Path | None:
        return next((p for p in folder.glob("*.whl")
                     if norm(p.name.split("-")[0]) == norm(name) and p.name.split("-")[1] == version), None)

    if present() is None:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_target_args(),
                        "-d", str(folder), requirement], check=True)
    wheel = present()
    if wheel is None:
        raise SystemExit(f"pip downloaded no wheel named {requirement} into {folder}")
    return wheel


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(name).decode().splitlines()
    return [line.split(": ", 1)[1] for line in lines if line.startswith("Requires-Dist: ") and "extra ==" not in line]


def pinned(wheel: Path, package: str) -> str:
    for requirement in requirements(wheel):
        match = re.match(rf"{package}\s*==\s*([\w.+]+)", requirement, re.I)
        if match:
            return match.group(1)
    raise SystemExit(f"{wheel.name} pins no {package}")


def device_packages() -> set[str]:
    text = IMAGE_PACKAGES.read_text() if IMAGE_PACKAGES and IMAGE_PACKAGES.exists() else ""
    if "Packages: " in text:
        listed = text.split("Packages: ")[-1].split("\n")[0].rstrip(".").split(",")
    else:
        listed = [line.split("==")[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {norm(name) for name in listed if name.strip()}


def pip_report(wanted: list[str], folder: Path, constraints: list[str] = ()) -> list[tuple[str, str]]:
    """(name, version) of every package pip installs for ``wanted`` on the device's Python and
    platforms, held to ``constraints``; cached in ``folder`` until ``wanted`` or ``constraints`` change."""
    folder.mkdir(parents=True, exist_ok=True)
    report, listing, held = folder / "resolved.json", folder / "requirements.txt", folder / "constraints.txt"
    asked = ("\n".join(wanted) + "\n", "".join(c + "\n" for c in constraints))
    if not report.exists() or (listing.read_text(), held.read_text() if held.exists() else "") != asked:
        listing.write_text(asked[0])
        held.write_text(asked[1])
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), *pip_target_args(), "--target", str(folder / "unused"),
                        "-r", str(listing), "-c", str(held)], check=True)
    return [(norm(item["metadata"]["name"]), item["metadata"]["version"])
            for item in json.loads(report.read_text())["install"]]


def resolve(vllm_wheel: Path, cache: Path) -> list[str]:
    """``name==version`` for each requirement of the release pip resolves here that the device needs;
    a pin the index does not serve is relaxed as ``scripts/vllm_venv.py --cuda`` does (scripts/pins.py)."""
    listing = cache / "requirements.txt"
    if listing.exists() and (cache / "resolved.json").exists():
        wanted = listing.read_text().split("\n")[:-1]  # decided once: reusing it asks the index nothing
    else:
        sys.path.insert(0, str(ROOT / "scripts"))
        from pins import index_versions, relax_unavailable

        wanted = [r for r in requirements(vllm_wheel) if requirement_name(r) not in NOT_IMPORTED]
        wanted, relaxed = relax_unavailable(wanted, lambda name: index_versions(sys.executable, name, PYTHON), PYTHON)
        for pin in relaxed:
            print(f"prepare: relaxed pin {pin.name}=={pin.pinned} -> {pin.chosen} ({pin.rule})")
    have = device_packages()
    resolved = without_cutlass_dsl_lacking_cuda13(pip_report(wanted, cache))
    return [f"{name}=={version}" for name, version in resolved
            if not (name in NOT_IMPORTED or name in TORCH_BUNDLE or (name in have and name not in ALWAYS))]


def without_cutlass_dsl_lacking_cuda13(resolved: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``resolved`` less CUTLASS's DSL where it would travel without its CUDA 13 libraries.

    A release that asks the DSL without the ``cu13`` extra (0.20.0) gets the CUDA 12 flavour, which
    stays here (``NOT_IMPORTED``); the DSL alone then fails vLLM's engine start on an H200 ("No CTK
    flavor installed"), while without it vLLM 0.20.0 starts and serves. 0.33.0 and 0.34.0 ask ``[cu13]``.
    """
    names = {name for name, _ in resolved}
    if "nvidia-cutlass-dsl-libs-cu13" in names:
        return resolved
    return [(name, version) for name, version in resolved if not name.startswith("nvidia-cutlass-dsl")]


def resolve_beside(wanted: list[str], folder: Path, site: list[str], constraints: list[str] = ()) -> list[str]:
    """``name==version`` for what ``wanted`` needs that neither the device image nor ``site`` (the
    ``name==version`` list already travelling) holds; the versions ``site`` holds stand."""
    held = device_packages() | NOT_IMPORTED | TORCH_BUNDLE | {norm(r.split("==")[0]) for r in site}
    return [f"{name}=={version}" for name, version in pip_report(wanted, folder, constraints) if name not in held]


def extra_requirements(extra: str) -> list[str]:
    """The requirements of this project's ``[extra]`` (pyproject.toml)."""
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]


def slim_vllm(wheel: Path, dest: Path) -> Path:
    """The wheel less ``LEFT_OUT``, its RECORD kept consistent with what ships."""
    slim = dest / wheel.name
    if slim.exists():
        return slim
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim.with_suffix(".part"), "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename in LEFT_OUT:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line + b"\n" for line in data.splitlines()
                                if not any(line.startswith(left.encode() + b",") for left in LEFT_OUT))
            out.writestr(info, data)
    slim.with_suffix(".part").rename(slim)
    return slim


def bundle(name: str, files: dict[str, Path]) -> list[Path]:
    """Tar ``files`` (archive name -> path) and cut the tar into ``.gpu/<name>/pN``; the last part
    holds ``<name>.sha256``."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for arcname, path in sorted(files.items()):
            tar.add(path, arcname=arcname)
    blob = data.getvalue()
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    parts = []
    for index, start in enumerate(range(0, len(blob), PART), start=1):
        part = folder / f"p{index}"
        part.mkdir(parents=True)
        (part / f"{name}.tar.{index:02d}").write_bytes(blob[start:start + PART])
        parts.append(part)
    (parts[-1] / f"{name}.sha256").write_text(hashlib.sha256(blob).hexdigest() + "\n")
    (parts[-1] / f"{name}.parts").write_text(f"{len(parts)}\n")
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default="0.34.0", help="the vLLM release (its CUDA wheel from PyPI)")
    parser.add_argument("--triton", action="store_true", help="also the Triton that the release's torch pins")
    parser.add_argument("--ray", action="store_true", help="also Ray, for the data-parallel stage")
    parser.add_argument("--image-packages", type=Path, help="the GPU host image's packages (IMAGE_PACKAGES)")
    args = parser.parse_args()
    global IMAGE_PACKAGES
    IMAGE_PACKAGES = args.image_packages
    release = args.vllm
    cache = BUILD / f"vllm-{release}"
    vllm_wheel = fetch(cache / "wheels", f"vllm=={release}")
    slim = slim_vllm(vllm_wheel, cache)
    files = {f"wheels/{slim.name}": slim}
    site = resolve(vllm_wheel, cache) + EXTRA
    trainers = {r: fetch(BUILD / "speculators" / r.split("==")[1], r) for r in TRAINER_SPECULATORS}
    # the [speculators-05] extra, held to the site's versions and to the ranges of the trainer that
    # reads the index it writes (0.9.0: datasets <= 5.1.0); install.sh puts it into the same site
    extra = extra_requirements("speculators-05")
    readers = [r.split(";")[0] for wheel in trainers.values() for r in requirements(wheel)
               if requirement_name(r) in {requirement_name(e) for e in extra}]
    site += resolve_beside(extra, cache / "speculators-05", site, site + readers)
    for requirement in site:
        wheel = fetch(cache / "small", requirement)
        files[f"wheels/{wheel.name}"] = wheel
    for requirement in SPECULATORS:
        wheel = fetch(BUILD / "speculators" / requirement.split("==")[1], requirement)
        files[f"speculators/{wheel.name}"] = wheel
    for requirement in trainers:  # not held to the site: 0.9.0 caps transformers below vLLM's
        version = requirement.split("==")[1]
        for needed in resolve_beside([requirement], cache / f"speculators-{version}", site):
            wheel = trainers[requirement] if needed == requirement else fetch(cache / "small", needed)
            files[f"speculators-with-requirements/{version}/{wheel.name}"] = wheel
    made = {f"vllm-{release}": bundle(f"vllm-{release}", files)}

    torch = pinned(vllm_wheel, "torch")
    if torch != DEVICE_TORCH:
        tdir = BUILD / f"torch-{torch}"
        torch_wheel = fetch(tdir, f"torch=={torch}")
        bundled = [torch_wheel, fetch(tdir, f"torchvision=={pinned(vllm_wheel, 'torchvision')}"),
                   fetch(tdir, f"nvidia-nccl-cu13=={pinned(torch_wheel, 'nvidia-nccl-cu13')}")]
        made[f"torch-{torch}"] = bundle(f"torch-{torch}", {f"wheels/{p.name}": p for p in bundled})
        if args.triton:
            triton = next(r for r in requirements(torch_wheel) if r.startswith("triton")).split(";")[0]
            found = fetch(BUILD / "triton", triton.replace("~=", "==").replace(" ", ""))
            made[f"triton-{torch}"] = bundle(f"triton-{torch}", {f"wheels/{found.name}": found})
    if args.ray:
        made["ray"] = bundle("ray", {f"wheels/{p.name}": p for p in (fetch(BUILD / "ray", r) for r in RAY)})
    for name, parts in made.items():
        for part in parts:
            size = sum(f.stat().st_size for f in part.rglob("*") if f.is_file())
            if size > 62 * 2**20:
                raise SystemExit(f"{part} is over the 64 MiB one transfer carries")
        print(f"{name}: {len(parts)} parts ({', '.join(str(p.relative_to(ROOT)) for p in parts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
