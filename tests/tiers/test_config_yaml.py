"""A config file read as strict YAML (tiers.config_yaml, through tiers.load_config): no anchors or
aliases, no key twice, only decimal numbers, true/false and text as plain scalars, and every
message short, whatever the file holds. Each rule is checked through a file on disk, as users
give it, with the message it must say; a seeded fuzz of mutated files checks that nothing but a
TiersConfig or a short ValueError comes back, within a second a file. Last, ``show``: a value as
a message shows it, exactly its repr when short, cut with its full length when long, in work
bounded whatever the value."""
from __future__ import annotations

import errno
import random
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.config import KEYS, TiersConfig, load_config, parse_config
from tiers.config_yaml import MAX_BYTES, MAX_DEPTH, MAX_DIGITS
from tiers.loader.shown import SHOWN, cut, show

LONGEST_MESSAGE = 1000
TAIL = 40  # the most "… (list of 1000000 items)" and the like add past SHOWN
TAKES = ("a config value is a plain decimal number (4096, 0.25), true or false, or text such as 24GiB or int8; "
         "quote it if you mean the text")
EVERY_KEY = [(section, name) for section, names in KEYS.items() for name in names]  # the twelve


@contextmanager
def within(seconds: float):
    """The body must finish within ``seconds``: an alarm interrupts it (Python code, at least)
    so a regression fails the test instead of hanging it, and the time is checked after."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < seconds


def write(tmp_path: Path, text: str | bytes, name: str = "tiers.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def refusal(path: Path, seconds: float = 1.0) -> str:
    """The ValueError message load_config gives for ``path``, checked short and quick."""
    with within(seconds), pytest.raises(ValueError) as ei:
        load_config(path)
    msg = str(ei.value)
    assert len(msg) < LONGEST_MESSAGE, msg[:2000]
    return msg


def one_value(section: str, name: str, text: str) -> str:
    """A config setting ``tiers.section.name`` to ``text`` as written, on line 3."""
    return f"tiers:\n  {section}:\n    {name}: {text}\n"


# -- anchors and aliases: refused at the first, so no bomb expands --------------------------


def billion_laughs(levels: int, width: int, where: str) -> str:
    """The classic bomb: each level a list of ``width`` aliases of the one below, ``width ** levels``
    strings once expanded. ``where``: ``inside`` builds it all inside tiers.gpu.fraction (the
    value an error message shows), ``top`` in top-level keys ahead of ``tiers``, ``merge``
    through merge keys."""
    names = [f"l{i}" for i in range(levels)]
    if where == "merge":
        lines = [f"{names[0]}: &{names[0]} {{{', '.join(f'k{j}: lol' for j in range(width))}}}"]
        lines += [f"{n}: &{n} {{<<: [{', '.join([f'*{p}'] * width)}]}}" for p, n in zip(names, names[1:])]
        return "\n".join(lines) + f"\ntiers: {{gpu: *{names[-1]}}}\n"
    rows = [f"&{names[0]} [{', '.join(['lol'] * width)}]"]
    rows += [f"&{n} [{', '.join([f'*{p}'] * width)}]" for p, n in zip(names, names[1:])]
    if where == "inside":
        return "tiers: {gpu: {fraction: [" + ",\n  ".join(rows) + "]}}\n"
    return "\n".join(f"{n}: {row}" for n, row in zip(names, rows)) + f"\ntiers: {{gpu: {{fraction: *{names[-1]}}}}}\n"


def laughs(levels: int, width: int = 9) -> list:
    """A billion-laughs value as a YAML loader would build it: ``width`` references to the level
    below, ``levels`` deep, ``width ** levels`` strings when written out, a few objects in memory."""
    value: list = ["lol"] * width
    for _ in range(levels - 1):
        value = [value] * width
    return value


@pytest.mark.parametrize("where", ["inside", "top", "merge"])
@pytest.mark.parametrize("levels, width", [(2, 2), (3, 9), (7, 9), (9, 10), (30, 4), (60, 2)])
def test_an_alias_bomb_is_refused_within_a_second(tmp_path, where, levels, width):
    """Up to 10**9 (9 of 10) and 2**60 nodes expanded; each refused at its first anchor."""
    path = write(tmp_path, billion_laughs(levels, width, where))
    msg = refusal(path)
    assert msg.startswith(f"config: {str(path)!r} line ") and "the anchor &l0; a Tiers config takes no YAML anchors or aliases" in msg


def test_a_single_alias_is_refused_with_the_file_and_line(tmp_path):
    path = write(tmp_path, "tiers:\n  gpu: {precision: int8}\n  cpu: *g\n")
    assert refusal(path) == (f"config: {str(path)!r} line 3: the alias *g; a Tiers config takes no YAML anchors or aliases "
                             "(nothing in it repeats, and aliases can expand a few hundred bytes into billions of nodes)")


@pytest.mark.parametrize("text, line, what", [
    ("tiers:\n  gpu: &g {precision: int8}\n", 2, "anchor &g"),  # an anchor alone expands nothing, but nothing needs it
    ("tiers:\n  gpu: &g {precision: int8}\n  cpu: *g\n", 2, "anchor &g"),
    ("tiers:\n  gpu: {fraction: &f 0.25}\n  cpu: {fraction: *f}\n", 2, "anchor &f"),
    ("base: &b {precision: int8}\ntiers:\n  cpu: {<<: *b}\n", 1, "anchor &b"),
    ("tiers: &t [*t]\n", 1, "anchor &t"),  # recursive
])
def test_any_anchor_or_alias_is_refused(tmp_path, text, line, what):
    path = write(tmp_path, text)
    assert refusal(path).startswith(f"config: {str(path)!r} line {line}: the {what}; ")


# -- duplicate keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, places", [
    ("tiers:\n  gpu: {fraction: 0.2, fraction: 0.3}\n", "tiers.gpu.fraction", "line 2, columns 9 and 24"),
    ("tiers:\n  gpu: {fraction: 0.2}\n  gpu: {fraction: 0.3}\n", "tiers.gpu", "lines 2 and 3"),
    ("tiers: {gpu: {fraction: 0.2}, gpu: {budget: 1GiB}}\n", "tiers.gpu", "line 1, columns 9 and 31"),
    ("tiers:\n  gpu:\n    fraction: 0.2\n    precision: bf16\n    fraction: 0.2\n", "tiers.gpu.fraction", "lines 3 and 5"),
    ("tiers:\n  rebalance:\n    window: 4\n    'window': 8\n", "tiers.rebalance.window", "lines 3 and 4"),  # quoted: the same key
    ("tiers: {}\ntiers: {gpu: {fraction: 0.5}}\n", "tiers", "lines 1 and 2"),
    ("tiers:\n  gpu: {colour: red, colour: red}\n", "tiers.gpu.colour", "line 2, columns 9 and 22"),  # unknown and twice
])
def test_a_key_given_twice_is_refused_naming_it_and_the_file(tmp_path, text, key, places):
    """Even with the same value twice: YAML leaves a duplicate undefined, and PyYAML kept the last."""
    path = write(tmp_path, text)
    assert refusal(path) == f"{key}: given twice in {str(path)!r} ({places}); a mapping takes each key once"


# -- plain scalars -------------------------------------------------------------------------------

SURPRISES = [  # plain text, what the message says YAML makes of it
    ("1:30", "a base-60 number to YAML 1.1 (1:30 is 90)"),
    ("1:30:00", "a base-60 number"), ("-1:30", "a base-60 number"), ("190:20:30.15", "a base-60 number"),
    ("017", "an octal number to YAML 1.1 (017 is 15)"), ("-017", "an octal number to YAML 1.1"), ("00", "an octal number"),
    ("0o17", "an octal number to YAML 1.2 (0o17 is 15)"),
    ("0x1F", "a hexadecimal number to YAML (0x1F is 31)"), ("-0xff", "a hexadecimal number"),
    ("0b11", "a binary number to YAML 1.1 (0b11 is 3)"),
    ("1_000", "a number with _ separators to YAML 1.1 (1_000 is 1000)"), ("1_000.5", "_ separators"), ("0.000_1", "_ separators"),
    (".inf", "infinity or not-a-number to YAML"), ("-.inf", "infinity"), ("+.INF", "infinity"), (".nan", "not-a-number"),
    (".NaN", "not-a-number"),
    ("yes", "a boolean to YAML 1.1 but text to YAML 1.2 (write true or false)"), ("No", "a boolean"), ("ON", "a boolean"),
    ("off", "a boolean"), ("y", "a boolean"), ("N", "a boolean"),
    ("2001-12-14", "a date to YAML 1.1"), ("2001-12-14t21:59:43.10-05:00", "a date"),
    ("1e3", "a number to YAML 1.2 but text to YAML 1.1 (1e3; write 1000 or 1.0e3)"), ("-2E-4", "a number to YAML 1.2"),
    ("1.2.3", "neither a plain decimal number nor a size such as 24GiB"), (".5GiB", "neither"), ("1,024", "neither"),
    ("1.0e999", "beyond a float's range"), ("9" * (MAX_DIGITS + 1), f"has {MAX_DIGITS + 1} digits"),
]


@pytest.mark.parametrize("text, reason", SURPRISES, ids=[t[:16] for t, _ in SURPRISES])
def test_a_surprising_plain_scalar_is_refused_at_every_key(tmp_path, text, reason):
    """At each of the twelve keys, whatever it takes: the message names the key, the text as
    written, the line and the file. Quoted, the same text is text and goes to the key's own check
    (which refuses it, but for a budget of digits: '017' is 17 bytes)."""
    for section, name in EVERY_KEY:
        path = write(tmp_path, one_value(section, name, text))
        msg = refusal(path)
        assert msg.startswith(f"tiers.{section}.{name}: {text!r} (line 3 of {str(path)!r}) ") and reason in msg, msg
        quoted = write(tmp_path, one_value(section, name, f"'{text}'"))
        if name == "budget" and text.isdigit() and 0 < int(text) < 2**63:
            assert getattr(load_config(quoted), section).size.budget == int(text)
            continue
        msg = refusal(quoted)
        assert msg.startswith(f"tiers.{section}.{name}: ") and repr(text) in msg and reason not in msg, msg


def test_sexagesimal_staging_slots_exact_message(tmp_path):
    """It loaded as staging_slots=90 before."""
    path = write(tmp_path, "tiers:\n  gpu: {staging_slots: 1:30}\n")
    assert refusal(path) == f"tiers.gpu.staging_slots: '1:30' (line 2 of {str(path)!r}) is a base-60 number to YAML 1.1 (1:30 is 90); {TAKES}"


def test_yes_where_a_bool_is_expected_exact_message(tmp_path):
    """It loaded as graphs=True before."""
    path = write(tmp_path, "tiers:\n  gpu:\n    graphs: yes\n")
    assert refusal(path) == (f"tiers.gpu.graphs: 'yes' (line 3 of {str(path)!r}) is a boolean to YAML 1.1 but text to YAML 1.2 "
                             f"(write true or false); {TAKES}")


@pytest.mark.parametrize("section, name, text, value", [
    ("gpu", "staging_slots", "12", 12), ("gpu", "staging_slots", "+12", 12), ("gpu", "staging_slots", "auto", "auto"),
    ("rebalance", "every_tokens", "0", 0), ("rebalance", "every_tokens", "-0", 0), ("rebalance", "window", "1024", 1024),
    ("gpu", "fraction", "0.25", 0.25), ("gpu", "fraction", ".5", 0.5), ("gpu", "fraction", "1.", 1.0), ("gpu", "fraction", "0", 0.0),
    ("gpu", "fraction", "2.5e-1", 0.25), ("gpu", "fraction", "+0.5", 0.5), ("gpu", "fraction", "1", 1.0),
    ("gpu", "graphs", "true", True), ("gpu", "graphs", "True", True), ("gpu", "graphs", "TRUE", True),
    ("gpu", "graphs", "false", False), ("gpu", "graphs", "False", False), ("gpu", "graphs", "FALSE", False),
    ("gpu", "budget", "24GiB", 24 << 30), ("gpu", "budget", "512 MB", 512 * 10**6), ("cpu", "budget", "1.5GiB", 3 << 29),
    ("cpu", "budget", "1073741824", 1 << 30), ("cpu", "budget", "9" * 18, int("9" * 18)),
    ("cpu", "precision", "bnb8", "bnb8"), ("nvme", "precision", "bf16", "bf16"),
    ("gpu", "staging_slots", '!!int "12"', 12), ("gpu", "fraction", "!!float '0.5'", 0.5), ("gpu", "graphs", "!!bool 'false'", False),
    ("nvme", "precision", "!!str int8", "int8"),
])
def test_the_scalars_the_config_takes(tmp_path, section, name, text, value):
    cfg = load_config(write(tmp_path, one_value(section, name, text)))
    got = {"fraction": lambda t: t.size.fraction, "budget": lambda t: t.size.budget}.get(name, lambda t: getattr(t, name))
    assert got(getattr(cfg, section)) == value and type(got(getattr(cfg, section))) is type(value)


@pytest.mark.parametrize("text", ["tiers:\n  gpu:\n", "tiers:\n  gpu: ~\n", "tiers:\n  gpu: null\n", "tiers: {gpu: {}}\n", "", "# only\n"])
def test_an_empty_section_or_file_takes_the_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == TiersConfig()


# -- tags, keys, depth, size ---------------------------------------------------------------------


@pytest.mark.parametrize("text, key, tag", [
    ("tiers: {gpu: {budget: !!python/object/apply:os.system [touch PWNED]}}", "tiers.gpu.budget", "!!python/object/apply:os.system"),
    ("tiers: {gpu: {budget: !!python/name:os.system }}", "tiers.gpu.budget", "!!python/name:os.system"),
    ("tiers: !!python/object:tiers.config.TiersConfig {}", "tiers", "!!python/object:tiers.config.TiersConfig"),
    ("tiers: {gpu: {fraction: !!python/tuple [1, 2]}}", "tiers.gpu.fraction", "!!python/tuple"),
    ("tiers: {gpu: {budget: !!binary aGVsbG8=}}", "tiers.gpu.budget", "!!binary"),
    ("tiers: {gpu: {budget: !!timestamp 2001-12-14}}", "tiers.gpu.budget", "!!timestamp"),
    ("tiers: {gpu: !!set {fraction, budget}}", "tiers.gpu", "!!set"),
    ("tiers: {gpu: !!omap [fraction: 0.5]}", "tiers.gpu", "!!omap"),
    ("tiers: {gpu: {budget: !local 1}}", "tiers.gpu.budget", "!local"),
    ("!!python/name:os.system : 1", "config", "!!python/name:os.system"),
])
def test_a_tag_other_than_the_plain_kinds_is_refused(tmp_path, monkeypatch, text, key, tag):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, text + "\n")
    assert refusal(path).startswith(f"{key}: the tag {tag!r} (line 1 of {str(path)!r}) is not allowed; ")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("text, message", [
    ("!!int 0x10", "'0x10' (line 3 of {path}) is a hexadecimal number"),
    ("!!float .inf", "'.inf' (line 3 of {path}) is infinity"),
    ("!!bool yes", "'yes' (line 3 of {path}) is a boolean"),
    ("!!int [1]", "a list tagged '!!int' (line 3 of {path}) is not a decimal integer"),
])
def test_a_plain_kind_tag_on_other_text_is_refused(tmp_path, text, message):
    path = write(tmp_path, one_value("gpu", "staging_slots", text))
    assert refusal(path).startswith("tiers.gpu.staging_slots: " + message.format(path=repr(str(path))))


@pytest.mark.parametrize("text, message", [
    ("tiers:\n  gpu:\n    on: 1\n", "tiers.gpu.on: unknown key"),  # YAML 1.1 made the key True: 'tiers.gpu.True'
    ("yes: 1\n", "config.yes: unknown key"),
    ("tiers:\n  gpu: {1:30: 1}\n", "tiers.gpu.1:30: unknown key"),
    ("tiers:\n  gpu: {<<: {fraction: 0.5}}\n", "tiers.gpu.<<: unknown key"),  # YAML 1.1 merged it: fraction 0.5
    ("tiers:\n  ? [gpu]\n  : {fraction: 0.5}\n", "tiers: a list as a key (line 2 of {path}) is not a name; a key is a name such as gpu or fraction"),
])
def test_a_key_is_its_text(tmp_path, text, message):
    path = write(tmp_path, text)
    assert refusal(path).startswith(message.format(path=repr(str(path))))


def test_nesting_is_capped_at_max_depth(tmp_path):
    """MAX_DEPTH nodes deep still reaches the key's check; one more is refused while composing,
    and ten thousand levels are refused as quickly (PyYAML's composer recursed out of the stack)."""
    inner = MAX_DEPTH - 3  # the document, tiers, gpu: then lists down to the scalar
    ok = write(tmp_path, "tiers: {gpu: {fraction: " + "[" * (inner - 1) + "1" + "]" * (inner - 1) + "}}\n", "ok.yaml")
    assert refusal(ok).startswith("tiers.gpu.fraction: expected a number in [0, 1], got [[[")
    deep = write(tmp_path, "tiers: {gpu: {fraction: " + "[" * inner + "1" + "]" * inner + "}}\n", "deep.yaml")
    assert refusal(deep) == (f"config: {str(deep)!r} line 1: nested more than {MAX_DEPTH} deep; "
                             "a Tiers config is 4 (the document, tiers, gpu, fraction)")
    assert "nested more than" in refusal(write(tmp_path, "[" * 10000 + "]" * 10000, "abyss.yaml"))


def test_a_file_over_max_bytes_is_refused_unread(tmp_path):
    at_limit = write(tmp_path, "#" * (MAX_BYTES - 1) + "\n", "at.yaml")
    assert load_config(at_limit) == TiersConfig()
    over = write(tmp_path, "#" * MAX_BYTES + "\n", "over.yaml")
    assert refusal(over) == f"config: {str(over)!r} is over {MAX_BYTES} bytes; a Tiers config is a few lines of YAML"


def test_an_unreadable_file_is_a_value_error_naming_it(tmp_path, monkeypatch):
    """A read error (here EIO, faked: permissions do not stop root) is not let out as an OSError."""
    path = write(tmp_path, "tiers: {}\n")

    def failing_open(self, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "open", failing_open)
    assert refusal(path) == f"config: {str(path)!r} cannot be read: Input/output error"


def test_an_int_of_thousands_of_digits_names_its_key(tmp_path):
    """PyYAML's int() raised Python's own 'Exceeds the limit (4300 digits)', naming no key."""
    path = write(tmp_path, one_value("rebalance", "window", "9" * 5000))
    assert refusal(path).startswith(f"tiers.rebalance.window: '{'9' * 199}… (5000 characters) (line 3 of {str(path)!r}) has 5000 digits")
    path = write(tmp_path, one_value("rebalance", "window", "9" * MAX_DIGITS))
    assert refusal(path) == f"tiers.rebalance.window: expected an integer in [1, 1024], got {'9' * MAX_DIGITS}"


# -- short messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("section, name", EVERY_KEY)
def test_a_huge_value_is_shown_cut_at_every_key(tmp_path, section, name):
    """From a dict (a billion strings behind nine shared lists, as a caller's own yaml.safe_load of
    an alias bomb builds it) and from a file (50,000 characters): the value part of the message is
    at most SHOWN characters and its length."""
    with within(1.0), pytest.raises(ValueError, match=f"^tiers.{section}.{name}: ") as ei:
        parse_config({"tiers": {section: {name: laughs(9, width=10)}}})
    msg = str(ei.value)
    value = msg[msg.index("[[["): msg.index("… (list of 10 items)") + len("… (list of 10 items)")]
    assert len(msg) < LONGEST_MESSAGE and len(value) <= SHOWN + TAIL, msg
    msg = refusal(write(tmp_path, one_value(section, name, "x" * 50_000)))
    value = msg[msg.index("'xxx"): msg.index("… (50000 characters)") + len("… (50000 characters)")]
    assert msg.startswith(f"tiers.{section}.{name}: ") and len(value) <= SHOWN + TAIL, msg


def test_a_huge_key_or_section_is_shown_cut():
    with pytest.raises(ValueError) as ei:
        parse_config({"tiers": {"gpu": {"k" * 10**6: 1}}})
    assert str(ei.value).startswith(f"tiers.gpu.'{'k' * 199}… (1000000 characters): unknown key")
    with pytest.raises(ValueError) as ei:
        parse_config({"tiers": {"gpu": list(range(10**6))}})
    assert len(str(ei.value)) < LONGEST_MESSAGE and str(ei.value).endswith("… (list of 1000000 items)")


def test_a_long_yaml_syntax_error_is_cut(tmp_path):
    path = write(tmp_path, "tiers: !" + "h" * 5000 + "!x 1\n")
    msg = refusal(path)
    assert msg.startswith(f"config: {str(path)!r} is not valid YAML: ") and msg.endswith(" characters)")


# -- fuzz ----------------------------------------------------------------------------------------

SEEDS = [
    "tiers:\n  gpu:  {fraction: 0.25}   # hot\n  cpu:  {fraction: 0.5, precision: int8}\n  nvme: {precision: int8}\n",
    "tiers:\n  gpu:\n    budget: 24GiB\n    precision: bf16\n    staging_slots: 4\n    graphs: false\n  cpu:\n    budget: 512MB\n"
    "    precision: bnb8\n  nvme:\n    precision: int8\n  rebalance:\n    every_tokens: 16\n    window: 4\n    max_moves: 2\n",
    "tiers:\n  gpu: {budget: 16GiB}\n  cpu: {budget: 24GiB, precision: int8}\n  rebalance: {every_tokens: 8}\n",
    billion_laughs(5, 9, "inside"),
    billion_laughs(4, 9, "top"),
]
WORDS = ["1:30", "90:00", "yes", "no", "on", "off", "0o17", "017", "0x1F", "1_000", ".inf", ".nan", "~", "2001-12-14", "1e3",
         "'1:30'", "!!python/name:os.system", "!!binary aGVsbG8=", "*a", "&a", "[", "{", "}", "- x", "? x", "|", ">", "\t"]


def _mutate(doc: bytes, rng: random.Random) -> bytes:
    """One random mutation: a byte flip, a line duplicated, an alias or anchor inserted, a number
    made sexagesimal, a YAML 1.1 word or a bit of syntax dropped in, a character or a line
    deleted, a number changed, a comment added."""
    lines = doc.split(b"\n")
    kind = rng.randrange(10)
    if kind == 7:
        return re.sub(rb"\b[0-9]+(\.[0-9]+)?\b", lambda m: rng.choice([b"0", b"1", b"0.1", b"8", b"2048", b"-3"]), doc, count=1)
    if kind == 8:
        del lines[rng.randrange(len(lines))]
        return b"\n".join(lines)
    if kind == 9:
        i = rng.randrange(len(lines))
        lines[i] += b"  # " + rng.choice(WORDS).encode()
        return b"\n".join(lines)
    if kind == 0 and doc:
        i = rng.randrange(len(doc))
        return doc[:i] + bytes([rng.randrange(256)]) + doc[i + 1:]
    if kind == 1:
        i = rng.randrange(len(lines))
        return b"\n".join(lines[: i + 1] + [lines[i]] + lines[i + 1:])
    if kind == 2:
        i, j = sorted(rng.randrange(len(lines)) for _ in range(2))
        lines[i] = re.sub(rb": ", b": &a ", lines[i], count=1)
        lines[j] = re.sub(rb": [^ {]+", b": *a", lines[j], count=1)
        return b"\n".join(lines)
    if kind == 3:
        return re.sub(rb"\b[0-9]+(\.[0-9]+)?\b", lambda m: b"%d:%02d" % (rng.randrange(100), rng.randrange(60)), doc, count=1)
    if kind in (4, 5) and doc:
        i = rng.randrange(len(doc))
        return doc[:i] + rng.choice(WORDS).encode() + doc[i:]
    i = rng.randrange(max(len(doc), 1))
    return doc[:i] + doc[i + 1:]


def test_fuzzed_files_load_or_refuse_quickly_with_a_short_message(tmp_path):
    """400 seeded mutations of five files (three configs, two small alias bombs), one to three mutations
    each: load_config returns a TiersConfig or raises a ValueError under LONGEST_MESSAGE
    characters, within a second a file; never another exception, never a long wait."""
    rng = random.Random(1729)
    loaded = refused = 0
    slowest = 0.0
    for case in range(400):
        doc = rng.choices(SEEDS, weights=[3, 3, 3, 1, 1])[0].encode()  # a bomb one time in eleven
        for _ in range(rng.randint(1, 3)):
            doc = _mutate(doc, rng)
        path = write(tmp_path, doc, f"fuzz{case}.yaml")
        start = time.perf_counter()
        try:
            with within(1.0):
                cfg = load_config(path)
        except ValueError as e:
            assert len(str(e)) < LONGEST_MESSAGE, (doc, str(e)[:2000])
            refused += 1
        else:
            assert isinstance(cfg, TiersConfig)
            loaded += 1
        slowest = max(slowest, time.perf_counter() - start)
    print(f"fuzz: {loaded} loaded, {refused} refused, slowest {slowest * 1e3:.1f} ms")
    assert loaded >= 25 and refused >= 200, (loaded, refused)  # both ways are exercised


# -- show ----------------------------------------------------------------------------------------


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12),
                     st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner), st.tuples(inner, inner),
                                                         st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=_values)
def test_a_short_value_is_its_repr_and_a_long_one_its_repr_cut(value):
    text = repr(value)
    shown = show(value)
    if len(text) <= SHOWN:
        assert shown == text
    else:
        assert shown.startswith(text[:SHOWN]) and shown[SHOWN] == "…" and len(shown) <= SHOWN + TAIL


@pytest.mark.parametrize("value, tail", [
    ("x" * 1000, "… (1000 characters)"),
    (b"z" * 300, "… (300 bytes)"),
    (list(range(10**6)), "… (list of 1000000 items)"),
    (tuple(range(500)), "… (tuple of 500 items)"),
    ({"key": "v" * 10**6}, "… (dict of 1 item)"),
])
def test_a_long_value_ends_in_its_full_length(value, tail):
    shown = show(value)
    assert shown == repr(value)[:SHOWN] + tail


@pytest.mark.parametrize("levels", [4, 7])
def test_an_expanded_alias_bomb_is_shown_in_bounded_work(levels):
    """9**7 = 4.8 million strings: repr writes 39 MB (a second or two); show stops at SHOWN."""
    value = laughs(levels)
    start = time.perf_counter()
    shown = show(value)
    assert time.perf_counter() - start < 0.5  # repr: seconds at 7 levels
    assert len(shown) <= SHOWN + TAIL and shown.startswith("[[[") and shown.endswith("… (list of 9 items)")


def test_a_huge_int_is_described_not_converted():
    """Python refuses to write an int of over 4300 digits; show says how long it is."""
    assert show(10**5000) == "<an integer of 5001 digits>"
    assert show(-(10**400)) == "<an integer of 401 digits>"
    assert show([1, 10**5000]) == "[1, <an integer of 5001 digits>]"
    assert show(10**170) == repr(10**170)
    for n in (2**700, 10**300 - 1, 10**300, 10**300 + 1, 2**1999, -(2**1999)):
        assert show(n) == f"<an integer of {len(str(abs(n)))} digits>"


def test_a_self_referential_list_and_a_large_set_are_bounded():
    loop: list = []
    loop.append(loop)
    assert len(show(loop)) <= SHOWN + TAIL
    assert show(set(range(1000))) == "<set of 1000 items>"


def test_cut():
    assert cut("abc", 3) == "abc"
    assert cut("abcd", 3) == "abc… (4 characters)"
    assert cut("abcd", 3, "a length") == "abc… (a length)"
