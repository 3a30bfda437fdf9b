"""Packaging: the wheel holds one top-level import name, ``tiers``, with every module of the
folders installed under it, and each console script in pyproject.toml names a function that
the installed package has."""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Folder in the checkout -> the package it installs as (pyproject's packages and package-dir).
PACKAGES = {"tiers": "tiers", "quant": "tiers.quant", "loader": "tiers.loader", "tools": "tiers.tools"}
BUILD_INPUTS = ("pyproject.toml", "README.md", *PACKAGES)
# pip's errors when the build backend it may not install (--no-build-isolation) is missing or too old.
MISSING_BACKEND = ("No module named 'setuptools'", "No module named 'wheel'", "invalid command 'bdist_wheel'",
                   "Cannot import 'setuptools.build_meta'")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the build's inputs, so the build's own files (build/,
    *.egg-info) land beside the copy and never in the checkout."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(out)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        missing = next((m for m in MISSING_BACKEND if m in proc.stdout + proc.stderr), None)
        if missing or "No module named pip" in proc.stderr:
            pytest.skip(f"cannot build a wheel here without build isolation ({missing or 'no pip'}): "
                        "install setuptools (>= 70.1, or older with wheel)")
        pytest.fail(f"pip wheel failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (whl,) = out.glob("*.whl")
    return whl


def _scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs tomllib (Python 3.11+)")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_tiers_is_the_only_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tiers"}, sorted(tops)
    for folder, package in PACKAGES.items():  # every module of every folder, under its installed name
        want = {f"{package.replace('.', '/')}/{p.relative_to(REPO / folder).as_posix()}" for p in (REPO / folder).rglob("*.py")
                if "__pycache__" not in p.parts}
        assert want and want <= set(names), sorted(want - set(names))


def test_console_scripts_point_at_functions_that_exist(wheel, tmp_path):
    scripts = _scripts()
    assert scripts, "pyproject.toml lists no console scripts"
    with zipfile.ZipFile(wheel) as z:
        entry_points = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        ini = configparser.ConfigParser()
        ini.read_string(z.read(entry_points).decode())
        z.extractall(tmp_path / "site")
    assert dict(ini["console_scripts"]) == scripts  # what the wheel installs is what pyproject says
    # Import each target from the unpacked wheel alone (not the checkout, not an editable install).
    probe = (
        "import importlib, json, sys; import tiers; out = {'tiers': tiers.__file__}\n"
        "for name, target in json.loads(sys.argv[1]).items():\n"
        "    module, _, attr = target.partition(':')\n"
        "    obj = importlib.import_module(module)\n"
        "    for part in attr.split('.'):\n"
        "        obj = getattr(obj, part, None)\n"
        "    out[name] = [importlib.import_module(module).__file__, callable(obj)]\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(scripts)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    site = str(tmp_path / "site")
    assert found.pop("tiers").startswith(site)
    for name, (path, is_callable) in found.items():
        assert path.startswith(site) and is_callable, f"{name} = {scripts[name]}: {path}, callable: {is_callable}"
