"""The audit's whole output, byte for byte, over every combination of consumers: speculators (absent,
installed, named with or without its source, refused), generic consumers beside it or alone, and the
bad inputs that end in exit 2. Each case's text, JSON and exit code are compared with a snapshot under
``tests/unit/golden/audit/``; the temporary directory is written ``TMP`` there.

The other audit tests pin fragments; this one pins the rest (section order, counts, the order of
call sites and findings, the JSON keys), so a change of how consumers are audited that shows in the
output fails here. A deliberate change of the output is written into the snapshots with
``VLLM_COMPAT_WRITE_GOLDEN=1`` and reviewed in the diff.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from tests.unit.synthetic_wheels import ENGINE_VLLM_FILES, make_wheel
from vllm_compat import consumer
from vllm_compat.cli import main

GOLDEN = Path(__file__).resolve().parent / "golden" / "audit"
WRITE = os.environ.get("VLLM_COMPAT_WRITE_GOLDEN") == "1"

VLLM = ENGINE_VLLM_FILES

GENERATOR_TEXT = ("from typing import TYPE_CHECKING\n"
                  "from vllm.v1.executor.abstract import Executor\n"
                  "from vllm.v1.core.sched.scheduler import Scheduler\n"
                  "from vllm.v1.request import Request\n"
                  "from vllm.v1.request import Gone\n"
                  "if TYPE_CHECKING:\n"
                  "    from vllm.v1.request import Typed\n"
                  "class VllmHiddenStatesGenerator:\n"
                  "    def __init__(self, config):\n"
                  "        self.executor = Executor(config)\n"
                  "        self.scheduler = Scheduler(config)\n"
                  "    def generate(self, ids):\n"
                  "        out = self.scheduler.schedule()\n"
                  "        Request(1, ids, None, None, 5)\n"
                  "        return out\n")

# speculators' layout: data_generation's own modules are its call sites; a deeper module and one
# outside data_generation mention vLLM too (read by a generic consumer's rules, not speculators')
SPECULATORS = {
    "speculators/__init__.py": "",
    "speculators/train.py": "from vllm.v1.request import Outside\n",
    "speculators/data_generation/__init__.py": "",
    "speculators/data_generation/vllm_hidden_states_generator.py": GENERATOR_TEXT,
    "speculators/data_generation/custom_worker.py": ("from vllm.v1.request import Request\n"
                                                     "class Mixed(Request):\n"
                                                     "    def __init__(self, request_id):\n"
                                                     "        pass\n"),
    "speculators/data_generation/deep/__init__.py": "",
    "speculators/data_generation/deep/probe.py": "from vllm.v1.request import Deep\n",
}

ACME = {
    "acme/__init__.py": "",
    "acme/hooks.py": ("from typing import TYPE_CHECKING\n"
                      "from vllm.v1.request import Request\n"
                      "from vllm.v1.request import Gone\n"
                      "if TYPE_CHECKING:\n"
                      "    from vllm.v1.request import Typed\n"),
}
SHIMMED = {
    "shimmed/__init__.py": "import vllm_compat\nvllm_compat.apply()\n",
    "shimmed/run.py": "from vllm.v1.request import Request\nRequest(1, [2], None, None, eos_token_id=3)\n",
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# name -> (arguments after `audit --vllm VLLM`, the installed speculators' version or None); in the
# arguments SPEC is the directory holding the fake speculators/, SPEC_WHEEL the same as a wheel
CASES = {
    "absent": ([], None),
    "installed": ([], "0.4.0"),
    "named_03_not_found": (["--consumer", "speculators==0.3.0"], None),
    "named_03_installed_04": (["--consumer", "speculators==0.3.0"], "0.4.0"),
    "named_04_installed": (["--consumer", "speculators==0.4.0"], "0.4.0"),
    "named_03_source": (["--consumer", "speculators==0.3.0", "--consumer-source", "SPEC"], None),
    "named_04_source": (["--consumer", "speculators==0.4.0", "--consumer-source", "SPEC"], None),
    "named_04_package_dir": (["--consumer", "speculators==0.4.0", "--consumer-source", "SPEC/speculators"], None),
    "named_04_wheel": (["--consumer", "speculators==0.4.0", "--consumer-source", "SPEC_WHEEL"], None),
    "source_only": (["--consumer-source", "SPEC"], None),
    "named_04_and_acme": (["--consumer", "speculators==0.4.0", "--consumer-source", "SPEC", "--consumer", "ACME"],
                          None),
    "acme_and_named_04_not_found": (["--consumer", "ACME", "--consumer", "speculators==0.4.0"], None),
    "acme_only": (["--consumer", "ACME"], "0.4.0"),
    "acme_and_shimmed": (["--consumer", "ACME", "--consumer", "SHIMMED"], None),
    "source_with_acme": (["--consumer-source", "SPEC", "--consumer", "ACME"], None),
    "refused_0_9_9": (["--consumer", "speculators==0.9.9"], None),
    "refused_0_2": (["--consumer", "speculators==0.2"], None),
    "named_twice": (["--consumer", "speculators==0.3.0", "--consumer", "speculators==0.4.0"], None),
    "bare_speculators": (["--consumer", "speculators"], "0.4.0"),
    "source_not_speculators": (["--consumer", "speculators==0.4.0", "--consumer-source", "ACME"], None),
}


@pytest.fixture
def world(tmp_path, monkeypatch):
    """The small vLLM, the fake speculators (as a directory and a wheel), two generic consumers, and
    no speculators importable unless a case installs it (a site directory on ``sys.path`` holding the
    package and its dist-info: found the way any install is). Touch points are declared by this
    checkout alone: another declarer installed beside it (a venv's connector package) would add its
    own lines."""
    own = [(dist, point) for dist, point in consumer._declarations() if dist == consumer.SELF]
    monkeypatch.setattr(consumer, "_declarations", lambda: own)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "speculators").exists()])
    importlib.invalidate_caches()
    if "speculators" in sys.modules or importlib.util.find_spec("speculators") is not None:
        pytest.skip("speculators is imported in this interpreter: the cases without it cannot be made")
    vllm = _write(tmp_path / "vllm-src", VLLM)
    spec = _write(tmp_path / "spec", SPECULATORS)
    paths = {"SPEC": str(spec), "SPEC_WHEEL": str(make_wheel(tmp_path / "speculators-0.4.0-py3-none-any.whl",
                                                                SPECULATORS)),
             "ACME": str(_write(tmp_path / "acme-src", ACME) / "acme"),
             "SHIMMED": str(_write(tmp_path / "shimmed-src", SHIMMED) / "shimmed")}

    def install(version: str | None):
        if version:
            site = _write(tmp_path / "site", dict(SPECULATORS, **{
                f"speculators-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}\n",
                f"speculators-{version}.dist-info/top_level.txt": "speculators\n"}))
            monkeypatch.syspath_prepend(str(site))

    return tmp_path, vllm, paths, install


def _argv(vllm: Path, args: list[str], paths: dict[str, str]) -> list[str]:
    out = []
    for arg in args:
        head, sep, tail = arg.partition("/")
        out.append(paths[head] + sep + tail if head in paths else arg)
    return ["audit", "--vllm", str(vllm), *out]


def _compare(name: str, got: str) -> None:
    path = GOLDEN / name
    if WRITE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        return
    assert path.is_file(), f"{path} missing (VLLM_COMPAT_WRITE_GOLDEN=1 writes it)"
    expected = path.read_text()
    assert got == expected, f"{name} differs from its snapshot"


@pytest.mark.parametrize("case", sorted(CASES))
def test_audit_output_matches_its_snapshot(case, world, capsys):
    tmp, vllm, paths, install = world
    args, installed = CASES[case]
    install(installed)
    argv = _argv(vllm, args, paths)
    code = main(argv)
    captured = capsys.readouterr()
    text = f"exit {code}\nstdout:\n{captured.out}stderr:\n{captured.err}".replace(str(tmp), "TMP")
    _compare(f"{case}.txt", text)
    if code == 2:
        return
    assert main([*argv, "--json"]) == code
    _compare(f"{case}.json", capsys.readouterr().out.replace(str(tmp), "TMP"))
