"""Diagnostic (2 GPUs), pure torch: does AdamW (fused, and foreach) skip its step when GradScaler finds an
overflow and the parameters live on two GPUs?

On 2xH200 (torch 2.11) tests/test_amp.py::test_multigpu_fp16_grad_scaler_adamw_matches_plain saw a head
with shards on cuda:0 and cuda:1 and fused AdamW change its parameters on the injected-overflow step,
where plain PyTorch on one GPU skipped it. This script separates torch's fused multi-device path from
hugehead: run it on a 2-GPU machine (python3 bench/diag_fused_adamw.py) and compare the lines.
"""
import torch
for fused in (True, False):
    for devs in (["cuda:0", "cuda:0"], ["cuda:0", "cuda:1"]):
        ps = [torch.nn.Parameter(torch.randn(1000, 32, device=d)) for d in devs]
        opt = torch.optim.AdamW(ps, lr=1e-2, fused=fused, foreach=None if fused else True)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
        before = [p.detach().clone() for p in ps]
        for i, p in enumerate(ps):
            p.grad = torch.randn_like(p) * 2.0**16
            if i == 1:
                p.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        changed = [not torch.equal(b, p.detach()) for b, p in zip(before, ps)]
        print(f"fused={fused} devices={devs}: changed={changed} scale={scaler.get_scale()}", flush=True)

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
