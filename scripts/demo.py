#!/usr/bin/env python3
"""The README's demo command: a CPU extraction on a tiny local model, checked against HF.

Builds (or reuses) the vLLM venv under .cache/ (scripts/vllm_venv.py), then runs
``python -m hidden_states demo`` inside it with speculators 0.3.0 on the path. Shows the demo's own
lines; third-party log noise (vLLM's INFO lines, Gloo, warnings from speculators and transformers)
goes to ``<output-dir>/demo.log`` only, unless ``--verbose``. Once the demo has passed, ends with the
commands that run the extractor on your own data in the same environment, and what each speculators
line's trainer reads. ``--help`` and a wrong flag are answered before anything is built.
"""
import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_venv  # noqa: E402

VLLM = os.environ.get("DEMO_VLLM", "0.17.0")
SPECULATORS = os.environ.get("DEMO_SPECULATORS", "0.3.0")
# Lines that are ours or that a user must see; everything else is third-party chatter.
SHOWN = re.compile(r"^(\[hidden-states\]|hidden-states:|Traceback|\s|\w*Error|\w*Exception|\| |\d+ samples|OK|MISMATCH"
                   r"|ERROR|CRITICAL|.*vllm-compat)")
ONCE = re.compile(r"^\[hidden-states\]|vllm-compat")  # shown once: every vLLM process logs the same report
QUIET_AFTER = 5.0  # seconds without a shown line before the demo says it is still working


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The demo's flags, read before anything is built: ``--help`` and a wrong flag cost nothing."""
    parser = argparse.ArgumentParser(
        prog="python3 scripts/demo.py",
        description="Extract hidden states on CPU with a tiny local model through the unmodified speculators "
                    "generator and vllm_compat.apply(), and compare every layer with HF transformers.",
        epilog=f"The first run builds vLLM {VLLM}'s venv under .cache/ (about 8 GB; minutes, from PyPI) and reuses "
               f"it after. DEMO_VLLM and DEMO_SPECULATORS pick other releases (now {VLLM} and {SPECULATORS}).")
    parser.add_argument("--output-dir", default="demo-output",
                        help="where the demo writes its model, data, states and demo.log, relative to the "
                             "repository (default: demo-output)")
    parser.add_argument("--samples", type=int, default=24, help="conversations to extract (default: 24)")
    parser.add_argument("--verbose", action="store_true",
                        help="print every line, third-party ones included (they otherwise go to demo.log only)")
    return parser.parse_args(argv)


def show_ours(stream, log, verbose: bool) -> None:
    """Copy every line to ``log``; print ours (all with ``verbose``), each once; during a silence
    longer than QUIET_AFTER, say what it is waiting on and for how long."""
    state = {"since": time.monotonic(), "said": 0.0, "stage": "starting Python, torch and vLLM"}
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(1.0):
            quiet = time.monotonic() - state["since"]
            if quiet > QUIET_AFTER and quiet - state["said"] >= 15 or (quiet > QUIET_AFTER and not state["said"]):
                state["said"] = quiet
                print(f"[demo] ... {state['stage']} ({quiet:.0f} s)", flush=True)

    threading.Thread(target=heartbeat, daemon=True).start()
    seen = set()
    for line in stream:
        log.write(line)
        text = line.rstrip("\n")
        key = re.sub(r"pid \d+", "pid", text)
        if not verbose and (not SHOWN.match(text) or (ONCE.search(text) and key in seen)):
            continue
        seen.add(key)
        print(text, flush=True)
        if text.startswith("[hidden-states]"):
            state["stage"] = text.removeprefix("[hidden-states] ").split(" (")[0][:80]
        state.update(since=time.monotonic(), said=0.0)
    done.set()


def own_data_commands(python, speculators) -> str:
    """What to run on one's own data in the demo's environment: the plan (seconds), then the extraction,
    both working as printed once the three names are filled in (tests/unit/test_plan.py runs them)."""
    prefix = f"PYTHONPATH={speculators} HF_HUB_OFFLINE=1 {python} -m hidden_states"
    flags = "--model-path MODEL_DIR --data CONVERSATIONS.jsonl --output-dir OUT_DIR"
    return ("\nTo extract your own data in the same environment (docs/getting-started.md): MODEL_DIR a checkpoint "
            "directory or a model id in the local Hugging Face cache; first the plan (seconds, no model load), "
            f"then the run:\n  {prefix} plan {flags}\n  {prefix} extract {flags}")


def next_steps(python, speculators, out: Path) -> str:
    """What to run after a demo that passed: one's own data, then the trainer of each speculators line."""
    return (own_data_commands(python, speculators)
            + f"\n\nThe files in {out / 'hidden_states'} are what speculators 0.3/0.4's trainer reads "
              "(docs/reference/output-formats.md, section --format speculators-0.3); for speculators >= 0.5 (0.9 included) add "
              "--format speculators-0.5 to the run above (the section of that name), or serve the states to its "
              "online trainer (docs/guides/serve.md).")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    print(f"[demo] preparing the vLLM {VLLM} venv (built once, cached under .cache/; minutes the first time)",
          flush=True)
    python = vllm_venv.build_venv(VLLM, rebuild=False)
    speculators = vllm_venv.build_speculators(SPECULATORS)
    # no VLLM_CPU_KVCACHE_SPACE: the extractor sizes vLLM's CPU KV cache itself, as for the command below
    env = {**os.environ, "PYTHONPATH": str(speculators), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if not args.verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning")
    out = ROOT / args.output_dir  # the demo runs in ROOT: a relative path is relative to it
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo.log", "w") as log:
        proc = subprocess.Popen([str(python), "-m", "hidden_states", "demo", "--output-dir", args.output_dir,
                                 "--samples", str(args.samples)],
                                cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        show_ours(proc.stdout, log, args.verbose)
        code = proc.wait()
    if not args.verbose:
        print(f"[demo] the whole log, third-party lines included: {out / 'demo.log'} (or rerun with --verbose)")
    # what to run next only after a demo that worked: after a failure the error above is the next step
    print(next_steps(python, speculators, out) if code == 0 else "[demo] failed: the lines above say why")
    sys.exit(code)
