"""lightning_ft uses only public names of the core, never accelerate_ft, and imports without accelerate."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

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


def test_imports_with_accelerate_blocked():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('accelerate', 'accelerate_ft'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import lightning_ft\n"
            "print(lightning_ft.FaultTolerantCheckpoint.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "FaultTolerantCheckpoint" in out.stdout, out.stderr[-2000:]
