"""examples/kubernetes/pytorchjob.yaml: no cluster can run here, so check what can be checked without one.

It is a Kubeflow PyTorchJob of 2 elastic workers launched by torchrun, restarted on failure, with a
grace period longer than torchrun's own shutdown wait, and its ``FT_CHECKPOINT_*`` variables are real
settings that build a valid configuration (``from_env`` ignores names that are not settings).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from ft_checkpoint.config import ENV_PREFIX, CheckpointConfig

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MANIFEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "kubernetes",
                        "pytorchjob.yaml")


def load() -> tuple[dict, dict, dict[str, str]]:
    """The job, its worker spec, and the worker container's env as a dict."""
    with open(MANIFEST) as f:
        job = yaml.safe_load(f)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    container, = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"  # the training-operator finds the container by this name
    return job, worker, {e["name"]: e["value"] for e in container["env"]}


def test_two_elastic_torchrun_workers_restarted_on_failure():
    job, worker, _ = load()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert worker["replicas"] == 2 and worker["restartPolicy"] in ("OnFailure", "ExitCode")
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["minReplicas"] <= 2 <= elastic["maxReplicas"]
    assert elastic["maxRestarts"] >= 1
    assert worker["template"]["spec"]["containers"][0]["command"][0] == "torchrun"


def test_grace_period_outlasts_torchruns_shutdown_wait():
    _, worker, env = load()
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] > int(env["PET_SHUTDOWN_TIMEOUT"]) > 30


def test_checkpoint_settings_are_valid(monkeypatch):
    _, _, env = load()
    settings = {name: value for name, value in env.items() if name.startswith(ENV_PREFIX)}
    known = {f.name for f in dataclasses.fields(CheckpointConfig)}
    assert {name[len(ENV_PREFIX):].lower() for name in settings} <= known
    assert settings[ENV_PREFIX + "DIRPATH"].startswith(("gs://", "s3://", "/"))  # shared by every worker
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    config = CheckpointConfig.from_env()
    assert config.dirpath == settings[ENV_PREFIX + "DIRPATH"]
    assert config.preemption_exit_code != 0 and "SIGTERM" in config.preemption_signals
