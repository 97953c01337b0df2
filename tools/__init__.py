"""Contributor tools: kernel probes, the compute-sanitizer harness, A/B runs of two commits, the GPU check."""
