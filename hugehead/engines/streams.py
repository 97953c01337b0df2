"""The stream interface the offload engine schedules its copies through: :class:`CudaStreams` (per compute
GPU one stream for weight copies in and one for gradient copies out) and :class:`InlineStreams` (a CPU
"compute device": the same schedule with immediate copies, which the tests record and check for races)."""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

__all__ = ["CudaStreams", "InlineStreams"]


class CudaStreams:
    """Per compute device a stream for weight copies in (H2D) and one for gradient copies out (D2H),
    created once; events and copies on them. Copies are ``non_blocking`` from/to pinned host memory."""

    def __init__(self):
        self._h2d: Dict[torch.device, torch.cuda.Stream] = {}
        self._d2h: Dict[torch.device, torch.cuda.Stream] = {}

    def compute(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def h2d(self, device: torch.device):
        if device not in self._h2d:
            self._h2d[device] = torch.cuda.Stream(device)
        return self._h2d[device]

    def d2h(self, device: torch.device):
        if device not in self._d2h:
            self._d2h[device] = torch.cuda.Stream(device)
        return self._d2h[device]

    def event(self):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, dst: Tensor, src: Tensor, stream) -> None:
        """``dst.copy_(src)`` queued on ``stream`` (a cast when the dtypes differ)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def lend(self, tensor: Tensor, stream) -> None:
        """``tensor`` (from the compute stream's allocator) is used on ``stream`` too: its memory is not
        reused until the work queued there when it is freed has finished."""
        tensor.record_stream(stream)

    def use(self, stream, tensor: Tensor, write: bool = False) -> None:
        """Work queued on ``stream`` since its last event reads (or writes) ``tensor``: a hook for the race
        checker of the tests; nothing to do here."""

    def host_wait(self, device: torch.device) -> None:
        """Block the host until every copy queued on ``device``'s copy streams is done: the gradients have
        landed in host memory and no weight is being read any more (the host may update both)."""
        events = []
        for stream in (self.h2d(device), self.d2h(device)):
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        for event in events:
            event.synchronize()


class InlineStreams:
    """The stream interface for a CPU compute device: every copy runs at once, in program order, so
    events have nothing to order. Tests subclass it to record the schedule."""

    def compute(self, device: torch.device):
        return ("compute", str(device))

    def h2d(self, device: torch.device):
        return ("h2d", str(device))

    def d2h(self, device: torch.device):
        return ("d2h", str(device))

    def event(self):
        return object()

    def record(self, event, stream) -> None:
        pass

    def wait(self, stream, event) -> None:
        pass

    def copy(self, dst: Tensor, src: Tensor, stream) -> None:
        dst.copy_(src)

    def lend(self, tensor: Tensor, stream) -> None:
        pass

    def use(self, stream, tensor: Tensor, write: bool = False) -> None:
        pass

    def host_wait(self, device: torch.device) -> None:
        pass
