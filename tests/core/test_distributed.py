"""Two real gloo processes under torchrun: sharded save, then load on 2 ranks and on 1 rank, bit-exact."""

from __future__ import annotations

import os

import pytest

from ft_checkpoint.format.layout import read_manifest
from ft_checkpoint.store.storage import Storage
from ft_checkpoint.testing import jobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "dist_worker.py")


def torchrun(nproc: int, *args: str) -> str:
    return jobs.run(WORKER, *args, launcher="torchrun", nproc=nproc, timeout=300).expect(0).stdout


def test_sharded_save_then_load_on_2_and_on_1_rank(tmp_path):
    url = str(tmp_path / "ckpt")
    torchrun(2, "save", url, str(tmp_path))

    manifest = read_manifest(Storage(url), 3)
    assert manifest.world_size == 2
    shards = {n: f.size for n, f in manifest.files.items() if n.endswith(".distcp")}
    assert set(shards) == {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}, \
        "each rank writes its own shard files (writers=2)"
    per_rank = [sum(size for name, size in shards.items() if name.startswith(f"__{r}_")) for r in (0, 1)]
    assert min(per_rank) > 0.25 * sum(per_rank), f"replicated tensors spread over ranks: {shards}"
    assert {"rank_00000.pt", "rank_00001.pt"} <= set(manifest.files)

    out2 = torchrun(2, "load", url, str(tmp_path))
    assert "rank 0/2: bit-exact" in out2 and "rank 1/2: bit-exact" in out2
    out1 = torchrun(1, "load", url, str(tmp_path))
    assert "rank 0/1: bit-exact" in out1


def test_per_rank_tensors_come_back_to_their_own_rank(tmp_path):
    out = torchrun(2, "per_rank", str(tmp_path / "ckpt"), str(tmp_path))
    assert "rank 0: own batch back" in out and "rank 1: own batch back" in out


def test_a_shared_tensor_that_differs_across_ranks_is_refused_naming_it(tmp_path):
    """Before: DCP wrote one rank's copy and every rank resumed with it, silently."""
    out = torchrun(2, "diverge", str(tmp_path / "ckpt"), str(tmp_path))
    assert "rank 0: refused" in out and "rank 1: refused" in out
    assert "1 tensor(s) of the shared state differ across ranks: batch" in out and "per_rank=" in out


def test_a_key_that_is_a_tensor_on_one_rank_and_a_float_on_another_is_refused_at_the_save(tmp_path):
    """Issue 22: before, the background writer failed ("tensor(s) of the shared state differ across ranks") at
    the next save, and every restart died the same way with nothing committed."""
    out = torchrun(2, "mixed_types", str(tmp_path / "ckpt"), str(tmp_path))
    for rank in (0, 1):
        assert f"rank {rank}: refused at the save: state key 'best_val_loss' is a Tensor on rank 0 but a float on " \
               "rank 1" in out, out
        assert f"rank {rank}: saved once fixed" in out, out
    assert "HINT: give 'best_val_loss' one type on every rank" in out


def test_the_managers_gloo_groups_are_destroyed_when_it_closes(tmp_path):
    """A closed manager leaves no gloo group behind: each kept two threads and its sockets for the rest of the
    process (a job that opens managers in turn, a sweep or a notebook, piled them up)."""
    out = torchrun(2, "groups", str(tmp_path / "ckpt"), str(tmp_path))
    assert "rank 0: our groups destroyed" in out and "rank 1: our groups destroyed" in out


def test_two_machines_given_one_node_id_are_refused_at_the_start(tmp_path):
    """Two ranks with a fast-tier folder each (two machines) but one ``node_id`` were taken for one node, silently:
    no peer copy, and a resume saw one folder only (a plain crash fell back to the durable tier). Refused now."""
    out = torchrun(2, "same_node_id", str(tmp_path / "ckpt"), str(tmp_path))
    for rank in (0, 1):
        assert f"rank {rank}: refused: ranks [1] name their node 'node-1' like other ranks" in out, out
    assert "HINT: give each node a node_id of its own" in out
