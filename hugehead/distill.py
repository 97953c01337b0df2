"""Distillation of a teacher head into a student head without either's ``N × V`` logits: forward KL, reverse KL
and the generalized Jensen-Shannon divergence between their tempered softmaxes, streamed over the classes with
both heads' chunks of the same classes in lockstep (:mod:`hugehead.distill_target`); the teacher gets no gradient.

Each head is a weight ``[V, D]`` (with its bias) or a :class:`hugehead.ChunkedClassifier` in any placement
(shards on several devices, in pinned host memory, across ranks); the teacher's classes are read by class range,
so within a process the two heads' shard boundaries need not agree (across ranks each rank's teacher must hold its
student's classes). A teacher may also be given as its top-k ``(ids, log-probs)`` per row.

The passes: for JSD the two log-sum-exps first (a statistics pass over each head's classes); then one pass of both
heads that folds the divergence's sums (the KLs' with both heads' log-sum-exps online), then the backward (the
student's logits recomputed or kept, the teacher's recomputed).
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .distill_target import DIVERGENCES, DistillTarget, TeacherLogits
from .engines.local import LocalEngine, ShardTensors
from .functional import linear_cross_entropy
from .logprob import check_temperature
from .module import ChunkedClassifier
from .options import LossOptions, check_chunk_size, check_inputs, check_memory_budget, reduce_loss
from .sharded_loss import LossSpec, backward_of_shards, save_for_shards, saved_rows

__all__ = ["linear_distill", "ShardedDistill"]


class _Teacher:
    """A teacher head for one call: its engine, shards, rows ``x / T`` in its compute dtype and softcap ``/ T``."""

    def __init__(self, engine: LocalEngine, shards, x: Tensor, softcap: Optional[float], temperature: float):
        self.engine, self.temperature = engine, temperature
        self.shards = [ShardTensors(s.weight.detach(), None if s.bias is None else s.bias.detach() / temperature,
                                    s.start) for s in shards]
        self.x = x.detach() / temperature
        self.softcap = 0.0 if softcap is None else softcap / temperature

    def lse(self) -> Tensor:
        no_target = torch.full((self.x.shape[0],), -1, dtype=torch.int64, device=self.x.device)
        with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            lse, _, _, _ = self.engine.row_stats(self.x, no_target, self.shards,
                                                 LossOptions(softcap=self.softcap or None))
        return lse

    def logits(self) -> TeacherLogits:
        return TeacherLogits(self.x, tuple((s.start, s.weight, s.bias) for s in self.shards), self.softcap)


class ShardedDistill(torch.autograd.Function):
    """Per-row divergences ``[N]`` (accumulation dtype, 0 on rows outside ``mask``) of the student ``x`` against
    every shard of ``spec`` and the teacher; gradients reach the student's rows and shards only."""

    @staticmethod
    def forward(ctx, spec: LossSpec, teacher: _Teacher, divergence: str, beta: float, mask: Tensor, x: Tensor,
                *params: Tensor) -> Tensor:
        shards = spec.shards(params)
        no_target = torch.full((x.shape[0],), -1, dtype=torch.int64, device=x.device)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            teacher_lse = student_lse = None
            if divergence == "jsd":  # its log m needs both log-sum-exps first; the KLs fold theirs online
                teacher_lse = teacher.lse().to(x.device)
                student_lse = spec.engine.row_stats(x, no_target, shards, spec.options)[0]
            target = DistillTarget(teacher.logits(), divergence, beta, teacher_lse, student_lse)
            lse, slot, sums, placed = spec.engine.row_stats(x, target, shards, spec.options,
                                                            keep=any(ctx.needs_input_grad))
        if divergence == "forward_kl":  # slot: the teacher's log-sum-exp; sums: Σ q (u - s)
            teacher_lse, rows, coef = slot, sums + lse - slot, torch.zeros_like(lse)
        elif divergence == "reverse_kl":  # slot: the teacher's log-sum-exp; sums: Σ p (s - u)
            teacher_lse, rows, coef = slot, sums - lse + slot, sums
        else:  # slot: Σ p (log p - log m)
            rows, coef = sums, (1 - beta) * slot
        rows = torch.where(mask, rows, torch.zeros_like(rows))
        save_for_shards(ctx, spec, x, [mask, lse, coef, teacher_lse], params, placed)
        return rows

    @staticmethod
    def backward(ctx, grad_rows: Optional[Tensor]):
        mask, lse, coef, teacher_lse = saved_rows(ctx)
        zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
        grad = zero.expand(lse.shape) if grad_rows is None else torch.where(mask, grad_rows.to(lse.dtype), zero)
        grads = backward_of_shards(ctx, "linear_distill", 5, 6, lse, grad, row_terms=(coef, teacher_lse))
        return (None, None, None, None, None, grads[0], *grads[1:])


def _head(weight, bias, name: str, local: LocalEngine):
    """``(engine, this process's shards, classes, compute dtype, softcap)`` of a weight (with its bias) or a
    ChunkedClassifier."""
    if isinstance(weight, ChunkedClassifier):
        if bias is not None:
            raise ValueError(f"hugehead: {name}_bias is for a weight tensor; a ChunkedClassifier has its own")
        shards = [ShardTensors(s.weight, s.bias if weight.has_bias else None, s.start) for s in weight.shards]
        return weight.engine, shards, weight.num_classes, weight.dtype, weight.softcap
    if not isinstance(weight, Tensor):
        raise TypeError(f"hugehead: {name}_weight must be a [V, D] tensor or a ChunkedClassifier")
    return local, [ShardTensors(weight, bias, 0)], weight.shape[0] if weight.dim() == 2 else 0, None, None


def _check_covers(teacher_shards, student_shards) -> None:
    """The teacher's classes held here include every class of the student's shards here (heads across ranks meet
    by class range: each rank's student classes need that rank's teacher rows)."""
    held = sorted((s.start, s.start + s.weight.shape[0]) for s in teacher_shards)
    for s in student_shards:
        a, b = s.start, s.start + s.weight.shape[0]
        for lo, hi in held:
            if lo <= a < hi:
                a = hi
        if a < b:
            raise ValueError(f"hugehead: the student's classes [{s.start}, {s.start + s.weight.shape[0]}) on this "
                             f"process are not all among the teacher's classes here {held}: across ranks, give both "
                             f"heads the same class ranges per rank (shard_sizes=), or the teacher as a weight")


def _check_beta(divergence: str, beta) -> float:
    if divergence not in DIVERGENCES:
        raise ValueError(f"hugehead: unknown divergence {divergence!r}; expected one of {DIVERGENCES}")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise TypeError(f"hugehead: beta must be a number in (0, 1), got {type(beta).__name__}")
    beta = float(beta)
    if divergence == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"hugehead: the jsd's beta must be in (0, 1) (forward_kl and reverse_kl are its limits), "
                         f"got {beta}")
    return beta


def linear_distill(
    student_x: Tensor,
    student_weight: Union[Tensor, ChunkedClassifier],
    teacher_x: Optional[Tensor],
    teacher_weight: Union[Tensor, ChunkedClassifier, None],
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: Optional[Tensor] = None,
    reduction: str = "mean",
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    teacher_topk: Optional[Tuple[Tensor, Tensor]] = None,
    chunk_size: Optional[int] = None,
    memory_budget: Optional[int] = None,
) -> Tensor:
    """The divergence between the teacher's and the student's ``softmax(logits / temperature)`` per row, reduced.

    ``divergence``: ``"forward_kl"`` ``KL(teacher || student)``, ``"reverse_kl"`` ``KL(student || teacher)``, or
    ``"jsd"`` ``β KL(teacher || m) + (1 - β) KL(student || m)`` with ``m = β teacher + (1 - β) student`` and
    ``0 < beta < 1`` (its limits are the two KLs). No ``T²`` factor: scale the loss yourself.

    Args:
        student_x: ``[N, D_s]``; student_weight: ``[V, D_s]`` (with ``student_bias [V]``) or a
            :class:`hugehead.ChunkedClassifier` (its bias and softcap; shards on local devices, in host memory or
            across ranks — this rank's rows; a teacher across ranks then holds the same class ranges per rank).
        teacher_x, teacher_weight: the same for the teacher (``[N, D_t]``, its own width), which gets no gradient;
            or both None with ``teacher_topk = (ids [N, k] int64, log_probs [N, k])``, the teacher's top-k at its
            own temperature (offline distillation): only ``"forward_kl"``, truncated to those ids —
            ``Σ_k q_k (log q_k - log p_k)``, the rest of the teacher's mass left out (not renormalized).
        chunk_size, memory_budget: as :func:`hugehead.linear_cross_entropy`, for heads given as weights.
        mask: ``[N]`` bool, the rows that count (None: all). reduction: ``"none"`` (per row, 0 outside the mask),
            ``"sum"``, or ``"mean"`` over the rows in the mask (``F.kl_div``'s batchmean; NaN when there are none).
    Returns:
        float32 (float64 for float64 inputs) on the student's device: a scalar, or ``[N]`` for ``"none"``.
    Raises:
        ValueError, TypeError: an unknown divergence or reduction, ``beta`` out of range, shapes or devices that
            do not match, a temperature that is not finite and positive; as :func:`hugehead.linear_cross_entropy`.
    """
    t = check_temperature(temperature)
    beta = _check_beta(divergence, beta)
    options = LossOptions(reduction=reduction)
    n = student_x.shape[0] if isinstance(student_x, Tensor) and student_x.dim() == 2 else None
    if n is None:
        raise ValueError("hugehead: student_x must be a [N, D] tensor")
    if mask is None:
        mask = torch.ones(n, dtype=torch.bool, device=student_x.device)
    elif not (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == (n,)):
        raise ValueError(f"hugehead: mask must be a [N] = [{n}] bool tensor")
    mask = mask.to(student_x.device)
    if teacher_topk is not None:
        return _topk_forward_kl(student_x, student_weight, student_bias, teacher_topk, divergence, t, mask,
                                options.reduction)
    local = LocalEngine(check_chunk_size(chunk_size), check_memory_budget(memory_budget))
    engine, shards, num_classes, dtype, softcap = _head(student_weight, student_bias, "student", local)
    t_engine, t_shards, t_classes, t_dtype, t_softcap = _head(teacher_weight, teacher_bias, "teacher", local)
    if not isinstance(teacher_x, Tensor) or teacher_x.dim() != 2 or teacher_x.shape[0] != n:
        raise ValueError(f"hugehead: teacher_x must be [N, D_t] with the student's N = {n} rows")
    for xs, sh in ((student_x, shards), (teacher_x, t_shards)):
        for s in sh:
            check_inputs(xs, s.weight, None, s.bias)
    x = student_x if dtype is None or student_x.dtype == dtype else student_x.to(dtype)
    tx = teacher_x if t_dtype is None or teacher_x.dtype == t_dtype else teacher_x.to(t_dtype)
    teacher = _Teacher(t_engine, t_shards, tx, t_softcap, t)
    if t_classes != num_classes:
        raise ValueError(f"hugehead: the student and the teacher must have the same number of classes, got "
                         f"{num_classes} and {t_classes}")
    _check_covers(t_shards, shards)
    spec = LossSpec(engine, [s.start for s in shards], shards[0].bias is not None, num_classes,
                    LossOptions(softcap=None if softcap is None else softcap / t))
    params = [s.weight for s in shards] + [s.bias / t for s in shards if s.bias is not None]
    rows = ShardedDistill.apply(spec, teacher, divergence, beta, mask, x / t if t != 1.0 else x, *params)
    return reduce_loss(rows, mask, options.reduction)


def _topk_forward_kl(x, weight, bias, topk, divergence, t, mask, reduction):
    """Forward KL against the teacher's top-k: a sparse-target cross-entropy (``-Σ q log p``) plus ``Σ q log q``."""
    if divergence != "forward_kl" or isinstance(weight, ChunkedClassifier):
        raise ValueError("hugehead: a top-k teacher takes divergence='forward_kl' and a student weight tensor")
    ids, log_q = topk
    n, k = ids.shape
    q = log_q.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32).exp()
    q = torch.where(mask[:, None], q, torch.zeros_like(q))
    rows_of = torch.arange(n, device=x.device).repeat_interleave(k)
    target = torch.sparse_coo_tensor(torch.stack([rows_of, ids.reshape(-1).to(x.device)]), q.reshape(-1).to(x.device),
                                     (n, weight.shape[0]), check_invariants=True)
    ce = linear_cross_entropy(x / t if t != 1.0 else x, weight, target, None if bias is None else bias / t,
                              reduction="none")
    rows = ce + torch.where(q > 0, q * log_q.to(q.dtype), torch.zeros_like(q)).sum(1).to(ce.dtype)
    return reduce_loss(torch.where(mask, rows, torch.zeros_like(rows)), mask, reduction)

