"""NCCL's rules, enforced on any backend: catch on a laptop what would fail on a GPU cluster.

NCCL refuses or silently mishandles three things that Gloo allows, so code tested only on
Gloo can break on the first GPU run:

1. **A tensor that is not on the rank's GPU.** NCCL has no CPU path ("No backend type
   associated with device type cpu"): every tensor handed to a collective or a send must be on
   the device the rank's communicator was built for (:func:`engine.launch.device.rank_device`).
2. **A receive from any source** (``recv(t, src=None)``): NCCL has none.
3. **Tags.** NCCL ignores them: messages between two ranks match in the order they were sent.
4. **A blocking receive behind an unbatched send to the same peer.** NCCL runs the unbatched
   sends and receives between two ranks on one stream: ``isend`` to a peer then a blocking
   ``recv`` from it, on both ranks, hangs once the message outgrows NCCL's buffers (about
   1-4 MiB), each send waiting for a receive queued behind the other's send. Post the two
   together in one ``batch_isend_irecv`` (:mod:`engine.pp.link` does), or wait for the send
   first. :func:`unbatched_send` notes each ``ops.isend`` until it is waited on.

Every wrapper in :mod:`engine.comm.ops` checks these rules whenever the group runs on NCCL, and
also inside ``with nccl_rules():`` on any backend, where ``torch.distributed``'s own collectives
and sends are checked too (code may call them directly). A refusal is a ``ValueError`` naming
the op, the rule and the line of the caller that issued it.

**On a CPU, rule 1 needs one more step**, because the rank's device (the CPU) is also where a
tensor made without ``device=`` lands, so such a tensor looks right. Inside ``nccl_rules()`` a
torch function mode therefore marks every tensor that a factory (``torch.tensor``,
``torch.zeros``, ``torch.empty``, ...) made without a ``device`` argument, and moving it with
``.to(device)`` clears the mark. Handing a marked tensor to an op is refused, with the line
that made it: on a GPU it would have been on the CPU. (Tensors computed from a marked one are
not marked; the rule catches the usual bug, a scalar or flag made for a collective with no
device.) Model parameters are not marked: placing a model is its caller's job.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from engine.observe.patching import patched

_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint,
              torch.randperm}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_MARK = "_engine_made_without_device"
# the engine's own communication code, whose frames a refusal looks past: the wrappers and
# collectives (engine/comm) and this package (engine/observe: the rules, the meter, the patcher)
_ENGINE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMM = tuple(os.path.join(_ENGINE, package) + os.sep for package in ("comm", "observe"))
_ACTIVE: list["nccl_rules"] = []  # the rules entered on this rank, innermost last


def caller() -> str:
    """``file:line in function`` of the first frame outside ``engine/comm``, ``engine/observe``
    and torch.

    A walk up the stack: :func:`check` takes it only for an op it refuses, so the rules cost
    no walk per op (and nothing at all on a backend other than NCCL, outside ``nccl_rules()``).
    """
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_COMM) and f"{os.sep}torch{os.sep}" not in path:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


_INSIDE: dict = {}  # code object -> whether it is engine/comm's or torch's, decided once


class Site:
    """Where something happened that a later refusal may have to name (an unbatched send
    posted, a tensor made without a device): the code and line of the frame that called into
    ``engine/comm`` or torch, kept as they are (no text; the frame itself is not kept, it
    holds its locals). ``str()`` gives :func:`caller`'s ``file:line in function``, and runs
    only when a refusal is reported, so a valid op under the rules pays two attribute reads
    and a dictionary look-up per frame inside ``engine/comm`` and torch (one or two)."""

    __slots__ = ("code", "line")

    def __init__(self, depth: int = 1):
        frame = sys._getframe(depth + 1)
        while frame is not None:
            code = frame.f_code
            inside = _INSIDE.get(code)
            if inside is None:
                path = code.co_filename
                inside = _INSIDE[code] = path.startswith(_COMM) or \
                    f"{os.sep}torch{os.sep}" in path
            if not inside:
                break
            frame = frame.f_back
        self.code, self.line = (None, 0) if frame is None else (frame.f_code, frame.f_lineno)

    def __str__(self) -> str:
        if self.code is None:
            return "<unknown>"
        return f"{self.code.co_filename}:{self.line} in {self.code.co_name}"


class nccl_rules(TorchFunctionMode):
    """``with nccl_rules(device):`` makes every op of :mod:`engine.comm.ops` obey NCCL's rules.

    ``device``: the device this rank computes on (default: ``engine.launch.device.rank_device()``).
    """

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        if device is None:
            from engine.launch.device import rank_device
            device = rank_device()
        self.device = torch.device(device)

    def __enter__(self):
        if not _ACTIVE:
            _check_torch_distributed(True)
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _check_torch_distributed(False)
            _UNBATCHED.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if func in _FACTORIES and kwargs.get("device") is None:
                setattr(out, _MARK, Site())  # named only if the tensor is refused
            elif func in _MOVES and _names_a_device(args[1:], kwargs):
                if hasattr(out, _MARK):
                    delattr(out, _MARK)
        return out


# isend/irecv stay unwrapped: P2POp and batch_isend_irecv recognise them by identity
_DIST_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "send", "recv")
_PATCH = contextlib.ExitStack()  # torch.distributed's ops wrapped while any rules are active


def _check_torch_distributed(on: bool) -> None:
    """Wrap (``on``) or restore ``torch.distributed``'s ops so that direct calls are checked."""
    if not on:
        _PATCH.close()
        return
    _PATCH.enter_context(patched(dist, **{name: _checked(name, getattr(dist, name))
                                          for name in _DIST_OPS}))


def _checked(name: str, original):
    """``original`` (``torch.distributed.<name>``), refusing what breaks NCCL's rules first."""
    def checked(*args, **kwargs):
        tensors = [t for a in (*args, *kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]
        peer = {}
        if name in ("send", "recv"):
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            if name == "recv":
                peer["src"] = kwargs.get("src", args[1] if len(args) > 1 else None)
            peer["tag"] = tag
        check(f"torch.distributed.{name}", tensors, kwargs.get("group"), **peer)
        return original(*args, **kwargs)

    return checked


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device)) or type(a) is int for a in args)


def _op(name: str) -> str:
    return name if "." in name else f"ops.{name}"


def _backend(group) -> str | None:
    try:
        return dist.get_backend(group)
    except ValueError:  # this rank is not in the group: the op is a no-op for it
        return None


def check(op: str, tensors, group=None, src: int | None | str = "given", tag: int = 0) -> None:
    """Refuse ``op`` if it breaks one of NCCL's rules (see the module docstring)."""
    if _ACTIVE:
        device = _ACTIVE[-1].device
    elif _backend(group) == "nccl":
        from engine.launch.device import rank_device
        device = rank_device(group)
    else:
        return
    if src is None:
        raise ValueError(f"{_op(op)} from any source (src=None), at {caller()}: NCCL has no "
                         "any-source receive; name the sending rank")
    if tag:
        raise ValueError(f"{_op(op)} with tag={tag}, at {caller()}: NCCL ignores tags and "
                         "matches the messages between two ranks in the order they were sent; "
                         "send them in the order the receiver posts its receives, with tag 0")
    if isinstance(src, int) and op.endswith("recv") and not op.endswith("irecv"):
        behind = _UNBATCHED.get(src)
        if behind:
            raise ValueError(f"{_op(op)} from rank {src}, a blocking receive, at {caller()}, while "
                             f"an unbatched send to rank {src} is still pending (posted at "
                             f"{behind[0].where}): on NCCL both share one stream, and beyond "
                             "NCCL's buffers (about 1-4 MiB) each rank's send waits for a "
                             "receive queued behind its peer's send, a deadlock; post the send "
                             "and the receive together with ops.batch_isend_irecv")
    for t in tensors:
        if t.device != device and not (t.device.type == device.type == "cpu"):
            raise ValueError(f"{_op(op)} got a tensor on {t.device}, at {caller()}, but this rank "
                             f"computes on {device}: NCCL moves only tensors on the "
                             "rank's GPU; create it with device=engine.launch.device.rank_device()")
        made_at = getattr(t, _MARK, None)
        if made_at is not None:
            raise ValueError(f"{_op(op)} got a tensor made without a device at {made_at}, "
                             f"handed over at {caller()}: on a GPU it would be on the CPU, which "
                             "NCCL refuses; create it with device=engine.launch.device.rank_device()")


# -- rule 4: a blocking receive behind an unbatched send to the same peer -------------------

_UNBATCHED: dict[int, list["UnbatchedSend"]] = {}  # global rank -> sends to it not waited on


class UnbatchedSend:
    """The work of an unbatched send to global rank ``peer`` (posted at ``where``, a
    :class:`Site`), noted as pending until it is waited on (rule 4); everything else goes to
    the work itself."""

    __slots__ = ("work", "peer", "where")

    def __init__(self, work, peer: int, where: "Site | str"):
        self.work, self.peer, self.where = work, peer, where

    def wait(self, *args, **kwargs):
        pending = _UNBATCHED.get(self.peer, [])
        if self in pending:
            pending.remove(self)
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def unbatched_send(work, peer: int, group=None):
    """``work`` (an ``ops.isend`` to global rank ``peer``), noted for rule 4 while the rules
    apply (inside ``nccl_rules()`` or on NCCL); otherwise ``work`` itself. Where it was
    posted is kept as a :class:`Site`, made into text only if rule 4 refuses a receive."""
    if not _ACTIVE and _backend(group) != "nccl":
        return work
    noted = UnbatchedSend(work, peer, Site())
    _UNBATCHED.setdefault(peer, []).append(noted)
    return noted
