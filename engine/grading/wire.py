"""What a submission's code sends back to the grader: plain data, in a format that cannot run
code, decoded into exact types.

The learner's functions run in a worker (:mod:`engine.grading.worker`); what they return (and
what the check's drivers collected around them: tensors, schedules, counts) comes back as
JSON, never as a pickle (unpickling runs whatever the sender chose). :func:`decode` builds only
``None``, ``bool``, ``int``, ``float``, ``str``, ``list``, ``tuple``, ``dict``, ``torch.dtype``
and plain ``torch.Tensor`` (dense, CPU, contiguous, made from the bytes): a ``float`` subclass
whose subtraction returns 0, or a ``Tensor`` subclass that answers ``torch.equal`` itself, is
gone once decoded, and the checks compare what is left in the grader's own process.

The encoder is the worker's convenience, not a defence: whatever the worker sends, the
grader's decoder accepts only the shapes above, within :data:`MAX_MESSAGE_BYTES`.
"""

from __future__ import annotations

import base64
import json
import math
import numbers

import torch

MAX_MESSAGE_BYTES = 256 * 2**20  # a response larger than this is refused, not read
MAX_DEPTH = 32

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}


class WireError(ValueError):
    """A value that cannot travel (encoding) or a message that is not one the grader accepts
    (decoding)."""


def _float(x: float):
    """JSON has no nan or infinity: those travel as strings under a tag."""
    x = float.__float__(x)  # the value itself, whatever a subclass's methods say
    return x if math.isfinite(x) else {"__float__": repr(x)}


def _tensor(t: torch.Tensor) -> dict:
    t = torch.Tensor.detach(t).cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WireError(f"a tensor of dtype {t.dtype} cannot be sent back to the grader")
    raw = t.reshape(-1).view(torch.uint8) if t.numel() and t.dtype != torch.bool \
        else t.reshape(-1).to(torch.uint8)
    return {"__tensor__": name, "shape": list(t.shape),
            "data": base64.b64encode(bytes(raw.numpy().tobytes())).decode("ascii")}


def to_plain(value, depth: int = 0):
    """``value`` as JSON-ready data (the worker's side). Raises :class:`WireError` naming the
    type that cannot be sent."""
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested deeper than {MAX_DEPTH} levels cannot be sent back")
    if value is None or isinstance(value, bool):
        return bool(value) if value is not None else None
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"__tuple__": [int(x) for x in value]}
    if isinstance(value, (list, tuple)):
        items = [to_plain(x, depth + 1) for x in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {"__dict__": [[to_plain(k, depth + 1), to_plain(v, depth + 1)]
                             for k, v in value.items()]}
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats
        return _float(float(value))
    raise WireError(f"a value of type {type(value).__name__} cannot be sent back to the grader "
                    "(numbers, strings, lists, tuples, dicts and tensors can)")


def encode(value) -> bytes:
    """``value`` as UTF-8 JSON (the worker's side)."""
    return json.dumps(to_plain(value), allow_nan=False, separators=(",", ":")).encode()


def _from_plain(data, depth: int = 0):
    if depth > MAX_DEPTH:
        raise WireError(f"a message nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [_from_plain(x, depth + 1) for x in data]
    if kind is not dict or len(data) == 0:
        raise WireError(f"unexpected {kind.__name__} in a message")
    if set(data) == {"__tuple__"} and type(data["__tuple__"]) is list:
        return tuple(_from_plain(x, depth + 1) for x in data["__tuple__"])
    if set(data) == {"__dict__"} and type(data["__dict__"]) is list:
        out = {}
        for pair in data["__dict__"]:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("a dict entry that is not a [key, value] pair")
            key = _from_plain(pair[0], depth + 1)
            try:
                out[key] = _from_plain(pair[1], depth + 1)
            except TypeError as e:  # an unhashable key
                raise WireError(f"a dict key of type {type(key).__name__}") from e
        return out
    if set(data) == {"__float__"} and data["__float__"] in ("nan", "inf", "-inf"):
        return float(data["__float__"])
    if set(data) == {"__dtype__"} and data["__dtype__"] in _DTYPES:
        return _DTYPES[data["__dtype__"]]
    if set(data) == {"__tensor__", "shape", "data"} and data["__tensor__"] in _DTYPES:
        return _decode_tensor(data)
    raise WireError(f"an object with keys {sorted(data)[:5]} is not a value the grader accepts")


def _decode_tensor(data: dict) -> torch.Tensor:
    dtype, shape = _DTYPES[data["__tensor__"]], data["shape"]
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise WireError(f"a tensor's shape must be a list of sizes, got {shape!r:.80}")
    if type(data["data"]) is not str:
        raise WireError("a tensor's data must be base64 text")
    raw = base64.b64decode(data["data"], validate=True)
    numel = math.prod(shape)
    itemsize = 1 if dtype == torch.bool else torch.empty((), dtype=dtype).element_size()
    if len(raw) != numel * itemsize:
        raise WireError(f"a tensor of shape {shape} and dtype {dtype} needs "
                        f"{numel * itemsize} bytes, got {len(raw)}")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return flat.to(torch.bool).reshape(shape)
    return flat.view(dtype).reshape(shape).clone() if numel else torch.empty(shape, dtype=dtype)


def decode(message: bytes):
    """The value in ``message`` (the grader's side): only the types listed in this module's
    docstring, exactly those types; :class:`WireError` for anything else."""
    if type(message) is not bytes:
        raise WireError(f"a message must be bytes, got {type(message).__name__}")
    if len(message) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {len(message)} bytes is over the grader's limit of "
                        f"{MAX_MESSAGE_BYTES}")
    try:
        data = json.loads(message.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError(f"a message that is not JSON: {e}") from None
    return _from_plain(data)


def _no_constant(name: str):
    raise WireError(f"JSON constant {name} is not accepted")


def roundtrip(value):
    """``value`` as the grader would receive it from a worker: what a local run compares, so
    that a check sees the same types whether the learner's code ran here or in a worker."""
    return decode(encode(value))
