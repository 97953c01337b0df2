"""The demo's run: build data, backbone and head, train (a step count, or as many steps as fit the time
budget), evaluate each epoch, print the report and write the plot and ``summary.json``."""
from __future__ import annotations

import json
import platform
import sys
import time
from typing import List, Optional, Sequence

import torch

import hugehead
from hugehead.info import summary as build_summary
from .cli import dtype_name, parse_args
from .data import ZipfPrototypes
from .fit import WORKSPACE_BUDGET, check_fits, estimate_bytes_per_device
from .model import Backbone, autocast_context, evaluate, evaluate_multilabel, head_features, make_optimizer
from .report import fmt_bytes, peak_memory, plot_history

# Steps timed (after a first, warm-up step) before an automatic step count is chosen; a cap on that count.
_CALIBRATION_STEPS = 3
_MAX_AUTO_STEPS = 100_000
# Seconds kept free at the end of a time budget for the report, the plot and the summary.
_RESERVE_SECONDS = 6.0


def _sync(devices: Sequence[torch.device]) -> None:
    for dev in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(dev)


def _epoch_ends(total: int, epochs: int, done: int) -> List[int]:
    """Steps after which to evaluate: ``epochs`` even splits of ``total``, none before step ``done``."""
    return sorted({max(done, round(total * (e + 1) / epochs)) for e in range(epochs)} - {0})


def main(argv: Optional[Sequence[str]] = None, *, start: Optional[float] = None) -> int:
    """Run the demo; returns 0. See ``python -m hugehead.demo --help``. ``start``: the
    ``time.perf_counter()`` the time budget counts from (``python -m hugehead.demo`` passes the moment it
    began importing the demo; default: now).

    Raises:
        SystemExit: with a message for an impossible request (devices, dtype, a size that cannot fit).
    """
    start = time.perf_counter() if start is None else start
    args = parse_args(argv)
    check_fits(args)
    print(build_summary())  # which build and GEMM path this run gets (python -m hugehead.info for all of it)
    torch.manual_seed(args.seed)
    devices, first, dtype = args.devices, args.devices[0], args.dtype
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but the demo should still run without it
        tqdm = None

    data = ZipfPrototypes(args.classes, args.input_dim, args.zipf, args.noise, args.seed, first)
    train_gen = torch.Generator(device=first).manual_seed(args.seed + 1)
    eval_gen = torch.Generator(device=first).manual_seed(args.seed + 2)
    multilabel = args.labels > 1
    if multilabel:  # y_eval: the rows' first labels (for the always-most-frequent baseline's share)
        x_eval, labels_eval = data.sample_labels(args.eval_size, args.labels, eval_gen)
        y_eval = labels_eval[:, 0]
    else:
        x_eval, y_eval = data.sample(args.eval_size, eval_gen)
    head_loss = "binary_cross_entropy" if multilabel and args.multilabel_loss == "ova" else "cross_entropy"

    backbone = Backbone(args.input_dim, args.hidden, args.dim).to(first)
    head = hugehead.ChunkedClassifier(args.dim, args.classes, devices=[str(d) for d in devices], dtype=dtype,
                                      memory_budget=WORKSPACE_BUDGET, offload=args.offload, loss=head_loss)
    optimizer = make_optimizer(backbone, head, args.lr, dtype)
    shard_info = [dict(device=str(s.device), start=int(s.start), stop=int(s.stop)) for s in head.shards]
    if args.offload:
        for info, s in zip(shard_info, head.shards):
            info["device"] = f"{s.device}->{s.compute_device}"  # lives in pinned host memory, computes there

    chance = 1.0 / args.classes
    majority = float((y_eval == data.most_frequent_class).double().mean())
    if multilabel:  # P@1 of always predicting the most frequent class
        majority = float((labels_eval == data.most_frequent_class).any(dim=1).double().mean())
    expected_majority = data.most_frequent_share(args.labels)
    steps_text = f"{args.steps} steps" if args.steps else f"steps to fit {args.time_budget:.0f} s"
    print(f"hugehead.demo: {args.classes:,} classes, D={args.dim}, {dtype_name(dtype)}, batch {args.batch}, "
          f"{steps_text}; head shards{' (offloaded: pinned host memory)' if args.offload else ''}: "
          + ", ".join(f"{s['device']}[{s['start']:,}:{s['stop']:,})" for s in shard_info), flush=True)

    history = dict(num_classes=args.classes, step_loss=[], train_loss=[], epoch_end_step=[], epoch_seconds=[],
                   eval_step=[], eval_loss=[], eval_accuracy=[], eval_p5=[], eval_ndcg5=[])

    def run_eval(step: int) -> float:
        t0 = time.perf_counter()
        if multilabel:  # "accuracy" is precision@1 here
            r = evaluate_multilabel(backbone, head, data, x_eval, labels_eval, args.batch, dtype,
                                    args.multilabel_loss, args.autocast)
            loss, acc = r["loss"], r["p1"]
            history["eval_p5"].append(r["p5"])
            history["eval_ndcg5"].append(r["ndcg5"])
        else:
            loss, acc = evaluate(backbone, head, x_eval, y_eval, args.batch, dtype, args.autocast)
        history["eval_step"].append(step)
        history["eval_loss"].append(loss)
        history["eval_accuracy"].append(acc)
        return time.perf_counter() - t0

    # Step 0: the untrained model (at chance); also times one evaluation for the budget.
    eval_seconds = run_eval(0)
    deadline = None if args.time_budget is None else start + args.time_budget
    total = args.steps
    ends = _epoch_ends(total, args.epochs, 0) if total else []
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, disable=args.no_progress) if tqdm else None
    write = bar.write if bar is not None else print
    step, epoch_losses, stopped_early = 0, [], False
    train_seconds, t_epoch = 0.0, time.perf_counter()
    t_train = t_epoch
    while total is None or step < total:
        if multilabel:
            x, labels = data.sample_labels(args.batch, args.labels, train_gen)
            target = data.label_target(labels, args.multilabel_loss)
        else:
            x, target = data.sample(args.batch, train_gen)
        with autocast_context(args.autocast, x.device):
            loss = head(head_features(backbone, x, dtype, args.autocast), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        epoch_losses.append(loss.detach())
        step += 1
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        evals_left = args.epochs - len(history["epoch_end_step"])
        if total is None and step == 1:
            _sync(devices)
            t_warm = time.perf_counter()
        if total is None and step == 1 + _CALIBRATION_STEPS:
            _sync(devices)
            per_step = (time.perf_counter() - t_warm) / _CALIBRATION_STEPS
            left = deadline - time.perf_counter() - evals_left * 1.2 * eval_seconds - _RESERVE_SECONDS
            total = min(_MAX_AUTO_STEPS, max(step, args.epochs, step + int(left / per_step)))
            ends = _epoch_ends(total, args.epochs, step)
            if bar is not None:
                bar.total = total
                bar.refresh()
            write(f"auto: {total} steps fit the {args.time_budget:.0f} s budget "
                  f"({per_step:.2f} s/step, {eval_seconds:.1f} s per evaluation)")
        late = (deadline is not None and step not in ends
                and time.perf_counter() + evals_left * 1.2 * eval_seconds + _RESERVE_SECONDS > deadline)
        if step in ends or late:
            losses = torch.stack(epoch_losses).float().cpu().tolist()
            _sync(devices)
            train_seconds += time.perf_counter() - t_epoch
            eval_seconds = run_eval(step)
            history["step_loss"].extend(losses)
            history["train_loss"].append(sum(losses) / len(losses))
            history["epoch_end_step"].append(step)
            history["epoch_seconds"].append(time.perf_counter() - t_epoch)
            planned = len(ends) or args.epochs  # no ends yet: the budget ran out before the step count was set
            write(f"epoch {len(history['epoch_end_step'])}/{planned} (step {step}): train loss "
                  f"{history['train_loss'][-1]:.3f}  held-out loss {history['eval_loss'][-1]:.3f}  "
                  f"held-out {'P@1' if multilabel else 'accuracy'} {100 * history['eval_accuracy'][-1]:.2f}%")
            epoch_losses, t_epoch = [], time.perf_counter()
            if late:
                stopped_early = True
                write(f"stopping at step {step} to stay within --time-budget {args.time_budget:.0f} s")
                break
    if bar is not None:
        bar.close()
    steps_done = step

    itemsize = torch.empty((), dtype=dtype).element_size()
    logits_bytes = args.batch * args.classes * itemsize
    peaks = peak_memory(list(devices) + ([torch.device("cpu")] if args.offload else []))
    final_acc = history["eval_accuracy"][-1]
    print()
    what = "held-out precision@1  " if multilabel else "held-out top-1 accuracy"
    print(f"{what}   {100 * final_acc:.2f}%   on {args.eval_size:,} samples "
          f"(untrained: {100 * history['eval_accuracy'][0]:.2f}%)")
    if multilabel:
        print(f"held-out precision@5     {100 * history['eval_p5'][-1]:.2f}%   nDCG@5 {100 * history['eval_ndcg5'][-1]:.2f}%"
              f"   ({args.labels} Zipf-drawn labels per sample, {head_loss})")
    print(f"  always-most-frequent    {100 * majority:.2f}%   (expected {100 * expected_majority:.2f}%)")
    print(f"  uniform chance 1/V      {100 * chance:.5f}%")
    print(f"train: {steps_done} steps in {train_seconds:.1f} s "
          f"({steps_done * args.batch / train_seconds:,.0f} samples/s); wall time so far "
          f"{time.perf_counter() - start:.1f} s")
    print("peak memory per device:")
    for dev, b in peaks.items():
        what = "process peak RSS" if dev == "cpu" else "torch.cuda.max_memory_allocated"
        print(f"  {dev:8s} {fmt_bytes(b):>12s}  ({what})")
    print(f"plain nn.Linear + F.cross_entropy at N={args.batch}, V={args.classes:,}, {dtype_name(dtype)} "
          f"would need {fmt_bytes(2 * logits_bytes)} for the logits alone "
          f"({fmt_bytes(logits_bytes)} + {fmt_bytes(logits_bytes)} for their gradient), on one device")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_history(out / "training.png", history, chance, majority, "P@1" if multilabel else "top-1 accuracy")
    summary = dict(
        hugehead_version=hugehead.__version__, torch_version=torch.__version__, python=platform.python_version(),
        argv=list(sys.argv[1:] if argv is None else argv),
        config=dict(classes=args.classes, dim=args.dim, input_dim=args.input_dim, hidden=args.hidden,
                    batch=args.batch, steps=steps_done, steps_requested=args.steps or "auto",
                    epochs=args.epochs, eval_size=args.eval_size, dtype=dtype_name(dtype), lr=args.lr,
                    zipf=args.zipf, noise=args.noise, seed=args.seed, time_budget=args.time_budget,
                    devices=[str(d) for d in devices], offload=args.offload, autocast=args.autocast,
                    offload_stats=head.offload_stats),
        shards=shard_info,
        final=dict(eval_accuracy=final_acc, eval_loss=history["eval_loss"][-1],
                   untrained_eval_accuracy=history["eval_accuracy"][0],
                   chance_uniform=chance, chance_most_frequent=majority,
                   chance_most_frequent_expected=expected_majority,
                   accuracy_over_most_frequent=final_acc / majority if majority else None,
                   stopped_early=stopped_early,
                   **(dict(labels=args.labels, multilabel_loss=args.multilabel_loss,
                           eval_precision_at_1=final_acc, eval_precision_at_5=history["eval_p5"][-1],
                           eval_ndcg_at_5=history["eval_ndcg5"][-1]) if multilabel else {})),
        epochs=[dict(epoch=i + 1, end_step=s, train_loss=tl, eval_loss=el, eval_accuracy=ea, seconds=sec)
                for i, (s, tl, el, ea, sec) in enumerate(zip(history["epoch_end_step"], history["train_loss"],
                                                             history["eval_loss"][1:], history["eval_accuracy"][1:],
                                                             history["epoch_seconds"]))],
        step_loss=history["step_loss"],
        timing=dict(train_seconds=train_seconds, loop_seconds=time.perf_counter() - t_train,
                    samples_per_second=steps_done * args.batch / train_seconds,
                    wall_seconds=time.perf_counter() - start),
        memory=dict(peak_bytes=peaks,
                    peak_kind={d: ("process_peak_rss" if d == "cpu" else "cuda_max_memory_allocated") for d in peaks},
                    estimated_bytes={str(d): b for d, b in estimate_bytes_per_device(args).items()},
                    plain_logits_bytes=logits_bytes, plain_logits_grad_bytes=logits_bytes,
                    plain_logits_total_bytes=2 * logits_bytes),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'training.png'} and {out / 'summary.json'}")
    return 0
