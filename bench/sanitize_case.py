"""A few small hugehead.linear_cross_entropy problems (forward + backward) to run under compute-sanitizer;
each result is also checked against the float64 plain-PyTorch reference so garbage cannot pass silently.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 bench/sanitize_case.py            # --device cpu runs the same checks without a GPU

The shapes cross every chunk edge the kernels have: N and D not multiples of anything, V not a multiple
of the chunk width (a partial last chunk), the row-split path (a tiny memory budget), ignored rows,
every option, bias, and all three floating dtypes. PyTorch's caching allocator would hide an
out-of-bounds access inside a cached block from memcheck, hence PYTORCH_NO_CUDA_MEMORY_CACHING=1.
Exit status 1 when a result is off.
"""
import argparse
import sys
import zlib

import torch

import hugehead
from hugehead import reference

# (name, N, D, V, dtype, options)
CASES = [
    ("bf16 chunks+tail", 37, 40, 1000, torch.bfloat16, dict(chunk_size=256)),
    ("fp32 rows split", 37, 40, 1000, torch.float32, dict(chunk_size=256, memory_budget=20_000)),
    ("fp16 all options", 29, 24, 777, torch.float16,
     dict(chunk_size=128, bias=True, label_smoothing=0.1, z_loss=1e-3, softcap=30.0, ignore=True)),
    ("bf16 sum, planned", 5, 16, 70_001, torch.bfloat16, dict(reduction="sum", ignore=True)),
    ("fp32 none, bias", 64, 8, 300, torch.float32, dict(chunk_size=64, bias=True, reduction="none")),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(name, n, d, v, dtype, opts, device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(n, d, generator=g).to(device, dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(device, dtype)
    b = (0.1 * torch.randn(v, generator=g)).to(device, dtype) if opts.get("bias") else None
    t = torch.randint(0, v, (n,), generator=g).to(device)
    if opts.get("ignore"):
        t[::3] = -100
    kw = {k: opts[k] for k in ("label_smoothing", "z_loss", "softcap") if k in opts}
    reduction = opts.get("reduction", "mean")
    leaves = [x, w] + ([b] if b is not None else [])
    for tensor in leaves:
        tensor.requires_grad_(True)

    loss = hugehead.linear_cross_entropy(x, w, t, b, reduction=reduction, chunk_size=opts.get("chunk_size"),
                                         memory_budget=opts.get("memory_budget"), **kw)
    seed = torch.randn(loss.shape, generator=g).to(device, torch.float32) if reduction == "none" else None
    grads = torch.autograd.grad(loss, leaves, grad_outputs=None if seed is None else seed.to(loss.dtype))

    leaves64 = [p.detach().double().requires_grad_(True) for p in leaves]
    b64 = leaves64[2] if b is not None else None
    loss64 = reference.linear_cross_entropy(leaves64[0], leaves64[1], t, b64, reduction=reduction, **kw)
    grads64 = torch.autograd.grad(loss64, leaves64, grad_outputs=None if seed is None else seed.double())

    errs = [rel(loss, loss64)] + [rel(a, r) for a, r in zip(grads, grads64)]
    ok = all(e <= TOLERANCE[dtype] for e in errs)
    labels = ["loss", "dx", "dW", "db"][: len(errs)]
    print(f"{'ok  ' if ok else 'BAD '} {name:<20} N={n} D={d} V={v} {str(dtype):<15} "
          + " ".join(f"{k} {e:.1e}" for k, e in zip(labels, errs)), flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    device = torch.device(p.parse_args().device)
    print(f"hugehead {hugehead.__version__} from {hugehead.__file__}; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    results = [run(*case, device) for case in CASES]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"{sum(results)}/{len(results)} cases within tolerance", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
