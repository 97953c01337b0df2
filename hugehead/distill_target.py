"""The chunk target of distillation (:mod:`hugehead.distill`): each student logits chunk the loop hands it meets the
teacher's logits of the same classes, computed there from the teacher's rows and weight (:class:`TeacherLogits`),
and folds the divergence's per-row sums into the statistics' two free slots — plain sums over classes, so shards
merge them by adding, like the cross-entropy's target logit.

With ``s`` the student's and ``u`` the teacher's (tempered) logits, ``L_s``, ``L_t`` their log-sum-exps, ``p`` and
``q`` their softmaxes and, for the Jensen-Shannon divergence, ``m = β q + (1 - β) p``:

- forward KL ``KL(q || p) = Σ q (u - s) - L_t + L_s``: the sum needs ``L_t`` only (the teacher's pass first);
  ``d/ds = p - q``.
- reverse KL ``KL(p || q) = Σ p (s - u) - L_s + L_t``: the sum needs ``L_s`` (the student's pass first);
  ``d/ds = p (s - u - Σ p (s - u))``.
- JSD ``β KL(q || m) + (1 - β) KL(p || m)`` (both log-sum-exps first); ``d/ds = p (a - Σ p a)`` with
  ``a = (1 - β) (log p - log m)``, whose sum the forward keeps in ``target_logit``'s slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["TeacherLogits", "DistillTarget", "DIVERGENCES"]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class TeacherLogits:
    """The teacher's logits of any class range for its rows ``x [N, D_t]``: ``shards`` ``(start, weight [V_k, D_t],
    bias [V_k] or None)`` in class order covering ``[0, V)`` wherever they live (a chunk's rows are copied to the
    rows' device, cast to their dtype), then ``softcap`` (0: none). The caller folds the temperature in (``x / T``,
    ``b / T``, ``softcap / T``)."""

    x: Tensor
    shards: Tuple[Tuple[int, Tensor, Optional[Tensor]], ...]
    softcap: float = 0.0

    def to(self, device: torch.device, non_blocking: bool = False) -> "TeacherLogits":
        return self if self.x.device == device else replace(self, x=self.x.to(device, non_blocking=non_blocking))

    def rows(self, r0: int, r1: int) -> "TeacherLogits":
        return replace(self, x=self.x[r0:r1])

    def logits(self, c0: int, c1: int, dtype: torch.dtype) -> Tensor:
        """``[R, c1 - c0]`` in ``dtype`` (the accumulation dtype) on the rows' device."""
        x = self.x
        parts = []
        for start, weight, bias in self.shards:
            a, b = max(c0, start) - start, min(c1, start + weight.shape[0]) - start
            if a >= b:
                continue
            w = weight.detach()[a:b].to(device=x.device, dtype=x.dtype)
            part = x @ w.T if bias is None else torch.addmm(bias.detach()[a:b].to(device=x.device, dtype=x.dtype), x,
                                                             w.T)
            parts.append(part.to(dtype))
        u = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self.softcap * torch.tanh(u / self.softcap) if self.softcap > 0 else u


def _capped(z: Tensor, softcap: float) -> Tuple[Tensor, Optional[Tensor]]:
    """The (softcapped) logits and their derivative (None: 1)."""
    if softcap <= 0:
        return z, None
    t = torch.tanh(z / softcap)
    return softcap * t, 1 - t * t


def _weighted(p: Tensor, v: Tensor) -> Tensor:
    """``Σ_j p_j v_j`` per row, a zero-probability term counting 0 (its ``v`` may be infinite)."""
    return torch.where(p > 0, p * v, torch.zeros_like(p)).sum(dim=1)


def _fold_lse(row_max: Tensor, row_sumexp: Tensor, s: Tensor) -> None:
    """Fold chunk ``s [R, C]`` into the running ``(max, sum of exp(s - max))`` in place."""
    new_max = torch.maximum(row_max, s.max(dim=1).values)
    finite = new_max > -math.inf
    keep = torch.where(finite & (row_max > -math.inf), torch.exp(row_max - new_max), torch.zeros_like(row_max))
    shift = torch.where(finite, new_max, torch.zeros_like(new_max))
    row_sumexp.mul_(keep).add_(torch.exp(s - shift[:, None]).sum(dim=1))
    row_max.copy_(new_max)


@dataclass(frozen=True)
class DistillTarget:
    """The loop's chunk target for one divergence (module docstring) against ``teacher``.

    Attributes:
        teacher_lse: ``[N]`` the teacher's log-sum-exp. student_lse: ``[N]`` the student's, from a pass before
            (reverse KL and JSD), else None. coef: ``[N]`` the backward's ``Σ p (s - u)`` (reverse KL) or
            ``Σ p a`` (JSD), set by :meth:`with_grads`.
    """

    teacher: TeacherLogits
    divergence: str
    beta: float
    teacher_lse: Tensor
    student_lse: Optional[Tensor] = None
    coef: Optional[Tensor] = None
    GRAD_TERMS = 0  # with_grads' coefficient is not a gradient (across ranks it is gathered as it is)

    @property
    def device(self) -> torch.device:
        return self.teacher_lse.device

    def to(self, device: torch.device, non_blocking: bool = False) -> "DistillTarget":
        if self.device == device:
            return self
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))  # noqa: E731
        return replace(self, teacher=self.teacher.to(device, non_blocking), teacher_lse=move(self.teacher_lse),
                       student_lse=move(self.student_lse), coef=move(self.coef))

    def columns(self, start: int, stop: int) -> "DistillTarget":
        return self

    def rows(self, r0: int, r1: int) -> "DistillTarget":
        cut = (lambda t: None if t is None else t[r0:r1])  # noqa: E731
        return replace(self, teacher=self.teacher.rows(r0, r1), teacher_lse=self.teacher_lse[r0:r1],
                       student_lse=cut(self.student_lse), coef=cut(self.coef))

    def gather(self, engine, rows: int) -> "DistillTarget":
        """Every rank's rows (the distributed engine's all-gather, each rank's padded to ``rows``)."""
        pad = (lambda t: None if t is None else engine.gather_rows(t, rows, 0))  # noqa: E731
        return replace(self, teacher=replace(self.teacher, x=pad(self.teacher.x)), teacher_lse=pad(self.teacher_lse),
                       student_lse=pad(self.student_lse))

    def with_grads(self, coef: Tensor) -> "DistillTarget":
        return replace(self, coef=coef)

    def _log_mixture(self, log_p: Tensor, log_q: Tensor) -> Tensor:
        return torch.logaddexp(log_q + math.log(self.beta), log_p + math.log1p(-self.beta))

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        """The student's running log-sum-exp, and the divergence's sums into ``logit_sum`` (and, for JSD,
        ``Σ p (log p - log m)`` into ``target_logit``)."""
        acc = stats.max.dtype
        s, _ = _capped(z.to(acc), softcap)
        u = self.teacher.logits(class_start, class_start + z.shape[1], acc)
        _fold_lse(stats.max, stats.sumexp, s)
        log_q = u - self.teacher_lse[:, None]
        if self.divergence == "forward_kl":
            stats.logit_sum.add_(_weighted(log_q.exp(), u - s))
            return
        log_p = s - self.student_lse[:, None]
        p = log_p.exp()
        if self.divergence == "reverse_kl":
            stats.logit_sum.add_(_weighted(p, s - u))
            return
        log_m = self._log_mixture(log_p, log_q)
        stats.logit_sum.add_(self.beta * _weighted(log_q.exp(), log_q - log_m)
                             + (1 - self.beta) * _weighted(p, log_p - log_m))
        stats.target_logit.add_(_weighted(p, log_p - log_m))

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        """``z`` becomes ``grad_rows · d divergence / dz`` in place (rows whose ``grad_rows`` is 0: exact zeros)."""
        acc = lse.dtype
        s, dcdz = _capped(z.to(acc), softcap)
        u = self.teacher.logits(class_start, class_start + z.shape[1], acc)
        log_p = s - lse[:, None]
        p = log_p.exp()
        if self.divergence == "forward_kl":
            g = p - torch.exp(u - self.teacher_lse[:, None])
        elif self.divergence == "reverse_kl":
            g = p * (s - u - self.coef[:, None])
        else:
            log_m = self._log_mixture(log_p, u - self.teacher_lse[:, None])
            g = p * ((1 - self.beta) * (log_p - log_m) - self.coef[:, None])
        g = torch.where(p > 0, g, torch.zeros_like(g)) if self.divergence != "forward_kl" else g
        g = g * grad_rows[:, None]
        if dcdz is not None:
            g = g * dcdz
        z.copy_(torch.where((grad_rows != 0)[:, None], g, torch.zeros_like(g)))

