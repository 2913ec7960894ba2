"""Start ``world_size`` ranks in a real process group and collect what each returns.

``launch(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank inside an
initialised ``torch.distributed`` process group and returns the return values in rank order.

Which backend, and how ranks start:

* **Gloo, the default on every machine: fork.** ``backend="auto"`` means Gloo, with or without
  GPUs, so a lesson written for the CPU runs the same on a laptop and on an 8-GPU node. Forked
  ranks start in a fraction of a second (spawn re-imports torch in every rank, several seconds
  each; ``benchmarks/launch.py`` measures both), and a function defined in a notebook cell
  works, since nothing is pickled. Every rank calls ``torch.set_num_threads(1)`` before its
  first op: a child forked from a parent that already ran an OpenMP op can otherwise hang. The
  first launch imports ``torch._dynamo`` (which the first optimizer step needs) in the parent,
  so forked ranks inherit it instead of each importing it again.
* **NCCL, only when asked for: spawn**, one GPU per rank, each bound to ``cuda:LOCAL_RANK``
  (:mod:`engine.launch.device`). ``fn`` must be importable (defined at module level in a file).
* **CUDA in a forked rank** works only if the parent never touched CUDA: once the parent has
  called ``torch.cuda.is_available()`` (or anything that initialises the CUDA driver), a forked
  child cannot. The Gloo path of ``launch`` asks CUDA nothing, and a rank that hits the error
  is told to use ``start_method="spawn"``.
* **Under torchrun** (``RANK`` and ``WORLD_SIZE`` set) ``fn`` runs in the current process, so a
  lab script is the same code on one node or many. Every process makes the same backend
  decision: it depends on the arguments and on ``LOCAL_WORLD_SIZE``, never on ``LOCAL_RANK``.

The ranks of a local launch meet through a ``FileStore`` in the launch's own directory (mode
0700, removed when the launch ends): no other user can read or write its keys, nothing listens
on a port, two notebooks launching at once never collide, and a rank that finishes first (rank 0
included) takes nothing with it. Gloo (and NCCL) listen on loopback only. Under torchrun the
store is torchrun's (``docs/lab.md`` says what it exposes and how to fence it in).

When something goes wrong the caller gets a :class:`LaunchError` naming the rank, never a hang:
a rank that raises (its original traceback is carried along), a rank that dies without a word
(``os._exit``, a signal), a rank that is stuck past the deadline (``timeout``: 60 s by default
for forked ranks, 300 s for spawned ones and under torchrun), or a Ctrl-C / kernel interrupt. A
rank that NCCL's watchdog aborted because a collective timed out is a symptom, not the cause:
the report names the rank that never joined. Every rank is killed and reaped before the error
is raised, and with it every process it started, even one that detached itself (a double fork,
``os.setsid()``: :mod:`~engine.launch.reaper`), so nothing is left behind and the kernel stays
usable.

The package holds no mutable state: importing it starts nothing, and each launch keeps its
bookkeeping in its own :class:`~engine.launch.supervisor.Launch`.

The layers, each its own module, each importing only those above it in this list:

* :mod:`~engine.launch.env`: the launch environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_*``,
  torchelastic's restart count), read into one frozen record, :class:`LaunchEnv`.
* :mod:`~engine.launch.errors`: :class:`LaunchError` and its kinds, and the failure
  classification (a rank at fault, or a symptom of another's failure) that
  :mod:`engine.launch.elastic` shares.
* :mod:`~engine.launch.reaper`: a subreaper, and ending every process below it (/proc).
* :mod:`~engine.launch.backend`: the one :func:`resolve_backend`, and joining the group.
* :mod:`~engine.launch.rank`: the rank body, inside each started process: its keeper, which
  ends what the rank started, and its worker, which runs ``fn``.
* :mod:`~engine.launch.torchrun`: the torchrun path, ``fn`` in this process.
* :mod:`~engine.launch.supervisor`: the parent's side of a local launch.
* :mod:`~engine.launch.entry`: :func:`launch` itself, which picks the path.

``engine.launch`` the attribute is the function (``engine/__init__`` binds it, so
``engine.launch(fn, n)`` works), while ``from engine.launch import X`` and
``unittest.mock.patch("engine.launch.X")`` reach this package. Import a layer by
``from engine.launch import supervisor`` (``import engine.launch.supervisor as m`` finds the
function first and fails, as ``import engine.launch as m`` always gave the function).
"""

from engine.launch.backend import BACKENDS, resolve_backend
from engine.launch.entry import (
    DEFAULT_SPAWN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TORCHRUN_TIMEOUT_S,
    launch,
)
from engine.launch.env import LaunchEnv, is_global_rank_zero
from engine.launch.errors import (
    LaunchError,
    RankDiedError,
    RankError,
    RankTimeoutError,
    says_peer_is_missing,
)
from engine.launch.rank import die_with_parent
from engine.launch.supervisor import DEADLINE_GRACE_S

_DEADLINE_GRACE_S = DEADLINE_GRACE_S  # the name this constant had before launch was a package

__all__ = [
    "BACKENDS", "DEADLINE_GRACE_S", "DEFAULT_SPAWN_TIMEOUT_S", "DEFAULT_TIMEOUT_S",
    "DEFAULT_TORCHRUN_TIMEOUT_S", "LaunchEnv", "LaunchError",
    "RankDiedError", "RankError", "RankTimeoutError", "die_with_parent", "is_global_rank_zero",
    "launch", "resolve_backend", "says_peer_is_missing",
]
