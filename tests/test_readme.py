"""The README's two set-up commands stay true: CI runs the same test command."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in first_block.splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    main_job, tests = readme_commands()
    assert main_job.startswith("python3 -m venv") and "python examples/" in main_job
    assert tests.startswith("python3 -m venv") and tests.endswith("pytest")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert tests in f.read().splitlines()


def test_main_job_example_exists():
    main_job, _ = readme_commands()
    script = main_job.split("python ")[-1].split()[0]
    assert os.path.exists(os.path.join(ROOT, script))


def test_the_configuration_table_names_every_setting():
    """Each CheckpointConfig field has a row in the README's table (writer, writer_priority, writers had none)."""
    from ft_checkpoint.config import FIELDS

    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("| field | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = {name for line in table.splitlines() if line.startswith("| ") for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    assert set(FIELDS) - rows == set()
