"""``--consumer`` for any consumer of vLLM internals: small consumers (a directory, a wheel, an sdist,
an installed-looking distribution) in tmp_path, checked against a small vLLM tree; read, never imported."""
import io
import json
import subprocess
import tarfile

import pytest
from packaging.requirements import Requirement

from tests.unit.synthetic_wheels import VLLM_FILES, declaring_wheel, make_wheel
from vllm_compat import callsites, wheels
from vllm_compat.cli import main
from vllm_compat.consumer_tree import ConsumerError, module_of, resolve
from vllm_compat.probes.static import DirTree, StaticSource

VLLM = dict(VLLM_FILES, **{"vllm/v1/__init__.py": "", "vllm/v1/core.py": "class Engine:\n    def step(self, n):\n        pass\n"})

# a package with a subpackage, a relative import, a file that does not mention vLLM, and one break:
# `Gone` is not in the small vLLM below
CONSUMER = {
    "acme/__init__.py": "",
    "acme/plain.py": "X = 1\n",
    "acme/sub/__init__.py": "",
    "acme/sub/hooks.py": ("from vllm.v1.core import Engine\n"
                          "from vllm.v1.request import Gone\n"
                          "from .helpers import H\n"),
    "acme/sub/helpers.py": "import vllm.v1.request\nH = vllm.v1.request.Request\n",
}


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def vllm_tree(tmp_path):
    return _write(tmp_path / "vllm-src", VLLM)


def _sdist(path, prefix, files):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{prefix}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_package_directory(tmp_path):
    root = _write(tmp_path / "src", CONSUMER)
    consumer = resolve(str(root / "acme"))
    assert (consumer.name, consumer.version, consumer.packages) == ("acme", "", ("acme",))
    assert sorted(consumer.files()) == ["acme/sub/helpers.py", "acme/sub/hooks.py"]  # any depth, mentions vllm
    assert resolve(str(root)).packages == ("acme",)  # the directory holding it: same package
    assert not consumer.applies_shim


def test_module_and_package_of_a_file():
    assert module_of("a/b/c.py") == ("a.b.c", "a.b")
    assert module_of("a/__init__.py") == ("a", "a")


def test_a_wheel_and_an_sdist(tmp_path):
    meta = "Metadata-Version: 2.1\nName: acme-tools\nVersion: 1.2.3\n"
    wheel = make_wheel(tmp_path / "acme_tools-1.2.3-py3-none-any.whl",
                       dict(CONSUMER, **{"acme_tools-1.2.3.dist-info/METADATA": meta,
                                         "acme_tools-1.2.3.dist-info/top_level.txt": "acme\n"}))
    consumer = resolve(str(wheel))
    assert (consumer.label, consumer.packages) == ("acme-tools==1.2.3", ("acme",))
    assert sorted(consumer.files()) == ["acme/sub/helpers.py", "acme/sub/hooks.py"]
    src = {f"src/{name}": text for name, text in CONSUMER.items()}
    sdist = _sdist(tmp_path / "acme_tools-1.2.3.tar.gz", "acme_tools-1.2.3", dict(src, **{"PKG-INFO": meta}))
    consumer = resolve(str(sdist))
    assert (consumer.label, consumer.packages) == ("acme-tools==1.2.3", ("acme",))
    assert sorted(consumer.files()) == ["acme/sub/helpers.py", "acme/sub/hooks.py"]


def test_an_installed_distribution(tmp_path, monkeypatch):
    site = _write(tmp_path / "site", CONSUMER)
    info = site / "acme_tools-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tools\nVersion: 2.0\n")
    (info / "top_level.txt").write_text("acme\n")
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in CONSUMER))
    monkeypatch.syspath_prepend(str(site))
    consumer = resolve("acme-tools")
    assert (consumer.label, consumer.packages) == ("acme-tools==2.0", ("acme",))
    assert "installed, not imported" in consumer.source
    assert sorted(consumer.files()) == ["acme/sub/helpers.py", "acme/sub/hooks.py"]
    assert resolve("acme-tools==2.0").label == "acme-tools==2.0"


def test_call_sites_of_a_consumer_name_its_file_line(tmp_path, vllm_tree):
    consumer = resolve(str(_write(tmp_path / "src", CONSUMER) / "acme"))
    sites = callsites.check_consumer(StaticSource(DirTree(vllm_tree)), [], consumer)
    problems = [(c.site, c.target) for c in sites if c.status == callsites.PROBLEM]
    assert problems == [("acme/sub/hooks.py:2", "vllm.v1.request:Gone")]
    assert {c.consumer for c in sites} == {"acme"}
    assert any(c.target == "vllm.v1.core:Engine" and c.status == callsites.OK for c in sites)


def test_a_break_under_type_checking_is_a_warning_not_a_problem(tmp_path, vllm_tree, capsys):
    """An import only type checkers run (``if TYPE_CHECKING:``) cannot fail the consumer: said as a
    warning, and the audit passes; the same import outside it is a problem."""
    typed = dict(CONSUMER, **{"acme/sub/hooks.py": ("from typing import TYPE_CHECKING\n"
                                                     "from vllm.v1.core import Engine\n"
                                                     "if TYPE_CHECKING:\n"
                                                     "    from vllm.v1.request import Gone\n")})
    acme = str(_write(tmp_path / "src", typed) / "acme")
    sites = callsites.check_consumer(StaticSource(DirTree(vllm_tree)), [], resolve(acme))
    assert [(c.site, c.status) for c in sites if c.status != callsites.OK] == [
        ("acme/sub/hooks.py:4", callsites.WARNING)]
    main(["audit", "--vllm", str(vllm_tree), "--consumer", acme])  # exit 1 here: the small vLLM lacks adapters' targets
    text = capsys.readouterr().out
    assert "0 problems, 1 warning (read from" in text
    assert "warning: acme/sub/hooks.py:4 -> vllm.v1.request:Gone" in text
    assert "in acme (it would break)" not in text


def test_cli_groups_a_consumer_and_its_json(tmp_path, vllm_tree, capsys):
    acme = str(_write(tmp_path / "src", CONSUMER) / "acme")
    assert main(["audit", "--vllm", str(vllm_tree), "--consumer", acme]) == 1
    text = capsys.readouterr().out
    assert "consumer acme (acme; does not run vllm_compat.apply()" in text
    assert "PROBLEM: acme/sub/hooks.py:2 -> vllm.v1.request:Gone" in text
    assert "PROBLEMS: 1 in acme (it would break)" in text
    assert "other touch points" not in text  # speculators' generator is not audited
    assert "skipped for acme" in text
    main(["audit", "--vllm", str(vllm_tree), "--consumer", acme, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == 6 and [c["name"] for c in out["consumers"]] == ["acme"]
    assert out["consumer"] is None and out["engine_steps"] == []
    assert [c["site"] for c in out["call_sites"] if c["consumer"] == "acme" and c["status"] == "PROBLEM"] == [
        "acme/sub/hooks.py:2"]


def test_a_consumer_that_applies_the_shim_is_marked(tmp_path):
    files = dict(CONSUMER, **{"acme/boot.py": "import vllm\nimport vllm_compat\nvllm_compat.apply()\n"})
    assert resolve(str(_write(tmp_path / "src", files) / "acme")).applies_shim


def test_unknown_package_is_a_usage_error_naming_the_flag(capsys, tmp_path, vllm_tree):
    assert main(["audit", "--vllm", str(vllm_tree), "--consumer", "no-such-consumer-pkg"]) == 2
    err = capsys.readouterr().err
    assert "--consumer 'no-such-consumer-pkg': no-such-consumer-pkg is not installed" in err


def test_unknown_release_offline_is_a_usage_error_naming_the_flag(capsys, tmp_path, vllm_tree, monkeypatch):
    monkeypatch.setenv("VLLM_COMPAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(wheels, "_run_pip", lambda args: subprocess.CompletedProcess(
        args, 1, "", "ERROR: Could not find a version\nNewConnectionError: Temporary failure in name resolution"))
    assert main(["audit", "--vllm", str(vllm_tree), "--consumer", "no-such-consumer-pkg==1.0"]) == 2
    err = capsys.readouterr().err
    assert "--consumer 'no-such-consumer-pkg==1.0': could not reach the package index" in err


def test_a_release_is_downloaded_with_pip_no_deps(tmp_path, monkeypatch):
    calls = []

    def pip(args):
        calls.append(args)
        make_wheel(tmp_path / "acme_tools-1.0-py3-none-any.whl", CONSUMER)
        return subprocess.CompletedProcess(args, 0, f"Saved {tmp_path}/acme_tools-1.0-py3-none-any.whl\n", "")

    monkeypatch.setattr(wheels, "_run_pip", pip)
    got = wheels.fetch_consumer(Requirement("acme-tools==1.0"), tmp_path)
    assert got == tmp_path / "acme_tools-1.0-py3-none-any.whl"
    assert calls[0][:3] == ["download", "--no-deps", "--only-binary=:all:"]
    assert wheels.fetch_consumer(Requirement("acme-tools==1.0"), tmp_path) == got and len(calls) == 1  # cached


def test_vllm_is_not_a_consumer(tmp_path):
    with pytest.raises(ConsumerError, match="--consumer 'vllm==1'"):
        resolve("vllm==1")


def test_a_consumer_declaring_touch_points_from_source_says_so_under_its_name(tmp_path, vllm_tree, capsys):
    """A wheel whose dist-info declares entry points of the touch-point group: the audit reads them
    (never loads them) and says so under the consumer, in text and in --json; a consumer that
    declares nothing gets no such line."""
    from vllm_compat.consumer import TOUCHPOINTS_GROUP

    wheel = declaring_wheel(tmp_path, package_source="from vllm.v1.core import Engine\n")
    main(["audit", "--vllm", str(vllm_tree), "--consumer", str(wheel)])
    text = capsys.readouterr().out
    note = (f"  note: declaring==1.0: touch points declared ({TOUCHPOINTS_GROUP}: declaring:x), read from source "
            "only (not installed: its declaration is not loaded or checked)")
    assert note in text.splitlines(), text
    assert text.index("consumer declaring==1.0") < text.index(note)
    main(["audit", "--vllm", str(vllm_tree), "--consumer", str(wheel), "--json"])
    (described,) = json.loads(capsys.readouterr().out)["consumers"]
    assert described["declaration"] == note.removeprefix("  note: ")
    main(["audit", "--vllm", str(vllm_tree), "--consumer", str(_write(tmp_path / "src", CONSUMER) / "acme")])
    assert "touch points declared" not in capsys.readouterr().out


def test_a_projects_checkout_is_read_whole_but_its_environments(tmp_path, vllm_tree):
    """A training repository's root: a src/ layout, a scripts/ folder and a namespace package are its
    code (read before, they were not: the audit said OK having checked nothing); its .venv and a
    virtual environment by another name, each holding a vLLM, are not."""
    files = {"src/trainer/__init__.py": "", "src/trainer/capture.py": "from vllm.v1.request import Gone\n",
             "scripts/run.py": "from vllm.v1.core import Engine\n",
             "plugins/hooks.py": "import vllm.v1.request\nH = vllm.v1.request.Missing\n",
             ".venv/lib/site-packages/vllm/x.py": "from vllm.v1.request import AlsoGone\n",
             "env/pyvenv.cfg": "home = /usr\n", "env/lib/vllm/y.py": "from vllm.v1.request import AlsoGone\n"}
    root = _write(tmp_path / "my-training-repo", files)
    consumer = resolve(str(root))
    assert (consumer.name, consumer.packages) == ("my-training-repo", ("plugins", "scripts", "src"))
    assert sorted(consumer.files()) == ["plugins/hooks.py", "scripts/run.py", "src/trainer/capture.py"]
    sites = callsites.check_consumer(StaticSource(DirTree(vllm_tree)), [], consumer)
    problems = sorted((c.site, c.target) for c in sites if c.status == callsites.PROBLEM)
    assert problems == [("plugins/hooks.py:2", "vllm.v1.request:Missing"), ("src/trainer/capture.py:1", "vllm.v1.request:Gone")]
