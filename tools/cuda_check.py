"""Quick CUDA check used during development on a GPU: small-shape correctness of every dtype/option
against float64, then the xc6M shape (N=4096, D=768, V=6M, bf16): timing, bitwise repeatability and a
pure-PyTorch chunked float32 comparison of loss and gradient norms."""
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import hugehead
from hugehead import reference


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def small_checks():
    torch.manual_seed(0)
    worst = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for kw in (dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=15.0),
                   dict(reduction="sum", label_smoothing=0.2, z_loss=1e-2, softcap=5.0)):
            N, D, V = 333, 96, 5003
            x = torch.randn(N, D, device="cuda", dtype=dt, requires_grad=True)
            w = (torch.randn(V, D, device="cuda", dtype=dt) / math.sqrt(D)).requires_grad_()
            b = torch.randn(V, device="cuda", dtype=dt, requires_grad=True)
            t = torch.randint(0, V, (N,), device="cuda"); t[::17] = -100
            loss = hugehead.linear_cross_entropy(x, w, t, b, chunk_size=1000, **kw)
            g = torch.autograd.grad(loss, (x, w, b))
            xr, wr, br = [a.detach().cpu().double().requires_grad_() for a in (x, w, b)]
            lr = reference.linear_cross_entropy(xr, wr, t.cpu(), br, **kw)
            gr = torch.autograd.grad(lr, (xr, wr, br))
            errs = [rel(loss, lr)] + [rel(a, c) for a, c in zip(g, gr)]
            # same-dtype plain PyTorch for the 2x rule
            xs, ws, bs = [a.detach().clone().requires_grad_() for a in (x, w, b)]
            ls = reference.linear_cross_entropy(xs, ws, t, bs, **kw)
            gs = torch.autograd.grad(ls, (xs, ws, bs))
            plain = [rel(ls, lr)] + [rel(a, c) for a, c in zip(gs, gr)]
            key = f"{dt}-{kw}"
            worst[key] = {"ours": errs, "plain": plain}
            print(key, "ours", ["%.2e" % e for e in errs], "plain", ["%.2e" % e for e in plain], flush=True)
    return worst


def chunked_reference(x, w, t, chunk=65536):
    """float32 pure-PyTorch chunked loss and gradients (no N x V tensor)."""
    xf = x.float()
    m = torch.full((x.shape[0],), -math.inf, device=x.device)
    s = torch.zeros(x.shape[0], device=x.device)
    tl = torch.zeros(x.shape[0], device=x.device)
    for c0 in range(0, w.shape[0], chunk):
        z = xf @ w[c0:c0 + chunk].float().t()
        cm = torch.maximum(m, z.max(1).values)
        s = s * (m - cm).exp() + (z - cm[:, None]).exp().sum(1)
        m = cm
        inside = (t >= c0) & (t < c0 + z.shape[1])
        tl = torch.where(inside, z.gather(1, (t - c0).clamp(0, z.shape[1] - 1)[:, None])[:, 0], tl)
    lse = m + s.log()
    loss = (lse - tl).mean()
    gx = torch.zeros_like(xf)
    gw_sq = 0.0
    for c0 in range(0, w.shape[0], chunk):
        wc = w[c0:c0 + chunk].float()
        z = xf @ wc.t()
        p = (z - lse[:, None]).exp()
        inside = (t >= c0) & (t < c0 + z.shape[1])
        p[inside, (t[inside] - c0)] -= 1
        p /= x.shape[0]
        gx += p @ wc
        gw_sq += float((p.t() @ xf).double().square().sum())
    return float(loss), float(gx.double().norm()), math.sqrt(gw_sq)


def xc6m(n=4096, d=768, v=6_000_000):
    torch.manual_seed(1)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16) / math.sqrt(d)).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def step():
        x.grad = None; w.grad = None
        loss = hugehead.linear_cross_entropy(x, w, t)
        loss.backward()
        return loss.detach().clone(), x.grad.clone(), w.grad.clone()

    out1 = step(); torch.cuda.synchronize()
    times, ftimes = [], []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
    with torch.no_grad():
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); hugehead.linear_cross_entropy(x, w, t); b.record(); torch.cuda.synchronize()
            ftimes.append(a.elapsed_time(b))
    out2 = step()
    bitwise = all(torch.equal(p, q) for p, q in zip(out1, out2))
    ref = chunked_reference(x.detach(), w.detach(), t)
    med = sorted(times)[len(times) // 2]
    res = {
        "shape": [n, d, v], "fwd_bwd_ms": med, "fwd_ms": sorted(ftimes)[2], "all_fwd_bwd_ms": times,
        "tflops": 8 * n * d * v / med / 1e9, "bitwise_repeat": bitwise,
        "loss": float(out1[0]), "ref_loss": ref[0],
        "gx_norm": float(out1[1].double().norm()), "ref_gx_norm": ref[1],
        "gw_norm": float(out1[2].double().norm()), "ref_gw_norm": ref[2],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(res, indent=1), flush=True)
    return res


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), "cuda kernels:", hugehead.has_kernel("chunk_stats_", "CUDA"))
    out = {"small": small_checks()}
    if "--xc6m" in sys.argv:
        out["xc6m"] = xc6m()
    if len(sys.argv) > 1 and sys.argv[-1].endswith(".json"):
        json.dump(out, open(sys.argv[-1], "w"), indent=1)
