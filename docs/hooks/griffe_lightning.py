"""Griffe extension: the API reference of `ringreduce.lightning`'s classes.

`ringreduce.lightning` builds `RingReduceStrategy`, `RingReduceEnvironment` and
`RingReduceSyncBatchNorm` inside `strategy_classes()`, once per installed Lightning package, and
binds the module-level names at import (`RingReduceStrategy = _main.RingReduceStrategy`). Static
analysis sees only those assignments, so this extension imports the module and puts the
inspected classes (signatures, docstrings, methods) in their place. Without Lightning installed
the import fails and the names stay as they are (the build still passes).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import griffe

NAMES = ("RingReduceStrategy", "RingReduceEnvironment", "RingReduceSyncBatchNorm")
log = logging.getLogger("mkdocs.plugins.ringreduce_docs")


class LightningClasses(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.path != "ringreduce" or "lightning" not in pkg.members:
            return
        module = pkg.members["lightning"]
        try:
            # griffe imports with sys.path set to import_paths alone: keep site-packages
            root = str(Path(module.filepath).parents[1])
            inspected = griffe.inspect("ringreduce.lightning", filepath=module.filepath,
                                       import_paths=[root, *sys.path],
                                       docstring_parser=loader.docstring_parser,
                                       docstring_options=loader.docstring_options)
        except Exception as exc:          # Lightning not installed, or it failed to import
            log.info("ringreduce.lightning not inspected (%s: %s): its classes are listed "
                     "without their documentation", type(exc).__name__, exc)
            return
        for name in NAMES:
            if name not in inspected.members:
                continue
            cls = inspected.members[name]
            for member in list(cls.members):
                if member.startswith("_") and member != "__init__":
                    cls.del_member(member)            # __doc__, __module__, ...
                elif cls.members[member].is_attribute:
                    cls.members[member].docstring = None   # inspection gives str's docstring
            module.set_member(name, cls)
