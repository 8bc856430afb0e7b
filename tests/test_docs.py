"""The documentation site (docs/, mkdocs.yml): it builds in strict mode, its API reference names
every public name, and its Performance tables match the benchmark JSON they come from.

`mkdocs build --strict` fails on a broken link or anchor, an unresolved cross-reference, a
missing snippet and any warning of mkdocstrings (an object it cannot find or render).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 120        # the build takes about 10 s on a 2-core machine


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _public_names() -> list[str]:
    """ringreduce.__all__, read from the source (no import of the package)."""
    tree = ast.parse((ROOT / "ringreduce" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("ringreduce/__init__.py has no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out),
             "-f", str(ROOT / "mkdocs.yml")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mkdocs build took over {BUILD_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {result.returncode}):\n"
                    f"{result.stdout}\n{result.stderr}")
    return out


def test_site_builds_strict(site):
    assert (site / "index.html").exists()
    for page in ("getting-started", "performance", "horovod", "architecture", "api/collectives",
                 "api/lightning", "api/distributed", "guide/settings"):
        assert (site / page / "index.html").exists(), page


def test_settings_table_lists_every_setting(site):
    config = _load(ROOT / "ringreduce" / "config.py", "_ringreduce_config_for_test")
    page = (site / "guide" / "settings" / "index.html").read_text()
    assert "settings-table" not in page, "the settings hook did not run"
    for field in dataclasses.fields(config.Settings):
        assert config.Settings.env_name(field.name) in page, field.name
    assert "RINGREDUCE_ELASTIC_RESET_LIMIT" in page


def test_lightning_classes_documented(site):
    """The strategy's classes are built at import; docs/hooks/griffe_lightning.py inspects them."""
    pytest.importorskip("lightning", reason="the lightning extra")
    page = (site / "api" / "lightning" / "index.html").read_text()
    assert "gradient_as_bucket_view" in page          # RingReduceStrategy's signature
    assert "optimizer_step" in page


def test_api_reference_names_every_public_name():
    """Each name of ringreduce.__all__ has a `::: ringreduce.NAME` block (or, for the ops that
    are ReduceOp members, a row naming `ringreduce.NAME`) on an API page."""
    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    directives = set(re.findall(r"^::: ringreduce\.([A-Za-z_]\w*)\s*$", text, re.M))
    missing = [n for n in _public_names()
               if n not in directives and f"`ringreduce.{n}`" not in text]
    assert not missing, f"not in docs/api/*.md: {missing}"
    for module in ("elastic", "checkpoint", "lightning", "runner"):
        assert module in directives, f"no `::: ringreduce.{module}` in docs/api/"


def test_performance_tables_match_their_json():
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    assert sorted(DOCS.glob("figures/*.json")), "no benchmark JSON in docs/figures/"
    assert figures.main(["--check"]) == 0, "run: python scripts/docs_figures.py"
    performance = (DOCS / "performance.md").read_text()
    for path in sorted(DOCS.glob("figures/*.json")):
        assert f'--8<-- "figures/{path.stem}.md"' in performance, \
            f"docs/performance.md does not include {path.stem}.md"
