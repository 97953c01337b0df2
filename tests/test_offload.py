"""The offload engine (shards in pinned host memory, streamed through a GPU): its results against the
local engine's, its copy/compute schedule, exact-size pinned memory, the host-memory check and errors.

On the CPU the engine runs with a CPU "compute device" (InlineStreams: the same schedule, copies run at
once), and a recording stream layer replays every copy, event and buffer use on a vector-clock model of
CUDA streams: any two uses of one buffer, one a write, that no event chain orders are a race. CUDA tests
(marked ``cuda``) compare offloaded and resident heads on the GPU over optimizer steps, under autocast,
across checkpoints, and check pinning and the step's single host synchronization.
"""
import itertools
from typing import Dict, List, Optional

import pytest
import torch

import hugehead
from hugehead import pinned
from hugehead.engines import offload
from hugehead.engines.local import ShardTensors
from hugehead.engines.offload import HostGradPool, OffloadEngine, StreamedChunks, chunk_bounds
from hugehead.engines.streams import InlineStreams
from hugehead.plan import SLOT_BYTES, cap_plan, stream_cols

from conftest import host_syncs_of_step, requires_cuda, requires_multigpu

D, V = 8, 37


@pytest.fixture
def cpu_compute(monkeypatch):
    """Let ChunkedClassifier(offload=True) compute on 'cpu' devices (the engine's inline mode)."""
    monkeypatch.setattr(offload, "_ALLOW_CPU_COMPUTE", True)


def make_pair(sizes, *, dtype=torch.float64, bias=True, seed=0, devices=None, **kwargs):
    """An offloaded head and a resident one with the same logical weight and options."""
    kwargs.setdefault("chunk_size", 4)
    devices = devices or ["cpu"] * len(sizes)
    heads = []
    for off in (True, False):
        torch.manual_seed(seed)
        heads.append(hugehead.ChunkedClassifier(D, sum(sizes), bias, devices=devices, shard_sizes=sizes, dtype=dtype,
                                                offload=off, **kwargs))
    return heads


def inputs(n=13, *, dtype=torch.float64, device="cpu", seed=1, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype).to(device)
    target = torch.randint(0, V, (n,), generator=g)
    target[::5] = ignore_index
    return x, target.to(device)


def grads(head):
    return [None if p.grad is None else p.grad.detach().clone() for p in head.parameters()]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for u, w in zip(a, b):
        assert (u is None) == (w is None)
        if u is not None:
            assert u.dtype == w.dtype and u.shape == w.shape
            assert torch.equal(u.cpu(), w.cpu()), float((u.double().cpu() - w.double().cpu()).abs().max())


# --------------------------------------------------------------------------------------------------
# A vector-clock model of CUDA streams, fed by the engine's stream interface
# --------------------------------------------------------------------------------------------------
class _Event:
    pass


class RecordingStreams(InlineStreams):
    """InlineStreams that also records every operation in host issue order and checks it for races.

    Model: each stream runs its operations in order; ``record(e, s)`` captures what ``s`` has done so far,
    ``wait(s, e)`` makes later work on ``s`` follow it; an operation the host issues follows every host
    operation before it (host program order); ``host_wait`` makes the host follow a stream. A buffer use
    is (stream, vector clock, byte range, write?).
    """

    HOST = ("host",)

    def __init__(self, drop_waits_on: Optional[str] = None):
        self.clock: Dict[tuple, Dict[tuple, int]] = {}
        self.events: Dict[int, Dict[tuple, int]] = {}
        self.uses: List[tuple] = []
        self.log: List[tuple] = []
        self.lent: Dict[tuple, set] = {}
        self.keep = []  # every storage used stays alive: no address is reused within a test
        self.drop_waits_on = drop_waits_on

    def _vc(self, stream):
        return self.clock.setdefault(stream, {})

    @staticmethod
    def _join(a, b):
        for k, v in b.items():
            a[k] = max(a.get(k, 0), v)

    def _tick(self, stream):
        vc = self._vc(stream)
        if stream != self.HOST:
            self._join(vc, self._vc(self.HOST))  # issued after all the host did so far
        vc[stream] = vc.get(stream, 0) + 1
        return dict(vc)

    @staticmethod
    def _range(t):
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()

    def _use(self, stream, t, write):
        if t.numel() == 0:
            return
        self.keep.append(t.untyped_storage())
        self.uses.append((stream, self._tick(stream), self._range(t), write, t.untyped_storage().data_ptr()))

    # the interface ---------------------------------------------------------------------------------
    def event(self):
        return _Event()

    def record(self, event, stream):
        self.log.append(("record", stream[0]))
        self.events[id(event)] = self._tick(stream)
        self.keep.append(event)

    def wait(self, stream, event):
        self.log.append(("wait", stream[0]))
        if self.drop_waits_on == stream[0]:
            return
        if id(event) in self.events:
            self._join(self._vc(stream), self.events[id(event)])

    def copy(self, dst, src, stream):
        dst.copy_(src)
        self.log.append(("copy", stream[0], src.data_ptr(), dst.data_ptr()))
        self._use(stream, src, False)
        self._use(stream, dst, True)

    def lend(self, tensor, stream):
        # The buffer was just allocated on the compute stream: the caching allocator may have handed out
        # memory that earlier compute-stream work still uses, so model the allocation as a compute-stream
        # write here; the copy stream's uses must be ordered after it.
        self._use(("compute", stream[1]), tensor, True)
        self.lent.setdefault(stream, set()).add(tensor.untyped_storage().data_ptr())

    def use(self, stream, tensor, write=False):
        self._use(stream, tensor, write)

    def host_wait(self, device):
        self.log.append(("host_wait", str(device)))
        for stream in (self.h2d(device), self.d2h(device)):
            self._join(self._vc(self.HOST), self._vc(stream))

    def host_use(self, tensor, write):
        """The host reads or writes ``tensor`` now (an optimizer step, a checkpoint load)."""
        self._use(self.HOST, tensor, write)

    # checks ----------------------------------------------------------------------------------------
    def races(self):
        found = []
        for a, b in itertools.combinations(self.uses, 2):
            (sa, ca, (lo_a, hi_a), wa, _), (sb, cb, (lo_b, hi_b), wb, _) = a, b
            if not (wa or wb) or hi_a <= lo_b or hi_b <= lo_a:
                continue
            ordered = ca[sa] <= cb.get(sa, 0) or cb[sb] <= ca.get(sb, 0)
            if not ordered:
                found.append((sa, sb, wa, wb))
        return found

    def unlent(self, host_storages):
        """Device-side buffers used on a copy stream without having been lent to it."""
        bad = []
        for stream, _, _, _, storage in self.uses:
            if stream[0] in ("h2d", "d2h") and storage not in host_storages and storage not in self.lent.get(stream, ()):
                bad.append((stream, storage))
        return bad


def engine_with(head, streams, **kwargs):
    """Swap an offloaded head's engine for one on ``streams`` (same devices and plan options)."""
    head.engine = head._offload_engine = OffloadEngine(
        head.engine.devices, head.engine.chunk_size, head.engine.memory_budget, streams=streams,
        allocate_host=pinned.empty_host, **kwargs)
    return head.engine


def host_storages(head):
    return {p.untyped_storage().data_ptr() for p in head.parameters()} | {
        p.grad.untyped_storage().data_ptr() for p in head.parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------------------
# Chunk schedule and ring
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, cols", [(37, 4), (32, 8), (5, 16), (1, 1), (0, 4), (256, 256)])
def test_chunk_bounds_cover_rows_once(rows, cols):
    bounds = chunk_bounds(rows, cols)
    covered = [r for c0, c1 in bounds for r in range(c0, c1)]
    assert covered == list(range(rows))
    assert all(0 < c1 - c0 <= cols for c0, c1 in bounds)
    assert all(c1 - c0 == cols for c0, c1 in bounds[:-1])


def test_stream_cols_caps_slot_bytes():
    assert stream_cols(32768, 768, 2) == 32768  # 48 MiB slot: the plan's width
    capped = stream_cols(32768, 8192, 4)  # 1 GiB at the plan's width
    assert capped * 8192 * 4 <= SLOT_BYTES and capped % 256 == 0 and capped == 8192
    # An enormous D: the cap would be under one row group; chunks stay 256 wide (or the plan's, if narrower).
    assert stream_cols(4096, 1 << 30, 4) == 256
    assert stream_cols(10, 1 << 30, 4) == 10


def test_plan_is_capped_to_stream_width_keeping_kept_classes():
    from hugehead.plan import Plan

    # The local planner keeps a whole same-dtype shard as one chunk; streamed, that becomes capped chunks,
    # all still kept.
    whole = Plan(rows=4096, cols=6_000_000, keep_logits=True, kept_chunks=1)
    capped = cap_plan(whole, 6_000_000, 32768)
    assert (capped.cols, capped.keep_logits, capped.kept_chunks) == (32768, True, 184)
    # Partly kept (a wide D made the cap bind): as many whole capped chunks as the kept classes hold.
    part = Plan(rows=64, cols=4096, keep_logits=True, kept_chunks=3, overlap=True)
    capped = cap_plan(part, 100_000, 1024)
    assert (capped.cols, capped.kept_chunks, capped.overlap) == (1024, 12, True)
    assert cap_plan(Plan(rows=8, cols=512), 10_000, 1024) == Plan(rows=8, cols=512)
    streaming = cap_plan(Plan(rows=8, cols=4096), 10_000, 1024)
    assert (streaming.cols, streaming.keep_logits, streaming.kept_chunks) == (1024, False, 0)


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("cast", [False, True], ids=["same_dtype", "autocast_cast"])
def test_ring_prefetches_depth_chunks_in_slot_order(depth, cast):
    torch.manual_seed(0)
    weight = torch.randn(37, D)
    bias = torch.randn(37)
    streams = RecordingStreams()
    source = StreamedChunks(weight, bias, torch.bfloat16 if cast else torch.float32, torch.device("cpu"),
                            streams, depth=depth)
    w_ptrs = {weight[c0].data_ptr(): j for j, (c0, _) in enumerate(chunk_bounds(37, 4))}
    seen = []
    for j, chunk in enumerate(source.chunks(4)):
        fetched = [w_ptrs[entry[2]] for entry in streams.log if entry[:2] == ("copy", "h2d") and entry[2] in w_ptrs]
        assert fetched == list(range(len(fetched)))  # chunks are copied in order
        ahead = fetched[-1] - j
        n = len(chunk_bounds(37, 4))
        ring = max(depth, 2)
        # Prefetch: the ring ahead of the chunk in use, but for the slot of the chunk before it (still read
        # by an overlapped backward); a cast chunk frees its slot at once.
        assert ahead == min(ring if cast else ring - 2 + (j == 0), n - 1 - j)
        torch.testing.assert_close(chunk.weight, weight[chunk.c0:chunk.c1].to(chunk.weight.dtype), rtol=0, atol=0)
        torch.testing.assert_close(chunk.bias, bias[chunk.c0:chunk.c1].to(chunk.bias.dtype), rtol=0, atol=0)
        seen.append((chunk.c0, chunk.c1))
    assert seen == chunk_bounds(37, 4)
    # Slots are used round-robin: chunk j lands in the ring buffer of j % depth.
    dst = [entry[3] for entry in streams.log if entry[:2] == ("copy", "h2d") and entry[2] in w_ptrs]
    assert len(set(dst)) == min(max(depth, 2), len(seen))
    assert all(dst[j] == dst[j % max(depth, 2)] for j in range(len(dst)))
    assert streams.races() == []


def test_ring_is_narrower_than_the_plan_when_slots_are_capped():
    weight = torch.randn(1000, D)
    source = StreamedChunks(weight, None, torch.float32, torch.device("cpu"), InlineStreams(),
                            slot_bytes=300 * D * 4)
    assert [(c.c0, c.c1) for c in source.chunks(600)] == chunk_bounds(1000, 256)


@pytest.mark.parametrize("cast", [False, True], ids=["same_dtype", "autocast_cast"])
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_previous_chunk_stays_valid_for_an_overlapped_consumer(depth, cast):
    # The loop's overlapped backward queues chunk j's logits, then chunk j-1's dX and dW GEMMs, and only
    # then asks for chunk j+1: chunk j-1 must still hold its weights, and no copy may race its reads.
    torch.manual_seed(0)
    weight, bias = torch.randn(45, D), torch.randn(45)
    streams = RecordingStreams()
    dtype = torch.bfloat16 if cast else torch.float32
    source = StreamedChunks(weight, bias, dtype, torch.device("cpu"), streams, depth=depth)
    compute = streams.compute(torch.device("cpu"))
    pending = []

    def consume():
        chunk = pending.pop(0)
        streams.use(compute, chunk.weight)
        streams.use(compute, chunk.bias)
        assert torch.equal(chunk.weight, weight[chunk.c0:chunk.c1].to(dtype))
        assert torch.equal(chunk.bias, bias[chunk.c0:chunk.c1].to(dtype))

    for chunk in source.chunks(4):
        streams.use(compute, chunk.weight)  # produce: the logits GEMM
        pending.append(chunk)
        if len(pending) > 1:
            consume()
    while pending:
        consume()
    assert streams.races() == []


# --------------------------------------------------------------------------------------------------
# The engine on a CPU compute device: bitwise the local engine's results
# --------------------------------------------------------------------------------------------------
LAYOUTS = [[37], [20, 17], [5, 20, 12]]
OPTIONS = {
    "plain": {},
    "options": dict(label_smoothing=0.1, z_loss=1e-3, softcap=3.0, ignore_index=7),
    "rows_split": dict(memory_budget=1500, label_smoothing=0.2),
    "kept_logits": dict(chunk_size=None, memory_budget=1 << 20),
}


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(map(str, s)))
def test_matches_local_engine_bitwise_over_sgd_steps(cpu_compute, sizes, opts):
    off, res = make_pair(sizes, **opts)
    assert off.engine.name == "offload" and res.engine.name == "local"
    streams = RecordingStreams()
    engine_with(off, streams)
    x, target = inputs(ignore_index=opts.get("ignore_index", -100))
    optimizers = [torch.optim.SGD(h.parameters(), lr=0.5, momentum=0.9) for h in (off, res)]
    for step in range(3):
        results = []
        for head, opt in zip((off, res), optimizers):
            opt.zero_grad()
            xr = x.clone().requires_grad_()
            loss = head(xr, target)
            loss.backward()
            results.append((loss.detach(), xr.grad, grads(head)))
            if head is off:
                for p in head.parameters():
                    streams.host_use(p.grad, write=False)  # the optimizer reads .grad ...
                    streams.host_use(p, write=True)  # ... and writes the weight on the host
            opt.step()
        (l_off, gx_off, g_off), (l_res, gx_res, g_res) = results
        assert torch.equal(l_off, l_res)
        assert torch.equal(gx_off, gx_res)
        assert_bitwise(g_off, g_res)
    assert_bitwise(list(off.parameters()), list(res.parameters()))
    assert streams.races() == []
    assert streams.unlent(host_storages(off)) == []
    # The step's one host synchronization: once per backward and compute device.
    assert sum(1 for e in streams.log if e[0] == "host_wait") == 3


@pytest.mark.parametrize("depth, grad_depth", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_schedule_has_no_races_for_any_ring_size(cpu_compute, depth, grad_depth):
    off, res = make_pair([20, 17], memory_budget=1500)  # rows split: dW through put_grad
    streams = RecordingStreams()
    engine_with(off, streams, depth=depth, grad_depth=grad_depth)
    x, target = inputs()
    for head in (off, res):
        head(x.clone().requires_grad_(), target).backward()
    assert_bitwise(grads(off), grads(res))
    for p in off.parameters():
        streams.host_use(p.grad, write=False)
    assert streams.races() == []


@pytest.mark.parametrize("stream", ["h2d", "compute", "d2h"])
def test_race_checker_catches_a_missing_wait(cpu_compute, stream):
    # The checker itself: with the waits of one stream dropped, the recorded schedule must show a race.
    off, _ = make_pair([37], memory_budget=1500)
    streams = RecordingStreams(drop_waits_on=stream)
    engine_with(off, streams, depth=2, grad_depth=1)
    x, target = inputs()
    off(x, target).backward()
    if stream == "d2h":
        for p in off.parameters():
            streams.host_use(p.grad, write=False)
    assert streams.races()


def test_autocast_float32_masters_cast_per_chunk_on_the_compute_device(cpu_compute):
    off, res = make_pair([20, 17], dtype=torch.float32, chunk_size=8)
    streams = RecordingStreams()
    engine_with(off, streams)
    x, target = inputs(dtype=torch.float32)
    out = []
    for head in (off, res):
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = head(xr, target)
        loss.backward()
        out.append((loss.detach(), xr.grad, grads(head)))
    assert out[0][0].dtype == torch.float32
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert_bitwise(out[0][2], out[1][2])
    assert all(g.dtype == torch.float32 for g in out[0][2])
    # float32 chunks stream in (never a bfloat16 copy of the shard) and are cast on the compute stream.
    h2d_bytes = sum(1 for e in streams.log if e[:2] == ("copy", "h2d"))
    assert h2d_bytes > 0 and streams.races() == []


def test_without_bias_only_x_needs_grad_and_empty_batch(cpu_compute):
    off, res = make_pair([20, 17], bias=False)
    x, target = inputs()
    for p in off.parameters():
        p.requires_grad_(False)
    xr = x.clone().requires_grad_()
    off(xr, target).backward()
    xs = x.clone().requires_grad_()
    res(xs, target).backward()
    assert torch.equal(xr.grad, xs.grad)
    for p in off.parameters():
        p.requires_grad_(True)
    empty = x[:0].clone().requires_grad_()
    off(empty, target[:0], ).backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in off.parameters())


def test_topk_and_log_prob_match_local(cpu_compute):
    off, res = make_pair([5, 20, 12], softcap=2.0)
    x, target = inputs()
    target = target.clamp(min=0)
    for a, b in zip(off.topk(x, 6), res.topk(x, 6)):
        assert torch.equal(a, b)
    assert torch.equal(off.log_prob(x, target), res.log_prob(x, target))


# --------------------------------------------------------------------------------------------------
# Host gradients: pinned buffers reused across steps, accumulation stays correct
# --------------------------------------------------------------------------------------------------
def test_gradient_buffers_are_reused_and_become_grad(cpu_compute):
    off, _ = make_pair([20, 17])
    x, target = inputs()
    ptrs = None
    for _ in range(3):
        off.zero_grad()  # set_to_none: last step's .grad lets go of the buffer
        off(x, target).backward()
        now = [p.grad.data_ptr() for p in off.parameters()]
        assert ptrs is None or now == ptrs
        ptrs = now
    stats = off.offload_stats
    assert stats["grad_bytes"] == sum(p.numel() * p.element_size() for p in off.parameters())
    assert stats["weight_bytes"] == stats["grad_bytes"] and stats["pin_seconds"] >= 0


def test_gradient_accumulation_and_held_gradients_are_not_overwritten(cpu_compute):
    off, res = make_pair([20, 17])
    x, target = inputs()
    x2, target2 = inputs(seed=5)
    for head in (off, res):
        head(x, target).backward()
    for head in (off, res):
        head(x2, target2).backward()  # accumulates into .grad (on the host, as autograd does)
    assert_bitwise(grads(off), grads(res))
    held = [p.grad for p in off.parameters()]
    held_values = [g.clone() for g in held]
    off.zero_grad()
    off(x, target).backward()  # `held` (a reference kept by the user) must not be written into
    assert all(torch.equal(h, v) for h, v in zip(held, held_values))


def test_grad_pool_keeps_two_buffers_per_parameter():
    allocated = []

    def allocate(shape, dtype, what):
        allocated.append(shape)
        return torch.empty(shape, dtype=dtype)

    pool = HostGradPool(allocate)
    p = torch.nn.Parameter(torch.zeros(4, 3))
    a = pool.take(p, "g")
    b = pool.take(p, "g")  # a is held: a second buffer
    c = pool.take(p, "g")  # both held: a third, not kept
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3 and len(allocated) == 3
    del a, c
    d = pool.take(p, "g")
    assert len(allocated) == 3 and d.shape == (4, 3)
    p.data = torch.zeros(4, 3, dtype=torch.float64)  # a cast head: buffers of the old dtype are dropped
    del b, d
    e = pool.take(p, "g")
    assert e.dtype == torch.float64 and len(allocated) == 4


# --------------------------------------------------------------------------------------------------
# Checkpoints and placement rules
# --------------------------------------------------------------------------------------------------
def test_state_dict_and_safetensors_load_between_offloaded_and_resident(cpu_compute, tmp_path):
    off, res = make_pair([20, 17], seed=3)
    assert torch.equal(off.state_dict()["weight"], res.state_dict()["weight"])
    other = make_pair([37], seed=4)[0]
    other.load_state_dict(res.state_dict())
    assert torch.equal(other.state_dict()["weight"], res.state_dict()["weight"])
    path = str(tmp_path / "head.safetensors")
    off.save_safetensors(path)
    back = make_pair([10, 27], seed=5)[1]
    back.load_safetensors(path)
    assert torch.equal(back.state_dict()["bias"], off.state_dict()["bias"])
    res.save_safetensors(path)
    other = make_pair([5, 32], seed=6)[0]
    other.load_safetensors(path)
    assert torch.equal(other.state_dict()["weight"], res.state_dict()["weight"])
    # Loading copies into the host shards in place: they stay where the engine's allocator put them.
    assert all(s.weight.device.type == "cpu" for s in other.shards)


def test_offloaded_shards_stay_on_the_host_under_module_to(cpu_compute):
    off, _ = make_pair([20, 17], dtype=torch.float32)
    before = [p.detach().clone() for p in off.parameters()]
    off.to("meta")
    assert all(p.device.type == "cpu" for p in off.parameters())
    off.to(torch.float64)
    assert off.dtype == torch.float64
    for p, b in zip(off.parameters(), before):
        assert p.device.type == "cpu" and torch.equal(p, b.double())
    x, target = inputs()
    off(x, target).backward()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages on a machine without CUDA")
@pytest.mark.parametrize("devices", [None, ["cpu"], ["cuda:0"]])
def test_offload_without_cuda_raises_clearly(devices):
    match = "CUDA is not available|asks for CUDA, which is not available"
    with pytest.raises(ValueError, match=match):
        hugehead.ChunkedClassifier(D, V, devices=devices, offload=True)


def test_offload_rejects_non_cuda_compute_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="streams each shard to a CUDA device, but devices has cpu"):
        offload.check_offload_devices([torch.device("cpu")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_pinned_memory_without_cuda_raises():
    with pytest.raises(RuntimeError, match="pinned host memory needs CUDA"):
        pinned.empty_pinned((4, 4), torch.float32)


# --------------------------------------------------------------------------------------------------
# Exact-size pinned memory and the host-memory check
# --------------------------------------------------------------------------------------------------
def test_empty_pinned_is_exact_zeroed_and_unregisters_with_its_last_tensor():
    calls = []
    t = pinned.empty_pinned((1000, 7), torch.bfloat16, register=lambda p, n: calls.append(("register", p, n)),
                            unregister=lambda p: calls.append(("unregister", p)))
    assert t.shape == (1000, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 14000  # not rounded to a power of two (16384)
    assert calls == [("register", t.data_ptr(), 14000)]
    assert int(torch.count_nonzero(t)) == 0
    view = t[10:20]
    del t
    assert len(calls) == 1  # a view still holds the block
    del view
    assert calls[-1][0] == "unregister" and calls[-1][1] == calls[0][1]
    assert pinned.empty_pinned((0, 5), torch.float32, register=pinned.no_register,
                               unregister=pinned.no_unregister).shape == (0, 5)


MEMINFO = """MemTotal:       24684092 kB
MemFree:        19856416 kB
MemAvailable:   22652888 kB
Buffers:           20092 kB
"""


def test_host_memory_check_names_needed_and_available():
    assert pinned.parse_meminfo(MEMINFO) == 22652888 * 1024
    assert pinned.parse_meminfo("MemTotal: 5 kB\n") is None
    pinned.check_host_memory(10, "x", available=10)
    with pytest.raises(pinned.HostMemoryError, match=r"need 2,000,000,000 bytes .* only 1,000 bytes"):
        pinned.check_host_memory(2_000_000_000, "the test's weights", available=1000)
    assert isinstance(pinned.available_host_memory(), (int, type(None)))


def test_cgroup_limit_caps_available_memory(monkeypatch):
    files = {"/proc/meminfo": MEMINFO, "/sys/fs/cgroup/memory.max": "4096\n", "/sys/fs/cgroup/memory.current": "1024\n"}
    monkeypatch.setattr(pinned, "_read", files.get)
    assert pinned.available_host_memory() == 3072
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert pinned.available_host_memory() == 22652888 * 1024


def test_offloaded_head_checks_host_memory_before_allocating(cpu_compute, monkeypatch):
    monkeypatch.setattr(pinned, "available_host_memory", lambda: 1000)
    needed = V * (D + 1) * 4
    with pytest.raises(pinned.HostMemoryError, match=f"need {needed:,} bytes .* only 1,000 bytes"):
        hugehead.ChunkedClassifier(D, V, devices=["cpu"], dtype=torch.float32, offload=True)


# --------------------------------------------------------------------------------------------------
# CUDA: offloaded vs resident on the GPU
# --------------------------------------------------------------------------------------------------
def gpu_pair(sizes, devices, dtype, **kwargs):
    kwargs.setdefault("chunk_size", 64)
    kwargs.setdefault("memory_budget", 1 << 26)
    heads = []
    for off in (True, False):
        torch.manual_seed(0)
        heads.append(hugehead.ChunkedClassifier(64, sum(sizes), devices=devices, shard_sizes=sizes, dtype=dtype,
                                                offload=off, **kwargs))
    return heads


def gpu_inputs(n, v, dtype, device="cuda:0", seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, 64, generator=g, device=device).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=device)
    target[::7] = -100
    return x, target


def run_steps(heads, x, target, steps, make_opt, autocast=None):
    """Train each head ``steps`` steps on the same batch; per step, its loss, dX and parameter grads."""
    histories = []
    for head in heads:
        opt = make_opt(head)
        history = []
        for _ in range(steps):
            opt.zero_grad()
            xr = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                loss = head(xr, target)
            loss.backward()
            history.append((loss.detach().cpu(), xr.grad.cpu(), [p.grad.detach().cpu().clone() for p in head.parameters()]))
            opt.step()
        histories.append(history)
    return histories


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_offload_equals_resident_bitwise_step_by_step(monkeypatch, dtype):
    # One step at a time from the same weights: the same kernels in the same order give the same bits. The
    # resident head's fused forward would take chunks plan.FUSED_STATS_WIDEN times wider (a slice costs no
    # copy), folding the statistics in another order; here it keeps the offloaded head's width.
    from hugehead import plan

    monkeypatch.setattr(plan, "FUSED_STATS_WIDEN", 1)
    off, res = gpu_pair([3000, 1931], ["cuda:0", "cuda:0"], dtype, label_smoothing=0.1, z_loss=1e-4)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in off.parameters())
    x, target = gpu_inputs(512, 4931, dtype)
    for _ in range(3):
        (h_off,), (h_res,) = run_steps([off, res], x, target, 1, lambda h: torch.optim.SGD(h.parameters(), lr=1.0))
        assert torch.equal(h_off[0], h_res[0]) and torch.equal(h_off[1], h_res[1])
        assert_bitwise(h_off[2], h_res[2])
        assert all(p.grad.is_pinned() and p.grad.dtype == dtype for p in off.parameters())
        res.load_state_dict(off.state_dict())  # both continue from the offloaded head's (CPU-stepped) weights


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_cuda_offload_trains_like_resident_over_steps(optimizer):
    # Several optimizer steps: the offloaded head steps on the CPU, the resident one on the GPU; they agree
    # within float32 rounding.
    off, res = gpu_pair([2500, 2500], ["cuda:0", "cuda:0"], torch.float32)
    x, target = gpu_inputs(256, 5000, torch.float32)
    if optimizer == "sgd":
        make = lambda h: torch.optim.SGD(h.parameters(), lr=2.0, momentum=0.9, foreach=True)  # noqa: E731
    else:
        make = lambda h: torch.optim.AdamW(h.parameters(), lr=1e-2, foreach=True)  # noqa: E731
    h_off, h_res = run_steps([off, res], x, target, 4, make)
    for (l_o, gx_o, g_o), (l_r, gx_r, g_r) in zip(h_off, h_res):
        torch.testing.assert_close(l_o, l_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx_o, gx_r, rtol=1e-4, atol=1e-7)
        for a, b in zip(g_o, g_r):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert h_off[-1][0] < h_off[0][0]  # it trains
    # AdamW divides by sqrt(v): an element whose second moment is tiny amplifies float32 rounding of
    # its gradient (CPU vs GPU optimizer arithmetic), measured 2.3e-6 absolute on one of 160000 weights.
    atol = 1e-5 if optimizer == "adamw" else 1e-6
    for a, b in zip(off.parameters(), res.parameters()):
        torch.testing.assert_close(a.detach(), b.detach().cpu(), rtol=1e-5, atol=atol)


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_autocast_float32_masters_bitwise():
    off, res = gpu_pair([4000], ["cuda:0"], torch.float32, softcap=20.0)
    x, target = gpu_inputs(384, 4000, torch.float32)
    (h_off,), (h_res,) = run_steps([off, res], x, target, 1, lambda h: torch.optim.SGD(h.parameters(), lr=1.0),
                                   autocast=torch.bfloat16)
    assert h_off[0].dtype == torch.float32 and torch.equal(h_off[0], h_res[0])
    assert torch.equal(h_off[1], h_res[1])
    assert_bitwise(h_off[2], h_res[2])
    assert all(g.dtype == torch.float32 for g in h_off[2])


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_default_plan_keeps_logits_and_matches_reference():
    # memory_budget=None: the offload engine may keep logits in half the free GPU memory.
    torch.manual_seed(0)
    head = hugehead.ChunkedClassifier(64, 50_000, devices=["cuda:0"], dtype=torch.float32, offload=True)
    x, target = gpu_inputs(300, 50_000, torch.float32)
    plan = head.engine.plan(x, ShardTensors(head.shards[0].weight, head.shards[0].bias, 0), True)
    assert plan.keep_logits and plan.cols <= 32768
    xr = x.clone().requires_grad_()
    loss = head(xr, target)
    loss.backward()
    w = head.shards[0].weight.detach().cuda().double().requires_grad_()
    b = head.shards[0].bias.detach().cuda().double().requires_grad_()
    xd = x.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xd @ w.t() + b, target)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(xr.grad.double(), xd.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(head.shards[0].weight.grad.double(), w.grad.cpu(), rtol=1e-4, atol=1e-7)


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_pins_exact_size_and_reuses_gradient_buffers():
    off, _ = gpu_pair([1000, 999], ["cuda:0", "cuda:0"], torch.bfloat16)
    for p in off.parameters():
        assert p.is_pinned() and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    x, target = gpu_inputs(64, 1999, torch.bfloat16)
    ptrs = None
    for _ in range(3):
        off.zero_grad()
        off(x, target).backward()
        now = [p.grad.data_ptr() for p in off.parameters()]
        assert all(p.grad.is_pinned() for p in off.parameters())
        assert ptrs is None or now == ptrs
        ptrs = now
    stats = off.offload_stats
    assert stats["grad_bytes"] == stats["weight_bytes"]


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_backward_syncs_the_host_once(monkeypatch):
    off, _ = gpu_pair([3000, 2000], ["cuda:0", "cuda:0"], torch.float32)
    x, target = gpu_inputs(128, 5000, torch.float32)
    waits = []
    real = off.engine.streams.host_wait
    monkeypatch.setattr(off.engine.streams, "host_wait", lambda device: (waits.append(device), real(device)))
    off(x, target).backward()  # warm-up: gradient buffers are pinned in the first backward
    waits.clear()
    off.zero_grad()
    forward_syncs, syncs = host_syncs_of_step(lambda: off(x, target))  # check_targets: the forward's one sync
    assert forward_syncs <= 1 and len(syncs) == forward_syncs, syncs
    assert waits == [torch.device("cuda", 0)]  # the one host wait, for the gradient copies


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_checkpoints_round_trip_with_resident(tmp_path):
    off, res = gpu_pair([700, 1300], ["cuda:0", "cuda:0"], torch.float32)
    x, target = gpu_inputs(64, 2000, torch.float32)
    off(x, target).backward()
    torch.optim.SGD(off.parameters(), lr=1.0).step()
    res.load_state_dict(off.state_dict())
    assert torch.equal(res.state_dict()["weight"].cpu(), off.state_dict()["weight"])
    path = str(tmp_path / "head.safetensors")
    res.save_safetensors(path)
    torch.manual_seed(9)
    back = hugehead.ChunkedClassifier(64, 2000, devices=["cuda:0"], dtype=torch.float32, offload=True,
                                      chunk_size=64, memory_budget=1 << 26)
    back.load_safetensors(path)
    assert torch.equal(back.state_dict()["weight"], off.state_dict()["weight"])
    assert all(p.is_pinned() for p in back.parameters())
    assert torch.equal(back(x, target), off(x, target))


@requires_cuda
@pytest.mark.cuda
def test_cuda_offload_init_equals_resident_init():
    for dtype in (torch.float32, torch.bfloat16):
        off, res = gpu_pair([1234, 766], ["cuda:0", "cuda:0"], dtype)
        assert_bitwise(list(off.parameters()), list(res.parameters()))


@requires_multigpu
@pytest.mark.cuda
@pytest.mark.multigpu
def test_multigpu_offload_each_gpu_streams_its_shards():
    off, res = gpu_pair([3000, 2000, 1000], ["cuda:0", "cuda:1", "cuda:1"], torch.float32)
    assert [s.compute_device for s in off.shards] == [torch.device("cuda", i) for i in (0, 1, 1)]
    x, target = gpu_inputs(256, 6000, torch.float32, device="cuda:1")
    (h_off,), (h_res,) = run_steps([off, res], x, target, 1, lambda h: torch.optim.SGD(h.parameters(), lr=1.0))
    assert torch.equal(h_off[0], h_res[0]) and torch.equal(h_off[1], h_res[1])
    assert_bitwise(h_off[2], h_res[2])


# --------------------------------------------------------------------------------------------------
# The demo offloads by itself when the head does not fit the GPUs
# --------------------------------------------------------------------------------------------------
def _demo_args(offload="auto", classes=6_000_000):
    import argparse

    return argparse.Namespace(devices=[torch.device("cuda", 0)], classes=classes, dim=768, input_dim=128, hidden=1024,
                              batch=4096, dtype=torch.bfloat16, offload=offload)


def _fake_memory(monkeypatch, gpu_bytes, host_bytes):
    from hugehead import demo
    from hugehead.demo import fit

    monkeypatch.setattr(fit, "available_bytes", lambda dev: gpu_bytes if dev.type == "cuda" else host_bytes)
    return demo


def test_demo_offloads_when_the_head_does_not_fit_the_gpu(monkeypatch, capsys):
    demo = _fake_memory(monkeypatch, gpu_bytes=20 << 30, host_bytes=120 << 30)
    args = _demo_args()
    demo.check_fits(args)
    assert args.offload is True
    assert "keeping it in pinned host memory instead" in capsys.readouterr().out
    need = demo.estimate_bytes_per_device(args)
    host = 6_000_000 * 769 * 2 * 4  # weight, gradient and Adam's two moments, in host memory
    assert need[torch.device("cpu")] == host and need[torch.device("cuda", 0)] < 4 << 30


def test_demo_stays_resident_when_the_head_fits(monkeypatch):
    demo = _fake_memory(monkeypatch, gpu_bytes=140 << 30, host_bytes=120 << 30)
    args = _demo_args()
    demo.check_fits(args)
    assert args.offload is False


def test_demo_names_both_shortfalls_when_nothing_fits(monkeypatch):
    demo = _fake_memory(monkeypatch, gpu_bytes=20 << 30, host_bytes=16 << 30)
    args = _demo_args()
    with pytest.raises(SystemExit, match=r"free memory\. Offloading the head to host memory would need about "
                                         r"34\.4 GiB of RAM, and 16\.0 GiB are available"):
        demo.check_fits(args)


def test_demo_offload_on_needs_gpus(monkeypatch):
    demo = _fake_memory(monkeypatch, gpu_bytes=0, host_bytes=120 << 30)
    args = _demo_args("on")
    args.devices = [torch.device("cpu")]
    with pytest.raises(SystemExit, match="--offload on streams the head to GPUs"):
        demo.check_fits(args)


@pytest.mark.slow  # a benchmark pipeline end to end: python -m pytest -m slow tests
def test_bench_offload_cpu_smoke(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # `bench` under python -P -m pytest
    from bench import bench_offload

    try:
        assert bench_offload.main(["--cpu-smoke", "--reps", "1", "--warmup", "1", "--train-steps", "1",
                                   "--out", str(tmp_path)]) == 0
    finally:
        offload._ALLOW_CPU_COMPUTE = False
    doc = json.loads((tmp_path / "offload.json").read_text())
    rows = doc["rows"]
    assert {r["impl"] for r in rows} == {"hugehead-offload", "hugehead"} and doc["meta"]["git_sha"]
    assert all(r["status"] == "ok" and r["fwd_bwd_ms"] > 0 for r in rows)
    assert [r["shape"] for r in rows if r["placement"] == "resident"] == ["xc6M", "xc6M_16k"]
    assert all(v == 0.0 for v in doc["meta"]["checks"].values())  # same kernels, same order: same loss
    train = [r for r in rows if r["variant"].startswith("train step")][0]
    assert len(train["losses"]) == 2 and train["losses"][1] < train["losses"][0]
    assert (tmp_path / "offload.md").read_text().startswith("# ChunkedClassifier(offload=True)")
    assert (tmp_path / "offload.png").stat().st_size > 0
