"""The value codec between the harness (T) and the solution's process (U): plain data only.

JSON scalars go as they are, containers as tagged lists (``["L", ...]`` a list, ``"T"`` a tuple,
``"D"`` a dict of pairs, ``"S"`` a set, ``"Z"`` a frozenset, ``"N"`` an int too big for JSON,
``"B"`` bytes, ``"C"`` a complex); objects of the problem's data classes (``ListNode``,
``TreeNode``, ...) go into a table keyed by id (``["O", i]``), so long chains and cycles need no
recursion; anything else is sent as a handle (``["H", i]``) that the other side can call or read
attributes of, never compare. A message is ``{"v": value, "o": {id: [class name, attributes]}}``.

:func:`decode` trusts nothing: a malformed message raises :class:`CodecError`. Both sides nest at
most :data:`MAX_DEPTH` levels.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 200
_BIG = 1 << 12000  # ints at least this large go as hex strings


class CodecError(ValueError):
    """A value that cannot be sent, or a message that is not a well-formed value."""


def encode(value: Any, data_name: Callable[[Any], str | None], to_handle: Callable[[Any], int | None], exact: bool) -> dict:
    """``value`` as a JSON-able message.

    Args:
        value: what to send.
        data_name: the data-class name of an object to send by value (its attributes), or None.
        to_handle: a handle for an object to send by reference, or None (it cannot be sent).
        exact: only the exact builtin types are plain data (the harness's side); False converts
            builtin subclasses, numpy scalars and numbers honestly (the solution's side).

    Raises:
        CodecError: nested too deeply, or an object that is neither data nor has a handle.
    """
    ids: dict[int, int] = {}
    keep: list[Any] = []  # the objects in ``ids``, alive until the message is built
    queue: list[tuple[int, Any, str]] = []
    table: dict[str, list] = {}

    def enc(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError("value nested too deeply")
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -_BIG < v < _BIG else ["N", format(v, "x")]
        if t is float:
            return v
        if t is list:
            return ["L"] + [enc(x, depth + 1) for x in v]
        if t is tuple:
            return ["T"] + [enc(x, depth + 1) for x in v]
        if t is dict:
            return ["D"] + [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]
        if t is set:
            return ["S"] + [enc(x, depth + 1) for x in v]
        if t is frozenset:
            return ["Z"] + [enc(x, depth + 1) for x in v]
        if t is bytes or t is bytearray:
            return ["B", bytes(v).hex()]
        if t is complex:
            return ["C", v.real, v.imag]
        name = data_name(v)
        if name is not None:
            i = ids.get(id(v))
            if i is None:
                i = ids[id(v)] = len(ids)
                keep.append(v)
                queue.append((i, v, name))
            return ["O", i]
        if not exact:  # the solution's side: convert builtin subclasses and numeric types honestly
            if isinstance(v, str):
                return str.__str__(v)
            if isinstance(v, int):
                return enc(int.__index__(v), depth)
            if isinstance(v, float):
                return float.__float__(v)
            if isinstance(v, list):
                return enc(list(v), depth)
            if isinstance(v, tuple):
                return enc(tuple(v), depth)
            if isinstance(v, dict):
                return enc(dict(v), depth)
            if isinstance(v, (set, frozenset)):
                return enc(set(v) if isinstance(v, set) else frozenset(v), depth)
            if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
                return enc(v.item(), depth)  # numpy scalars (np.int64, np.bool_, ...) as Python scalars
            if isinstance(v, numbers.Integral):
                return enc(int(v), depth)
            if isinstance(v, numbers.Real):
                return float(v)
        h = to_handle(v)
        if h is None:
            raise CodecError(f"cannot send a {t.__name__} to the solution")
        return ["H", h]

    root = enc(value, 0)
    while queue:
        i, v, name = queue.pop()
        attrs = {}
        for k, x in vars(v).items():
            if isinstance(k, str) and not k.startswith("__"):
                attrs[k] = enc(x, 1)
        table[str(i)] = [name, attrs]
    return {"v": root, "o": table}


def decode(msg: Any, make_obj: Callable[[str], Any], set_attr: Callable[[Any, str, Any], None], get_handle: Callable[[int], Any]) -> Any:
    """The value of message ``msg`` (from :func:`encode` on the other side).

    Args:
        msg: the parsed JSON message.
        make_obj: a new, empty object of the named data class.
        set_attr: sets one attribute of such an object.
        get_handle: the object a handle stands for.

    Raises:
        CodecError: a malformed message (or what ``make_obj`` / ``get_handle`` raise).
    """
    if type(msg) is not dict or type(msg.get("o")) is not dict:
        raise CodecError("malformed value")
    table = msg["o"]
    made: dict[int, Any] = {}
    pending: list[int] = []

    def obj(i: Any) -> Any:
        if type(i) is not int:
            raise CodecError("malformed object reference")
        o = made.get(i)
        if o is None:
            entry = table.get(str(i))
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not dict:
                raise CodecError("malformed object")
            o = made[i] = make_obj(entry[0])
            pending.append(i)
        return o

    def dec(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError("value nested too deeply")
        t = type(x)
        if x is None or t is bool or t is int or t is float or t is str:
            return x
        if t is not list or not x or type(x[0]) is not str:
            raise CodecError("malformed value")
        tag, rest = x[0], x[1:]
        if tag == "L":
            return [dec(y, depth + 1) for y in rest]
        if tag == "T":
            return tuple(dec(y, depth + 1) for y in rest)
        if tag == "S":
            return {dec(y, depth + 1) for y in rest}
        if tag == "Z":
            return frozenset(dec(y, depth + 1) for y in rest)
        if tag == "D":
            out = {}
            for pair in rest:
                if type(pair) is not list or len(pair) != 2:
                    raise CodecError("malformed dict")
                out[dec(pair[0], depth + 1)] = dec(pair[1], depth + 1)
            return out
        if len(rest) == 1 and tag == "N" and type(rest[0]) is str and len(rest[0]) < 1000000:
            return int(rest[0], 16)
        if len(rest) == 1 and tag == "B" and type(rest[0]) is str:
            return bytes.fromhex(rest[0])
        if len(rest) == 2 and tag == "C" and all(type(y) in (int, float) for y in rest):
            return complex(rest[0], rest[1])
        if len(rest) == 1 and tag == "O":
            return obj(rest[0])
        if len(rest) == 1 and tag == "H" and type(rest[0]) is int:
            return get_handle(rest[0])
        raise CodecError("malformed value")

    root = dec(msg["v"], 0)
    while pending:
        i = pending.pop()
        o = made[i]
        for k, x in table[str(i)][1].items():
            if type(k) is not str or not k.isidentifier() or k.startswith("__"):
                raise CodecError("malformed attribute")
            set_attr(o, k, dec(x, 1))
    return root
