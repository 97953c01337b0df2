"""Distributed faults (gloo, 3 spawned CPU processes): a rank of a process_group= head dies (os._exit)
inside the head's backward, mid-step. The other ranks must raise within a bounded time instead of hanging
(gloo reports the closed connection at once; the process group's timeout bounds every other case), the
last checkpoint written by hugehead.checkpoint.save_checkpoint stays intact, and a new run resumed from it
ends bit for bit where an uninterrupted run does. Each world is bounded by a wall-clock limit (its ranks
are killed past it and the test fails), so a hang fails the test instead of stalling CI."""
import os

import pytest
import torch

from hugehead import checkpoint as ck

import dtensor_cases
from dtensor_cases import FAULT

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

WORLD = 3
# Collectives give up after this long on a peer that neither answers nor closes its connection.
PG_TIMEOUT_S = 30


def test_a_rank_dying_mid_step_stops_the_others_and_the_run_resumes_from_the_last_checkpoint(tmp_path):
    out = str(tmp_path)
    codes = dtensor_cases.spawn_world(WORLD, ["fault:dies"], out, timeout_s=4 * PG_TIMEOUT_S,
                                      pg_timeout_s=PG_TIMEOUT_S)
    victim = FAULT["victim"]
    # The victim died with its exit code; every other rank raised, reported and left (exit 0): none hung
    # (a rank still running at the wall-clock limit would be None here).
    assert codes[victim] == FAULT["exit_code"], codes
    assert [c for r, c in enumerate(codes) if r != victim] == [0] * (WORLD - 1), codes
    for rank in range(WORLD):
        if rank == victim:
            continue
        result = torch.load(dtensor_cases.result_path(out, "fault:dies", rank), weights_only=False)
        assert result["step"] == FAULT["die_at"], result
        error = result["error"] or ""
        # gloo names the dead peer's closed (or reset) connection; not the process group's timeout.
        assert error.startswith(("RuntimeError", "DistBackendError")), result
        assert "closed by peer" in error or "reset by peer" in error, result
    # The checkpoint of the last completed save (after step 4) is whole.
    path = os.path.join(out, "fault.ckpt")
    assert ck.is_checkpoint_dir(path)
    assert not [n for n in os.listdir(out) if n.startswith(".fault.ckpt")]  # no temporary left

    results = dtensor_cases.run_world(WORLD, ["fault:straight", "fault:resume"], out, timeout_s=240)
    for rank in range(WORLD):
        straight, resumed = results["fault:straight"][rank], results["fault:resume"][rank]
        assert resumed["resumed_at"] == FAULT["die_at"]
        assert [s[:2] for s in resumed["shards"]] == [s[:2] for s in straight["shards"]]
        for (_, _, w, b), (_, _, w0, b0) in zip(resumed["shards"], straight["shards"]):
            assert torch.equal(w, w0) and torch.equal(b, b0), rank
        assert all(torch.equal(p, p0) for p, p0 in zip(resumed["backbone"], straight["backbone"])), rank
