"""The seed's model with Hugging Face transformers: ``BertForSequenceClassification`` with 6,000,000 labels
(BERT-base from a config, random init: nothing is downloaded), patched by
``hugehead.integrations.transformers.patch`` to a head over every visible GPU, trained in Lightning with
``bf16-mixed`` and AdamW, then ``trainer.test`` with accuracy@k (:class:`hugehead.metrics.AccuracyAtK`, from
the head's streamed top-k).

    python examples/hf_bert_6m.py                     # GPUs: BERT-base, 6M labels, head over all GPUs
    python examples/hf_bert_6m.py --head-devices cuda:0 --steps 100
    python examples/hf_bert_6m.py --cpu               # tiny smoke run: a small BERT, head as two CPU shards

What ``patch`` changes (README, "Hugging Face transformers"): ``model.classifier`` becomes a
:class:`hugehead.integrations.transformers.ClassifierHead` (a ``ChunkedClassifier`` with the Linear's weights,
split over ``--head-devices``), ``model(input_ids, labels=...)`` returns hugehead's loss and no logits (a
6M-label head has too many to return), and ``save_pretrained`` still writes ``classifier.weight``. The test
step asks the patched head for its top-k classes of the pooled features (``head_inputs``): no
``[batch, 6M]`` logits anywhere.

The model is built on the first GPU (``torch.device`` context: the 6M x 768 Linear is initialized there, not
on the host), patched (the Linear's weights are copied into the shards and the Linear freed), and the
optimizer is built from the patched model's parameters. The data are the synthetic Zipf-distributed token
patterns of ``examples/lightning_6m.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from hugehead.metrics import AccuracyAtK, accuracy_at_k, label_frequencies, most_frequent_topk

try:
    import lightning as L
    from transformers import BertConfig, BertForSequenceClassification

    from hugehead.integrations.transformers import head_inputs, patch
    from hugehead.lightning import ShardPlacementCallback
except ImportError as exc:  # pragma: no cover - exercised only without the optional dependencies
    raise SystemExit(f"examples/hf_bert_6m.py needs lightning and transformers: pip install lightning transformers "
                     f"(import failed: {exc})") from None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_common import (  # noqa: E402
    add_sequence_args, add_size_args, example_parser, fill_defaults, fused_optimizer, head_devices, require_gpu_unless_cpu,
    require_positive)
from lightning_6m import synthetic_sequences  # noqa: E402  (the same data as the plain-PyTorch example)

TOPK = (1, 5, 10)


def bert_config(args) -> BertConfig:
    """BERT-base (12 layers, 768 wide) on GPUs; a small BERT for --cpu."""
    sizes = (dict(hidden_size=args.dim, num_hidden_layers=12, num_attention_heads=12, intermediate_size=4 * args.dim)
             if not args.cpu else dict(hidden_size=args.dim, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=2 * args.dim))
    return BertConfig(vocab_size=args.token_vocab, max_position_embeddings=max(64, args.seq_len), num_labels=args.classes,
                      problem_type="single_label_classification", attn_implementation="sdpa", **sizes)


class PatchedBert(L.LightningModule):
    """A patched ``BertForSequenceClassification``: ``training_step`` is the model's own forward with
    labels; ``test_step`` pools once and asks the head for the loss and the top-k classes."""

    def __init__(self, model: BertForSequenceClassification, lr: float, head_lr: float):
        super().__init__()
        self.model, self.lr, self.head_lr = model, lr, head_lr
        # Streaming accuracy@k from the top-k class ids (running sums; no [N, V] scores).
        self.test_accuracy = nn.ModuleDict({str(k): AccuracyAtK(k) for k in TOPK})

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        loss = self.model(input_ids=tokens, labels=target).loss
        self.log("train_loss", loss.float(), prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        tokens, target = batch
        features = head_inputs(self.model, input_ids=tokens)  # the pooled rows the head sees, [B, 768]
        head = self.model.classifier
        loss = head(features, target)
        _, top = head.topk(features, k=max(TOPK))  # streamed over the shards: no [B, V] logits
        self.log("test_loss", loss.float(), batch_size=target.shape[0])
        for k, accuracy in self.test_accuracy.items():
            accuracy.update(top, target)
            self.log(f"test_acc@{k}", accuracy)  # computed and reset by Lightning at the epoch's end

    def configure_optimizers(self):
        # Built after patch(): the head's Parameters are the shards'. A higher learning rate for the head,
        # whose rows each see few examples; AdamW steps each shard on its own GPU.
        head = list(self.model.classifier.parameters())
        head_ids = {id(p) for p in head}
        backbone = [p for p in self.model.parameters() if id(p) not in head_ids]
        groups = [dict(params=backbone, lr=self.lr), dict(params=head, lr=self.head_lr, weight_decay=0.0)]
        return fused_optimizer(torch.optim.AdamW, groups)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = example_parser(__doc__)
    gpu = dict(classes=6_000_000, dim=768, steps=200, batch=1024, test_size=16384, precision="bf16-mixed")
    cpu = dict(classes=3000, dim=32, steps=30, batch=64, test_size=256, precision="32-true")
    add_size_args(p, dict(classes="num_labels", dim="BERT hidden size", steps="training steps",
                          batch="sequences per step", test_size="test sequences"), gpu, cpu)
    add_sequence_args(p)
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate of the BERT backbone")
    p.add_argument("--head-lr", type=float, default=2e-3, help="AdamW learning rate of the head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", help="Lightning precision (GPU default bf16-mixed, --cpu 32-true)")
    p.add_argument("--head-devices", help="comma list of the head's shard devices (GPU default: every visible GPU; "
                   "--cpu: cpu,cpu)")
    p.add_argument("--no-progress", action="store_true", help="no Lightning progress bar")
    p.add_argument("--cpu", action="store_true", help="smoke mode: tiny sizes, accelerator='cpu', head on two CPU shards")
    args = p.parse_args(argv)
    require_gpu_unless_cpu(p, args.cpu)
    fill_defaults(args, cpu if args.cpu else gpu)
    require_positive(p, args, ("classes", "dim", "steps", "batch", "test_size"))
    args.head_devices = head_devices(args.head_devices, args.cpu)
    return args


def build_model(args) -> BertForSequenceClassification:
    """A random-init BERT with ``args.classes`` labels, patched to a head over ``args.head_devices``."""
    t0 = time.perf_counter()
    config = bert_config(args)
    # transformers stores num_labels as an id2label dict and type-checks every entry: seconds at 6M labels.
    print(f"BertConfig(num_labels={args.classes:,}) built in {time.perf_counter() - t0:.1f} s", flush=True)
    where = contextlib.nullcontext() if args.cpu else torch.device("cuda", 0)  # init the 6M-row Linear on a GPU
    with where:
        model = BertForSequenceClassification(config)
    return patch(model, devices=args.head_devices)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Fit, then test. Returns ``{"trainer", "model", "test_metrics", "baseline" (always-most-frequent
    accuracy@k), "first_loss", "last_loss", "fit_seconds", "test_seconds"}``."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    L.seed_everything(args.seed, verbose=False)
    train_set = synthetic_sequences(args.steps * args.batch, args.classes, args.seq_len, args.token_vocab, args.zipf,
                                    args.corrupt, seed=args.seed + 1)
    test_set = synthetic_sequences(args.test_size, args.classes, args.seq_len, args.token_vocab, args.zipf,
                                   args.corrupt, seed=args.seed + 2)

    t0 = time.perf_counter()
    model = build_model(args)
    head = model.classifier
    placement = [str(s.device) for s in head.shards]
    print(f"BertForSequenceClassification ({model.config.num_hidden_layers} layers, hidden {args.dim}), "
          f"{args.classes:,} labels, patched in {time.perf_counter() - t0:.1f} s: head "
          + ", ".join(f"{s.device}[{s.start:,}:{s.stop:,})" for s in head.shards) + f"; precision {args.precision}")
    losses: List[float] = []

    class RecordLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu" if args.cpu else "gpu", devices=1, precision=args.precision,
                        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                        callbacks=[ShardPlacementCallback(), RecordLoss()], enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, enable_progress_bar=not args.no_progress)
    module = PatchedBert(model, args.lr, args.head_lr)
    t0 = time.perf_counter()
    trainer.fit(module, DataLoader(train_set, batch_size=args.batch, shuffle=False))
    fit_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = trainer.test(module, DataLoader(test_set, batch_size=args.batch), verbose=False)[0]
    test_seconds = time.perf_counter() - t0

    moved = [str(s.device) for s in head.shards]
    if moved != placement:
        raise RuntimeError(f"the head's shards moved from {placement} to {moved}")
    tail = max(1, len(losses) // 10)
    first, last = sum(losses[:tail]) / tail, sum(losses[-tail:]) / tail
    print(f"fit: {trainer.global_step} steps in {fit_seconds:.1f} s ({1000 * fit_seconds / max(1, trainer.global_step):.0f} "
          f"ms/step incl. data), train loss {first:.3f} (first {tail} steps) -> {last:.3f} (last {tail}); "
          f"test: {test_seconds:.1f} s")
    print("test metrics: " + ", ".join(f"{k}={float(v):.4f}" for k, v in metrics.items()))
    # An honest baseline under Zipf-distributed classes: always answer the k most frequent training classes.
    test_target = test_set.tensors[1]
    baseline = most_frequent_topk(label_frequencies(train_set.tensors[1], args.classes), max(TOPK), len(test_target))
    chance = accuracy_at_k(baseline, test_target, list(TOPK)).tolist()
    print("always-most-frequent baseline: " + ", ".join(f"acc@{k}={a:.4f}" for k, a in zip(TOPK, chance))
          + f"; shards stayed on {moved}")
    if torch.cuda.is_available() and not args.cpu:
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i} peak {torch.cuda.max_memory_allocated(i) / 2**30:.2f} GiB")
    return dict(trainer=trainer, model=model, test_metrics={k: float(v) for k, v in metrics.items()},
                baseline=dict(zip(TOPK, chance)), first_loss=first, last_loss=last, fit_seconds=fit_seconds,
                test_seconds=test_seconds)


if __name__ == "__main__":
    main()
