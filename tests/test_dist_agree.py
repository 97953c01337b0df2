"""Ranks of a process_group head fail together (2 spawned gloo ranks): an input error on one rank is
raised on every rank, a call-order mismatch is named instead of hanging, and the ranks stay in step
afterwards; a peer killed during a collective save leaves no temporary and the previous checkpoint whole.
Each world runs under a wall-clock limit (a hang guard, far above the seconds these take)."""
import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import dtensor_cases

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

HANG_GUARD_S = 60


def _outcome(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error each rank saw is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def _agree_rank(rank, world, store, out, jobs, pg_timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        import hugehead

        head = hugehead.ChunkedClassifier(8, 10, dtype=torch.float64, process_group=dist.group.WORLD)
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        good = torch.tensor([0, 3, 9, 5])
        bad = torch.tensor([0, 3, 10, 5]) if rank == 1 else good  # class 10 of 10: out of range on rank 1
        result = {"bad_target": _outcome(lambda: head(x, bad))}
        result["after_bad"] = float(head(x, good).detach())  # still in step: a collective forward works
        result["mismatch"] = _outcome(lambda: head.topk(x, 3) if rank == 0 else head(x, good))
        result["after_mismatch"] = float(head(x, good).detach())
        parts = []
        for local in (torch.cat([s.weight.detach() for s in head.shards]), torch.cat([s.bias.detach() for s in head.shards])):
            every = [torch.empty_like(local) for _ in range(world)]  # 5 classes per rank
            dist.all_gather(every, local)
            parts.append(torch.cat(every))
        result["reference"] = float(torch.nn.functional.cross_entropy(x @ parts[0].T + parts[1], good))
        torch.save(result, os.path.join(out, f"agree.{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_raise_the_same_input_error_and_name_a_call_order_mismatch(tmp_path):
    codes = dtensor_cases.spawn_world(2, [], str(tmp_path), timeout_s=HANG_GUARD_S, pg_timeout_s=HANG_GUARD_S,
                                      target=_agree_rank)
    assert codes == [0, 0], codes  # None: a rank hung past the guard
    results = [torch.load(tmp_path / f"agree.{r}.pt", weights_only=True) for r in range(2)]
    errors = [r["bad_target"] for r in results]
    assert errors[0] == errors[1] and errors[0].startswith("ValueError: "), errors
    assert "raised by rank 1 of 2" in errors[0] and "10" in errors[0], errors
    for r in results:
        assert r["mismatch"].startswith("RuntimeError: hugehead: the ranks of a process_group head are out of step")
        assert "(topk)" in r["mismatch"] and "(forward)" in r["mismatch"], r["mismatch"]
    # The steps after both errors are ordinary collective forwards, equal to a plain float64 reference of
    # each rank's rows over the gathered weight.
    for r in results:
        assert r["after_bad"] == pytest.approx(r["reference"], rel=1e-10)
        assert r["after_mismatch"] == pytest.approx(r["reference"], rel=1e-10)


def _save_rank(rank, world, store, out, jobs, pg_timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        import torch.distributed.checkpoint.filesystem as dcp_fs

        import hugehead
        from hugehead import checkpoint as ck

        head = hugehead.ChunkedClassifier(16, 4000, dtype=torch.float32, process_group=dist.group.WORLD)
        path = os.path.join(out, "peer.ckpt")
        ck.save_checkpoint(path, head, extra={"version": 1}, process_group=dist.group.WORLD)
        if rank == 1:  # dies while writing its files of the second save
            dcp_fs._write_files_from_queue = lambda *a, **k: os._exit(7)
        with torch.no_grad():
            for s in head.shards:
                s.weight.add_(1)
        error = _outcome(lambda: ck.save_checkpoint(path, head, extra={"version": 2}, process_group=dist.group.WORLD))
        torch.save({"error": error}, os.path.join(out, f"save.{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_a_peer_killed_mid_save_leaves_no_temporary_and_the_previous_checkpoint(tmp_path):
    codes = dtensor_cases.spawn_world(2, [], str(tmp_path), timeout_s=HANG_GUARD_S, pg_timeout_s=HANG_GUARD_S,
                                      target=_save_rank)
    assert codes == [0, 7], codes
    error = torch.load(tmp_path / "save.0.pt", weights_only=True)["error"]
    assert error is not None and "peer" in error, error
    assert [n for n in os.listdir(tmp_path) if ".hugehead-tmp." in n] == []
    import hugehead
    from hugehead import checkpoint as ck

    head = hugehead.ChunkedClassifier(16, 4000, dtype=torch.float32)
    assert ck.load_checkpoint(tmp_path / "peer.ckpt", head) == {"version": 1}
