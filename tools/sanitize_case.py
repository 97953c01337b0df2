"""The compute-sanitizer harness: every kernel op of ``torch.ops.hugehead`` (discovered from the dispatcher)
called directly on inputs made by PyTorch on the host and copied to the device, each result checked
against a float64 reference computed on the host. Nothing else runs on the GPU between the copies: no
cuBLAS, no PyTorch kernel, so the only kernels compute-sanitizer sees are ours (``tools/gpu_check.sh``
also filters on the ``hugehead`` namespace), and every byte a kernel reads was written by a host-to-device
copy (what initcheck counts as initialized) or by our own kernels.

    python -m tools.sanitize_case --device cpu     # the same cases and checks on the CPU kernels (CI runs it)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --kernel-name kns=hugehead \\
        --error-exitcode 1 python -P -m tools.sanitize_case -q       # what tools/gpu_check.sh runs
    python -m tools.sanitize_case --list           # the kernel ops found and the cases each has

PyTorch's caching allocator would hide an out-of-bounds access inside a cached block from memcheck, hence
PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor its own cudaMalloc). Exit status: 0 when every case is within
tolerance, 1 when one is off, 2 when a kernel op has no case here.

Adding an op: one function under ``@kernel_case("op_name_")`` that yields ``(label, actual, expected, tol)``
for each result (see the two below). The shapes cross every edge the kernels have: N, C not multiples of
the block size, a chunk that is a strided column slice of a wider buffer (as the chunk loop passes kept
logits), targets inside and outside the chunk, ignored rows, every option, every floating dtype.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import zlib
from typing import Callable, Dict, Iterator, List, Tuple

import torch

import hugehead  # noqa: F401  (loads hugehead._C: registers torch.ops.hugehead.*)

Result = Tuple[str, torch.Tensor, torch.Tensor, float]  # (label, actual, expected float64, tolerance)
CASES: Dict[str, Callable[[torch.device], Iterator[Result]]] = {}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Results rounded to the logits' dtype (chunk_grad_) are checked against its rounding; statistics that
# are accumulated in float32 / float64 from the (already rounded) inputs against that precision.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
ACC_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
IGNORE = -100


def kernel_case(op: str):
    """Register the cases of ``torch.ops.hugehead.<op>``: a generator of (label, actual, expected, tol)."""
    def register(fn: Callable[[torch.device], Iterator[Result]]):
        CASES[op] = fn
        return fn
    return register


def kernel_ops() -> List[str]:
    """Every op of the hugehead namespace with a compiled kernel (CPU or CUDA) in this build: the ops the
    sanitizer must see. The Python-level ops (linear_cross_entropy_forward/backward) compose these with
    cuBLAS and are left out."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("hugehead::"))
    return [n.split("::", 1)[1] for n in names
            if any(torch._C._dispatch_has_kernel_for_dispatch_key(n, k) for k in ("CPU", "CUDA"))]


def _gen(label: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_on(device, full: torch.Tensor, c0: int, c1: int, pad: int) -> torch.Tensor:
    """``full[:, c0:c1]`` on ``device`` as a column slice of a wider buffer (row stride ``c1 - c0 + pad``):
    the kernels must stay inside the slice. Built on the host, then one host-to-device copy."""
    n = full.shape[0]
    wide = torch.full((n, c1 - c0 + pad), 1e4, dtype=full.dtype)  # out-of-slice canaries
    wide[:, :c1 - c0] = full[:, c0:c1]
    return wide.to(device)[:, :c1 - c0]


def _softcapped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


# (label, N, V, chunk [c0, c1), row padding, softcap, ignore every k-th row)
STATS_SHAPES = [
    ("one block", 3, 50, (0, 50), 0, 0.0, 0),
    ("tail chunk, strided", 37, 1000, (768, 1000), 13, 0.0, 3),
    ("mid chunk, softcap", 29, 777, (128, 384), 5, 30.0, 4),
    ("wide rows", 5, 70_001, (0, 70_001), 0, 0.0, 2),
]


@kernel_case("chunk_stats_")
def stats_cases(device: torch.device) -> Iterator[Result]:
    """Fold a chunk into running (max, sum-exp, target logit, logit sum) that start from earlier values."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, softcap, ignore in STATS_SHAPES:
            name = f"{label} {str(dtype)[6:]}"
            g = _gen(name)
            full = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
            target = torch.randint(0, v, (n,), generator=g)
            target[::2] = torch.randint(c0, c1, (n,), generator=g)[::2]  # half the rows hit this chunk
            if ignore:
                target[::ignore] = IGNORE
            acc = _acc(dtype)
            # running stats as after an earlier chunk (or the start values for row 0)
            row_max = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
            row_max[0] = -math.inf
            row_sumexp = torch.rand(n, generator=g, dtype=torch.float64).add_(0.5).to(acc)
            row_sumexp[0] = 0.0
            target_logit = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
            logit_sum = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
            # copy=True: on the CPU .to() would alias the reference's inputs, which the op updates in place
            state = [t.to(device, copy=True) for t in (row_max, row_sumexp, target_logit, logit_sum)]
            logits = _chunk_on(device, full, c0, c1, pad)
            torch.ops.hugehead.chunk_stats_.default(logits, target.to(device), c0, softcap, *state)

            z = _softcapped(full[:, c0:c1].double(), softcap)
            m_old, s_old = row_max.double(), row_sumexp.double()
            m_new = torch.maximum(m_old, z.max(dim=1).values)
            s_new = s_old * torch.exp(m_old - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
            inside = (target >= c0) & (target < c1)
            picked = z.gather(1, (target - c0).clamp(0, c1 - c0 - 1)[:, None]).squeeze(1)
            t_new = torch.where(inside, picked, target_logit.double())  # set (a row's target is in one chunk)
            sums = logit_sum.double() + z.sum(dim=1)
            got = [t.cpu() for t in state]
            tol = ACC_TOLERANCE[acc]
            yield f"{name}: row_max", got[0], m_new, tol
            # compare sum-exp at the kernel's own max (the pair means exp(max) * sumexp)
            yield f"{name}: lse", got[0].double() + got[1].double().log(), m_new + s_new.log(), tol
            yield f"{name}: target_logit", got[2], t_new, tol
            yield f"{name}: logit_sum", got[3], sums, 10 * tol  # a sum of +-3 values: some cancellation


# (label, N, V, chunk [c0, c1), row padding, label_smoothing, z_loss, softcap, with grad_lse, ignore every k)
GRAD_SHAPES = [
    ("plain", 7, 300, (0, 300), 0, 0.0, 0.0, 0.0, False, 0),
    ("tail chunk, strided, ignored", 37, 1000, (768, 1000), 11, 0.0, 0.0, 0.0, False, 3),
    ("all options", 29, 777, (128, 384), 3, 0.1, 1e-3, 30.0, True, 4),
    ("grad_lse only on ignored rows", 6, 513, (256, 513), 0, 0.0, 0.0, 0.0, True, 2),
]


@kernel_case("chunk_grad_")
def grad_cases(device: torch.device) -> Iterator[Result]:
    """Replace a chunk by dLoss/dlogits; the reference is float64 autograd of the whole row's loss."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, eps, z_loss, softcap, with_lse, ignore in GRAD_SHAPES:
            name = f"{label} {str(dtype)[6:]}"
            g = _gen(name)
            full = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
            target = torch.randint(0, v, (n,), generator=g)
            target[::2] = torch.randint(c0, c1, (n,), generator=g)[::2]
            if ignore:
                target[::ignore] = IGNORE
            valid = target != IGNORE
            grad_rows = torch.where(valid, torch.rand(n, generator=g, dtype=torch.float64) + 0.5, 0.0)
            grad_lse = torch.randn(n, generator=g, dtype=torch.float64) if with_lse else None

            z = full.double().requires_grad_(True)
            c = _softcapped(z, softcap)
            lse = torch.logsumexp(c, dim=1)
            tgt = torch.where(valid, target, 0)
            row = lse - (1 - eps) * c.gather(1, tgt[:, None]).squeeze(1) - eps / v * c.sum(dim=1) + z_loss * lse**2
            total = (grad_rows * torch.where(valid, row, 0.0)).sum()
            if grad_lse is not None:
                total = total + (grad_lse * lse).sum()
            (expected,) = torch.autograd.grad(total, z)

            acc = _acc(dtype)
            logits = _chunk_on(device, full, c0, c1, pad)
            torch.ops.hugehead.chunk_grad_.default(
                logits, target.to(device), c0, v, lse.detach().to(acc).to(device), grad_rows.to(acc).to(device),
                eps, z_loss, softcap, None if grad_lse is None else grad_lse.to(acc).to(device))
            got = logits.cpu()
            ref = expected[:, c0:c1]
            if ignore and not with_lse:
                # ignored rows with no lse gradient are exact zeros
                yield f"{name}: ignored rows are 0", got[~valid].double().abs().max().reshape(1), \
                    torch.zeros(1, dtype=torch.float64), 0.0
            yield f"{name}: dlogits", got, ref, TOLERANCE[dtype]


@kernel_case("entropy_chunk_stats_")
def entropy_stats_cases(device: torch.device) -> Iterator[Result]:
    """Fold a chunk into a running (max, sum-exp, target logit, shifted sum) that starts from earlier values; the
    reference merges the float64 triples of the two class sets."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, softcap, ignore in STATS_SHAPES:
            name = f"{label} {str(dtype)[6:]}"
            g = _gen("entropy " + name)
            full = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
            target = torch.randint(0, v, (n,), generator=g)
            acc = _acc(dtype)
            row_max = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
            row_max[0] = -math.inf
            row_sumexp = torch.rand(n, generator=g, dtype=torch.float64).add_(0.5).to(acc)
            row_sumexp[0] = 0.0
            shifted = -torch.rand(n, generator=g, dtype=torch.float64).to(acc)
            shifted[0] = 0.0
            state = [t.to(device, copy=True) for t in (row_max, row_sumexp, torch.zeros(n, dtype=acc), shifted)]
            torch.ops.hugehead.entropy_chunk_stats_.default(_chunk_on(device, full, c0, c1, pad), target.to(device),
                                                            c0, softcap, *state)
            z = _softcapped(full[:, c0:c1].double(), softcap)
            m_old, s_old, a_old = row_max.double(), row_sumexp.double(), shifted.double()
            m_new = torch.maximum(m_old, z.max(dim=1).values)
            scale = torch.exp(m_old - m_new)
            e = torch.exp(z - m_new[:, None])
            s_new = s_old * scale + e.sum(dim=1)
            a_new = scale * (a_old + torch.where(s_old > 0, (m_old - m_new) * s_old, 0.0)) + (e * (z - m_new[:, None])).sum(1)
            got = [t.cpu().double() for t in state]
            tol = ACC_TOLERANCE[acc]
            yield f"{name}: lse", got[0] + got[1].log(), m_new + s_new.log(), tol
            yield f"{name}: entropy", got[1].log() - got[3] / got[1], s_new.log() - a_new / s_new, 10 * tol


@kernel_case("entropy_chunk_grad_")
def entropy_grad_cases(device: torch.device) -> Iterator[Result]:
    """Replace a chunk by the gradient of g (-log p(target)) + g_H H; the reference is float64 autograd."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, _, _, softcap, _, ignore in GRAD_SHAPES:
            name = f"{label} {str(dtype)[6:]}"
            g = _gen("entropy " + name)
            full = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
            target = torch.randint(0, v, (n,), generator=g)
            up = torch.randn(2, n, generator=g, dtype=torch.float64)
            if ignore:
                up[:, ::ignore] = 0.0
            z = full.double().requires_grad_(True)
            lp = torch.log_softmax(_softcapped(z, softcap), dim=1)
            entropy = torch.special.entr(lp.exp()).sum(1)
            total = (-up[0] * lp.gather(1, target[:, None])[:, 0]).sum() + (up[1] * entropy).sum()
            (expected,) = torch.autograd.grad(total, z)
            acc = _acc(dtype)
            logits = _chunk_on(device, full, c0, c1, pad)
            lse = torch.logsumexp(_softcapped(full.double(), softcap), dim=1)
            torch.ops.hugehead.entropy_chunk_grad_.default(
                logits, target.to(device), c0, softcap, *(t.to(acc).to(device) for t in (lse, up[0], up[1], entropy)))
            yield f"{name}: dlogits", logits.cpu(), expected[:, c0:c1], TOLERANCE[dtype]


def _distill_inputs(dtype, label, n, v, softcap):
    """Student and teacher logits (the teacher in float32 for 16-bit students, as the kernels also take it), both
    rows' full log-sum-exps after their softcaps, float64."""
    g = _gen("distill " + label)
    student = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
    teacher = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(
        _acc(dtype) if dtype in (torch.bfloat16, torch.float16) else dtype)
    t_cap = softcap / 2
    s_lse = torch.logsumexp(_softcapped(student.double(), softcap), dim=1)
    t_lse = torch.logsumexp(_softcapped(teacher.double(), t_cap), dim=1)
    return g, student, teacher, t_cap, s_lse, t_lse


def _distill_terms(code: int, s, u, s_lse, t_lse, beta: float):
    """Per-element (sum, part) terms of distill.h in float64; rows summed by the caller."""
    log_q, log_p = u - t_lse[:, None], s - s_lse[:, None]
    q, p = log_q.exp(), log_p.exp()
    if code == 0:
        return q * (u - s), torch.zeros_like(s)
    if code == 1:
        return p * (s - u), torch.zeros_like(s)
    log_m = torch.log(beta * q + (1 - beta) * p)
    part = p * (log_p - log_m)
    return beta * q * (log_q - log_m) + (1 - beta) * part, part


@kernel_case("distill_chunk_stats_")
def distill_stats_cases(device: torch.device) -> Iterator[Result]:
    """Fold a student chunk and the teacher's chunk (both column slices of wider buffers) into a running state
    that starts from earlier values; the reference is the float64 merge of the old state and the chunk's terms (the
    KLs: the teacher's running log-sum-exp in target_logit, JSD: plain sums against the full log-sum-exps)."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, softcap, _ in STATS_SHAPES:
            for code in (0, 1, 2):
                name = f"{label} {str(dtype)[6:]} divergence {code}"
                g, student, teacher, t_cap, s_lse, t_lse = _distill_inputs(dtype, name, n, v, softcap)
                acc = _acc(dtype)
                row_max = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
                row_max[0] = -math.inf
                row_sumexp = torch.rand(n, generator=g, dtype=torch.float64).add_(0.5).to(acc)
                row_sumexp[0] = 0.0
                sums = torch.randn(2, n, generator=g, dtype=torch.float64).to(acc)
                sums[1, 0] = 0.0 if code == 2 else -math.inf  # an empty teacher state for the KLs
                state = [t.to(device, copy=True) for t in (row_max, row_sumexp, sums[0], sums[1])]
                torch.ops.hugehead.distill_chunk_stats_.default(
                    _chunk_on(device, student, c0, c1, pad), _chunk_on(device, teacher, c0, c1, pad + 2), code, 0.3,
                    softcap, t_cap, t_lse.to(acc).to(device) if code == 2 else None,
                    s_lse.to(acc).to(device) if code == 2 else None, *state)
                s = _softcapped(student[:, c0:c1].double(), softcap)
                u = _softcapped(teacher[:, c0:c1].double(), t_cap)
                m_old, s_old, a_old, l_old = row_max.double(), row_sumexp.double(), sums[0].double(), sums[1].double()
                m_new = torch.maximum(m_old, s.max(dim=1).values)
                e = torch.exp(s - m_new[:, None])
                s_new = s_old * torch.exp(m_old - m_new) + e.sum(dim=1)
                l_chunk = torch.logsumexp(u, dim=1)
                l_new = torch.logaddexp(l_old, l_chunk)
                if code == 0:  # the running mean of u - s under the teacher's softmax, reweighted by the shares
                    mean_chunk = (torch.softmax(u, dim=1) * (u - s)).sum(1)
                    a_new = torch.exp(l_old - l_new) * a_old + torch.exp(l_chunk - l_new) * mean_chunk
                elif code == 1:  # Σ exp(s - max) (s - u), rescaled with the max as the sum of exps
                    a_new = a_old * torch.exp(m_old - m_new) + (e * (s - u)).sum(1)
                else:
                    terms, part = _distill_terms(code, s, u, s_lse.to(acc).double(), t_lse.to(acc).double(), 0.3)
                    a_new, l_new = a_old + terms.sum(1), l_old + part.sum(1)
                got = [t.cpu().double() for t in state]
                tol = ACC_TOLERANCE[acc]
                yield f"{name}: lse", got[0] + got[1].log(), m_new + s_new.log(), tol
                yield f"{name}: sums", got[2], a_new, 10 * tol
                yield f"{name}: target slot", got[3], l_new, 10 * tol


@kernel_case("distill_chunk_grad_")
def distill_grad_cases(device: torch.device) -> Iterator[Result]:
    """Replace a student chunk by g d divergence / dz; the reference is float64 autograd of the rows' divergences
    (their log-sum-exp terms included) through the student's softcap."""
    for dtype in DTYPES:
        for label, n, v, (c0, c1), pad, _, _, softcap, _, ignore in GRAD_SHAPES:
            for code in (0, 1, 2):
                name = f"{label} {str(dtype)[6:]} divergence {code}"
                g, student, teacher, t_cap, s_lse, t_lse = _distill_inputs(dtype, name, n, v, softcap)
                up = torch.randn(n, generator=g, dtype=torch.float64)
                if ignore:
                    up[::ignore] = 0.0
                z = student.double().requires_grad_(True)
                s = _softcapped(z, softcap)
                lse = torch.logsumexp(s, dim=1)
                terms, part = _distill_terms(code, s, _softcapped(teacher.double(), t_cap), lse, t_lse, 0.3)
                rows = terms.sum(1) + (lse - t_lse if code == 0 else (t_lse - lse if code == 1 else 0.0))
                (expected,) = torch.autograd.grad((up * rows).sum(), z)
                coef = None if code == 0 else (terms.sum(1) if code == 1 else 0.7 * part.sum(1)).detach()
                acc = _acc(dtype)
                on = (lambda t: None if t is None else t.detach().to(acc).to(device))  # noqa: E731
                logits = _chunk_on(device, student, c0, c1, pad)
                torch.ops.hugehead.distill_chunk_grad_.default(
                    logits, _chunk_on(device, teacher, c0, c1, pad + 1), code, 0.3, softcap, t_cap, on(lse), on(t_lse),
                    on(coef), on(up))
                yield f"{name}: dlogits", logits.cpu(), expected[:, c0:c1], TOLERANCE[dtype]


# (label, N, V, chunks, k, softcap, row padding, with bias)
TOPK_SHAPES = [
    ("k=1", 5, 300, [(0, 300)], 1, 0.0, 0, False),
    ("k=5, three chunks, strided", 17, 1000, [(0, 256), (256, 257), (257, 1000)], 5, 0.0, 7, False),
    ("k=5, bias", 17, 1000, [(0, 256), (256, 1000)], 5, 0.0, 2, True),
    ("k=37, softcap, bias", 9, 777, [(0, 400), (400, 777)], 37, 30.0, 3, True),
    ("k > V: empty slots stay -1", 4, 20, [(0, 7), (7, 20)], 25, 0.0, 1, False),
]


@kernel_case("chunk_topk_")
def topk_cases(device: torch.device) -> Iterator[Result]:
    """Fold chunks (ascending classes) into a running top-k; the reference is a stable descending sort of
    the whole row (ties to the lower class id)."""
    for dtype in DTYPES:
        for label, n, v, chunks, k, softcap, pad, with_bias in TOPK_SHAPES:
            name = f"{label} {str(dtype)[6:]}"
            full = (3 * torch.randn(n, v, generator=_gen(name), dtype=torch.float64)).to(dtype)
            bias = torch.randn(v, generator=_gen("bias " + name), dtype=torch.float64).to(dtype) if with_bias else None
            values, indices = _on(device, torch.zeros(n, k, dtype=dtype), torch.full((n, k), -1, dtype=torch.int64))
            for j, (a, b) in enumerate(chunks):
                (chunk_bias,) = _on(device, None if bias is None else bias[a:b].contiguous())
                torch.ops.hugehead.chunk_topk_.default(_chunk_on(device, full, a, b, pad + j), chunk_bias, a, softcap,
                                                       values, indices)
            z = full.to(_acc(dtype)) + (0 if bias is None else bias.to(_acc(dtype)))  # bias added first
            c = _softcapped(z, softcap).to(dtype).double()  # then rounded once
            order = torch.sort(c, dim=1, descending=True, stable=True)
            kk = min(k, v)
            got_values, got_indices = values.cpu().double(), indices.cpu()
            yield f"{name}: values", got_values[:, :kk], order.values[:, :kk], 0.0 if not softcap else TOLERANCE[dtype]
            if not softcap:  # with a softcap, tanh's last bit may differ between backends and reorder near-ties
                yield f"{name}: indices", got_indices[:, :kk].double(), order.indices[:, :kk].double(), 0.0
            if k > v:
                yield f"{name}: empty slots", got_indices[:, kk:].double(), torch.full((n, k - kk), -1.0), 0.0


# --------------------------------------------------------------------------------------------------
# Sparse targets: CSR probability / binary targets
# --------------------------------------------------------------------------------------------------
SPARSE_CHUNKS = [(0, 211), (211, 212), (212, 530)]  # a one-class chunk in the middle
SPARSE_N, SPARSE_V = 9, 530


def _sparse_target(label: str, kind: str, acc: torch.dtype):
    """A dense float64 target ``[9, 530]`` (row 0 empty, row 1 every label, entries at every chunk edge
    in row 2) and its CSR form made on the host by hugehead.sparse.prepare."""
    from hugehead import sparse

    g = _gen("target " + label)
    n, v = SPARSE_N, SPARSE_V
    t = (torch.rand(n, v, generator=g, dtype=torch.float64) < 0.03) * torch.rand(n, v, generator=g, dtype=torch.float64)
    t[0] = 0
    t[1] = 1.0 if kind == "binary" else torch.rand(v, generator=g, dtype=torch.float64)
    t[2, [0, 210, 211, 212, v - 1]] = 0.5
    target = sparse.prepare(t.to_sparse_coo(), n, v, kind=kind, dtype=acc, device=torch.device("cpu"))
    return t, target


def _on(device, *tensors):
    return [None if t is None else t.to(device, copy=True) for t in tensors]


@kernel_case("sparse_chunk_stats_")
def sparse_stats_cases(device: torch.device) -> Iterator[Result]:
    for dtype in DTYPES:
        for softcap, weighted in ((0.0, False), (4.0, True)):
            name = f"softcap {softcap:g}{', class weights' if weighted else ''} {str(dtype)[6:]}"
            acc = _acc(dtype)
            t, target = _sparse_target(name, "probability", acc)
            full = (3 * torch.randn(SPARSE_N, SPARSE_V, generator=_gen(name), dtype=torch.float64)).to(dtype)
            w = torch.rand(SPARSE_V, generator=_gen("w " + name), dtype=torch.float64) + 0.5
            crow, col, val = _on(device, target.crow, target.col, target.val)
            stats = _on(device, torch.full((SPARSE_N,), -math.inf, dtype=acc),
                        *[torch.zeros(SPARSE_N, dtype=acc) for _ in range(3)])
            for k, (a, b) in enumerate(SPARSE_CHUNKS):
                (cw,) = _on(device, w[a:b].to(acc) if weighted else None)
                torch.ops.hugehead.sparse_chunk_stats_.default(_chunk_on(device, full, a, b, 3 * k), crow, col, val,
                                                               a, softcap, cw, *stats)
            c = _softcapped(full.double(), softcap)
            tv = t.to(acc).double()
            ww = w.to(acc).double() if weighted else torch.ones(SPARSE_V, dtype=torch.float64)
            row_max, row_sumexp, target_dot, logit_sum = (x.cpu().double() for x in stats)
            tol = ACC_TOLERANCE[acc]
            yield f"{name}: lse", row_max + row_sumexp.log(), torch.logsumexp(c, 1), tol
            yield f"{name}: target_dot", target_dot, (tv * c).sum(1), 10 * tol
            yield f"{name}: logit_sum", logit_sum, (ww * c).sum(1), 10 * tol


@kernel_case("sparse_chunk_grad_")
def sparse_grad_cases(device: torch.device) -> Iterator[Result]:
    import torch.nn.functional as F

    for dtype in DTYPES:
        for eps, z_loss, softcap, weighted, with_lse in ((0.0, 0.0, 0.0, False, False), (0.2, 1e-3, 5.0, True, True)):
            name = f"eps {eps:g} z {z_loss:g} softcap {softcap:g}{' weighted' if weighted else ''}" \
                   f"{' grad_lse' if with_lse else ''} {str(dtype)[6:]}"
            acc = _acc(dtype)
            t, target = _sparse_target(name, "probability", acc)
            n, v = SPARSE_N, SPARSE_V
            full = (3 * torch.randn(n, v, generator=_gen(name), dtype=torch.float64)).to(dtype)
            w = torch.rand(v, generator=_gen("w " + name), dtype=torch.float64) + 0.5
            tv = t.to(acc).double()
            wv = w.to(acc).double() if weighted else torch.ones(v, dtype=torch.float64)
            z = full.double().requires_grad_(True)
            c = _softcapped(z, softcap)
            rows = F.cross_entropy(c, tv, weight=wv if weighted else None, label_smoothing=eps, reduction="none")
            rows = rows + z_loss * torch.logsumexp(c, 1) ** 2
            g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
            g[4] = 0.0  # a row without gradient
            gl = torch.linspace(-1, 1, n, dtype=torch.float64) if with_lse else None
            total = (rows * g).sum() + ((torch.logsumexp(c, 1) * gl).sum() if with_lse else 0.0)
            (expected,) = torch.autograd.grad(total, z)
            lse = torch.logsumexp(c.detach(), 1)
            mass = (1 - eps) * (tv * wv).sum(1) + eps / v * wv.sum()
            weighted_val = target.val * wv.to(acc)[target.col]
            crow, col, val, lse_d, g_d, mass_d, gl_d = _on(device, target.crow, target.col, weighted_val, lse.to(acc),
                                                           g.to(acc), mass.to(acc),
                                                           None if gl is None else gl.to(acc))
            for k, (a, b) in enumerate(SPARSE_CHUNKS):
                (cw,) = _on(device, wv[a:b].to(acc) if weighted else None)
                chunk = _chunk_on(device, full, a, b, 2 * k + 1)
                torch.ops.hugehead.sparse_chunk_grad_.default(chunk, crow, col, val, a, v, lse_d, g_d, mass_d, eps,
                                                              z_loss, softcap, cw, gl_d)
                yield f"{name} [{a}, {b}): dlogits", chunk.cpu(), expected[:, a:b], TOLERANCE[dtype]


@kernel_case("bce_chunk_")
def bce_cases(device: torch.device) -> Iterator[Result]:
    import torch.nn.functional as F

    for dtype in DTYPES:
        for pos_weighted, mode in ((False, "both"), (True, "loss"), (True, "grad")):
            name = f"{mode}{' pos_weight' if pos_weighted else ''} {str(dtype)[6:]}"
            acc = _acc(dtype)
            t, target = _sparse_target(name, "binary", acc)
            n, v = SPARSE_N, SPARSE_V
            full = 6 * torch.randn(n, v, generator=_gen(name), dtype=torch.float64)
            full[3, :8] = torch.tensor([30.0, -30.0, 80.0, -80.0, 0.0, 1e-3, -1e-3, 15.0], dtype=torch.float64)
            full = full.to(dtype)
            tv = t.to(acc).double()
            pw = (torch.rand(v, generator=_gen("pw " + name), dtype=torch.float64) * 3).to(acc) if pos_weighted else None
            entry_weight = (1 + (pw[target.col] - 1) * target.val).contiguous() if pos_weighted else None
            z = full.double().requires_grad_(True)
            ref_rows = F.binary_cross_entropy_with_logits(z, tv, pos_weight=None if pw is None else pw.double(),
                                                          reduction="none").sum(1)
            g = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
            (expected,) = torch.autograd.grad((ref_rows * g).sum(), z)
            crow, col, val, ew = _on(device, target.crow, target.col, target.val, entry_weight)
            (row_loss,) = _on(device, torch.zeros(n, dtype=acc) if mode != "grad" else None)
            (grad_rows,) = _on(device, g.to(acc) if mode != "loss" else None)
            for k, (a, b) in enumerate(SPARSE_CHUNKS):
                chunk = _chunk_on(device, full, a, b, k)
                torch.ops.hugehead.bce_chunk_.default(chunk, crow, col, val, ew, a, row_loss, grad_rows)
                if grad_rows is not None:
                    yield f"{name} [{a}, {b}): dlogits", chunk.cpu(), expected[:, a:b], TOLERANCE[dtype]
                else:  # loss only: the chunk is read, not written
                    yield f"{name} [{a}, {b}): chunk unchanged", chunk.cpu(), full[:, a:b].double(), 0.0
            if row_loss is not None:
                yield f"{name}: row_loss", row_loss.cpu(), ref_rows.detach(), 10 * ACC_TOLERANCE[acc]


@kernel_case("scale_")
def scale_cases(device: torch.device) -> Iterator[Result]:
    """In-place scaling by a 0-d device tensor: sizes off the 16-byte packs and the unroll, views starting
    mid-pack inside a canary-filled buffer (a write outside the view shows as a changed canary)."""
    for dtype in DTYPES:
        for n, offset in ((1, 0), (7, 1), (4099, 3), (70_001, 5)):
            name = f"n {n} from {offset} {str(dtype)[6:]}"
            x = torch.randn(n, generator=_gen(name), dtype=torch.float64).to(dtype)
            buf = torch.full((n + offset + 9,), 1e3, dtype=dtype)
            buf[offset:offset + n] = x
            buf = buf.to(device)
            scale = torch.tensor(-0.37, dtype=torch.float32)
            torch.ops.hugehead.scale_.default(buf[offset:offset + n], scale.to(device))
            got = buf.cpu()
            yield f"{name}: scaled", got[offset:offset + n], x.double() * float(scale), TOLERANCE[dtype]
            canaries = torch.cat([got[:offset], got[offset + n:]])
            yield f"{name}: canaries", canaries, torch.full_like(canaries, 1e3, dtype=torch.float64), 0.0


@kernel_case("row_scale")
def row_scale_cases(device: torch.device) -> Iterator[Result]:
    """out = x * scale[:, None]: widths on and off the 16-byte packs, rows starting mid-pack, out a column slice
    of a canary-filled buffer (a write outside it shows as a changed canary)."""
    for dtype in DTYPES:
        acc = _acc(dtype)
        for rows, cols, offset in ((1, 8, 0), (7, 13, 1), (33, 768, 8), (130, 1003, 3)):
            name = f"{rows} x {cols} from {offset} {str(dtype)[6:]}"
            x = torch.randn(rows, cols + offset, generator=_gen(name), dtype=torch.float64).to(dtype)[:, offset:]
            scale = torch.randn(rows, generator=_gen("s " + name), dtype=torch.float64).to(acc)
            buf = torch.full((rows, cols + 2 * offset + 8), 1e3, dtype=dtype).to(device)
            out = buf[:, offset:offset + cols]
            xd, sd = _on(device, x, scale)
            torch.ops.hugehead.row_scale.default(out, xd, sd)
            got = buf.cpu()
            yield f"{name}: scaled", got[:, offset:offset + cols], x.double() * scale.double()[:, None], TOLERANCE[dtype]
            canaries = torch.cat([got[:, :offset].reshape(-1), got[:, offset + cols:].reshape(-1)])
            yield f"{name}: canaries", canaries, torch.full_like(canaries, 1e3, dtype=torch.float64), 0.0


# (label, N, C, D, class_start, bias, softcap): rows and columns off the GEMM's tiles; the depth picks the
# schedule (cooperative from 2048 on, kStatsCooperativeDepth in csrc/include/hugehead/gemm.h), so both are run
GEMM_STATS_SHAPES = [
    ("one row", 1, 300, 64, 0, False, 0.0),
    ("tails, bias", 130, 257, 128, 1000, True, 0.0),
    ("softcap, bias", 200, 1000, 768, 64, True, 30.0),
    ("deep (cooperative), tails", 130, 257, 2048, 0, False, 0.0),
]


@kernel_case("gemm_chunk_stats_")
def gemm_stats_cases(device: torch.device) -> Iterator[Result]:
    """The CUTLASS statistics GEMM (CUDA builds with CUTLASS, sm_90 only), on the schedule each depth picks,
    from earlier running statistics; the reference folds the float64 logits of the same bf16 inputs."""
    from hugehead import ops

    if not ops.has_fused_gemm(device, torch.bfloat16):
        return
    for (label, n, c, d, c0, with_bias, softcap), sums in itertools.product(GEMM_STATS_SHAPES, (True, False)):
        name = label + ("" if sums else " without logit sums (8-byte partials)")
        g = _gen(name)
        x = torch.randn(n, d, generator=g, dtype=torch.float64).to(torch.bfloat16)
        w = (torch.randn(c, d, generator=g, dtype=torch.float64) * 3 / math.sqrt(d)).to(torch.bfloat16)
        b = torch.randn(c, generator=g, dtype=torch.float64).to(torch.bfloat16) if with_bias else None
        target = torch.randint(0, c0 + c + 50, (n,), generator=g)
        target[::2] = torch.randint(c0, c0 + c, (n,), generator=g)[::2]
        target[1::3] = IGNORE
        row_max = torch.randn(n, generator=g, dtype=torch.float64).float()
        row_max[0] = -math.inf
        row_sumexp = torch.rand(n, generator=g, dtype=torch.float64).add_(0.5).float()
        row_sumexp[0] = 0.0
        target_logit = torch.randn(n, generator=g, dtype=torch.float64).float()
        logit_sum = torch.randn(n, generator=g, dtype=torch.float64).float()
        state = [t.to(device, copy=True) for t in (row_max, row_sumexp, target_logit, logit_sum)]
        torch.ops.hugehead.gemm_chunk_stats_.default(
            x.to(device), w.to(device), None if b is None else b.to(device), target.to(device), c0, softcap,
            *state, with_logit_sum=sums)
        # the kernel rounds each logit once to bf16 (as a stored GEMM output), then softcaps in float32
        z = (x.double() @ w.double().t() + (0 if b is None else b.double())).to(torch.bfloat16).double()
        z = _softcapped(z, softcap)
        m_old, s_old = row_max.double(), row_sumexp.double()
        m_new = torch.maximum(m_old, z.max(dim=1).values)
        s_new = s_old * torch.exp(m_old - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
        inside = (target >= c0) & (target < c0 + c)
        picked = z.gather(1, (target - c0).clamp(0, c - 1)[:, None]).squeeze(1)
        got = [t.cpu() for t in state]
        tol = 1e-3  # float32 accumulation vs float64: now and then a logit rounds to the other bf16
        yield f"{name}: row_max", got[0], m_new, tol
        yield f"{name}: lse", got[0].double() + got[1].double().log(), m_new + s_new.log(), tol
        yield f"{name}: target_logit", got[2], torch.where(inside, picked, target_logit.double()), tol
        if sums:
            yield f"{name}: logit_sum", got[3], logit_sum.double() + z.sum(dim=1), 10 * tol
        else:  # left as it was, exactly
            yield f"{name}: logit_sum untouched", got[3], logit_sum.double(), 0.0


@kernel_case("gemm_chunk_grad_")
def gemm_grad_cases(device: torch.device) -> Iterator[Result]:
    """The CUTLASS gradient GEMM (CUDA builds with CUTLASS, sm_90 only) into a column slice of a wider buffer
    (canaries beside it), every option; the reference is numerics.h's formula on the bf16-rounded float64
    logits."""
    from hugehead import ops

    if not ops.has_fused_gemm(device, torch.bfloat16):
        return
    # (label, N, C, D, class_start, bias, label_smoothing, z_loss, softcap, grad_lse, row padding)
    for label, n, c, d, c0, with_bias, eps, z_loss, softcap, with_gl, pad in [
        ("plain", 7, 300, 64, 0, False, 0.0, 0.0, 0.0, False, 0),
        ("odd C, strided, all options", 130, 257, 128, 1000, True, 0.1, 1e-3, 30.0, True, 5),
    ]:
        g = _gen(f"gemm grad {label}")
        x = torch.randn(n, d, generator=g, dtype=torch.float64).to(torch.bfloat16)
        w = (torch.randn(c, d, generator=g, dtype=torch.float64) * 3 / math.sqrt(d)).to(torch.bfloat16)
        b = torch.randn(c, generator=g, dtype=torch.float64).to(torch.bfloat16) if with_bias else None
        num_classes = c0 + c + 50
        target = torch.randint(0, num_classes, (n,), generator=g)
        target[::2] = torch.randint(c0, c0 + c, (n,), generator=g)[::2]
        target[1::3] = IGNORE
        lse = (torch.randn(n, generator=g, dtype=torch.float64) + 6).float()
        grad_rows = torch.rand(n, generator=g, dtype=torch.float64).float() / n
        grad_rows[1::3] = 0.0
        grad_lse = (torch.randn(n, generator=g, dtype=torch.float64) / n).float() if with_gl else None
        out = _chunk_on(device, torch.zeros(n, c, dtype=torch.bfloat16), 0, c, pad)
        ops.gemm_chunk_grad_(x.to(device), w.to(device), None if b is None else b.to(device), target.to(device), c0,
                             num_classes, lse.to(device), grad_rows.to(device), eps, z_loss, softcap,
                             None if grad_lse is None else grad_lse.to(device), out)
        z = (x.double() @ w.double().t() + (0 if b is None else b.double())).to(torch.bfloat16).double()
        dcdz = torch.ones_like(z)
        if softcap > 0:
            th = torch.tanh(z / softcap)
            z, dcdz = softcap * th, 1 - th * th
        p = torch.exp(z - lse.double()[:, None])
        dz = p - eps / num_classes + p * 2 * z_loss * lse.double()[:, None]
        inside = (target >= c0) & (target < c0 + c)
        rows = torch.nonzero(inside).squeeze(1)
        dz[rows, target[rows] - c0] -= 1 - eps
        expected = grad_rows.double()[:, None] * dz
        if grad_lse is not None:
            expected = expected + grad_lse.double()[:, None] * p
        yield f"gemm grad {label}", out.cpu(), expected * dcdz, TOLERANCE[torch.bfloat16]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    denom = float(e.norm())
    return float((a - e).norm()) / (denom if denom > 0 else 1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--ops", default=None, help="comma list of ops (default: every kernel op found)")
    p.add_argument("--list", action="store_true", help="print the kernel ops and whether each has cases")
    p.add_argument("-q", "--quiet", action="store_true", help="print failures and the summary only")
    opts = p.parse_args(argv)
    found = kernel_ops()
    missing = [op for op in found if op not in CASES]
    if opts.list:
        for op in found:
            print(f"{op:<24} {'cases: ' + CASES[op].__name__ if op in CASES else 'NO CASES'}")
        return 2 if missing else 0
    if missing:
        print(f"kernel op(s) without a sanitizer case: {', '.join(missing)}: add a function under "
              f"@kernel_case(\"{missing[0]}\") in tools/sanitize_case.py", flush=True)
        return 2
    device = torch.device(opts.device)
    ops = opts.ops.split(",") if opts.ops else found
    print(f"hugehead {hugehead.__version__} from {hugehead.__file__}; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; kernel ops: {', '.join(ops)}", flush=True)
    bad, count = [], 0
    for op in ops:
        for label, actual, expected, tol in CASES[op](device):
            count += 1
            err = rel_err(actual, expected)
            ok = err <= tol
            if not ok:
                bad.append(f"{op} {label}")
            if not ok or not opts.quiet:
                print(f"{'ok ' if ok else 'BAD'} {op:<14} {label:<48} rel err {err:.1e} (tol {tol:.0e})", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"{count - len(bad)}/{count} results within tolerance" + (f"; off: {', '.join(bad)}" if bad else ""),
          flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
