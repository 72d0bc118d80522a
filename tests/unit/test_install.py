"""The README's install line, run as written in a fresh venv (no vLLM there): both commands it
promises are on the path and answer."""
import re
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_install_line() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"```console[^\n]*\n(.*?)\n```", section, flags=re.S)
    assert len(lines) == 1 and "\n" not in lines[0], "the README's Install section holds one command"
    return lines[0]


def test_readme_install_line_works_in_a_fresh_venv(tmp_path):
    line = readme_install_line()
    written = re.fullmatch(r'python3 -m pip install -e "\.\[([a-z0-9,-]+)\]"', line)
    assert written, f"the README's install line changed shape: {line}"
    declared = (ROOT / "pyproject.toml").read_text()
    for extra in written.group(1).split(","):
        assert re.search(rf"^{re.escape(extra)} = \[", declared, flags=re.M), f"extra [{extra}] not in pyproject.toml"
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python3"
    # the line as written, in the fresh venv, without the extras' downloads (ray, datasets): checked above
    args = ["-m", "pip", "install", "-e", "."]
    done = subprocess.run([str(python), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for command in (["vllm-compat", "adapters"], ["hidden-states", "--help"]):
        ran = subprocess.run([str(env_dir / "bin" / command[0]), *command[1:]], capture_output=True, text=True,
                             cwd=tmp_path)
        assert ran.returncode == 0, (command, ran.stderr[-2000:])
        assert ran.stdout.strip(), command
    assert "vllm" not in subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True).stdout.split()
