"""Thin adapters from other frameworks onto hugehead's public API (one module per framework, each
importing its framework only when used): :mod:`hugehead.integrations.transformers`, and
:mod:`hugehead.integrations.verl` (a drop-in for verl's fused log-prob and entropy kernel)."""
