"""Every private DeepSpeed API ft_checkpoint relies on, exercised against the installed DeepSpeed.

A failure here names a use in ``ft_checkpoint/integrations/_deepspeed_internals.py`` that a DeepSpeed release
changed: fix that function (and widen ``TESTED`` and the pyproject bound only once this passes).
"""

from __future__ import annotations

import pytest

from tests.deepspeed.conftest import torchrun

pytestmark = pytest.mark.slow

CHECKS = ["version in TESTED", "safe globals resolve to DeepSpeed's classes", "checkpoint engine interface"] + [
    f"zero{zero}: {what}" for zero in (1, 2, 3) for what in (
        "default checkpoint engine is torch's", "sizes, stage, offload", "files a load reads",
        "save_checkpoint and load_checkpoint take our arguments", "save_checkpoint's calls",
        "load_checkpoint lists model files with glob", "model states file on every rank")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds-internals")
    run = torchrun("ds_checks.py", 1, out, "internals", out=out)
    assert run.returncode == 0, run.explain()
    return {r["check"]: r for r in run.rows}, run


@pytest.mark.parametrize("name", CHECKS)
def test_deepspeed_internal_still_behaves_as_ft_checkpoint_expects(results, name):
    rows, run = results
    assert name in rows, f"the check {name!r} did not run\n{run.explain()}"
    assert rows[name]["ok"], (f"ft_checkpoint/integrations/_deepspeed_internals.py: DeepSpeed changed ({name}): "
                              f"{rows[name]['detail']}")
