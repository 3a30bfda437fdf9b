"""The config's input boundary: a file read as strict YAML.

Owns turning a config file into the plain document ``tiers.config.parse_config`` validates
(dicts with str keys, lists, str, int, float, bool, None); its messages show values with
``tiers.loader.shown.show``. PyYAML's safe loader reads YAML 1.1,
where ``1:30`` is 90, ``017`` is 15, ``0x1F`` is 31, ``1_000`` is 1000 and ``yes``/``on`` are
true; where a key given twice keeps its last value; and where a few hundred bytes of anchors
and aliases expand into billions of nodes. ``StrictLoader`` keeps none of that.

Invariant: a plain (unquoted) scalar is one of

- a decimal integer, ``[-+]?(0|[1-9][0-9]*)``, of at most MAX_DIGITS digits: ``4096`` (a
  leading zero is octal to YAML 1.1);
- a decimal float with a point, ``0.25``, ``.5``, ``2.5e-3``, finite;
- ``true`` or ``false`` (also ``True``, ``TRUE``, ``False``, ``FALSE``);
- null: empty, ``~`` or ``null`` (an empty section takes its defaults);
- text, unless it reads as something else to some YAML reader: a number in another base, with
  ``_`` separators or in base 60 (``1:30``), a date, ``yes``/``no``/``on``/``off``/``y``/``n``,
  ``.inf``/``.nan``, or anything else that begins like a number and is neither a number above
  nor a size such as ``24GiB``. Those are refused with a ValueError naming the key and the text.

A quoted scalar is always text. An explicit tag may only name one of those kinds (``!!str``,
``!!int``, ``!!float``, ``!!bool``, ``!!null``, ``!!map``, ``!!seq``): ``!!str`` makes any
scalar text, as quotes do, and the others' text must be of their kind; any other tag (``!!python/...``, ``!!binary``, ``!!set``, ``!!timestamp``,
``!local``) is refused. A key is taken as its text, never interpreted (``on:`` is the key "on"),
and a key given twice in one mapping is refused, naming it, the file and both lines.

Anchors and aliases are refused, at the first ``&`` or ``*``, before a node is built. The bound
is zero rather than a node count because a config is a dozen scalars that never repeat a part,
so any count would be an arbitrary limit that only an attack reaches; with none, the document
is a tree no larger than its text. With nesting capped at MAX_DEPTH and the file at MAX_BYTES,
reading is linear in a small input (and PyYAML's recursive composer never hits the recursion
limit). Every error is a ValueError beginning with the dotted key (``config`` for the file).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from tiers.loader.shown import cut, show

MAX_BYTES = 64 << 10  # a full config with comments is under 1 KiB
MAX_DEPTH = 8  # nodes deep; the config is 4 (the document, tiers, gpu, fraction)
MAX_DIGITS = 64  # of a decimal integer; the largest the config takes (a budget in bytes) has 19
YAML_ERROR = 500  # characters of PyYAML's own message kept


# -- the strict loader -----------------------------------------------------

_T = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, MAP, SEQ = (_T + k for k in ("str", "int", "float", "bool", "null", "map", "seq"))
REFUSED = "tag:tiers,2025:refused"  # a plain scalar that YAML would read as something surprising

_NULL = r"~|null|Null|NULL|"
_BOOL = r"true|True|TRUE|false|False|FALSE"
_INT = r"[-+]?(?:0|[1-9][0-9]*)"
_FLOAT = r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_SIZE = r"[-+]?[0-9]+(?:\.[0-9]+)?[ \t]*[A-Za-z]+"  # 24GiB, 512 MB: text for tiers.config.parse_size
_NUMBER_LIKE = r"[-+]?\.?[0-9](?s:.*)"
# What some YAML reader makes of a plain scalar like these, in the order they are tried.
_SURPRISES = (
    (r"[-+]?[0-9][0-9_]*(?::[0-9_]*)+(?:\.[0-9_]*)?", "a base-60 number to YAML 1.1 (1:30 is 90)"),
    (r"[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt \t](?s:.*))?", "a date to YAML 1.1"),
    (r"[-+]?0[xX][0-9a-fA-F_]+", "a hexadecimal number to YAML (0x1F is 31)"),
    (r"[-+]?0[oO][0-7_]+", "an octal number to YAML 1.2 (0o17 is 15)"),
    (r"[-+]?0[bB][01_]+", "a binary number to YAML 1.1 (0b11 is 3)"),
    (r"[-+]?0[0-9_]+", "an octal number to YAML 1.1 (017 is 15)"),
    (r"(?=[^_]*_)[-+]?\.?[0-9][0-9_.]*(?:[eE][-+]?[0-9_]+)?", "a number with _ separators to YAML 1.1 (1_000 is 1000)"),
    (r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+", "a number to YAML 1.2 but text to YAML 1.1 (1e3; write 1000 or 1.0e3)"),
    (r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "infinity or not-a-number to YAML, never a setting here"),
    (r"y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF", "a boolean to YAML 1.1 but text to YAML 1.2 (write true or false)"),
)
_TAKES = ("a config value is a plain decimal number (4096, 0.25), true or false, or text such as 24GiB "
          "or int8; quote it if you mean the text")


def _full(pattern: str) -> re.Pattern:
    return re.compile(f"(?:{pattern})\\Z")  # the resolver calls .match: anchored at the start only


_SURPRISE_RES = tuple((_full(p), reason) for p, reason in _SURPRISES)


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the rules of this module's docstring: its own resolvers (none of
    YAML 1.1's) and constructors, anchors, aliases and deep nesting refused while composing."""

    yaml_implicit_resolvers: dict = {}
    yaml_constructors: dict = {}
    yaml_multi_constructors: dict = {}

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.source = source  # the file, as messages show it
        self.paths = ["config"]  # the dotted key of each node being built, innermost last
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> yaml.Node:
        event = self.peek_event()
        if event.anchor is not None:  # an alias (*a) or an anchor (&a)
            what = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise ValueError(f"config: {self.source} line {event.start_mark.line + 1}: the {what}{cut(event.anchor, 40)}; "
                             "a Tiers config takes no YAML anchors or aliases (nothing in it repeats, and aliases "
                             "can expand a few hundred bytes into billions of nodes)")
        if self._depth >= MAX_DEPTH:
            raise ValueError(f"config: {self.source} line {event.start_mark.line + 1}: nested more than {MAX_DEPTH} deep; "
                             "a Tiers config is 4 (the document, tiers, gpu, fraction)")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def refuse(self, node: yaml.Node, subject: str, predicate: str, fix: str = _TAKES) -> ValueError:
        """The error for ``node``, at the key being built: ``{key}: {subject} (line, file) {predicate}; {fix}``."""
        where = f"line {node.start_mark.line + 1} of {self.source}"
        return ValueError(f"{cut(self.paths[-1])}: {subject} ({where}) {predicate}; {fix}")

    def scalar(self, node: yaml.Node, pattern: re.Pattern, kind: str) -> str:
        """``node``'s text, if ``node`` is a scalar that ``pattern`` matches whole."""
        if not isinstance(node, yaml.ScalarNode):
            raise self.refuse(node, f"a {_kind(node)} tagged {_tag(node)}", f"is not {kind}", f"{kind} is one scalar")
        if not pattern.match(node.value):
            raise self.refuse(node, show(node.value), f"is {_reason(node.value, f'not {kind}')}")
        return node.value

    def key(self, node: yaml.Node) -> str:
        """A mapping key: a scalar, taken as its text."""
        if not isinstance(node, yaml.ScalarNode):
            raise self.refuse(node, f"a {_kind(node)} as a key", "is not a name", "a key is a name such as gpu or fraction")
        if node.tag not in _PLAIN:
            _refuse_tag(self, node)
        return node.value

    def child(self, key: str) -> str:
        """The dotted key of ``key`` in the mapping being built (a top-level key is itself)."""
        parent = self.paths[-1]
        return key if parent == "config" else f"{parent}.{key}"


_PLAIN = {STR, INT, FLOAT, BOOL, NULL, REFUSED}  # the tags a scalar key may carry; its text is the key


def _tag(node: yaml.Node) -> str:
    """``node``'s tag as written: ``!!python/name:os.system`` for YAML's own, else in full."""
    return show(f"!!{node.tag[len(_T):]}" if node.tag.startswith(_T) else node.tag)


def _kind(node: yaml.Node) -> str:
    return {yaml.ScalarNode: "scalar", yaml.SequenceNode: "list", yaml.MappingNode: "mapping"}[type(node)]


def _reason(text: str, default: str) -> str:
    """What some YAML reader makes of ``text`` (a refused plain scalar), else ``default``."""
    return next((reason for pattern, reason in _SURPRISE_RES if pattern.match(text)), default)


def _str(loader: StrictLoader, node: yaml.Node) -> str:
    return loader.scalar(node, _ANY_RE, "text")


def _null(loader: StrictLoader, node: yaml.Node) -> None:
    loader.scalar(node, _NULL_RE, "null (~)")


def _bool(loader: StrictLoader, node: yaml.Node) -> bool:
    return loader.scalar(node, _BOOL_RE, "true or false").lower() == "true"


def _int(loader: StrictLoader, node: yaml.Node) -> int:
    text = loader.scalar(node, _INT_RE, "a decimal integer")
    if len(text.lstrip("+-")) > MAX_DIGITS:
        raise loader.refuse(node, show(text), f"has {len(text.lstrip('+-'))} digits", f"no config number has more than {MAX_DIGITS}")
    return int(text)


def _float(loader: StrictLoader, node: yaml.Node) -> float:
    text = loader.scalar(node, _FLOAT_RE, "a decimal number")
    if not math.isfinite(value := float(text)):
        raise loader.refuse(node, show(text), "is beyond a float's range")
    return value


def _refused(loader: StrictLoader, node: yaml.Node) -> None:
    raise loader.refuse(node, show(node.value), f"is {_reason(node.value, 'neither a plain decimal number nor a size such as 24GiB')}")


def _refuse_tag(loader: StrictLoader, node: yaml.Node) -> None:
    raise loader.refuse(node, f"the tag {_tag(node)}", "is not allowed",
                        "a config value is an untagged mapping, decimal number, true or false, or text")


def _mapping(loader: StrictLoader, node: yaml.Node) -> dict:
    if not isinstance(node, yaml.MappingNode):
        raise loader.refuse(node, f"a {_kind(node)} tagged {_tag(node)}", "is not a mapping", "!!map tags a mapping")
    out: dict[str, Any] = {}
    marks: dict[str, yaml.Mark] = {}
    for key_node, value_node in node.value:
        key = loader.key(key_node)
        path = loader.child(key)
        if key in marks:
            raise ValueError(f"{cut(path)}: given twice in {loader.source} ({_places(marks[key], key_node.start_mark)}); "
                             "a mapping takes each key once")
        marks[key] = key_node.start_mark
        loader.paths.append(path)
        out[key] = loader.construct_object(value_node, deep=True)
        loader.paths.pop()
    return out


def _places(first: yaml.Mark, second: yaml.Mark) -> str:
    """``lines 2 and 5``, or ``line 2, columns 9 and 24`` for two keys on one line."""
    if first.line != second.line:
        return f"lines {first.line + 1} and {second.line + 1}"
    return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"


def _sequence(loader: StrictLoader, node: yaml.Node) -> list:
    if not isinstance(node, yaml.SequenceNode):
        raise loader.refuse(node, f"a {_kind(node)} tagged {_tag(node)}", "is not a list", "!!seq tags a list")
    out = []
    for i, item in enumerate(node.value):
        loader.paths.append(f"{loader.paths[-1]}[{i}]")
        out.append(loader.construct_object(item, deep=True))
        loader.paths.pop()
    return out


_NULL_RE, _BOOL_RE, _INT_RE, _FLOAT_RE, _ANY_RE = (_full(p) for p in (_NULL, _BOOL, _INT, _FLOAT, r"(?s:.*)"))


def _register() -> None:
    """StrictLoader's resolvers, tried in this order (the first match wins; a plain scalar none
    matches is text), and its constructors (any tag without one is refused)."""
    for tag, pattern in ((NULL, _NULL), (BOOL, _BOOL), (INT, _INT), (FLOAT, _FLOAT), *((REFUSED, p) for p, _ in _SURPRISES),
                         (STR, _SIZE), (REFUSED, _NUMBER_LIKE)):
        StrictLoader.add_implicit_resolver(tag, _full(pattern), None)
    for tag, construct in ((STR, _str), (NULL, _null), (BOOL, _bool), (INT, _int), (FLOAT, _float), (REFUSED, _refused),
                           (MAP, _mapping), (SEQ, _sequence), (None, _refuse_tag)):
        StrictLoader.add_constructor(tag, construct)


_register()


def read_yaml(path: Path) -> Any:
    """The config file at ``path`` as a plain document, or a ValueError naming the key (or the file)."""
    source = show(str(path))
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:  # unreadable: permissions, a read error
        raise ValueError(f"config: {source} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"config: {source} is over {MAX_BYTES} bytes; a Tiers config is a few lines of YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config: {source} is not valid YAML: {e}") from None
    try:
        loader = StrictLoader(text, source)  # the reader refuses control characters here
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ValueError(f"config: {source} is not valid YAML: {cut(str(e), YAML_ERROR)}") from None
