"""A 6,000,000-class classifier in PyTorch Lightning, in ONE process: a small transformer backbone on the
first GPU and a :class:`hugehead.ChunkedClassifier` whose weight is split over the GPUs of ``--head-devices``
(default: all visible), trained with one Lightning device (no DDP, no FairScale/DeepSpeed), then
``trainer.test`` with only a test dataloader, which reports accuracy@1 and accuracy@5 from the head's
streaming top-k (``head.topk``: no ``[N, V]`` logits) through :mod:`hugehead.metrics`' streaming metrics,
printed beside the always-most-frequent baseline.

    python examples/lightning_6m.py                    # GPUs: 6M classes, D=768, bf16-mixed, head over all GPUs
    python examples/lightning_6m.py --classes 1000000 --steps 100 --head-devices cuda:0,cuda:1
    python examples/lightning_6m.py --precision bf16-true          # bf16 parameters, no float32 masters
    python examples/lightning_6m.py --offload                      # head in pinned host memory, streamed
    python examples/lightning_6m.py --cpu                          # tiny smoke run, head as two CPU shards
    python examples/lightning_6m.py --cpu --labels 3               # multi-label (sparse target), P@k / nDCG@k

Precision (``--precision``, Lightning's names): ``bf16-mixed`` (GPU default) and ``16-mixed`` keep float32
parameters — the head's weight included, as master weights — and run the steps under autocast, where the
head casts ``x`` and each weight chunk to the low precision inside its loop (no low-precision copy of the
weight); ``bf16-true`` and ``32-true`` (CPU default) hold every parameter in that dtype (the head is built
in it; Lightning converts the backbone).

Checkpoints and resume (README, "Checkpoints and resume"):

    python examples/lightning_6m.py --steps 200 --ckpt-dir ckpts --ckpt-every 100   # fit; saves ckpts/last.ckpt
    python examples/lightning_6m.py --steps 300 --ckpt-dir ckpts --ckpt-path ckpts/last.ckpt   # resume to 300

With ``--ckpt-dir``, ``ModelCheckpoint(save_last=True)`` saves every ``--ckpt-every`` steps and at the end,
and the test runs as ``trainer.test(ckpt_path=<last checkpoint>)`` (weights reloaded from disk);
``--ckpt-path`` resumes ``fit`` from a checkpoint (optimizer state, step counter and all).
``--ckpt-format dcp`` (default) trains with :class:`hugehead.lightning.ShardedHeadStrategy`: each
checkpoint is a directory of ``torch.distributed.checkpoint`` files in which every head shard is written
from its own GPU, never gathered, and loads into any head placement; ``--ckpt-format lightning`` keeps
Lightning's single ``.ckpt`` file (the head's logical weight gathered on the host). Either way
:class:`hugehead.lightning.ShardPlacementCallback` keeps each shard's optimizer state on that shard's
GPU: Lightning restores optimizer state onto its root device and moves it to the CPU when ``fit`` ends,
which would leave the Adam moments of a shard on ``cuda:1`` on ``cuda:0``.

Lightning moves the LightningModule with ``module.to(device)`` (and back with ``.cpu()`` after ``fit``). A
ChunkedClassifier built with explicit ``devices`` (or ``offload=True``) is pinned: those calls cast dtypes
but leave every shard where it was placed; ``main`` checks that the shards did not move.

The data: sequences of ``--seq-len`` tokens; class ``c`` has a fixed token pattern (a hash of ``c``), a
sample is that pattern with a fraction of its tokens replaced at random, and classes follow a Zipf law,
so the frequent classes are learnable within a short run.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import hugehead
from hugehead.metrics import AccuracyAtK, NDCGAtK, PrecisionAtK, accuracy_at_k, most_frequent_topk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_common import (  # noqa: E402
    add_sequence_args, add_size_args, example_parser, fill_defaults, fused_optimizer, head_devices, require_gpu_unless_cpu,
    require_positive)

try:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hugehead.lightning import ShardedHeadStrategy, ShardPlacementCallback
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise SystemExit(
        "examples/lightning_6m.py needs PyTorch Lightning: pip install lightning "
        f"(import failed: {exc})"
    ) from None

PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "32-true")
TOP_K = (1, 5)

_MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def synthetic_sequences(num_samples: int, num_classes: int, seq_len: int, token_vocab: int, zipf: float,
                        corrupt: float, seed: int, data_seed: int = 1234, labels: int = 1) -> TensorDataset:
    """``(tokens [n, seq_len] int64, target [n] int64)``. The class patterns depend only on
    ``data_seed`` (shared by train and test); ``seed`` draws the samples. ``labels > 1``: a multi-label
    set of that many Zipf draws per sample, ``target [n, labels]``, position ``p`` showing the pattern of
    label ``p % labels``."""
    pattern_gen = torch.Generator().manual_seed(data_seed)
    mult = torch.randint(0, 1 << 31, (seq_len,), generator=pattern_gen) * 2 + 1
    add = torch.randint(0, 1 << 31, (seq_len,), generator=pattern_gen)
    perm_mult = 1
    while True:  # rank -> class id by an affine permutation, so frequent classes land on every shard
        perm_mult = int(torch.randint(1, 1 << 31, (1,), generator=pattern_gen))
        if math.gcd(perm_mult, num_classes) == 1:
            break
    perm_add = int(torch.randint(0, num_classes, (1,), generator=pattern_gen))

    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, num_classes + 1, dtype=torch.float64).pow_(-zipf)
    cdf = torch.cumsum(probs / probs.sum(), 0)
    rank = torch.searchsorted(cdf, torch.rand(num_samples, labels, dtype=torch.float64, generator=gen))
    target = (rank.clamp_(max=num_classes - 1) * perm_mult + perm_add) % num_classes
    shown = target[:, torch.arange(seq_len) % labels]  # [n, seq_len]: the label each position shows
    h = (shown * mult + add) & _MASK32
    for _ in range(2):
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    tokens = (h ^ (h >> 16)) % token_vocab
    noisy = torch.rand(tokens.shape, generator=gen) < corrupt
    tokens = torch.where(noisy, torch.randint(0, token_vocab, tokens.shape, generator=gen), tokens)
    return TensorDataset(tokens, target[:, 0] if labels == 1 else target)


def label_target(labels: Tensor, num_classes: int, loss: str) -> Tensor:
    """The sparse ``[n, V]`` target of label sets ``[n, k]``: 1/k per draw for the softmax, 1 per label for
    one-vs-all."""
    n, k = labels.shape
    rows = torch.arange(n, device=labels.device).repeat_interleave(k)
    value = 1.0 / k if loss == "cross_entropy" else 1.0
    t = torch.sparse_coo_tensor(torch.stack([rows, labels.reshape(-1)]),
                                torch.full((n * k,), value, device=labels.device), (n, num_classes)).coalesce()
    if loss != "cross_entropy":  # a label drawn twice is one positive
        t = torch.sparse_coo_tensor(t.indices(), t.values().clamp(max=1.0), t.shape).coalesce()
    return t


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
class TokenEncoder(nn.Module):
    """``tokens [N, L]`` -> ``[N, dim]``: token + position embeddings, an ``nn.TransformerEncoder``,
    mean-pooled over positions, LayerNorm."""

    def __init__(self, token_vocab: int, seq_len: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(token_vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.encoder(self.tokens(tokens) + self.positions[: tokens.shape[1]])
        return self.norm(h.mean(dim=1))


class HugeHeadModule(L.LightningModule):
    """Backbone on Lightning's device; a ChunkedClassifier whose shards stay on ``head_devices`` (an
    explicit placement is pinned: Lightning's ``.to(device)`` does not move them)."""

    def __init__(self, num_classes: int, dim: int, token_vocab: int, seq_len: int, head_devices: List[str],
                 head_dtype: Optional[torch.dtype], lr: float, layers: int = 2, heads: int = 4,
                 offload: bool = False, labels: int = 1, loss: str = "cross_entropy"):
        super().__init__()
        self.backbone = TokenEncoder(token_vocab, seq_len, dim, layers, heads)
        self.head = hugehead.ChunkedClassifier(dim, num_classes, devices=head_devices, dtype=head_dtype,
                                               offload=offload, loss=loss)
        self.lr = lr
        self.multilabel, self.loss_kind = labels > 1, loss
        # Streaming accuracy@k (sums of hits and rows; non-persistent states, so checkpoints hold none).
        self.test_accuracy = nn.ModuleDict({str(k): AccuracyAtK(k) for k in TOP_K if k <= num_classes})
        # Multi-label: precision@k and nDCG@k from the same top-k.
        self.test_ranking = nn.ModuleDict({f"p@{k}": PrecisionAtK(k) for k in TOP_K if k <= num_classes})
        self.test_ranking.update({f"ndcg@{k}": NDCGAtK(k) for k in TOP_K if k <= num_classes and k > 1})

    def _loss_and_features(self, batch):
        tokens, target = batch
        # No cast: under autocast ("-mixed") the head computes in the autocast dtype from its float32
        # weight; with "-true" precisions the features already have the head's dtype.
        features = self.backbone(tokens)
        if self.multilabel:
            return self.head(features, label_target(target, self.head.num_classes, self.loss_kind)), features, target
        return self.head(features, target), features, target

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._loss_and_features(batch)
        self.log("train_loss", loss.float(), prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss, features, target = self._loss_and_features(batch)
        # One streamed top-k over all classes (every shard, chunk by chunk) serves every k.
        _, top = self.head.topk(features, max(int(k) for k in self.test_accuracy))
        self.log("test_loss", loss.float(), batch_size=target.shape[0])
        if self.multilabel:
            label_sets = [row.unique() for row in target]
            for name, metric in self.test_ranking.items():
                metric.update(top, label_sets)
                self.log(f"test_{name}", metric)
            return
        for k, accuracy in self.test_accuracy.items():
            accuracy.update(top, target)
            self.log(f"test_acc@{k}", accuracy)  # Lightning computes and resets it at the epoch's end

    def configure_optimizers(self):
        # The shard Parameters live on their own devices; Adam steps each where it is (ShardPlacementCallback
        # keeps each one's state there across checkpoint restores).
        params = list(self.parameters())
        return fused_optimizer(torch.optim.Adam, params, lr=self.lr)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    gpu = dict(classes=6_000_000, dim=768, steps=300, batch=1024, test_size=16384, precision="bf16-mixed")
    cpu = dict(classes=5000, dim=64, steps=60, batch=64, test_size=512, precision="32-true")
    add_size_args(p, dict(classes="number of classes", dim="backbone width = head in_features",
                          steps="training steps in all, a resumed run included", batch="sequences per step",
                          test_size="test sequences"), gpu, cpu)
    p.add_argument("--train-size", type=int, help="training sequences, one epoch (default: steps x batch); keep "
                   "it when resuming with more --steps to continue the same data order")
    add_sequence_args(p)
    p.add_argument("--labels", type=int, default=1, help="labels per sample (> 1: multi-label, Zipf-drawn label "
                   "sets from a sparse target, tested with precision@k / nDCG@k)")
    p.add_argument("--multilabel-loss", choices=("cross_entropy", "binary_cross_entropy"), default="cross_entropy",
                   help="the head's loss with --labels > 1: softmax over the label set or one-vs-all")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=PRECISIONS,
                   help="Lightning precision (GPU default bf16-mixed, --cpu default 32-true)")
    p.add_argument("--head-devices", help="comma list of the head's shard devices (GPU default: every visible "
                   "GPU, e.g. cuda:0,cuda:1; --cpu: cpu,cpu)")
    p.add_argument("--offload", action="store_true",
                   help="head shards in pinned host memory, streamed to --head-devices (ChunkedClassifier(offload=True))")
    p.add_argument("--ckpt-dir", help="ModelCheckpoint directory (save_last=True); the test then reloads the last checkpoint")
    p.add_argument("--ckpt-every", type=int, help="checkpoint every N training steps (default: only at the end)")
    p.add_argument("--ckpt-path", help="resume fit from this checkpoint (a .ckpt file or a sharded checkpoint directory)")
    p.add_argument("--ckpt-format", choices=("dcp", "lightning"), default="dcp",
                   help="dcp: sharded checkpoint directories (ShardedHeadStrategy, default); lightning: one .ckpt file")
    p.add_argument("--no-progress", action="store_true", help="no Lightning progress bar")
    p.add_argument("--cpu", action="store_true",
                   help="smoke mode: tiny sizes, accelerator='cpu', head on ['cpu', 'cpu'] (two shards)")
    args = p.parse_args(argv)
    require_gpu_unless_cpu(p, args.cpu)
    if args.offload and args.cpu:
        p.error("--offload streams the head from pinned host memory to a GPU; it needs CUDA (not --cpu)")
    fill_defaults(args, cpu if args.cpu else gpu)
    require_positive(p, args, ("classes", "dim", "steps", "batch", "test_size"))
    if args.ckpt_every is not None and args.ckpt_every < 1:
        p.error("--ckpt-every must be >= 1")
    args.head_devices = head_devices(args.head_devices, args.cpu)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Fit (or resume fitting), then test with only a test dataloader. Returns ``{"trainer", "model",
    "test_metrics"`` (``test_loss``, ``test_acc@1``, ``test_acc@5``), ``"chance_most_frequent"`` (the
    baseline's accuracy@1), ``"baseline"`` (``{k: accuracy@k}`` of always answering the k most frequent
    training classes), ``"fit_seconds", "test_seconds", "last_checkpoint"}``."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    L.seed_everything(args.seed, verbose=False)

    train_set = synthetic_sequences(args.train_size or args.steps * args.batch, args.classes, args.seq_len, args.token_vocab,
                                    args.zipf, args.corrupt, seed=args.seed + 1, labels=args.labels)
    test_set = synthetic_sequences(args.test_size, args.classes, args.seq_len, args.token_vocab,
                                   args.zipf, args.corrupt, seed=args.seed + 2, labels=args.labels)
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=False, num_workers=0)
    test_loader = DataLoader(test_set, batch_size=args.batch, num_workers=0)

    callbacks: list = [ShardPlacementCallback()]
    checkpoint = None
    if args.ckpt_dir:
        # Only last.ckpt (save_top_k=0): one checkpoint on disk, rewritten atomically each time.
        checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0, enable_version_counter=False,
                                     every_n_train_steps=args.ckpt_every or args.steps)
        callbacks.append(checkpoint)
    strategy = ShardedHeadStrategy() if args.ckpt_format == "dcp" else "auto"
    trainer = L.Trainer(accelerator="cpu" if args.cpu else "gpu", devices=1, strategy=strategy,
                        precision=args.precision, max_steps=args.steps, max_epochs=-1, logger=False,
                        callbacks=callbacks, enable_checkpointing=checkpoint is not None,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        enable_progress_bar=not args.no_progress)
    # "-true" precisions: the head is built in that dtype (Lightning converts the backbone); "-mixed": float32.
    # (Not under trainer.init_module(): its default-device context would also catch the head's host buffers.)
    head_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(args.precision, torch.float32)
    model = HugeHeadModule(args.classes, args.dim, args.token_vocab, args.seq_len, args.head_devices, head_dtype,
                           args.lr, heads=4 if args.dim % 4 == 0 else 1, offload=args.offload, labels=args.labels,
                           loss=args.multilabel_loss if args.labels > 1 else "cross_entropy")
    placement = [str(s.device) for s in model.head.shards]
    print(f"{args.classes:,} classes over {len(placement)} shard(s) ({model.head.dtype}, precision "
          f"{args.precision}{', offloaded' if args.offload else ''}): "
          + ", ".join(f"{s.device}[{s.start:,}:{s.stop:,})" for s in model.head.shards))

    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=train_loader, ckpt_path=args.ckpt_path)
    fit_seconds = time.perf_counter() - t0
    if args.ckpt_path:
        print(f"resumed from {args.ckpt_path}")
    last = checkpoint.last_model_path if checkpoint is not None else None
    t0 = time.perf_counter()
    # With checkpoints, test what was saved: the weights are read back from the last checkpoint.
    test_metrics = trainer.test(model, dataloaders=test_loader, ckpt_path=last or None, verbose=False)[0]
    test_seconds = time.perf_counter() - t0

    moved = [str(s.device) for s in model.head.shards]
    if moved != placement:
        raise RuntimeError(f"the head's shards moved from {placement} to {moved}")
    print(f"fit: {trainer.global_step} steps in {fit_seconds:.1f} s; test: {test_seconds:.1f} s"
          + (f" (from {last})" if last else ""))
    print("test metrics: " + ", ".join(f"{k}={float(v):.4f}" for k, v in test_metrics.items()))
    if args.labels > 1:  # multi-label: precision@k / nDCG@k above; no single-label baseline
        return dict(trainer=trainer, model=model, test_metrics={k: float(v) for k, v in test_metrics.items()},
                    fit_seconds=fit_seconds, test_seconds=test_seconds, last_checkpoint=last)
    # An honest baseline under Zipf-distributed classes: always answer the k most frequent training classes.
    frequencies = torch.bincount(train_set.tensors[1], minlength=args.classes)
    test_target = test_set.tensors[1]
    ks = [int(k) for k in model.test_accuracy]
    baseline = dict(zip(ks, accuracy_at_k(most_frequent_topk(frequencies, max(ks), len(test_target)), test_target,
                                          ks).tolist()))
    print("test accuracy " + ", ".join(f"@{k} {float(test_metrics[f'test_acc@{k}']):.4f}" for k in ks)
          + "; always-most-frequent " + ", ".join(f"@{k} {baseline[k]:.4f}" for k in ks)
          + f"; uniform @1 {1 / args.classes:.2e}")
    print(f"shards stayed on {moved}")
    if torch.cuda.is_available() and not args.cpu:
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i} peak {torch.cuda.max_memory_allocated(i) / 2**30:.2f} GiB")
    return dict(trainer=trainer, model=model, test_metrics={k: float(v) for k, v in test_metrics.items()},
                chance_most_frequent=baseline[1], baseline=baseline, fit_seconds=fit_seconds, test_seconds=test_seconds,
                last_checkpoint=last)


if __name__ == "__main__":
    main()
