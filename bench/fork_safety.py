#!/usr/bin/env python3
"""Can a child forked after this step still use CUDA? One fresh interpreter per step.

    python bench/fork_safety.py

vLLM forks its engine core (and, unless told otherwise, its workers). Torch refuses CUDA in a
child forked after the parent asked the CUDA runtime anything ("Cannot re-initialize CUDA in
forked subprocess"). Each row runs its step in a new process, forks, and touches CUDA in the child.
"""
import subprocess
import sys

STEPS = {
    "nothing": "",
    "import vllm": "import vllm",
    "vllm_compat.apply()": "import vllm_compat; vllm_compat.apply()",
    "apply() + import vLLM's engine": "import vllm_compat; vllm_compat.apply(); from vllm import LLM",
    "torch.cuda.is_available()": "import torch; torch.cuda.is_available()",
    "torch.cuda.device_count()": "import torch; torch.cuda.device_count()",
}

CHILD = """
import os, sys
{step}
pid = os.fork()
if pid == 0:
    try:
        import torch
        torch.zeros(1, device="cuda")
        os._exit(0)
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[0][:80])
        os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def main() -> int:
    print("| before the fork | CUDA in the forked child |\n|---|---|")
    for name, step in STEPS.items():
        proc = subprocess.run([sys.executable, "-c", CHILD.format(step=step)], capture_output=True, text=True)
        detail = proc.stdout.strip() or (proc.stderr.strip().splitlines() or [""])[-1]
        print(f"| {name} | {'works' if proc.returncode == 0 else 'fails: ' + detail[:100]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
