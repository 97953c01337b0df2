"""Placement-independent initialization: values uniform in ``[-bound, bound)`` from a counter-based hash
of ``(seed, class, feature)`` in integer arithmetic, computed on each shard's own device. Every placement
(any devices, shard count, CPU/GPU mix) draws the same logical weight."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["hashed_uniform_"]

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer, in place, on int64 tensors holding 32-bit values (products wrap
    in int64; the mask keeps the exact low 32 bits), identical on every device."""
    h.bitwise_xor_(h >> 16).mul_(0x85EBCA6B).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 13).mul_(0xC2B2AE35).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 16)


def hashed_uniform_(param: Tensor, seed: int, first_class: int, bound: float,
                     compute_device: Optional[torch.device] = None) -> None:
    """Fill ``param`` (``[rows, D]`` or ``[rows]``, rows = classes from ``first_class``) with values
    uniform in ``[-bound, bound)`` that depend only on ``(seed, class, feature)``: 24 random bits per
    value from a hash, computed on ``param``'s device (or ``compute_device``: an offloaded shard's GPU,
    each block copied to the host) a block of rows at a time."""
    rows = param.shape[0]
    cols = param.shape[1] if param.dim() == 2 else 1
    device = param.device if compute_device is None else compute_device
    budget = (1 << 26) if device.type == "cuda" else (1 << 20)
    block = max(1, budget // cols)
    col_key = _fmix32((torch.arange(cols, device=device, dtype=torch.int64) * 0x27D4EB2F + seed) & _MASK32)
    flat = param.view(rows, cols)
    for r0 in range(0, rows, block):
        r1 = min(r0 + block, rows)
        row_ids = torch.arange(first_class + r0, first_class + r1, device=device, dtype=torch.int64)
        row_key = _fmix32((row_ids * 0x165667B1 + (row_ids >> 32) + seed) & _MASK32)
        h = _fmix32(((row_key * 0x9E3779B1)[:, None] + col_key[None, :]).bitwise_and_(_MASK32))
        # Exact: 24-bit integers and a power-of-two scale; then one rounding into the bound.
        u = h.bitwise_right_shift_(8).to(torch.float32).mul_(2.0 / (1 << 24)).sub_(1.0)
        u = u.mul_(bound)
        if u.device != flat.device:  # cast where computed (as on a resident shard), then a plain copy
            u = u.to(flat.dtype)
        flat[r0:r1].copy_(u)
