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
