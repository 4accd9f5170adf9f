"""Package hygiene (issue 22, point 11): the public names, the version and its format notes, what an install
registers, the README's contents and quick start, and the wording of counts and durations."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

import ft_checkpoint
from ft_checkpoint.policies.interval import describe_policy, policy_from_interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERNALS = {"CheckpointEngine": "ft_checkpoint.save.engine", "SaveContext": "ft_checkpoint.policies.policy",
             "Journal": "ft_checkpoint.run.journal", "Storage": "ft_checkpoint.store.storage",
             "Manifest": "ft_checkpoint.format.layout", "apply_retention": "ft_checkpoint.run.retention"}


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_all_holds_what_users_call_and_every_name_imports():
    assert not set(INTERNALS) & set(ft_checkpoint.__all__)
    for name in ft_checkpoint.__all__:
        assert getattr(ft_checkpoint, name) is not None
    for name, module in INTERNALS.items():  # still importable from their own modules
        assert getattr(importlib.import_module(module), name) is not None


def test_the_readme_api_section_lists_exactly_all():
    api = section(readme(), "API")
    listed = set(re.findall(r"^\| (.+?) \|", api, re.M)) - {"name", "---"}
    names = {n.strip(" `") for cell in listed for n in cell.split(",")}
    assert names == set(ft_checkpoint.__all__)


def test_how_it_works_names_every_layer_of_the_package():
    how = section(readme(), "How it works")
    package = os.path.join(ROOT, "ft_checkpoint")
    layers = [d for d in os.listdir(package) if os.path.exists(os.path.join(package, d, "__init__.py"))]
    assert len(layers) >= 9 and all(f"{layer}/" in how for layer in layers), layers


def test_the_readme_has_a_table_of_contents_with_every_section():
    text = readme()
    contents = next(line for line in text.split("\n\n") if line.startswith("Contents:"))
    anchors = set(re.findall(r"\]\(#([\w-]+)\)", contents))
    for title in re.findall(r"^## (.+)$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        assert anchor in anchors, f"'{title}' (#{anchor}) is not in the contents"


def test_the_accelerate_quick_start_counts_with_ft_global_step():
    quick_start = re.search(r"```python\n(.*?)```", readme(), re.S).group(1)
    assert "from accelerate_ft import" in quick_start and "ft.global_step" in quick_start


def test_the_version_is_one_and_the_format_notes_name_formats():
    assert ft_checkpoint.__version__ == importlib.metadata.version("ft-checkpoint")
    text = readme()
    assert not re.search(r"written by 0\.\d\b(?!\.)", text), "a format note names a version, not a format"
    formats = section(text, "Checkpoint formats and versions")
    assert ft_checkpoint.__version__ in formats and "| 1 | 0.1.0 |" in formats and "| 2 | 0.2.0 on |" in formats


def test_faulty_is_not_registered_in_an_install():
    """The fault-injecting filesystem exists only where test code imports it (tests/conftest.py does)."""
    dist = importlib.metadata.distribution("ft-checkpoint")
    assert not [e for e in dist.entry_points if e.group == "fsspec.specs"]
    code = ("import fsspec, ft_checkpoint, ft_checkpoint.store.storage, ft_checkpoint.tools.cli\n"
            "try:\n    fsspec.get_filesystem_class('faulty')\nexcept ValueError:\n    print('unknown')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "unknown", out.stdout + out.stderr


def test_counts_read_right():
    assert describe_policy(policy_from_interval(1)) == "a save every step"
    assert describe_policy(policy_from_interval(500)) == "a save every 500 steps"


@pytest.mark.slow  # a subprocess or a long run: over 5 s (keeps the quick tier under 3 minutes)
def test_a_resume_says_its_time_with_a_unit_that_fits(tmp_path):
    """Not "loaded in 0.0 s": a quick load reads in ms."""
    code = ("import sys, torch; from ft_checkpoint import CheckpointManager\n"
            "with CheckpointManager(sys.argv[1], interval=1) as c:\n"
            "    state = {'w': torch.zeros(3)}; step = (c.resume(state) or 0) + 1; c.save(step, state, block=True)\n")
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
    assert re.search(r"verified and loaded in [\d.]+ ms", proc.stderr) and "0.0 s" not in proc.stderr, proc.stderr
