"""Gradient buckets: which parameters share one all-reduce. The rule (last parameter first,
closed at ``cap_bytes``) is :func:`engine.grad_buckets.assign_buckets`, which data
parallelism and ZeRO share; it is importable from here too."""

from engine.grad_buckets import assign_buckets

__all__ = ["assign_buckets"]
