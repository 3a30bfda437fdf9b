"""The fuzz harness: one tiny packed checkpoint, one seeded mutation per case, and a verdict on what tiers.load and a forward made of it.

``build`` packs a tiny Qwen3-MoE checkpoint (bf16 in every tier, with experts hot, warm and cold;
a routing prior; tokenizer files carried) and records its logits for ``PROMPT``. ``run_case``
copies it into a fresh directory, applies one mutation (``fuzz_kinds.KINDS``), then in a forked
child, under a deadline and a memory limit, loads it with ``tiers.load`` and runs a forward, while
``Watch`` records every file opened outside the pack: Python's ``open`` audit events
(``sys.addaudithook``: ``open``, ``os.open``), and for what native code opens, the process's open
files (/proc/self/fd, sampled every 2 ms) and its file mappings (/proc/self/maps). Verdicts:

- ``equal``: the logits are the clean pack's, bit for bit (every tier is bf16, so any difference is an error);
- ``caught``: ``tiers.IntegrityError`` or a ``ValueError`` subclass whose message names a file of
  the pack, the config or routing file, or the field changed (YAML: a message that starts with the key);
- ``changed``: other logits after a resealed edit that changed the weights or config the pack holds;
- bad (``BAD``): ``silent wrong`` (other logits, otherwise), ``unhelpful`` (any other exception
  type, or a message naming nothing), ``hang`` (past the deadline), ``crash`` (the child died),
  ``outside read`` (an open outside the pack, the config, the routing file, the Python
  installation and the repository, /proc and /sys).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import tiers
from fuzz_kinds import KINDS, write_base
from fuzz_mutations import CaseFiles, Kind, Mutation
from tiers.api import manager_of
from tiers.loader.pack import pack
from tiers.loader.routing import routing_document

MODEL = "qwen3_moe"
PROMPT = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(11))
GOOD = ("equal", "caught", "changed")
BAD = ("silent wrong", "unhelpful", "hang", "crash", "outside read")
TIMEOUT = 30.0  # seconds a case may take; a clean one takes about 0.2 on one core
MEMORY = 1 << 30  # address space a case's child may add to what it inherits
REPO = Path(__file__).resolve().parents[1]
ANONYMOUS = ("/dev/zero (deleted)",)  # how /proc/self/maps names shared anonymous memory (the host pool's slab)
TOKENIZER = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<pad>", "special": True}, {"id": 1, "content": "<eos>", "special": True}],
             "model": {"type": "BPE", "vocab": {f"<0x{i:02X}>": i for i in range(2, 256)}, "merges": []}}
TOKENIZER_CONFIG = {"model_max_length": 128, "eos_token": "<eos>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}


class Watch:
    """Files opened outside the allowed places while active (and not paused: a mutation's own writes)."""

    def __init__(self) -> None:
        self.active = self.paused = False
        self.pauses = 0
        self.map_checks = 0  # samples of the mappings checked so far
        self.dirs: tuple[str, ...] = ()
        self.files: frozenset[str] = frozenset()
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampler: int | None = None
        self._base_fds: dict[str, str] = {}
        self._base_maps: set[str] = set()

    def allow(self, dirs, files) -> None:
        self.dirs = tuple(os.path.realpath(d) for d in dirs)
        self.files = frozenset(os.path.realpath(f) for f in files)

    def hook(self, event: str, args: tuple) -> None:
        """The audit hook: ``open`` events (builtins.open, io.open, os.open) check their path."""
        if (event == "open" and self.active and not self.paused and isinstance(args[0], (str, bytes, os.PathLike))
                and threading.get_ident() != self._sampler):  # not the watch's own reads of /proc/self
            with contextlib.suppress(Exception):  # a hook that raises would fail the open itself
                self.check(os.fsdecode(args[0]))

    def check(self, path: str, *, resolve: bool = True) -> None:
        """Record ``path`` if it lies outside the allowed places (``resolve``: through its symlinks as
        they are now; the kernel's own names, /proc/self/fd and maps, are resolved already)."""
        real = os.path.realpath(path) if resolve else os.path.normpath(path)
        if real not in self.files and not any(real == d or real.startswith(d + os.sep) for d in self.dirs):
            self.seen.append(path)

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        self.pauses += 1
        try:
            yield
        finally:
            self.paused = False

    @staticmethod
    def _fds() -> dict[str, str]:
        out = {}
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed between the listing and the readlink
                out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        return out

    @staticmethod
    def _maps() -> set[str]:
        with open("/proc/self/maps") as f:
            return {parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6}

    def _sample(self) -> None:
        """Every 2 ms the open files, every 10 ms the mappings (safetensors maps a file and closes it at once)."""
        tick = 0
        self._sampler = threading.get_ident()
        while not self._stop.wait(0.002):
            tick += 1
            pauses = self.pauses
            fds = {} if self.paused else self._fds()
            maps = self._maps() if tick % 5 == 0 and not self.paused else set()
            if self.paused or self.pauses != pauses:  # a pause began while listing: the mutation's own files
                continue
            for fd, target in fds.items():
                if self._base_fds.get(fd) != target and target.startswith("/"):
                    self.check(target.removesuffix(" (deleted)"), resolve=False)
            if maps:
                self._check_maps(maps)
                self.map_checks += 1

    def _check_maps(self, maps: set[str]) -> None:
        for path in maps - self._base_maps:
            if path.startswith("/") and path not in ANONYMOUS:
                self.check(path.removesuffix(" (deleted)"), resolve=False)

    def start(self) -> None:
        self.seen = []
        self._base_fds, self._base_maps = self._fds(), self._maps()
        self._stop.clear()
        self.active = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> list[str]:
        """Stop watching; every outside path opened (or newly mapped) since ``start``."""
        self._stop.set()
        self._thread.join()
        self.active = False
        self._check_maps(self._maps())
        return sorted(set(self.seen))


WATCH = Watch()
_HOOKED = False


def install() -> None:
    """Add ``WATCH``'s audit hook to this process, once (an audit hook cannot be removed; it records only while a watch is active)."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(WATCH.hook)
        _HOOKED = True


@dataclass(frozen=True)
class Clean:
    root: Path  # packed/, tiers.yaml, routing.json
    logits: torch.Tensor
    names: frozenset[str]  # base names of the pack's files, the config and the routing file: an error naming one names a file


@dataclass(frozen=True)
class Verdict:
    kind: str
    seed: int
    outcome: str
    file: str
    detail: str
    error: str  # "Type: message" (shortened), or ""
    seconds: float
    outside: tuple[str, ...] = ()


class HarnessError(Exception):
    """The harness itself failed (a mutation, the child's report): no verdict on the library."""


def build(root: Path) -> Clean:
    """Pack the clean checkpoint under ``root`` and record its logits (computed the way cases compute theirs)."""
    from conftest import save_tiny

    install()
    hf = save_tiny(MODEL, root / "hf")
    (hf / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (hf / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    clean = root / "clean"
    prior = routing_document({L: [(L + e) % 8 + 1 for e in range(8)] for L in range(3)}, tokens=40)
    pack(hf, clean / "packed", precisions=("bf16",), progress=False, routing=prior)
    write_base(clean, routing_document({L: [(3 * e + L) % 8 for e in range(8)] for L in range(3)}, tokens=30))
    shutil.rmtree(hf)
    names = frozenset(p.name for p in (clean / "packed").rglob("*") if p.is_file()) | {"tiers.yaml", "routing.json"}
    probe = Clean(clean, torch.empty(0), names)
    status, out = _run(probe, Kind(lambda case, rng: None), random.Random(0), TIMEOUT)
    if status != "done" or out["error"] or not out["cold_read"]:
        raise HarnessError(f"the clean pack must load, and read cold experts in its forward: {status} {out}")
    return Clean(clean, torch.tensor(out["logits"], dtype=torch.float32).to(torch.bfloat16), names)


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def _attempt(clean: Clean, case: CaseFiles, kind: Kind, rng: random.Random) -> dict:
    """In the child: load, forward (after-load kinds: mutate, forward again), watched; what happened."""
    out = {"error": None, "equal": None, "first_equal": None, "mutation": None}
    WATCH.start()
    try:
        model = tiers.load(case.pack, case.yaml, device="cpu", progress=False, verify="always" if kind.after_load else "first",
                           routing=case.routing if kind.routing else None)
        try:
            logits = _forward(model)
            if kind.after_load:
                out["first_equal"] = torch.equal(logits, clean.logits)
                with WATCH.pause():
                    try:
                        out["mutation"] = asdict(kind.apply(case, rng))
                    except Exception as e:
                        raise HarnessError(traceback.format_exc()) from e
                logits = _forward(model)
            out["equal"] = logits.shape == clean.logits.shape and torch.equal(logits, clean.logits)
            if not clean.logits.numel():  # the clean run itself: its logits, and whether the forward read the cold tier
                out["logits"] = logits.float().tolist()
                out["cold_read"] = tiers.stats(model).bytes_moved.get("nvme", 0) > 0
        finally:
            with contextlib.suppress(Exception):
                manager_of(model).close()
    except HarnessError:
        raise
    except BaseException as e:  # noqa: BLE001 (whatever the load or forward raised is the verdict's subject)
        out.update(error=type(e).__name__, message=str(e)[:2000], integrity=isinstance(e, tiers.IntegrityError),
                   value_error=isinstance(e, ValueError))
    finally:
        out["outside"] = WATCH.stop()
    return out


def _child(clean: Clean, case: CaseFiles, kind: Kind, rng: random.Random, w: int) -> None:
    """The forked child: limits, the attempt, its report on ``w``; it never returns."""
    code = 0
    try:
        torch.set_num_threads(1)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY, resource.getrlimit(resource.RLIMIT_AS)[1]))
        report = _attempt(clean, case, kind, rng)
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises it)
        code, report = 70, {"harness": traceback.format_exc()}
    try:
        data = json.dumps(report).encode()
        while data:
            data = data[os.write(w, data):]
    finally:
        os._exit(code)


def _run(clean: Clean, kind: Kind, rng: random.Random, timeout: float) -> tuple[str, dict]:
    """Run one attempt on ``clean.root`` (already mutated) in a forked child: ("done" | "hang" | "crash", its report)."""
    case = CaseFiles(clean.root)
    WATCH.allow(dirs=(case.pack, sys.prefix, sys.base_prefix, sys.exec_prefix, REPO, "/proc", "/sys"),
                files=(case.yaml, case.routing, "/dev/null", "/dev/urandom"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(clean, case, kind, rng, w)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([r], [], [], left)[0]:
                if not (data := os.read(r, 1 << 16)):
                    break
                chunks.append(data)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", {}
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return "crash", {"status": status}
    report = json.loads(b"".join(chunks))
    if "harness" in report:
        raise HarnessError(report["harness"])
    return "done", report


def run_case(clean: Clean, kind_name: str, seed: int, *, timeout: float = TIMEOUT, kinds: dict[str, Kind] = KINDS) -> Verdict:
    """One case: a fresh copy of the clean pack, one mutation of kind ``kind_name`` seeded by ``seed``, and the verdict."""
    kind = kinds[kind_name]
    rng = random.Random(f"{kind_name}/{seed}")
    with tempfile.TemporaryDirectory(prefix="case-", dir=clean.root.parent) as d:
        case = CaseFiles(Path(d))
        shutil.copytree(clean.root / "packed", case.pack, symlinks=True)
        for name in ("tiers.yaml", "routing.json"):
            shutil.copy(clean.root / name, case.root / name)
        case.outside.mkdir()
        mutation = None if kind.after_load else kind.apply(case, rng)
        t0 = time.perf_counter()
        status, out = _run(Clean(case.root, clean.logits, clean.names), kind, rng, timeout)
        seconds = time.perf_counter() - t0
    if out.get("mutation"):
        mutation = Mutation(**{k: tuple(v) if k == "keys" else v for k, v in out["mutation"].items()})
    mutation = mutation or Mutation("?", "after load (the child reported nothing)")
    error = f"{out['error']}: {out['message']}"[:600] if out.get("error") else ""
    return Verdict(kind_name, seed, judge(status, out, mutation, clean.names), mutation.file, mutation.detail[:300], error,
                   round(seconds, 3), tuple(out.get("outside", ())))


def names_problem(message: str, mutation: Mutation, names: frozenset[str]) -> bool:
    """Whether an error message names a file of the case (the pack's, the config, the routing file) or the key changed."""
    keys = {k for k in mutation.keys if isinstance(k, str) and len(k) >= 2}
    if any(token in message for token in names | {Path(mutation.file).name} | keys):
        return True
    return mutation.file == "tiers.yaml" and re.match(r"(config|tiers)\b", message) is not None


def judge(status: str, out: dict, mutation: Mutation, names: frozenset[str]) -> str:
    """The verdict (module docstring) on one child's report."""
    if out.get("outside"):
        return "outside read"
    if status != "done":
        return status
    if out["first_equal"] is False:
        return "silent wrong"
    if out["error"] is None:
        return "equal" if out["equal"] else "changed" if mutation.changes_model else "silent wrong"
    if (out["integrity"] or out["value_error"]) and names_problem(out["message"], mutation, names):
        return "caught"
    return "unhelpful"


def summarize(verdicts: list[Verdict]) -> dict:
    """Counts per outcome, and per kind and outcome."""
    kinds: dict[str, dict[str, int]] = {}
    for v in verdicts:
        row = kinds.setdefault(v.kind, {})
        row[v.outcome] = row.get(v.outcome, 0) + 1
    outcomes = {o: sum(v.outcome == o for v in verdicts) for o in GOOD + BAD}
    return {"cases": len(verdicts), "seconds": round(sum(v.seconds for v in verdicts), 1), "outcomes": outcomes,
            "kinds": dict(sorted(kinds.items()))}


def describe(v: Verdict) -> str:
    where = f" outside: {list(v.outside)}" if v.outside else ""
    return f"{v.outcome}: {v.kind} seed {v.seed}: {v.file}: {v.detail} -> {v.error or 'no error'}{where}"
