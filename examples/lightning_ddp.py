"""A vocabulary-parallel head under PyTorch Lightning's DDP strategy: ``Trainer(strategy="ddp",
devices=2)`` replicates the backbone, and a :class:`hugehead.ChunkedClassifier` built with
``process_group=`` splits the classes over the DDP ranks; then ``trainer.test``, which reports accuracy@1
and accuracy@5 from the head's streaming top-k (:class:`hugehead.metrics.AccuracyAtK`, summed over the ranks
by torchmetrics) beside the always-most-frequent baseline.

    python examples/lightning_ddp.py                 # 2 GPUs: 6M classes, D=768, bf16-mixed
    python examples/lightning_ddp.py --cpu           # tiny, 2 CPU processes (gloo)
    python examples/lightning_ddp.py --devices 8 --num-nodes 2   # under a cluster launcher (SLURM, torchrun)

What matters for the head (see ``HugeHeadDDP.configure_model``):

- it is built in ``configure_model``, which Lightning calls once the process group exists, with the
  rank's own device (an explicit placement is pinned: Lightning's ``.to(device)`` leaves it alone);
- its Parameters are put on DDP's ignore list (:func:`hugehead.ignore_heads_in_ddp`)
  before Lightning wraps the module: DDP must neither broadcast rank 0's shard over the others' at
  construction — nor, for ``trainer.test``, in Lightning's module-state sync, which honours the same list —
  nor all-reduce the head's gradients, which are already those of the mean of the ranks' losses (the
  objective whose backbone gradients DDP averages);
- every rank runs the same steps (the DistributedSampler gives each the same number of batches): each
  forward, backward, ``topk`` and ``state_dict`` of the head is collective.

``--checkpoint PATH`` also writes a Lightning checkpoint after ``fit``: its ``state_dict`` holds the
head's logical ``head.weight [V, D]`` gathered from all ranks, which loads into any world size or into a
one-process head.

``--ckpt-dir DIR`` trains with :class:`hugehead.lightning.ShardedHeadDDPStrategy` and
``ModelCheckpoint(save_last=True)``: ``DIR/last.ckpt`` is a sharded checkpoint directory in which every
rank writes its own head rows and Adam state (nothing gathered); ``--ckpt-path DIR/last.ckpt`` resumes
from it, and the test reads the weights back from it::

    python examples/lightning_ddp.py --steps 100 --epoch-steps 50 --ckpt-dir ckpts
    python examples/lightning_ddp.py --steps 150 --epoch-steps 50 --ckpt-dir ckpts --ckpt-path ckpts/last.ckpt

The data are those of ``examples/ddp_train.py``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import hugehead
from hugehead import ignore_heads_in_ddp
from hugehead.metrics import AccuracyAtK, accuracy_at_k, most_frequent_topk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_train import synthetic_batch  # noqa: E402  (the same synthetic classes)
from example_common import add_size_args, example_parser, fill_defaults  # noqa: E402

try:
    import lightning as L
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise SystemExit(f"examples/lightning_ddp.py needs PyTorch Lightning: pip install lightning ({exc})") from None

from hugehead.lightning import ShardedHeadDDPStrategy  # noqa: E402  (needs lightning)

TOP_K = (1, 5)


class HugeHeadDDP(L.LightningModule):
    """An MLP backbone (replicated by DDP) and a head whose classes are split over the DDP ranks."""

    def __init__(self, num_classes: int, dim: int, in_dim: int, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Sequential(nn.Linear(in_dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim), nn.LayerNorm(dim))
        self.head: Optional[hugehead.ChunkedClassifier] = None
        # Streaming accuracy@k: sums of hits and rows, added over the ranks when Lightning computes them.
        self.test_accuracy = nn.ModuleDict({str(k): AccuracyAtK(k) for k in TOP_K if k <= num_classes})

    def configure_model(self) -> None:
        if self.head is not None:  # called again by trainer.test
            return
        group = dist.group.WORLD if dist.is_initialized() else None  # one process: an ordinary head
        self.head = hugehead.ChunkedClassifier(self.hparams.dim, self.hparams.num_classes,
                                               devices=[self.trainer.strategy.root_device], process_group=group)
        ignore_heads_in_ddp(self)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.head(self.backbone(inputs), target)  # this rank's rows; the mean over ranks is the objective
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        inputs, target = batch
        features = self.backbone(inputs)
        loss = self.head(features, target)
        _, top = self.head.topk(features, max(int(k) for k in self.test_accuracy))  # collective, like the loss
        self.log("test_loss", loss, sync_dist=True, batch_size=target.shape[0])
        for k, accuracy in self.test_accuracy.items():
            accuracy.update(top, target)
            self.log(f"test_acc@{k}", accuracy)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)


def shard_fingerprint(head: hugehead.ChunkedClassifier) -> float:
    return float(sum(s.weight.detach().double().sum() for s in head.shards))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    p.add_argument("--cpu", action="store_true", help="tiny run on CPU processes (gloo)")
    p.add_argument("--devices", type=int, default=2, help="processes (GPUs) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    gpu = dict(classes=6_000_000, dim=768, batch=2048, steps=100, test_size=16384)
    cpu = dict(classes=2000, dim=32, batch=64, steps=30, test_size=512)
    add_size_args(p, dict(classes="number of classes", dim="head in_features", batch="rows per rank per step",
                          steps="training steps", test_size="held-out rows in all"), gpu, cpu)
    p.add_argument("--in-dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-steps", type=int, help="steps per epoch (default: --steps, one epoch); resume at "
                   "an epoch boundary to continue exactly as an uninterrupted run")
    p.add_argument("--checkpoint", help="after fit, trainer.save_checkpoint to this path")
    p.add_argument("--ckpt-dir", help="sharded checkpoints (ShardedHeadDDPStrategy): DIR/last.ckpt at the end of fit")
    p.add_argument("--ckpt-path", help="resume fit from this sharded checkpoint directory")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    fill_defaults(args, cpu if args.cpu else gpu)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(args.seed, verbose=False)
    world = args.devices * args.num_nodes
    gen = torch.Generator().manual_seed(args.seed + 1)
    cpu = torch.device("cpu")
    epoch_steps = args.epoch_steps or args.steps
    train = TensorDataset(*synthetic_batch(epoch_steps * args.batch * world, args.classes, args.in_dim, 1.3, 0.5, gen, cpu))
    test = TensorDataset(*synthetic_batch(args.test_size, args.classes, args.in_dim, 1.3, 0.5, gen, cpu))
    model = HugeHeadDDP(args.classes, args.dim, args.in_dim, args.lr)
    sharded = bool(args.ckpt_dir or args.ckpt_path)
    callbacks = []
    if args.ckpt_dir:
        # save_top_k=0: only last.ckpt, rewritten atomically. Saved at the last training step (not at
        # on_train_end): Lightning then resumes a run that stopped at an epoch's end at the next epoch's
        # first batch, exactly as an uninterrupted run continues.
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0,
                                                             enable_version_counter=False,
                                                             every_n_train_steps=args.steps))
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=args.devices, num_nodes=args.num_nodes,
        strategy=ShardedHeadDDPStrategy() if sharded else "ddp",
        precision="32-true" if args.cpu else "bf16-mixed", max_steps=args.steps, max_epochs=-1, logger=False,
        enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, enable_progress_bar=not args.no_progress,
    )
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True), ckpt_path=args.ckpt_path)
    fit_seconds = time.perf_counter() - t0
    rank = trainer.global_rank
    head = model.head
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)  # every rank gathers the logical head; rank 0 writes
    before = shard_fingerprint(head)
    last = os.path.join(args.ckpt_dir, "last.ckpt") if args.ckpt_dir else None
    t0 = time.perf_counter()
    metrics = trainer.test(model, DataLoader(test, batch_size=args.batch), ckpt_path=last, verbose=False)[0]
    test_seconds = time.perf_counter() - t0
    # The baseline: always answer the k most frequent classes of the training set (every rank holds it).
    ks = [int(k) for k in model.test_accuracy]
    frequencies = torch.bincount(train.tensors[1], minlength=args.classes)
    baseline = dict(zip(ks, accuracy_at_k(most_frequent_topk(frequencies, max(ks), len(test)), test.tensors[1],
                                          ks).tolist()))
    if shard_fingerprint(head) != before:
        raise RuntimeError("trainer.test changed this rank's head shard (was the head left on DDP's ignore list?)")
    print(f"rank {rank}: classes [{head.shards[0].start:,}, {head.shards[-1].stop:,}) on {head.shards[0].device}; "
          f"head shard sum {before!r}", flush=True)
    if rank == 0:
        print(f"fit: {trainer.global_step} steps in {fit_seconds:.1f} s on {world} ranks; test: {test_seconds:.1f} s")
        print(f"test_loss={metrics['test_loss']:.4f} "
              + " ".join(f"test_acc@{k}={metrics[f'test_acc@{k}']:.4f}" for k in ks)
              + " (always-most-frequent " + " ".join(f"@{k} {baseline[k]:.4f}" for k in ks)
              + f"; log V = {math.log(args.classes):.2f}, uniform chance {1 / args.classes:.1e})", flush=True)
    return dict(test_loss=float(metrics["test_loss"]), test_acc={k: float(metrics[f"test_acc@{k}"]) for k in ks},
                baseline=baseline,
                fit_seconds=fit_seconds, test_seconds=test_seconds, global_step=trainer.global_step)


if __name__ == "__main__":
    main()
    # As in ddp_train.py: on torch 2.13 (CPU, gloo) the interpreter's teardown after DDP sometimes aborts
    # in a library thread ("terminate called without an active exception") once everything is done,
    # turning a finished run into SIGABRT; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
