"""Import boundaries: the core never imports the frameworks; storage never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Importing a blocked package fails; asking whether it is there (importlib.util.find_spec, as transformers does
# when torchmetrics imports it) still answers, as for any installed package that is never imported.
BLOCK = """
import importlib.machinery, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError("blocked for this test: " + spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Block())
"""


def run_blocked(blocked: set[str], code: str) -> None:
    script = BLOCK.format(blocked=sorted(blocked)) + code
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_core_imports_without_lightning_or_accelerate():
    run_blocked({"lightning", "pytorch_lightning", "accelerate"}, """
import ft_checkpoint
from ft_checkpoint import CheckpointManager, CheckpointConfig
from ft_checkpoint.store.storage import Storage
import ft_checkpoint.tools.cli, ft_checkpoint.save.engine, ft_checkpoint.manager
m = CheckpointManager("memory://imports", interval=5); m.close()
""")


def test_storage_does_not_import_torch():
    run_blocked({"torch"}, """
import ft_checkpoint.store.storage, ft_checkpoint.format.layout, ft_checkpoint.config, ft_checkpoint.run.journal
import ft_checkpoint.run.retention, ft_checkpoint.errors, ft_checkpoint.progress, ft_checkpoint.tools.cli
s = ft_checkpoint.store.storage.Storage("memory://no-torch")
s.write_bytes("a", b"1")
assert "torch" not in sys.modules
""")


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
@pytest.mark.parametrize("package,blocked", [("lightning_ft", "accelerate"), ("accelerate_ft", "lightning")])
def test_integrations_do_not_import_each_other(package, blocked):
    run_blocked({blocked}, f"import {package}\n")


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_deepspeed_is_imported_only_when_a_deepspeed_engine_is_saved():
    run_blocked({"deepspeed"}, """
import torch
import ft_checkpoint.integrations.deepspeed
from ft_checkpoint import CheckpointManager
m = CheckpointManager("memory://imports-deepspeed", interval=5, announce=False)
m.save(1, {"w": torch.zeros(1)}, block=True); m.close()
assert "deepspeed" not in sys.modules
""")
