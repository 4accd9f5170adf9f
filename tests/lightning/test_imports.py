"""lightning_ft uses only public modules of the core and never accelerate_ft (that it imports with accelerate
blocked is tests/test_imports.py's test_integrations_do_not_import_each_other)."""

from __future__ import annotations

import ast
import os

import lightning_ft

PACKAGE = os.path.dirname(lightning_ft.__file__)


def imported_modules() -> set[str]:
    names = set()
    for file in os.listdir(PACKAGE):
        if file.endswith(".py"):
            with open(os.path.join(PACKAGE, file)) as f:
                for node in ast.walk(ast.parse(f.read())):
                    if isinstance(node, ast.ImportFrom) and node.module:
                        names.add(node.module)
                    elif isinstance(node, ast.Import):
                        names.update(a.name for a in node.names)
    return names


def test_only_public_core_modules():
    core = {m for m in imported_modules() if m.split(".")[0] == "ft_checkpoint"}
    assert core and not [m for m in core if any(part.startswith("_") for part in m.split("."))], core
    assert not [m for m in imported_modules() if m.split(".")[0] in ("accelerate", "accelerate_ft")]

