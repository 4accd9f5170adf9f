"""The fast tier on 2 "nodes" of 2 ranks (two torchrun agents on one rendezvous, each with its own fast-tier folder).

One job per model runs a chain of attempts (``tests/helpers/tiers_train.py``): each ends in a failure the next
one must recover from, from the source the failure left:

- every process SIGKILLed: the fast tier, own node, with every read of the durable tier's data refused;
- one node's folder lost as well: the fast tier, from the peer copies the other node keeps (refused too);
- a flipped byte in rank 0's part on its node: the same step, rank 0's part from its peer copy (refused too);
- a flipped byte in that part and in its peer copy: the durable tier;
- both nodes' folders lost: the durable tier;
- a node lost in the middle of the transfer of a step's peer copies: the step before, whose copies were complete
  (refused too).

Each resume records what the nodes' folders showed (the failure class the multi-level plan learns from).
Each resumed state (every rank's tensors, other values and RNG) is bit-identical to the state the job had at that
step before the failure: for the first failure, an uninterrupted run. (Training on from a resume is not compared
with an uninterrupted run: with 4 ranks, gloo's ring all-reduce sums each element in an order that depends on
where it lies in DDP's bucket, and DDP lays its buckets out again after the first step of every process, so
later steps differ in the last bits with any checkpointing.)
"""

from __future__ import annotations

import os

import pytest

from ft_checkpoint.policies.adaptive.classes import CRASH, MORE, NO_FAST_STEP, NODE, class_counts
from ft_checkpoint.run.journal import attempt_summaries, read_journal
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "tiers_train.py")
OWN, PEER = "fast tier, own node", "fast tier, peer copies"


def run_chain(tmp_path, model: str, steps: int, crashes: list[str], refuse: list[int], nproc: int = 2) -> jobs.Finished:
    nodes = [{"FT_TEST_NODE": node, "FT_CHECKPOINT_FAST_DIRPATH": str(tmp_path / f"fast-{node}"),
              "FT_CHECKPOINT_DIRPATH": f"faulty://{tmp_path}/ckpt", "FT_CHECKPOINT_INTERVAL": "3",
              "FT_CHECKPOINT_FAST_INTERVAL": "1", "DS_ACCELERATOR": "cpu"} for node in "AB"]
    out = tmp_path / "out"
    return jobs.run_nodes(SCRIPT, out, "--model", model, "--steps", steps, "--crashes", ";".join(crashes),
                          "--refuse", ",".join(map(str, refuse)), out=out, nodes=nodes, nproc=nproc,
                          restarts=len(crashes), timeout=540).expect(0)


def check_resumes(job: jobs.Finished, expected: list[tuple[int, str]], ranks: int = 4) -> None:
    """Each attempt after the first resumed ``(step, source)`` on every rank, bit-identical to the state the job
    had at that step."""
    for rank in range(ranks):
        resumed = [(r["step"], r["source"]) for r in job.where(event="resumed", rank=rank)]
        got = [(step, "durable" if source.startswith("faulty://") else source) for step, source in resumed[1:]]
        assert got == expected, f"rank {rank}: {got}\n{job.explain()}"
        for r in job.where(event="resumed", rank=rank)[1:]:
            assert r["digest"] == before(job, rank, r), f"rank {rank}: step {r['step']} from {r['source']} differs"


def before(job: jobs.Finished, rank: int, resumed: dict) -> str:
    """The digest ``rank`` reported at the resumed step in the attempt before the one that resumed."""
    earlier = [r for r in job.where(event="step", rank=rank, step=resumed["step"]) if r["attempt"] < resumed["attempt"]]
    return earlier[-1]["digest"]


def test_ddp_resumes_from_the_fastest_source_each_failure_left(tmp_path):
    job = run_chain(tmp_path, "ddp", 15, ["5", "7:lose=B", "8:flip=own", "10:flip=own+peer", "11:lose=A+B",
                                           "13:die-copying"], refuse=[1, 2, 3, 6])
    check_resumes(job, [(5, OWN), (7, PEER), (8, PEER), (9, "durable"), (9, "durable"), (12, PEER)])
    assert "fast-tier step 10 (peer copies) is not used" in job.output, "the peer copy was tried, and failed its checks"
    assert not [p for node in "AB" for p in os.listdir(tmp_path / f"fast-{node}")], "a clean end cleans the fast tier"
    journal = Storage(str(tmp_path / "ckpt"))
    found = [e["failure_class"] for e in read_journal(journal) if e["event"] == "resume"]
    assert found == [CRASH, NODE, CRASH, CRASH, NO_FAST_STEP, NODE], "what each resume found in the nodes' folders"
    counts, failures, _ = class_counts(attempt_summaries(journal))
    assert (counts, failures) == ({CRASH: 3, NODE: 2, MORE: 1}, 6), "both folders lost after fast-tier saves: more"


def test_fsdp2_resumes_its_shards_from_the_fastest_source_each_failure_left(tmp_path):
    job = run_chain(tmp_path, "fsdp2", 12, ["5", "7:lose=B", "8:lose=A+B", "10:die-copying"], refuse=[1, 2, 4])
    check_resumes(job, [(5, OWN), (7, PEER), (6, "durable"), (9, PEER)])


@pytest.mark.parametrize("zero", [2, 3])
def test_a_deepspeed_engine_resumes_from_the_fastest_source_each_failure_left(tmp_path, zero):
    """ZeRO-2 (one rank writes the model states file for all: each rank's part holds a copy staged from its own
    replica) and ZeRO-3 (each rank its own), one rank per node; the durable tier's DeepSpeed files refused too."""
    pytest.importorskip("deepspeed")
    job = run_chain(tmp_path, f"zero{zero}", 13, ["5", "7:lose=B", "9:lose=A+B", "11:die-copying"], refuse=[1, 2, 4],
                    nproc=1)
    check_resumes(job, [(5, OWN), (7, PEER), (9, "durable"), (10, PEER)], ranks=2)
    parts = {name for node in "AB" for _, _, files in os.walk(tmp_path / f"fast-{node}") for name in files}
    assert not parts, "a clean end cleans the fast tier"
