"""Messages and values between the sandbox's processes and the trainer (stdlib only).

Messages are length-prefixed JSON frames on pipes. Values are builtin types only, tagged so that
tuple vs list, True vs 1, nan, huge ints and bytes survive JSON; anything else is a reference to
an object that stays where it was made. Decoding never builds an object of a type the sender
chose, which is what keeps a candidate's `__eq__` out of every comparison.

This file is also prepended to sandbox_harness.py to make the program run inside the sandbox.
"""

import json
import os
import struct

MAX_DEPTH = 60              # nesting of a value; deeper is an error, not a RecursionError
_FRAME_CAP = 64 << 20       # one message; a bigger one is a protocol error
_TAG = "~"


def send(fd, obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    buf = memoryview(struct.pack(">I", len(data)) + data)
    while buf:
        buf = buf[os.write(fd, buf):]


def read_exact(fd, n):
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the other side of the sandbox channel closed")
        out += chunk
    return bytes(out)


def recv(fd):
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    if n > _FRAME_CAP:
        raise ValueError("sandbox message too large")
    return json.loads(read_exact(fd, n))


def split_frames(data):
    """Complete frames in a byte string (the trainer's side); a torn or bad tail is dropped."""
    out, i = [], 0
    while i + 4 <= len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        if i + 4 + n > len(data):
            break
        try:
            out.append(json.loads(data[i + 4:i + 4 + n]))
        except (ValueError, RecursionError):
            break
        i += 4 + n
    return out


# --- values: builtin types only, tagged so that tuple != list and True != 1 survive JSON ---

_BASES = (bool, int, float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset)


def encode(x, refs=None, depth=0):
    """A JSON-able form of `x`. Exact builtin types only: an instance of a subclass of one is
    converted to the base type first (so its own __eq__/__hash__/__repr__ are gone); any other
    object becomes a reference into `refs` (or an opaque marker when `refs` is None)."""
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        # hex: exempt from the int <-> decimal string digit limit, so huge ints round-trip
        return x if -(1 << 53) < x < (1 << 53) else {_TAG: "h", "v": hex(x)}
    if t is float:
        return x if x - x == 0 else {_TAG: "f", "v": repr(x)}    # nan / inf are not JSON
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if t is list:
        return [encode(v, refs, d) for v in x]
    if t is tuple or t is set or t is frozenset:
        return {_TAG: {tuple: "t", set: "s", frozenset: "fs"}[t], "v": [encode(v, refs, d) for v in x]}
    if t is dict:
        return {_TAG: "d", "v": [[encode(k, refs, d), encode(v, refs, d)] for k, v in x.items()]}
    if t is bytes or t is bytearray:
        return {_TAG: "b" if t is bytes else "ba", "v": x.hex()}
    if t is complex:
        return {_TAG: "c", "v": [encode(x.real), encode(x.imag)]}
    if t is RunnerRef:                               # the grader passing a runner object back
        return {_TAG: "r", "v": x.ref}
    if getattr(t, "__module__", "") == "numpy" and hasattr(x, "tolist"):
        return encode(x.tolist(), refs, d)      # numpy scalars/arrays: their plain value
    for base in _BASES:
        if isinstance(x, base):
            return encode(base(x) if base is not bool else bool(int(x)), refs, d)
    if refs is None:
        return {_TAG: "r", "v": -1, "type": t.__name__[:80]}
    refs.append(x)
    return {_TAG: "r", "v": len(refs) - 1, "type": t.__name__[:80]}


def decode(o, remote=None, depth=0):
    """Inverse of `encode`; references become `remote(id, type)` (or stay opaque markers)."""
    if o is None or type(o) in (bool, int, float, str):
        return o
    if depth > MAX_DEPTH + 2:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if type(o) is list:
        return [decode(v, remote, d) for v in o]
    tag, v = o[_TAG], o.get("v")
    if tag == "h":
        return int(v, 16)
    if tag == "f":
        return float(v)
    if tag in ("t", "s", "fs"):
        return {"t": tuple, "s": set, "fs": frozenset}[tag](decode(x, remote, d) for x in v)
    if tag == "d":
        return {decode(k, remote, d): decode(x, remote, d) for k, x in v}
    if tag in ("b", "ba"):
        return (bytes if tag == "b" else bytearray).fromhex(v)
    if tag == "c":
        return complex(decode(v[0]), decode(v[1]))
    if tag == "r":
        return remote(v, o.get("type", "?")) if remote else Opaque(o.get("type", "?"))
    raise ValueError("bad value tag %r" % (tag,))


class Opaque:
    """A value the sandbox could not send as data. Equal to nothing, not even itself."""
    __slots__ = ("type",)

    def __init__(self, type_name):
        self.type = type_name

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return "<%s object from the sandbox>" % self.type


def describe_error(e):
    try:
        msg = str(e)[:300]
    except BaseException:
        msg = "?"
    return {"raise": type(e).__name__[:80], "msg": msg}


def describe_text(e):
    d = describe_error(e)
    return "%s: %s" % (d["raise"], d["msg"]) if d["msg"] else d["raise"]


class RunnerRef:
    """A runner object passed back to the runner (by the grader) as its reference."""
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref
