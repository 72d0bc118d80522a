"""``--model-path``: a local checkpoint directory, or a model id (``org/name``, ``org/name@revision``)
found in the local Hugging Face cache, offline: nothing is downloaded.

The cache's layout (huggingface_hub's, stable across its releases): ``<cache>/models--org--name/``
holds ``refs/<revision>`` (a file naming a commit) and ``snapshots/<commit>/`` (the files). The
cache is ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, as huggingface_hub finds it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import UsageError

_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def hub_cache(environ=os.environ) -> Path:
    """Where huggingface_hub keeps downloaded repositories."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(name):
            return Path(environ[name]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    base = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def resolve(model: str, flag: str = "--model-path", environ=os.environ) -> str:
    """``model`` when it is a directory; else, for a model id, its snapshot in the cache; else
    ``model`` as it is (the preflight names what is wrong with it). A model id not in the cache is
    one error naming it and where it was looked for."""
    if Path(model).expanduser().is_dir() or not _MODEL_ID.match(model) or model.startswith(("./", "../")):
        return model
    repo, _, revision = model.partition("@")
    revision = revision or "main"
    cache = hub_cache(environ)
    folder = cache / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    if snapshot.is_dir():
        return str(snapshot)
    found = sorted(p.name for p in (folder / "snapshots").glob("*")) if folder.is_dir() else []
    held = f" (it holds snapshots {', '.join(found)} but no revision {revision!r})" if found else ""
    raise UsageError(f"{flag} {model}: no such directory, and no model {repo} in the local Hugging Face cache "
                     f"{folder}{held}; download it first (huggingface-cli download {repo}) or give a local "
                     f"directory")


def served_name(model: str) -> str:
    """The id a server lists for ``--model-path model`` by default: a model id as given (less any
    ``@revision``: what speculators' trainer takes as ``--verifier-name-or-path``), a directory by
    its name: never a path, which would tell every client where the model lies on the host."""
    if _MODEL_ID.match(model) and not model.startswith(("./", "../")) and not Path(model).expanduser().is_dir():
        return model.partition("@")[0]
    return Path(model).expanduser().resolve().name or model
