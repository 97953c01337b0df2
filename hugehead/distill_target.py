"""The chunk target of distillation (:mod:`hugehead.distill`): each student logits chunk the loop hands it meets the
teacher's logits of the same classes, computed there from the teacher's rows and weight (:class:`TeacherLogits`),
and folds the divergence's per-row sums into the statistics' two free slots, merged over shards and ranks by the
slot rule each divergence declares (``SUM_SLOT``, :func:`hugehead.loop.chunks.sum_slot`).

With ``s`` the student's and ``u`` the teacher's (tempered) logits, ``L_s``, ``L_t`` their log-sum-exps, ``p`` and
``q`` their softmaxes and, for the Jensen-Shannon divergence, ``m = β q + (1 - β) p``:

- forward KL ``KL(q || p) = Σ q (u - s) - L_t + L_s``: the teacher's log-sum-exp in ``target_logit`` and the mean of
  ``u - s`` under the teacher's softmax in ``logit_sum``, both folded with the teacher's running max
  (``"teacher_mean"``), so no pass comes first; ``d/ds = p - q``.
- reverse KL ``KL(p || q) = Σ p (s - u) - L_s + L_t``: ``Σ exp(s - max) (s - u)`` with the student's running max in
  ``logit_sum``, a mean under the student's softmax, the teacher's log-sum-exp in ``target_logit``
  (``"student_mean"``); ``d/ds = p (s - u - Σ p (s - u))``.
- JSD ``β KL(q || m) + (1 - β) KL(p || m)`` (both log-sum-exps first, plain sums); ``d/ds = p (a - Σ p a)`` with
  ``a = (1 - β) (log p - log m)``, whose sum the forward keeps in ``target_logit``'s slot.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .ops import target_chunks
from .targets import TargetBase

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

    def logits(self, c0: int, c1: int) -> Tensor:
        """``[R, c1 - c0]`` before the softcap, in the rows' dtype on the rows' device."""
        x = self.x
        parts = []
        for start, weight, bias in self.shards:
            a, b = max(c0, start) - start, min(c1, start + weight.shape[0]) - start
            if a >= b:
                continue
            w = weight.detach()[a:b].to(device=x.device, dtype=x.dtype)
            parts.append(x @ w.T if bias is None else torch.addmm(bias.detach()[a:b].to(device=x.device, dtype=x.dtype),
                                                                   x, w.T))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@dataclass(frozen=True)
class DistillTarget(TargetBase):
    """The loop's chunk target for one divergence (module docstring) against ``teacher``.

    Attributes:
        teacher_lse, student_lse: ``[N]`` the two heads' log-sum-exps, from passes before (JSD's forward; the
            backward's ``teacher_lse`` is set by :meth:`with_grads`), else None. coef: ``[N]`` the backward's
            ``Σ p (s - u)`` (reverse KL) or ``Σ p a`` (JSD), set by :meth:`with_grads`.
    """

    teacher: TeacherLogits
    divergence: str
    beta: float
    teacher_lse: Optional[Tensor] = None
    student_lse: Optional[Tensor] = None
    coef: Optional[Tensor] = None
    GRAD_TERMS = 0  # with_grads' terms are not gradients (across ranks they are gathered as they are)

    @property
    def SUM_SLOT(self) -> str:  # noqa: N802  (hugehead.loop.chunks.sum_slot's attribute)
        return {"forward_kl": "teacher_mean", "reverse_kl": "student_mean"}.get(self.divergence, "sum")

    @property
    def device(self) -> torch.device:
        return self.teacher.x.device

    def rows(self, r0: int, r1: int) -> "DistillTarget":
        cut = (lambda t: None if t is None else t[r0:r1])  # noqa: E731
        return replace(self, teacher=self.teacher.rows(r0, r1), teacher_lse=cut(self.teacher_lse),
                       student_lse=cut(self.student_lse), coef=cut(self.coef))

    def gather(self, engine, rows: int) -> "DistillTarget":
        """Every rank's rows (the distributed engine's all-gather, each rank's padded to ``rows``)."""
        pad = (lambda t: None if t is None else engine.gather_rows(t, rows, 0))  # noqa: E731
        return replace(self, teacher=replace(self.teacher, x=pad(self.teacher.x)), teacher_lse=pad(self.teacher_lse),
                       student_lse=pad(self.student_lse))

    def with_grads(self, coef: Tensor, teacher_lse: Tensor) -> "DistillTarget":
        return replace(self, coef=coef, teacher_lse=teacher_lse)

    @property
    def code(self) -> int:
        return target_chunks.DIVERGENCE_CODES[self.divergence]

    def _teacher_chunk(self, z: Tensor, class_start: int) -> Tensor:
        """The teacher's logits of the student chunk ``z``'s classes, in ``z``'s dtype or its accumulation dtype
        (the kernels take either)."""
        u = self.teacher.logits(class_start, class_start + z.shape[1])
        return u if u.dtype in (z.dtype, ops.acc_dtype(z.dtype)) else u.to(ops.acc_dtype(z.dtype))

    def stats_(self, z: Tensor, class_start: int, softcap: float, stats) -> None:
        """The student's running log-sum-exp and the divergence's slots (module docstring)."""
        target_chunks.distill_chunk_stats_(z, self._teacher_chunk(z, class_start), self.code, self.beta, softcap,
                                           self.teacher.softcap, self.teacher_lse, self.student_lse, stats.max,
                                           stats.sumexp, stats.logit_sum, stats.target_logit)

    def grad_(self, z: Tensor, class_start: int, num_classes: int, lse: Tensor, grad_rows: Tensor,
              label_smoothing: float, z_loss: float, softcap: float, grad_lse: Optional[Tensor]) -> None:
        """``z`` becomes ``grad_rows · d divergence / dz`` in place (rows whose ``grad_rows`` is 0: exact zeros)."""
        target_chunks.distill_chunk_grad_(z, self._teacher_chunk(z, class_start), self.code, self.beta, softcap,
                                          self.teacher.softcap, lse, self.teacher_lse, self.coef, grad_rows)
