"""lightning_ft uses only public modules of the core and never accelerate_ft (that it imports with accelerate
blocked is tests/test_imports.py's test_integrations_do_not_import_each_other)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

import lightning_ft
from ft_checkpoint.testing import jobs

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


PROBE = "import sys, lightning\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'transformers'}))\n"


@pytest.mark.slow  # two Lightning processes: over 5 s (tests/test_imports.py keeps such tests out of the quick tier)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_test_jobs_start_lightning_without_transformers_unless_they_ask_for_it(tmp_path):
    """``ft_checkpoint.testing.jobs`` hides transformers from its jobs' package metadata: torchmetrics imports it with
    Lightning (a quarter of a Lightning process's start) where installed, and the test environment has it only for
    Accelerate's DeepSpeed plugin, whose jobs set ``FT_TEST_TRANSFORMERS=1``."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    assert jobs.run(str(script)).expect(0).stdout.strip() == "[]"
    assert jobs.run(str(script), env={"FT_TEST_TRANSFORMERS": "1"}).expect(0).stdout.strip() == "['transformers']"
