"""A 6,000,000-class classifier in PyTorch Lightning, in ONE process: a small transformer backbone on the
first GPU and a :class:`hugehead.ChunkedClassifier` whose weight is split over ALL visible GPUs,
trained with ``Trainer(accelerator="gpu", devices=1)`` (no DDP, no FairScale/DeepSpeed), then
``trainer.test(model, dataloaders=test_loader)`` with only a test dataloader.

    python examples/lightning_6m.py                    # GPUs: 6M classes, D=768, bf16 head
    python examples/lightning_6m.py --classes 1000000 --steps 100
    python examples/lightning_6m.py --cpu              # tiny smoke run, head as two CPU shards

Lightning moves the LightningModule to its device with ``module.to(device)`` (and back with ``.cpu()``
after ``fit``). A ChunkedClassifier built with explicit ``devices`` is pinned: those calls cast dtypes
but leave every shard where it was placed, so no special handling is needed here; ``main`` checks that
the shards did not move. (Lightning's strategy teardown does move all optimizer state to the CPU after
``fit``, the shards' Adam moments included: harmless here, where ``fit`` runs once; a ``fit`` resumed
from a checkpoint would likewise get every shard's optimizer state moved onto the root device by
``Strategy.load_optimizer_state_dict``.)

The data: sequences of ``--seq-len`` tokens; class ``c`` has a fixed token pattern (a hash of ``c``), a
sample is that pattern with a fraction of its tokens replaced at random, and classes follow a Zipf law,
so the frequent classes are learnable within a short run.
"""
from __future__ import annotations

import argparse
import math
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import hugehead

try:
    import lightning as L
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise SystemExit(
        "examples/lightning_6m.py needs PyTorch Lightning: pip install lightning "
        f"(import failed: {exc})"
    ) from None

_MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def synthetic_sequences(num_samples: int, num_classes: int, seq_len: int, token_vocab: int, zipf: float,
                        corrupt: float, seed: int, data_seed: int = 1234) -> TensorDataset:
    """``(tokens [n, seq_len] int64, target [n] int64)``. The class patterns depend only on
    ``data_seed`` (shared by train and test); ``seed`` draws the samples."""
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
    rank = torch.searchsorted(cdf, torch.rand(num_samples, dtype=torch.float64, generator=gen))
    target = (rank.clamp_(max=num_classes - 1) * perm_mult + perm_add) % num_classes
    h = (target[:, None] * mult + add) & _MASK32
    for _ in range(2):
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    tokens = (h ^ (h >> 16)) % token_vocab
    noisy = torch.rand(tokens.shape, generator=gen) < corrupt
    tokens = torch.where(noisy, torch.randint(0, token_vocab, tokens.shape, generator=gen), tokens)
    return TensorDataset(tokens, target)


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
                 head_dtype: torch.dtype, lr: float, layers: int = 2, heads: int = 4):
        super().__init__()
        self.backbone = TokenEncoder(token_vocab, seq_len, dim, layers, heads)
        self.head = hugehead.ChunkedClassifier(dim, num_classes, devices=head_devices, dtype=head_dtype)
        self.lr = lr

    def _loss_and_features(self, batch):
        tokens, target = batch
        features = self.backbone(tokens).to(self.head.dtype)
        return self.head(features, target), features, target

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._loss_and_features(batch)
        self.log("train_loss", loss.float(), prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss, features, target = self._loss_and_features(batch)
        _, top = self.head.topk(features, 1)
        accuracy = (top[:, 0] == target).float().mean()
        self.log("test_loss", loss.float(), batch_size=target.shape[0])
        self.log("test_acc", accuracy, batch_size=target.shape[0])

    def configure_optimizers(self):
        # The shard Parameters live on their own devices; Adam steps each where it is.
        params = list(self.parameters())
        try:
            return torch.optim.Adam(params, lr=self.lr, fused=True)
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.Adam(params, lr=self.lr, foreach=False)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, help="number of classes (GPU 6000000, --cpu 5000)")
    p.add_argument("--dim", type=int, help="backbone width = head in_features (GPU 768, --cpu 64)")
    p.add_argument("--steps", type=int, help="training steps (GPU 300, --cpu 60)")
    p.add_argument("--batch", type=int, help="sequences per step (GPU 1024, --cpu 64)")
    p.add_argument("--test-size", type=int, help="test sequences (GPU 16384, --cpu 512)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--token-vocab", type=int, default=4096)
    p.add_argument("--corrupt", type=float, default=0.25, help="fraction of tokens replaced at random")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the class frequencies")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no Lightning progress bar")
    p.add_argument("--cpu", action="store_true",
                   help="smoke mode: tiny sizes, accelerator='cpu', head on ['cpu', 'cpu'] (two shards)")
    args = p.parse_args(argv)
    gpu = not args.cpu
    if gpu and not (torch.cuda.is_available() and hugehead.has_kernel("chunk_stats_", "CUDA")):
        p.error("no CUDA GPU (or hugehead was built without CUDA kernels); pass --cpu for the CPU smoke run")
    defaults = (dict(classes=6_000_000, dim=768, steps=300, batch=1024, test_size=16384) if gpu
                else dict(classes=5000, dim=64, steps=60, batch=64, test_size=512))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("classes", "dim", "steps", "batch", "test_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Fit, then test with only a test dataloader. Returns ``{"trainer", "model", "test_metrics",
    "chance_most_frequent", "fit_seconds", "test_seconds"}``."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    L.seed_everything(args.seed, verbose=False)
    if args.cpu:
        accelerator, head_devices, head_dtype = "cpu", ["cpu", "cpu"], torch.float32
    else:
        accelerator, head_dtype = "gpu", torch.bfloat16
        head_devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]

    train_set = synthetic_sequences(args.steps * args.batch, args.classes, args.seq_len, args.token_vocab,
                                    args.zipf, args.corrupt, seed=args.seed + 1)
    test_set = synthetic_sequences(args.test_size, args.classes, args.seq_len, args.token_vocab,
                                   args.zipf, args.corrupt, seed=args.seed + 2)
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=False, num_workers=0)
    test_loader = DataLoader(test_set, batch_size=args.batch, num_workers=0)

    model = HugeHeadModule(args.classes, args.dim, args.token_vocab, args.seq_len, head_devices, head_dtype,
                           args.lr, heads=4 if args.dim % 4 == 0 else 1)
    placement = [str(s.device) for s in model.head.shards]
    print(f"{args.classes:,} classes over {len(placement)} shard(s): "
          + ", ".join(f"{s.device}[{s.start:,}:{s.stop:,})" for s in model.head.shards))

    trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=args.steps, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0,
                        enable_progress_bar=not args.no_progress)
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=train_loader)
    fit_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    test_metrics = trainer.test(model, dataloaders=test_loader, verbose=False)[0]
    test_seconds = time.perf_counter() - t0

    moved = [str(s.device) for s in model.head.shards]
    if moved != placement:
        raise RuntimeError(f"the head's shards moved from {placement} to {moved}")
    print(f"fit: {trainer.global_step} steps in {fit_seconds:.1f} s; test: {test_seconds:.1f} s")
    print("test metrics: " + ", ".join(f"{k}={float(v):.4f}" for k, v in test_metrics.items()))
    # An honest baseline under Zipf-distributed classes: always answer the most frequent training class.
    most_frequent = int(torch.bincount(train_set.tensors[1], minlength=args.classes).argmax())
    majority = float((test_set.tensors[1] == most_frequent).double().mean())
    print(f"chance: always-most-frequent {majority:.4f}, uniform {1 / args.classes:.2e}; "
          f"shards stayed on {moved}")
    if torch.cuda.is_available() and not args.cpu:
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i} peak {torch.cuda.max_memory_allocated(i) / 2**30:.2f} GiB")
    return dict(trainer=trainer, model=model, test_metrics={k: float(v) for k, v in test_metrics.items()},
                chance_most_frequent=majority, fit_seconds=fit_seconds, test_seconds=test_seconds)


if __name__ == "__main__":
    main()
