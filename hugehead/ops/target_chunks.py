"""The op contract of the chunk kernels of the targets beyond class ids (:mod:`hugehead.targets`,
:mod:`hugehead.distill_target`): log-probabilities with entropy, sparse (CSR) targets, one-vs-all and
distillation, each a thin wrapper over ``torch.ops.hugehead.*`` with its fake kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import chunk_rows_fake

__all__ = ["entropy_chunk_stats_", "entropy_chunk_grad_", "sparse_chunk_stats_", "sparse_chunk_grad_", "bce_chunk_",
           "DIVERGENCE_CODES", "distill_chunk_stats_", "distill_chunk_grad_"]


def entropy_chunk_stats_(logits: Tensor, target: Tensor, class_start: int, softcap: float, row_max: Tensor,
                         row_sumexp: Tensor, target_logit: Tensor, logit_sum: Tensor) -> None:
    """:func:`chunk_stats_` for the log-probability with entropy (:mod:`hugehead.logprob`): ``logit_sum`` holds
    the shifted sum instead (starting from 0), ``Σ_j exp(c_j - row_max) (c_j - row_max)`` over the softcapped
    logits ``c``, rescaled as ``row_max`` grows; a row's entropy is then ``log(row_sumexp) - logit_sum /
    row_sumexp``. Raises ``RuntimeError`` as :func:`chunk_stats_`."""
    torch.ops.hugehead.entropy_chunk_stats_.default(logits, target, class_start, softcap, row_max, row_sumexp,
                                                    target_logit, logit_sum)


def entropy_chunk_grad_(logits: Tensor, target: Tensor, class_start: int, softcap: float, lse: Tensor,
                        grad_rows: Tensor, grad_entropy: Tensor, entropy: Tensor) -> None:
    """Replace a logits chunk ``[N, C]`` by ``g (p - onehot) - g_H p (log p + H)`` through the softcap, in place:
    ``p = exp(c - lse)``, ``grad_rows`` (``g``) ``= dL/d(-log p(target))``, ``grad_entropy`` (``g_H``) ``= dL/dH``
    and ``entropy`` (``H``) over all classes, all ``[N]``; a row whose ``g`` and ``g_H`` are 0 becomes exact
    zeros. Raises ``RuntimeError`` as :func:`chunk_grad_`."""
    torch.ops.hugehead.entropy_chunk_grad_.default(logits, target, class_start, softcap, lse, grad_rows,
                                                   grad_entropy, entropy)

@torch.library.register_fake("hugehead::entropy_chunk_stats_")
@torch.library.register_fake("hugehead::entropy_chunk_grad_")
def _entropy_chunk_fake(logits, target, *args):
    return chunk_rows_fake(logits, target, *args)


def sparse_chunk_stats_(
    logits: Tensor,
    crow: Tensor,
    col: Tensor,
    val: Tensor,
    class_start: int,
    softcap: float,
    class_weight: Optional[Tensor],
    row_max: Tensor,
    row_sumexp: Tensor,
    target_dot: Tensor,
    logit_sum: Tensor,
) -> None:
    """:func:`chunk_stats_` for a sparse target: fold a logits chunk into running per-row statistics.

    Args:
        logits: ``[R, C]`` as for :func:`chunk_stats_` (classes ``[class_start, class_start + C)``).
        crow, col, val: the target's rows as CSR: ``crow [R + 1]`` int64 offsets into ``col`` / ``val``
            (absolute: a row block is a slice of ``crow``), ``col [nnz]`` int64 global class ids sorted
            ascending and distinct within each row, ``val [nnz]`` in :func:`acc_dtype` of the logits.
            Entries outside the chunk are skipped (found by binary search, not a scan).
        class_weight: ``[C]`` weights of the chunk's classes in the accumulation dtype, or None (all 1).
        row_max, row_sumexp, target_dot, logit_sum: ``[R]`` accumulation dtype, updated in place:
            ``target_dot += Σ val_e · c(col_e)`` over the row's entries in the chunk and
            ``logit_sum += Σ_j w_j c_j`` over the chunk (``c``: the softcapped logits).

    Raises:
        RuntimeError: on a shape, dtype, device or stride the kernel cannot take.
    """
    torch.ops.hugehead.sparse_chunk_stats_.default(
        logits, crow, col, val, class_start, softcap, class_weight, row_max, row_sumexp, target_dot, logit_sum
    )


def sparse_chunk_grad_(
    logits: Tensor,
    crow: Tensor,
    col: Tensor,
    val: Tensor,
    class_start: int,
    num_classes: int,
    lse: Tensor,
    grad_rows: Tensor,
    target_mass: Tensor,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    class_weight: Optional[Tensor] = None,
    grad_lse: Optional[Tensor] = None,
) -> None:
    """Replace a logits chunk ``[R, C]`` by the gradient of the softmax with a sparse target, in place.

    Row loss ``M_i lse_i - (1 - eps) Σ_e v_e c_e - eps/V Σ_j w_j c_j + z_loss lse_i²`` with
    ``M_i = target_mass[i]`` (the row's total target after smoothing and class weights); the gradient is
    ``g_i (M_i p - eps/V w_j - (1 - eps) v_e [entry] + 2 z_loss lse_i p) + g_lse_i p`` through the
    softcap. ``grad_rows``/``grad_lse`` as for :func:`chunk_grad_`; CSR and ``class_weight`` as for
    :func:`sparse_chunk_stats_`.

    Raises:
        RuntimeError: on a shape, dtype, device or stride the kernel cannot take.
    """
    torch.ops.hugehead.sparse_chunk_grad_.default(
        logits, crow, col, val, class_start, num_classes, lse, grad_rows, target_mass, label_smoothing, z_loss,
        softcap, class_weight, grad_lse,
    )


def bce_chunk_(
    logits: Tensor,
    crow: Tensor,
    col: Tensor,
    val: Tensor,
    entry_weight: Optional[Tensor],
    class_start: int,
    row_loss: Optional[Tensor],
    grad_rows: Optional[Tensor],
) -> None:
    """One-vs-all binary cross-entropy of a logits chunk ``[R, C]`` against a sparse target.

    Per logit (``t = 0`` where the target has no entry, ``lw = entry_weight`` of an entry, 1 without):
    loss ``(1 - t) z + lw softplus(-z)``, gradient ``(1 - t) - lw sigmoid(-z)``
    (``F.binary_cross_entropy_with_logits``). ``row_loss [R]`` (or None) gets the chunk's losses added;
    with ``grad_rows [R]`` the chunk is replaced by ``grad_rows[i] * dloss/dz`` in the same pass. CSR as
    for :func:`sparse_chunk_stats_`; ``entry_weight`` ``[nnz]`` like ``val`` holds
    ``1 + (pos_weight_j - 1) t_e``.

    Raises:
        RuntimeError: on a shape, dtype, device or stride the kernel cannot take.
    """
    torch.ops.hugehead.bce_chunk_.default(logits, crow, col, val, entry_weight, class_start, row_loss, grad_rows)


def _check_csr_fake(logits, crow, col, val):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got {logits.shape}")
    torch._check(crow.shape == (logits.shape[0] + 1,), lambda: "crow must be [R + 1]")
    torch._check(col.dim() == 1 and col.shape == val.shape, lambda: "col and val must be [nnz]")


@torch.library.register_fake("hugehead::sparse_chunk_stats_")
def _sparse_chunk_stats_fake(logits, crow, col, val, class_start, softcap, class_weight, row_max, row_sumexp,
                             target_dot, logit_sum):
    _check_csr_fake(logits, crow, col, val)
    return None


@torch.library.register_fake("hugehead::sparse_chunk_grad_")
def _sparse_chunk_grad_fake(logits, crow, col, val, class_start, num_classes, lse, grad_rows, target_mass,
                            label_smoothing, z_loss, softcap, class_weight=None, grad_lse=None):
    _check_csr_fake(logits, crow, col, val)
    return None


@torch.library.register_fake("hugehead::bce_chunk_")
def _bce_chunk_fake(logits, crow, col, val, entry_weight, class_start, row_loss, grad_rows):
    _check_csr_fake(logits, crow, col, val)
    return None


# The divergence argument of the distillation kernels (csrc/include/hugehead/distill.h's Divergence).
DIVERGENCE_CODES = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def distill_chunk_stats_(logits: Tensor, teacher: Tensor, divergence: int, beta: float, softcap: float,
                         teacher_softcap: float, teacher_lse: Optional[Tensor], student_lse: Optional[Tensor],
                         row_max: Tensor, row_sumexp: Tensor, logit_sum: Tensor, target_logit: Tensor) -> None:
    """Fold a student logits chunk ``[N, C]`` and the teacher's logits of the same classes (``teacher``, the
    student's dtype or its accumulation dtype) into running per-row statistics, in place: the student's online
    ``(row_max, row_sumexp)`` and the divergence's slots (:mod:`hugehead.distill_target`). With ``s``, ``u`` the
    softcapped logits and ``p``, ``q`` their softmaxes:

    - forward KL (code 0): ``target_logit`` the teacher's running log-sum-exp (start it at -inf) and ``logit_sum``
      the running mean of ``u - s`` under the teacher's softmax, ``Σ q (u - s)`` once every class is in;
    - reverse KL (code 1): ``target_logit`` as for code 0 and ``logit_sum`` ``Σ exp(s - row_max) (s - u)`` rescaled
      as ``row_max`` grows (over ``row_sumexp``: ``Σ p (s - u)``);
    - JSD (code 2), against the full log-sum-exps ``teacher_lse`` and ``student_lse`` (``[N]``): ``logit_sum +=
      β Σ q log(q / m) + (1 - β) Σ p log(p / m)`` and ``target_logit += Σ p log(p / m)``, ``m = β q + (1 - β) p``.

    A zero-probability term counts 0. The log-sum-exps are ignored by the KLs. Raises ``RuntimeError`` on bad
    shapes, dtypes or devices."""
    torch.ops.hugehead.distill_chunk_stats_.default(logits, teacher, divergence, beta, softcap, teacher_softcap,
                                                    teacher_lse, student_lse, row_max, row_sumexp, logit_sum,
                                                    target_logit)


def distill_chunk_grad_(logits: Tensor, teacher: Tensor, divergence: int, beta: float, softcap: float,
                        teacher_softcap: float, lse: Tensor, teacher_lse: Tensor, coef: Optional[Tensor],
                        grad_rows: Tensor) -> None:
    """Replace a student logits chunk ``[N, C]`` by ``grad_rows · d divergence / d logits`` in place, through
    the softcap: ``p - q`` (forward KL), ``p (s - u - coef)`` (reverse KL, ``coef = Σ p (s - u)``) or
    ``p ((1 - β) log(p / m) - coef)`` (JSD, ``coef = (1 - β) Σ p log(p / m)``), with ``p = exp(s - lse)`` and the
    names of :func:`distill_chunk_stats_`; a row whose ``grad_rows`` is 0 becomes exact zeros. ``coef`` is
    needed by codes 1 and 2. Raises ``RuntimeError`` as :func:`distill_chunk_stats_`."""
    torch.ops.hugehead.distill_chunk_grad_.default(logits, teacher, divergence, beta, softcap, teacher_softcap, lse,
                                                   teacher_lse, coef, grad_rows)


@torch.library.register_fake("hugehead::distill_chunk_stats_")
@torch.library.register_fake("hugehead::distill_chunk_grad_")
def _distill_chunk_fake(logits, teacher, *_):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D, got {logits.shape}")
    torch._check(teacher.shape == logits.shape, lambda: "teacher must have the logits' shape")
    return None
