"""Ad-hoc (not committed): where the one-vs-all step's time goes vs the single-label step, on the GPU."""
import sys, json
from bench import harness
import torch
from bench.bench_multilabel import sparse_target
import hugehead
from torch.profiler import profile, ProfilerActivity

shape = sys.argv[1] if len(sys.argv) > 1 else "xc1M"
n, d, v = dict(xc1M=(8192, 768, 1_000_000), xc6M=(4096, 768, 6_000_000))[shape]
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
x = (torch.randn(n, d, generator=g) / d ** 0.5).to(dev, torch.bfloat16).requires_grad_()
w = (torch.randn(v, d, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_()
y = torch.randint(0, v, (n,), generator=g).to(dev)
t = sparse_target(n, v, 5, 1.0, dev, seed=1)
cases = {"single": lambda: hugehead.linear_cross_entropy(x, w, y),
         "ova": lambda: hugehead.linear_binary_cross_entropy(x, w, t)}
def run(fn):
    x.grad = w.grad = None
    fn().backward()
for name, fn in cases.items():
    for _ in range(2): run(fn)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); run(fn); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    print(name, "ms", sorted(ts)[2], flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run(fn); torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
