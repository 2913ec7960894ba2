"""``launch(fn, world_size, *args)``: check the arguments, then take one of two paths.

Under torchrun the current process is already one rank (:mod:`engine.launch.torchrun`);
otherwise this process starts ``world_size`` ranks and supervises them
(:mod:`engine.launch.supervisor`): forked for Gloo, so a function defined in a notebook cell
works, spawned for NCCL, so ``fn`` must be importable.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from engine.launch.backend import BACKENDS, resolve_backend
from engine.launch.env import LaunchEnv
from engine.launch.supervisor import Launch
from engine.launch.torchrun import run_in_this_process
from engine.validation import one_of, positive_int, positive_number

# The default ``timeout`` of each path. Forked ranks (Gloo, a lesson's launch) start in a
# fraction of a second, so a hung rank is named within a minute rather than five. Spawned ranks
# (NCCL) import torch and initialise CUDA first, and under torchrun a peer may be on another
# node, behind a slower network, and NCCL builds its communicators over it: those keep 300 s.
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SPAWN_TIMEOUT_S = 300.0
DEFAULT_TORCHRUN_TIMEOUT_S = 300.0


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float | None = None,
    start_method: str | None = None,
    quiet: bool = False,
    deadline: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results in rank order.

    Args:
        fn: the per-rank function. With fork (Gloo's default) it may be defined anywhere,
            including a notebook cell; with spawn (NCCL) it must be importable.
        world_size: number of ranks, at least 1.
        backend: ``"gloo"`` or ``"auto"`` (the same: Gloo on any machine), or ``"nccl"``
            (one GPU per rank, asked for explicitly). See :func:`resolve_backend`.
        timeout: seconds. The process group's timeout: a rank blocked longer than this in one
            collective raises. A few seconds later comes the parent's deadline, after which any
            rank still running is reported as stuck and every rank is killed. By default 60 s
            (:data:`DEFAULT_TIMEOUT_S`) for forked ranks, Gloo's default, so pass more for a
            launch that runs longer; 300 s for spawned ranks (NCCL, which start slower:
            :data:`DEFAULT_SPAWN_TIMEOUT_S`) and under torchrun (peers on other nodes:
            :data:`DEFAULT_TORCHRUN_TIMEOUT_S`).
        start_method: ``"fork"`` or ``"spawn"``; by default fork for Gloo and spawn for NCCL.
            Gloo ranks that use CUDA need spawn once this process has touched CUDA.
        quiet: do not print the ranks' captured output (it is still on a raised error).
        deadline: stop the ranks as stuck once ``timeout`` (plus a few seconds) has passed
            since the launch began, wherever they are (a lesson's launch, the default).
            False for a long run (``engine train``): it ends when its ranks return, and a
            rank waiting for a lost or stuck peer still fails after ``timeout`` in that
            collective.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``. CUDA tensors come back on the CPU.

    No process a rank started outlives the launch, even one that detached itself (a double
    fork, ``os.setsid()``): each rank's keeper ends them (:mod:`engine.launch.reaper`). The
    ranks of a local launch meet through a store only this user can reach, and listen on
    loopback only.

    Raises:
        ValueError: bad arguments, before any process starts.
        RankError / RankDiedError / RankTimeoutError (all :class:`LaunchError`): a rank failed.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    positive_int("world_size", world_size)
    one_of("backend", backend, BACKENDS)
    if timeout is not None:
        positive_number("timeout (seconds)", timeout)
    one_of("start_method", start_method, (None, "fork", "spawn"))

    env = LaunchEnv.read()
    if env.under_torchrun:
        return run_in_this_process(fn, world_size, args, backend,
                                   DEFAULT_TORCHRUN_TIMEOUT_S if timeout is None else timeout,
                                   env)

    backend = resolve_backend(backend, world_size)
    start_method = start_method or ("spawn" if backend == "nccl" else "fork")
    if timeout is None:
        timeout = DEFAULT_SPAWN_TIMEOUT_S if start_method == "spawn" else DEFAULT_TIMEOUT_S
    if start_method == "spawn":
        _check_picklable(fn, args)
    else:
        _preimport()
    return Launch(fn, world_size, args, backend, timeout, start_method, quiet, deadline).run()


def _preimport() -> None:
    """Import what every rank needs once, in the parent, so forked ranks inherit it.

    The first optimizer step pulls in ``torch._dynamo`` (over a second on a small CPU);
    imported in the parent before the first fork, each forked rank gets it for free. Not done
    at ``import engine``, which must stay cheap (``engine.theory`` is pure formulas).
    """
    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401


def _check_picklable(fn, args) -> None:
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(
            f"with start_method='spawn' (NCCL's, or asked for) fn and its arguments must be "
            f"picklable: "
            f"{fn!r} is not ({type(e).__name__}: {e}). Define fn at module level in a .py file, "
            "or use backend='gloo' to fork, which accepts functions defined in a notebook."
        ) from e
