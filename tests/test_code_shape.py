"""The code's shape: modules under 500 lines, functions under 80, one job per module, and the layering.

Layering: ``quant`` <- ``loader`` <- ``tiers`` <- ``tools`` (the arrow reads "is imported by"); nothing
imports upward. quant/ and loader/ import each other relatively (they install as ``tiers.quant``
and ``tiers.loader``), so an absolute ``tiers`` import there is an upward one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for top in ("tiers", "quant", "loader", "tools", "experiments") for p in (ROOT / top).glob("**/*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_there_are_sources():
    assert len(SOURCES) > 30


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size_and_docstring(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 500, f"{path.relative_to(ROOT)}: {lines} lines; split it by responsibility"
    tree = _tree(path)
    too_long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not too_long, f"{path.relative_to(ROOT)}: functions over 80 lines: {too_long}"
    if path.name != "__init__.py" or lines > 5:
        doc = ast.get_docstring(tree)
        assert doc and doc.strip().splitlines()[0].strip(), f"{path.relative_to(ROOT)}: no docstring stating its job"


def _imports(path: Path) -> list[str]:
    """The absolute modules ``path`` imports (relative imports resolved against its package)."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = ("tiers",) + rel[:-1] if rel[0] in ("quant", "loader", "tools") else rel[:-1]
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module:
                    out.append(".".join(base + (node.module,)))
                else:  # from .. import quant: the names are modules
                    out += [".".join(base + (a.name,)) for a in node.names]
            else:
                out.append(node.module)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tiers":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ("quant", "loader", "tools") else "tiers"


ORDER = {"quant": 0, "loader": 1, "tiers": 2, "tools": 3}


@pytest.mark.parametrize("path", [p for p in SOURCES if p.relative_to(ROOT).parts[0] != "experiments"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_imports_upward(path):
    top = path.relative_to(ROOT).parts[0]
    mine = ORDER[top]
    upward = [m for m in _imports(path) if _layer(m) is not None and ORDER[_layer(m)] > mine]
    assert not upward, f"{path.relative_to(ROOT)} ({top}) imports upward: {upward}"
    if top in ("quant", "loader"):
        absolute = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").startswith("tiers")]
        assert not absolute, f"{path.relative_to(ROOT)}: import tiers.* relatively (it installs inside tiers)"


def test_the_layering_check_can_fail(tmp_path):
    """An upward import is caught: a quant module importing the runtime."""
    fake = ROOT / "quant" / "_layering_probe.py"
    fake.write_text('"""A probe."""\nfrom tiers.manager import Manager\n')
    try:
        with pytest.raises(AssertionError, match="imports upward"):
            test_nothing_imports_upward(fake)
    finally:
        fake.unlink()
