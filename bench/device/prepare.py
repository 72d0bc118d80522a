#!/usr/bin/env python3
"""Prepare, on this machine, everything the lent H200 needs to run vLLM and the extractor.

    python3 bench/device/prepare.py          # -> .gpu/p1 .gpu/p2 .gpu/p3 (each under 60 MiB, git-ignored)
    python3 bench/device/prepare.py --ray    # ... and .gpu/p4 .gpu/p5: Ray, for the data-parallel stage

The device has Python 3.12, torch 2.11.0+cu130, transformers 5.17 and no network. vLLM 0.20.x pins
torch 2.11.0 and its PyPI wheel links CUDA 13, like the image. The wheel (244 MB) is unpacked
without FlashAttention-2's kernels (Hopper runs FA3) and recompressed with xz (119 MiB), then split;
``p3`` adds the small wheels vLLM and speculators import that the image lacks, speculators
0.3.0 / 0.4.0, and compressed-tensors 0.17 for building the INT4 checkpoint only. Three device
calls carry one part each (``carry: [".gpu/pN"]``); the third runs
``bench/device/install.sh`` (bench/device/README.md gives the exact calls).
"""
import hashlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu"
BUILD = ROOT / ".cache" / "gpu"
VLLM = "vllm==0.20.0"
PART = 59 * 1024 * 1024
LEFT_OUT = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",)  # FA2: not used on Hopper
# What vLLM 0.20 and speculators import that the device image lacks (found by import discovery
# on the device; see shared/gpu/prepare-wheelhouse.sh), plus loguru for speculators.
SMALL = ["pydantic==2.12.5", "pydantic-core==2.41.5", "annotated-types==0.7.0", "typing-inspection==0.4.2",
         "openai==2.30.0", "distro==1.9.0", "sniffio==1.3.1", "openai-harmony==0.0.8", "fastapi==0.136.3",
         "starlette==1.3.1", "xgrammar==0.2.9", "apache-tvm-ffi==0.1.15.post2", "llguidance==1.3.0",
         "msgspec==0.20.0", "pyzmq==27.1.0", "cbor2==5.7.1", "pybase64==1.4.3", "cachetools==6.2.2",
         "gguf==0.17.1", "partial-json-parser==0.2.1.1.post7", "lm-format-enforcer==0.11.3", "interegular==0.3.3",
         "loguru==0.7.3", "compressed-tensors==0.15.0.1",  # the compressed-tensors vLLM 0.20 pins
         # --format speculators-0.5 writes its index with datasets (the image has pyarrow, fsspec, xxhash)
         "datasets==4.4.1", "dill==0.4.0", "multiprocess==0.70.18"]
# Only for building the INT4 checkpoint (tiny_model.QUANTIZED: 0.17's checkpoint converters), installed
# apart from vLLM (bench/device/install.sh) so that vLLM loads it with the version it pins.
BUILD_ONLY = ["compressed-tensors==0.17.0"]
SPECULATORS = ["speculators==0.3.0", "speculators==0.4.0"]
# Data-parallel replicas (issue 15, `stages.sh dp`, two GPUs): Ray as the extractor's `[ray]` extra
# pins it, and msgpack; the Ray wheel (79 MB) travels in two more parts, `.gpu/p4` and `.gpu/p5`.
RAY = ["ray==2.60.0", "msgpack==1.2.4"]
PLATFORMS = ["any", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64"]


def download(dest: Path, *requirements: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
               "--abi", "none", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *requirements], check=True)


def vllm_archive() -> Path:
    archive = BUILD / "vllm-0.20.0.tar.xz"
    if archive.exists():
        return archive
    download(BUILD, VLLM)
    wheel = next(BUILD.glob("vllm-0.20.0-*.whl"))
    with zipfile.ZipFile(wheel) as zf, tarfile.open(archive.with_suffix(".part"), "w:xz", preset=9) as tar:
        for info in zf.infolist():
            if info.filename in LEFT_OUT or info.is_dir():
                continue
            data = zf.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # keep RECORD consistent with what ships
                data = b"".join(line + b"\n" for line in data.splitlines()
                                if not any(line.startswith(left.encode()) for left in LEFT_OUT))
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            member.mode = 0o755 if info.filename.endswith(".so") else 0o644
            tar.addfile(member, fileobj=__import__("io").BytesIO(data))
    archive.with_suffix(".part").rename(archive)
    return archive


def ray_parts() -> list[Path]:
    """Ray's wheel split in two parts (``ray.whl.0``, ``ray.whl.1``, its sha256 and msgpack beside)."""
    wheels = BUILD / "ray"
    download(wheels, *RAY)
    wheel = next(wheels.glob("ray-*.whl"))
    data = wheel.read_bytes()
    parts = [OUT / "p4", OUT / "p5"]
    half = (len(data) + 1) // 2
    for index, part in enumerate(parts):
        part.mkdir(parents=True)
        (part / f"ray.whl.{index}").write_bytes(data[index * half:(index + 1) * half])
    (parts[1] / "ray.whl.name").write_text(wheel.name + "\n")
    (parts[1] / "ray.whl.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    shutil.copy(next(wheels.glob("msgpack-*.whl")), parts[1])
    return parts


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    parts = [OUT / "p1", OUT / "p2", OUT / "p3"]
    for part in parts:
        part.mkdir(parents=True)
    archive = vllm_archive()
    data = archive.read_bytes()
    (parts[2] / "vllm.tar.xz.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    chunks = [data[i:i + PART] for i in range(0, len(data), PART)]
    if len(chunks) > 3:
        raise SystemExit(f"{archive} needs {len(chunks)} parts of {PART} bytes")
    for index, chunk in enumerate(chunks):
        (parts[index] / f"vllm.tar.xz.{index}").write_bytes(chunk)
    download(parts[2] / "wheels", *SMALL)
    download(parts[2] / "build-only", *BUILD_ONLY)
    for requirement in SPECULATORS:  # pip resolves one version of a name per call
        download(parts[2] / "speculators", requirement)
    if "--ray" in sys.argv[1:]:
        parts += ray_parts()
    for part in parts:
        size = sum(f.stat().st_size for f in part.rglob("*") if f.is_file())
        print(f"{part.relative_to(ROOT)}: {size / 2**20:.1f} MiB")
        if size > 62 * 2**20:
            raise SystemExit(f"{part} is over the 64 MiB a device call carries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
