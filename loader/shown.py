"""Values shown in error messages: ``repr`` cut to about SHOWN characters, with work bounded by SHOWN.

``show`` returns ``repr(value)`` when that fits in SHOWN characters, else its first SHOWN, an
ellipsis and the value's full length; its work is bounded by SHOWN, not by the value: a string
is cut before it is written out, a list, tuple or dict stops at the item that crosses the limit,
and an int too long to write is described by its digit count. A config given as a dict may come
from the caller's own ``yaml.safe_load``, aliases expanded: with ``repr``, the message for a
325-byte alias bomb (seven levels of nine aliases under ``tiers.gpu.fraction``) took 15 s and
351 MB, nine times that per level more; and Python refuses ``repr`` of an int over 4300 digits.
The manifest, routing files and safetensors headers show their values the same way.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

SHOWN = 200  # characters of a value a message shows
_BITS_WRITTEN = 3 * SHOWN  # an int longer than this (about 180 digits) is described, not written


def show(value: Any) -> str:
    """``repr(value)`` if it fits in SHOWN characters, else its first SHOWN and ``… (its length)``."""
    text = ""
    for chunk in _repr_chunks(value):  # stops reading once past SHOWN, so the rest is never built
        text += chunk
        if len(text) > SHOWN:
            return cut(text, SHOWN, _length(value, text))
    return text


def cut(text: str, limit: int = SHOWN, length: str | None = None) -> str:
    """``text``, or its first ``limit`` characters, an ellipsis and ``length`` (default: its own)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({length or f'{len(text)} characters'})"


def _repr_chunks(value: Any) -> Iterator[str]:
    """``repr(value)`` in pieces, in order, none much longer than SHOWN: a list, tuple or dict
    yields its brackets and items one by one, a longer string only its beginning (the piece is
    then past SHOWN, where ``show`` cuts), a huge int or collection a description of it."""
    kind = type(value)
    if kind in (str, bytes):
        yield repr(value) if len(value) <= SHOWN else repr(value[: SHOWN + 1])
    elif kind is int and value.bit_length() > _BITS_WRITTEN:
        yield f"<an integer of {_digits(value)} digits>"
    elif kind in (list, tuple, dict):
        yield {list: "[", tuple: "(", dict: "{"}[kind]
        for i, item in enumerate(value.items() if kind is dict else value):
            if i:
                yield ", "
            if kind is dict:
                yield from _repr_chunks(item[0])
                yield ": "
                yield from _repr_chunks(item[1])
            else:
                yield from _repr_chunks(item)
        yield ",)" if kind is tuple and len(value) == 1 else {list: "]", tuple: ")", dict: "}"}[kind]
    elif isinstance(value, Sized) and len(value) > SHOWN:  # a set, a dict subclass: not written out
        yield f"<{kind.__name__} of {len(value)} items>"
    else:
        yield repr(value)


def _digits(n: int) -> int:
    """How many decimal digits ``n`` has, without writing it out: an estimate from its bit length,
    settled by comparing with powers of ten."""
    n, guess = abs(n), math.floor(abs(n).bit_length() * math.log10(2)) + 1
    return guess + 1 if n >= 10**guess else guess if n >= 10 ** (guess - 1) else guess - 1


def _length(value: Any, text: str) -> str:
    """The full length of a value ``show`` cut: characters of a string, items of a container."""
    if isinstance(value, (str, bytes)):
        return f"{len(value)} {'characters' if isinstance(value, str) else 'bytes'}"
    if isinstance(value, (list, tuple, dict)):
        return f"{type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return f"{len(text)} characters"
