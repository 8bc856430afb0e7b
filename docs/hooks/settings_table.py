"""MkDocs hook: the settings table, generated at build time from `ringreduce.core.config.Settings`.

A page that contains the line `<!-- settings-table -->` gets, in its place, one row per field
of `Settings` (its `RINGREDUCE_*` variable, the `init()` keyword, the default, the Horovod
variable honoured in its place, the accepted range and the field's doc line), then the
elastic reset limit, which `ringreduce.elastic` reads at each `run` call instead.

`ringreduce/core/config.py` and `ringreduce/elastic/__init__.py` are read from the source tree, not imported
through the package: importing `ringreduce` would import torch and start MPI inside MkDocs.
config.py needs only the standard library, so it is loaded on its own; elastic.py's two
constants are read from its syntax tree.
"""
from __future__ import annotations

import ast
import html
import dataclasses
import importlib.util
import sys
from pathlib import Path

MARKER = "<!-- settings-table -->"
ROOT = Path(__file__).resolve().parents[2]


def _load_config():
    path = ROOT / "ringreduce" / "core" / "config.py"
    spec = importlib.util.spec_from_file_location("_ringreduce_config_for_docs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses looks the module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _constants(path: Path, names: set[str]) -> dict:
    values = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                values[target.id] = ast.literal_eval(node.value)
    missing = names - set(values)
    if missing:
        raise RuntimeError(f"settings_table: {path} no longer defines {sorted(missing)}")
    return values


def _bytes(value: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value and value % scale == 0:
            return f"{value // scale}{suffix}"
    return str(value)


def _default(config, field) -> str:
    value = field.default
    if field.metadata["parse"] is config.parse_bytes:
        return _bytes(value)
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if value == "":
        return "empty"
    return str(value)


def _accepted(config, field) -> str:
    value = field.default
    if isinstance(value, bool) or field.metadata["parse"] is config._parse_bool:
        return "0/1, true/false, yes/no, on/off"
    if isinstance(value, str) and value == "auto":
        return "auto, or 0/1"
    if isinstance(value, str):
        return "a file's path, or empty"
    low, high = field.metadata["accepted"]
    off = "0 (off), or " if field.metadata["off"] else ""
    if field.metadata["parse"] is config.parse_bytes:
        high = "" if high == float("inf") else f" to {_bytes(int(high))}"
        return f"{off}{_bytes(int(low))}{high or ' or more'} bytes (K, M, G: powers of 1024)"
    return off + (f"{low:g} or more" if high == float("inf") else f"{low:g} to {high:g}")


def _cell(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    config = _load_config()
    rows = ["| variable | `init()` keyword | default | accepted | Horovod variable | meaning |",
            "| --- | --- | --- | --- | --- | --- |"]
    for field in dataclasses.fields(config.Settings):
        horovod = field.metadata["horovod"]
        rows.append("| " + " | ".join([
            f"`{config.Settings.env_name(field.name)}`", f"`{field.name}`",
            f"`{_default(config, field)}`", _cell(_accepted(config, field)),
            f"`{horovod}`" if horovod else "",
            _cell(field.metadata["doc"]),
        ]) + " |")
    elastic = _constants(ROOT / "ringreduce" / "elastic" / "__init__.py",
                         {"RESET_LIMIT_VARIABLE", "DEFAULT_RESET_LIMIT"})
    rows.append(f"| `{elastic['RESET_LIMIT_VARIABLE']}` | (none: read by each "
                f"`elastic.run` call) | `{elastic['DEFAULT_RESET_LIMIT']}` | 0 or more | | "
                "resets one `hvd.elastic.run` call recovers from before it gives up on every "
                "rank; 0 = none |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, settings_table())
    return markdown


if __name__ == "__main__":
    print(settings_table())
