"""Small CUDA case of linear_cross_entropy for compute-sanitizer (memcheck) runs."""
import torch
import hugehead

torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(67, 40, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(1001, 40, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(1001, device="cuda", dtype=dt, requires_grad=True)
    t = torch.randint(0, 1001, (67,), device="cuda"); t[5] = -100
    loss = hugehead.linear_cross_entropy(x, w, t, b, chunk_size=301, label_smoothing=0.1, z_loss=1e-3, softcap=10.0)
    loss.backward()
    # an unaligned row stride (odd chunk) exercises the scalar head/tail paths of the kernels
    loss = hugehead.linear_cross_entropy(x[:, 1:], w[:, 1:], t, chunk_size=77)
    loss.backward()
torch.cuda.synchronize()
print("sanitize case ok", float(loss))
