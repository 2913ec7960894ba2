"""Data parallelism: naive and bucketed/overlapped, from the engine's metered collectives."""

from engine.dp.async_ps import async_sgd
from engine.dp.buckets import assign_buckets
from engine.dp.data_parallel import DataParallel, NaiveDataParallel, broadcast_module
from engine.dp.local_sgd import LocalSGD, average_parameters

__all__ = ["DataParallel", "NaiveDataParallel", "assign_buckets", "broadcast_module",
           "LocalSGD", "average_parameters", "async_sgd"]
