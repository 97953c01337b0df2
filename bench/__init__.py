"""Benchmarks of hugehead against plain PyTorch and peer libraries; see bench/README.md."""
