"""PyTorch Lightning integration for models that hold hugehead heads.

- :class:`ShardPlacementCallback`: keeps every parameter's optimizer state on that parameter's device.
  Lightning restores optimizer state onto its root device (``Strategy.load_optimizer_state_dict``) and
  moves it to the CPU when ``fit`` ends (``Strategy.teardown``), so a shard on ``cuda:1`` would step with
  its Adam moments on ``cuda:0``. Works with any strategy and Lightning's own ``.ckpt`` files.
- :class:`ShardedHeadStrategy`: the single-device strategy plus sharded checkpoints — each checkpoint is
  a directory written by :func:`hugehead.checkpoint.save_checkpoint` (``torch.distributed.checkpoint``
  for the tensors), so no head is ever gathered, and it loads into any head placement. It keeps
  optimizer state on the shards itself (no callback needed).
- :class:`ShardedHeadDDPStrategy`: the same checkpoints under DDP, for heads that span the ranks: every
  rank writes its own rows and optimizer state into one directory.

This module imports Lightning (``lightning.pytorch``); ``import hugehead`` does not import it.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Dict, Optional

import torch

try:
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise ImportError(f"hugehead.lightning needs PyTorch Lightning: pip install lightning ({exc})") from None

from .checkpoint import (is_checkpoint_dir, keep_optimizer_state_on_shards, optional_state_keys, place_optimizer_state,
                         read_checkpoint, save_checkpoint, sharded_state_dict)
from .checkpoint.dcp import estimate_checkpoint_bytes
from .checkpoint.space import format_bytes, free_bytes, path_bytes

__all__ = ["ShardPlacementCallback", "ShardedHeadStrategy", "ShardedHeadDDPStrategy", "warn_if_no_room_for_checkpoints"]


class ShardPlacementCallback(Callback):
    """Keeps each parameter's optimizer state on that parameter's device, for every optimizer of the
    trainer: on ``on_train_start`` (which runs after Lightning restored optimizer state from
    ``fit(ckpt_path=...)`` and before the first step) it moves misplaced state back and installs
    :func:`hugehead.keep_optimizer_state_on_shards`'s step pre-hook, which re-checks before every step.

    At the start of ``fit``'s loop it also checks that the checkpoint directory has room for two checkpoints
    (a new checkpoint is written beside the previous one) and warns with the numbers if not
    (:func:`warn_if_no_room_for_checkpoints`).

    ``Trainer(callbacks=[hugehead.lightning.ShardPlacementCallback()])``.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        warn_if_no_room_for_checkpoints(trainer)
        for optimizer in trainer.optimizers:
            keep_optimizer_state_on_shards(optimizer)


def _checkpoint_dirs(trainer):
    dirs = [getattr(cb, "dirpath", None) for cb in getattr(trainer, "checkpoint_callbacks", [])]
    dirs = [d for d in dirs if d]
    return sorted(set(map(str, dirs))) or [str(trainer.default_root_dir)]


def warn_if_no_room_for_checkpoints(trainer, copies: Optional[int] = None) -> Optional[str]:
    """Warn (once per trainer and ``fit``) when a checkpoint directory of ``trainer`` (its
    ``ModelCheckpoint`` dirpaths, else ``default_root_dir``) cannot hold ``copies`` checkpoints of the
    model and its optimizers (estimated without writing: the parameters, and the optimizer state the
    first step allocates). ``copies`` defaults to 2 (a new checkpoint is written beside the previous one)
    or 1 when the strategy was built with ``keep_previous=False``. Only global rank 0 checks.

    Returns:
        The warning's text, or None.
    """
    if getattr(trainer, "_hugehead_room_checked", False) or not trainer.is_global_zero:
        return None
    trainer._hugehead_room_checked = True
    if copies is None:
        copies = 1 if getattr(trainer.strategy, "keep_previous", True) is False else 2
    per_checkpoint = estimate_checkpoint_bytes(trainer.lightning_module, list(trainer.optimizers))
    # keep_previous=False removes the checkpoint this fit resumed from before its first save.
    resumed = getattr(trainer, "ckpt_path", None)
    reclaimable = path_bytes(resumed) if copies == 1 and resumed and is_checkpoint_dir(resumed) else 0
    for directory in _checkpoint_dirs(trainer):
        try:
            free = free_bytes(directory)
        except OSError:
            continue
        if reclaimable and os.path.dirname(os.path.abspath(resumed)) == os.path.abspath(directory):
            free += reclaimable
        if free < copies * per_checkpoint:
            message = (
                f"hugehead: the checkpoint directory {directory} has {format_bytes(free)} free, but a "
                f"checkpoint of this model and its optimizer state takes about {format_bytes(per_checkpoint)} and "
                f"{copies} of them must fit ({format_bytes(copies * per_checkpoint)}: "
                + ("the next checkpoint is written beside the previous one, which stays intact until the new one "
                   "is complete" if copies > 1 else "one checkpoint")
                + "). A save that does not fit raises CheckpointSpaceError before writing. Free space, choose "
                "another dirpath, or keep one checkpoint on disk with "
                "ShardedHeadStrategy(keep_previous=False) (no checkpoint on disk while a new one is written)"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return message
    return None


class _ShardedCheckpoints:
    """Checkpoint methods shared by the strategies below: every checkpoint is a directory written by
    :func:`hugehead.checkpoint.save_checkpoint` (collectively over ``_checkpoint_group()`` when that is
    not None), loaded after setup straight into the shards and onto each parameter's device.

    ``keep_previous=False``: before each checkpoint is written, the one this strategy wrote or resumed from
    last (and any checkpoint at the new path) is removed, so the disk needs room for one checkpoint instead of two.
    **Risk**: while the new checkpoint is written there is none on disk; a crash, kill or failed write in
    that window loses the run's only checkpoint. It also defeats ``ModelCheckpoint(save_top_k>1)`` and
    ``save_last`` beside a best checkpoint: only the newest checkpoint survives."""

    keep_previous = True
    _last_checkpoint: Optional[str] = None

    def _checkpoint_group(self):
        return None

    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if trainer is not None:
            trainer._hugehead_room_checked = False  # the next fit checks again
        super().teardown()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after setup: the optimizers exist then, so their state is read straight onto the shards.
        return True

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return sharded_state_dict(self.lightning_module)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes checkpoint directories and takes no storage_options")
        checkpoint = dict(checkpoint)
        state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", None)
        t0 = time.perf_counter()
        previous = None if self.keep_previous or self._last_checkpoint == os.path.abspath(filepath) \
            else self._last_checkpoint
        save_checkpoint(filepath, state, optimizer_states, extra=checkpoint, process_group=self._checkpoint_group(),
                        keep_previous=self.keep_previous, previous=previous)
        self._last_checkpoint = os.path.abspath(filepath)
        rank_zero_info(f"hugehead: saved sharded checkpoint {filepath} ({_size_gb(filepath):.2f} GB) in "
                       f"{time.perf_counter() - t0:.1f} s")

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        # Nothing read runs code unless the caller passes weights_only=False (None, Lightning's default, is True).
        weights_only = True if weights_only is None else weights_only
        if not is_checkpoint_dir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        torch.cuda.empty_cache()
        # Optimizer state only for fit: after a fit, self.optimizers still holds its optimizers during test.
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting:  # the checkpoint a keep_previous=False save replaces
            self._last_checkpoint = os.path.abspath(checkpoint_path)
        t0 = time.perf_counter()
        state, optimizer_states, extra = read_checkpoint(
            checkpoint_path, self.lightning_module_state_dict(), (self.optimizers or None) if fitting else None,
            weights_only=weights_only, process_group=self._checkpoint_group(),
            optional_keys=optional_state_keys(self.lightning_module),
        )
        rank_zero_info(f"hugehead: loaded sharded checkpoint {checkpoint_path} (weights"
                       f"{'' if optimizer_states is None else ' and optimizer state'}) in {time.perf_counter() - t0:.1f} s")
        checkpoint = dict(extra or {})
        checkpoint["state_dict"] = state
        if optimizer_states is not None:
            checkpoint["optimizer_states"] = optimizer_states
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(opt_state)
            place_optimizer_state(optimizer)  # not Lightning's move of everything to the root device

    def on_train_start(self) -> None:
        super().on_train_start()
        # At the start of fit's loop: after a restore, so the optimizers' state and ckpt_path are known.
        warn_if_no_room_for_checkpoints(self.lightning_module.trainer)
        for optimizer in self.optimizers:
            keep_optimizer_state_on_shards(optimizer)


class ShardedHeadStrategy(_ShardedCheckpoints, SingleDeviceStrategy):
    """One process, one root device for the LightningModule (heads keep their own placement), and
    sharded checkpoints.

    ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write a *directory* (atomically; see
    :func:`hugehead.checkpoint.save_checkpoint`): ``torch.distributed.checkpoint`` files holding every
    head shard as rows of the logical ``weight``/``bias`` (written from the shard's device, in blocks),
    the other tensors and the optimizer state tensors, plus one small ``torch.save`` file with the rest
    of Lightning's checkpoint. ``fit(ckpt_path=dir)`` / ``test(ckpt_path=dir)`` load it in place:
    weights into any head placement and shard count, optimizer state (same placement) straight onto
    each parameter's device. Checkpoint files from other strategies (``.ckpt``) still load.

    Every save first checks that the disk has room for the new checkpoint beside the previous one and
    raises :class:`hugehead.checkpoint.CheckpointSpaceError` (nothing written, the previous checkpoint
    intact) if not; ``fit`` warns at its start when two checkpoints do not fit.

    Args:
        device: the root device; None: the accelerator's (``cuda:<current>`` for GPUs, else CPU).
        accelerator, checkpoint_io, precision_plugin: as for ``SingleDeviceStrategy``.
        keep_previous: False: keep one checkpoint on disk, removing the previous one *before* writing the
            new one (see the risk above, in the strategies' shared notes: no checkpoint on disk meanwhile).

    ``Trainer(accelerator="gpu", devices=1, strategy=hugehead.lightning.ShardedHeadStrategy())``.
    """

    strategy_name = "hugehead_sharded_head"

    def __init__(self, device=None, accelerator=None, checkpoint_io=None, precision_plugin=None, *,
                 keep_previous: bool = True):
        super().__init__(device="cpu" if device is None else device, accelerator=accelerator,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._device_given = device is not None
        self.keep_previous = bool(keep_previous)

    @property
    def root_device(self) -> torch.device:
        if self._device_given:
            return self._root_device
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class ShardedHeadDDPStrategy(_ShardedCheckpoints, DDPStrategy):
    """Lightning's DDP strategy for a model whose heads span the DDP ranks (``process_group=`` heads, see
    ``examples/lightning_ddp.py``), with sharded checkpoints: ``trainer.save_checkpoint`` and
    ``ModelCheckpoint`` write one directory (a shared file system) in which every rank writes its own
    head rows and its own optimizer state (the head's Adam moments differ per rank), the replicated
    backbone once, and rank 0 commits it atomically — the head is never gathered (DDP's own checkpoint
    gathers the logical head on every rank and keeps only rank 0's optimizer state, so a resumed fit
    would give every rank rank 0's moments). ``fit(ckpt_path=dir)`` resumes on the same world size;
    ``test(ckpt_path=dir)`` and :func:`hugehead.checkpoint.load_checkpoint` read the weights into any world
    size or one process. Arguments: those of ``DDPStrategy``, and ``keep_previous`` as for
    :class:`ShardedHeadStrategy` (the space check runs on rank 0 and its error is raised on every rank).

    ``Trainer(devices=2, strategy=hugehead.lightning.ShardedHeadDDPStrategy())``.
    """

    strategy_name = "hugehead_sharded_head_ddp"

    def __init__(self, *args, keep_previous: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_previous = bool(keep_previous)

    def _checkpoint_group(self):
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _size_gb(path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total / 1e9
