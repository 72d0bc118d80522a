"""bench/device/stages.sh: the stages its header lists are the ones it runs, bench/device/README.md
documents each, and a name it does not hold (a retired one, a typo) stops at once instead of running nothing."""
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT as _ROOT

ROOT = Path(_ROOT)
STAGES = ROOT / "bench" / "device" / "stages.sh"


def case_labels() -> list[str]:
    labels = re.findall(r"^  ([a-z0-9|-]+)\)  #", STAGES.read_text(), re.M)
    return [name for label in labels for name in label.split("|")]


def header_names() -> list[str]:
    header = STAGES.read_text().split("# Stages (")[1].split("# Results:")[0]
    return [name.strip() for line in header.splitlines()[1:]
            for name in re.match(r"#   ([a-z0-9, -]+?)\s{2,}", line).group(1).split(",")]


def test_the_header_lists_every_stage_and_the_readme_documents_each():
    assert sorted(header_names()) == sorted(case_labels())
    readme = (ROOT / "bench" / "device" / "README.md").read_text()
    assert [name for name in case_labels() if f"`{name}`" not in readme] == []


def test_an_unknown_stage_stops_before_anything_runs(tmp_path):
    proc = subprocess.run(["bash", str(STAGES), "no-such-stage"], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "no stage 'no-such-stage'" in proc.stderr
    assert "backends-vs-prefill" in proc.stderr and not (tmp_path / "out").exists()
