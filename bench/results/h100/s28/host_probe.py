import time, statistics, torch
from hugehead.options import start_target_check
dev = torch.device("cuda")
t = torch.randint(0, 128256, (4096,), device=dev)
def tm(fn, n=200):
    xs = []
    for _ in range(n):
        torch.cuda.synchronize(); a = time.perf_counter(); fn(); xs.append((time.perf_counter() - a) * 1e6)
    return statistics.median(xs), min(xs)
def pinned(): torch.empty((4096,), dtype=torch.int64, pin_memory=True)
def check(): start_target_check(t, 128256, -100)()
keep = []
def check_keep(): f = start_target_check(t, 128256, -100); f(); keep.append(f)
print("pinned empty  us median/min", tm(pinned))
print("start+finish  us median/min", tm(check))
print("start_target_check+finish, buffers kept alive", tm(check_keep, 50))
from bench.common import find_shape, make_inputs
import hugehead
from hugehead.functional import loss_plan
for name in ("llama3_4k", "xc6M"):
    s = find_shape(name); x, w, tt = make_inputs(s, dev, dtype=torch.bfloat16, seed=0)
    print(name, "loss_plan us median/min", tm(lambda: loss_plan(x, w, tt), 50))
