"""Diagnostic (2 GPUs): does AdamW (fused, and foreach) skip its step when GradScaler finds an overflow
and the parameters live on two GPUs?

Found on 2xH200 (torch 2.11): with a fused optimizer, GradScaler.step hands the optimizer
``found_inf = sum over devices of each device's found_inf`` (torch/amp/grad_scaler.py), while the fused
CUDA kernels skip only when ``*found_inf_ptr == 1`` (ATen's fused Adam/AdamW/SGD functors). When the
gradients on *two* devices overflow, the sum is 2.0: the fused step runs on inf/NaN gradients and the
parameters become NaN. One overflowing device (sum 1.0) or one device (0 or 1) is fine; foreach/for-loop
optimizers read ``sum(v.item() ...)`` and skip correctly. Pure torch first, then a hugehead head.

    python3 bench/diag_fused_adamw.py        # on a machine with two GPUs
"""
import torch

for fused in (True, False):
    for devs in (["cuda:0", "cuda:0"], ["cuda:0", "cuda:1"]):
        for overflow in ("one", "both"):
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(1000, 32, device=d)) for d in devs]
            opt = torch.optim.AdamW(ps, lr=1e-2, fused=fused, foreach=None if fused else True)
            scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
            scaler.scale(torch.ones((), device="cuda:0"))  # the scale exists, as after scaler.scale(loss)
            before = [p.detach().clone() for p in ps]
            for i, p in enumerate(ps):
                p.grad = torch.randn_like(p) * 2.0**16
                if i == 1 or overflow == "both":
                    p.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            per_device = {str(k): float(v) for k, v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].items()}
            scaler.step(opt)
            scaler.update()
            changed = [not torch.equal(b, p.detach()) for b, p in zip(before, ps)]
            nan = [bool(p.isnan().any()) for p in ps]
            print(f"torch fused={fused} devices={devs} overflow={overflow}: found_inf_per_device={per_device} "
                  f"changed={changed} nan={nan} scale={scaler.get_scale()}", flush=True)

# The same step for a hugehead head with shards on cuda:0 and cuda:1 (fp16 autocast, scale 2**100 so every
# gradient overflows), with and without a device-wide synchronize between backward and unscale_ (a race
# between the shards' gradient writes and GradScaler's inf check would show as "changed" only without it).
import hugehead  # noqa: E402

for fused in (True, False):
    for sync in (False, True):
        torch.manual_seed(0)
        head = hugehead.ChunkedClassifier(32, 1000, shard_sizes=[300, 700], devices=["cuda:0", "cuda:1"],
                                          chunk_size=128)
        ps = list(head.parameters())
        opt = torch.optim.AdamW(ps, lr=1e-2, fused=fused, foreach=None if fused else True)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**100)
        x = torch.randn(64, 32, device="cuda:0")
        t = torch.randint(0, 1000, (64,), device="cuda:0")
        before = [p.detach().clone() for p in ps]
        with torch.autocast("cuda", dtype=torch.float16):
            loss = head(x, t)
        scaler.scale(loss).backward()
        if sync:
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)
        scaler.unscale_(opt)
        found = {str(k): float(v) for k, v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].items()}
        finite = [bool(p.grad.isfinite().all()) for p in ps]
        scaler.step(opt)
        scaler.update()
        changed = [not torch.equal(b, p.detach()) for b, p in zip(before, ps)]
        print(f"hugehead fused={fused} sync={sync}: params={[str(p.device) for p in ps]} found_inf={found} "
              f"grads_finite={finite} changed={changed} scale={scaler.get_scale()}", flush=True)
