"""Facts about the installed transformers read from its files, never by importing it.

Importing ``transformers.configuration_utils`` imports torch (about 18 s on a 2-core machine): too
slow for the audit, which must answer in seconds. Both transformers adapters decide their need from
these reads, so ``apply()`` and ``vllm-compat audit`` of the installed vLLM state one fact the same way.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path


def package_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


def version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def has_module(package: Path, dotted: str) -> bool:
    """Whether ``transformers.<dotted>`` exists as a file or a package in ``package``."""
    path = package.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports_at_run_time(tree: ast.Module, name: str) -> bool:
    """Whether the module imports ``name`` when it runs: at top level, or under an ``if``/``try``
    other than ``if TYPE_CHECKING:``."""
    def walk(body) -> bool:
        for node in body:
            if isinstance(node, ast.Import) and any(a.name == name and a.asname is None for a in node.names):
                return True
            if isinstance(node, ast.If) and not _is_type_checking(node.test) and (walk(node.body) or walk(node.orelse)):
                return True
            if isinstance(node, ast.Try) and (walk(node.body) or any(walk(h.body) for h in node.handlers)):
                return True
        return False

    return walk(tree.body)


def class_annotations_naming(tree: ast.Module, class_names: tuple[str, ...], prefix: str) -> list[str]:
    """Names of the class-level annotations of the first class in ``class_names`` that mention ``prefix``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            return [item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and prefix in ast.unparse(item.annotation)]
    return []
