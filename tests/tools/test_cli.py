"""tools/pack.py and tools/inspect.py: the command-line front ends."""
from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_tiny
from disk_faults import WHERE, full_disk, read_only_fs
from tiers.loader.lock import hold
from tiers.loader.packed import read_manifest

REPO = Path(__file__).resolve().parents[2]
# tools.inspect shadows nothing when imported as a package module; as a script it must not
# be confused with the stdlib's inspect (tested through the subprocess below).
pack_cli = importlib.import_module("tiers.tools.pack")
inspect_cli = importlib.import_module("tiers.tools.inspect")

MODEL = "qwen3_moe"


# -- tiers-pack ------------------------------------------------------------------------------
def test_pack_main_packs_and_prints_summary(checkpoint_factory, tmp_path, capsys):
    dst = tmp_path / "packed"
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "packed 24 experts in 3 MoE layers" in out
    assert str(dst) in out
    assert "bf16:" in out and "int8:" in out and "dense:" in out
    m = read_manifest(dst)
    assert m.precisions == ("bf16", "int8")
    assert len(m.keys) == 24


def test_pack_main_existing_dst_without_overwrite(checkpoint_factory, tmp_path, capsys):
    dst = tmp_path / "packed"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep")
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "tiers-pack: error:" in err
    assert str(dst) in err and "exists" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert (dst / "mine.txt").read_text() == "keep"
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--quiet", "--overwrite", "--precisions", "bf16"])
    assert rc == 0
    assert not (dst / "mine.txt").exists()
    assert read_manifest(dst).precisions == ("bf16", "int8")  # --precisions adds to the defaults



def test_pack_main_into_its_own_source_is_refused(checkpoint_factory, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(checkpoint_factory(MODEL), src)
    before = sorted(p.name for p in src.iterdir())
    capsys.readouterr()  # the fixture's own output
    rc = pack_cli.main([str(src), str(src), "--quiet", "--overwrite"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tiers-pack: error: ")
    assert f"destination {str(src)!r} is the source {str(src)!r}" in err and "pack into a separate directory" in err
    assert sorted(p.name for p in src.iterdir()) == before and not (src / "manifest.json").exists()


# A pack killed outright once it has written one MoE layer: no finally runs, as under SIGKILL.
KILLED_PACK = """
import importlib, os, signal, sys
pack_module = importlib.import_module("tiers.loader.pack")
real = pack_module._write_experts
def killed(source, experts, *args):
    real(source, dict(list(experts.items())[:1]), *args)
    os.kill(os.getpid(), signal.SIGKILL)
pack_module._write_experts = killed
pack_module.pack(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL and PID probes are POSIX")
def test_pack_main_removes_what_a_killed_pack_left(checkpoint_factory, tmp_path, capsys):
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, "-c", KILLED_PACK, str(src), str(dst)], env=env, stderr=subprocess.PIPE, text=True) as proc:
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    # Its staging directory, and its lock file: the kernel dropped the lock with the process, the file stays.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".packed.lock", f".packed.tmp-{proc.pid}"]
    assert (tmp_path / ".packed.lock").read_text().split()[0] == str(proc.pid)
    left = tmp_path / f".packed.tmp-{proc.pid}"
    assert (left / "experts" / "int8" / "layer-0000.safetensors").is_file()
    nbytes = sum(p.stat().st_size for p in left.rglob("*") if p.is_file())
    capsys.readouterr()
    assert pack_cli.main([str(src), str(dst), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert (f"removed 1 staging directory that packs no longer running left beside the destination "
            f"({nbytes / 2**20:.1f} MiB): .packed.tmp-{proc.pid}") in out
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        ("tiers:\n  gpu: {fraction: 0.5}\n  cpu: {fraction: 0.25, precision: bf16}\n  nvme: {precision: bf16}\n", ("bf16",)),
        ("tiers:\n  cpu: {precision: int8}\n  nvme: {precision: bf16}\n", ("bf16", "int8")),
    ],
)
def test_pack_main_config_names_the_precisions(checkpoint_factory, tmp_path, capsys, yaml_text, expected):
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text(yaml_text)
    dst = tmp_path / "packed"
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--config", str(cfg), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert read_manifest(dst).precisions == expected
    assert sorted(p.name for p in (dst / "experts").iterdir()) == sorted(expected)


def test_pack_main_config_with_bnb8(checkpoint_factory, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  cpu: {precision: int8}\n  nvme: {precision: bnb8}\n")
    dst = tmp_path / "packed"
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--config", str(cfg), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    m = read_manifest(dst)
    assert m.precisions == ("bf16", "int8", "bnb8")
    assert all(m.layers[k.layer].experts[k.expert]["bnb8"].sqnr_db > 30 for k in m.keys)


def _one_error_line(err: str) -> str:
    """The message of a clean CLI error: exactly one line, no traceback."""
    assert err.count("\n") == 1 and err.startswith("tiers-pack: error: "), err
    return err[len("tiers-pack: error: "):].rstrip("\n")


def _bad_source(kind: str, good: Path, src: Path) -> str:
    """Make ``src`` a source checkpoint broken as ``kind`` says; the file its error must name."""
    if kind == "missing":
        return str(src)
    if kind == "a_file":
        src.write_text("not a checkpoint")
        return str(src)
    if kind == "empty_dir":
        src.mkdir()
        return str(src)
    shutil.copytree(good, src)
    if kind == "bad_config_json":
        (src / "config.json").write_text("{not json")
        return str(src / "config.json")
    if kind == "bad_shard":
        (src / "model.safetensors").write_bytes(b"garbage")
        return str(src / "model.safetensors")
    (src / "model.safetensors.index.json").write_text("{}")  # kind == "bad_index"
    return str(src / "model.safetensors.index.json")


@pytest.mark.parametrize("kind", ["missing", "a_file", "empty_dir", "bad_config_json", "bad_shard", "bad_index"])
def test_pack_main_bad_source_is_one_line_and_leaves_nothing(checkpoint_factory, tmp_path, capsys, kind):
    src, out = tmp_path / "hf", tmp_path / "out"
    out.mkdir()
    names = _bad_source(kind, checkpoint_factory(MODEL), src)
    capsys.readouterr()
    assert pack_cli.main([str(src), str(out / "packed"), "--quiet"]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and names in _one_error_line(err)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    "config, names",
    [
        (None, ["does not exist"]),  # a --config naming no file
        ("tiers:\n  gpu: {fraction: 0.5, colour: red}\n", ["tiers.gpu.colour: unknown key"]),
        ("tiers:\n  wrong: {}\n", ["tiers.wrong: unknown key"]),
        ("tiers: [\n", ["is not valid YAML"]),
        ("tiers:\n  cpu: {precision: fp4}\n", ["fp4"]),
        ("tiers:\n  gpu: {fraction: 1.5}\n", ["tiers.gpu.fraction: must be in [0, 1], got 1.5"]),
        ("- 1\n", ["expected a mapping with keys ['tiers']"]),
    ],
    ids=["missing", "unknown_key", "unknown_tier", "bad_yaml", "unknown_precision", "bad_fraction", "not_a_mapping"],
)
def test_pack_main_bad_config_is_one_line(config, names, checkpoint_factory, tmp_path, capsys):
    src = checkpoint_factory(MODEL)
    cfg = tmp_path / "tiers.yaml"
    if config is not None:
        cfg.write_text(config)
    capsys.readouterr()
    rc = pack_cli.main([str(src), str(tmp_path / "out"), "--config", str(cfg), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    msg = _one_error_line(err)
    assert str(cfg) in msg and all(n in msg for n in names), msg
    assert sorted(p.name for p in tmp_path.iterdir()) == (["tiers.yaml"] if config is not None else [])


def test_pack_main_missing_routing_file_is_one_line(checkpoint_factory, tmp_path, capsys):
    capsys.readouterr()
    missing = tmp_path / "routing.json"
    assert pack_cli.main([str(checkpoint_factory(MODEL)), str(tmp_path / "out"), "--routing", str(missing), "--quiet"]) == 2
    assert str(missing) in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_pack_main_read_only_parent_is_one_line(checkpoint_factory, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        capsys.readouterr()
        assert pack_cli.main([str(checkpoint_factory(MODEL)), str(parent / "packed"), "--quiet"]) == 2
        msg = _one_error_line(capsys.readouterr().err)
    finally:
        parent.chmod(0o755)
    assert "Permission denied" in msg and str(parent) in msg
    assert list(parent.iterdir()) == []


def test_pack_main_os_errors_are_one_line(checkpoint_factory, tmp_path, capsys, monkeypatch):
    """Simulated (root ignores permissions, and no test should fill a disk): a read-only
    directory refusing the staging directory, then a full disk while writing dense weights."""
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.parent == tmp_path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(Path, "mkdir", read_only)
        assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    msg = _one_error_line(capsys.readouterr().err)
    assert msg == f"[Errno {errno.EACCES}] Permission denied: '{tmp_path / f'.packed.tmp-{os.getpid()}'}'"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(importlib.import_module("tiers.loader.pack"), "_write_dense", full)
    assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    msg = _one_error_line(capsys.readouterr().err)
    assert msg == f"[Errno {errno.ENOSPC}] No space left on device (packing {src} into {dst})"
    assert list(tmp_path.iterdir()) == []


def test_pack_main_locked_destination_is_one_line(checkpoint_factory, tmp_path, capsys):
    """Another pack holds the destination (here: a holder in this process, on its own descriptor)."""
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    capsys.readouterr()
    with hold(dst):
        assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and _one_error_line(err) == (
        f"destination {str(dst)!r} is being packed by another pack (pid {os.getpid()}), which holds .packed.lock "
        f"beside it; wait for that pack to end, or pack into another directory")
    assert list(tmp_path.iterdir()) == []


def test_pack_main_destination_appearing_mid_pack_is_one_line_and_untouched(checkpoint_factory, tmp_path, capsys, monkeypatch):
    """Without --overwrite, a destination made by someone else while the pack writes its experts
    fails the pack at the final swap: one line, and what appeared is left as it was."""
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    pack_module = importlib.import_module("tiers.loader.pack")
    real = pack_module._write_experts

    def appearing(*args):
        dst.mkdir()
        (dst / "theirs.txt").write_text("theirs")
        return real(*args)

    monkeypatch.setattr(pack_module, "_write_experts", appearing)
    capsys.readouterr()
    assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and _one_error_line(err) == (
        f"destination {str(dst)!r} appeared while this pack ran (something else created it); it is left untouched "
        f"and this pack's output removed: pack again (with --overwrite to replace it), or into another directory")
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]
    assert [(p.name, p.read_text()) for p in dst.iterdir()] == [("theirs.txt", "theirs")]


def test_pack_main_read_only_directory_with_a_stale_lock_reports_its_own_error(checkpoint_factory, tmp_path, capsys,
                                                                               monkeypatch):
    """A directory that refuses new entries and removals (simulated: root ignores permissions) and
    holds a killed pack's lock file, which still opens: the one line is the pack's own error (its
    staging directory refused), not the lock file's removal; the stale file stays, blocking nothing."""
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    (tmp_path / ".packed.lock").write_text("4194305 elsewhere\n")  # a dead pack's: no pid is above 2**22

    def refusing(real):
        def refuse(path, *args, **kwargs):
            if Path(os.fsdecode(path)).parent == tmp_path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real(path, *args, **kwargs)
        return refuse

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", refusing(os.mkdir))
        m.setattr(os, "unlink", refusing(os.unlink))
        assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        f"[Errno {errno.EACCES}] {os.strerror(errno.EACCES)}: '{tmp_path / f'.packed.tmp-{os.getpid()}'}'")
    assert [p.name for p in tmp_path.iterdir()] == [".packed.lock"]
    assert pack_cli.main([str(src), str(dst), "--quiet"]) == 0  # writable again: it packs, and removes the file
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
def test_pack_main_full_disk_is_one_line_and_leaves_nothing(checkpoint_factory, tmp_path, capsys, monkeypatch, code, where):
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    fired = full_disk(monkeypatch, code, where)
    capsys.readouterr()
    assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    assert fired, "the fault did not strike"
    assert _one_error_line(capsys.readouterr().err) == f"[Errno {code}] {os.strerror(code)} (packing {src} into {dst})"
    assert list(tmp_path.iterdir()) == []


def test_pack_main_read_only_filesystem_is_one_line_and_leaves_nothing(checkpoint_factory, tmp_path, capsys, monkeypatch):
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    capsys.readouterr()
    with monkeypatch.context() as m:
        fired = read_only_fs(m, tmp_path)
        assert pack_cli.main([str(src), str(dst), "--quiet"]) == 2
    assert fired
    msg = _one_error_line(capsys.readouterr().err)
    assert msg == f"[Errno {errno.EROFS}] {os.strerror(errno.EROFS)}: '{tmp_path / '.packed.lock'}'"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, says", [
    (["--device", "nonsense"], "device 'nonsense' cannot quantize experts (Expected one of cpu, cuda"),
    (["--precisions", "fp4"], "fp4"),
], ids=["device", "precision"])
def test_pack_main_bad_arguments_are_one_line_and_leave_nothing(checkpoint_factory, tmp_path, capsys, args, says):
    capsys.readouterr()
    assert pack_cli.main([str(checkpoint_factory(MODEL)), str(tmp_path / "packed"), "--quiet", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and says in _one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_pack_main_unservable_family_is_one_line(tmp_path, capsys, monkeypatch):
    """A family ``unservable`` refuses (none today: a stand-in reason on a served one) is one line."""

    src = save_tiny("qwen3_moe", tmp_path / "hf")
    monkeypatch.setattr(importlib.import_module("tiers.loader.pack"), "unservable", lambda module: "its experts have no act_fn")
    capsys.readouterr()
    assert pack_cli.main([str(src), str(tmp_path / "packed"), "--quiet"]) == 2
    msg = _one_error_line(capsys.readouterr().err)
    assert msg == "qwen3_moe (Qwen3MoeExperts): its experts have no act_fn; Tiers cannot serve this family yet"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_pack_main_routing_prior_at_pack_time_then_set_and_cleared(checkpoint_factory, tmp_path, capsys):
    """--routing embeds a routing file when packing; --set-routing and --clear-routing change an
    existing pack's prior; tiers-inspect shows it; a bad file is refused naming it."""
    src = checkpoint_factory(MODEL)
    doc = {"format": "tiers-routing", "version": 1, "tokens": 5, "counts": {"1": [0, 0, 7, 0, 0, 0, 0, 3]}}
    good, bad = tmp_path / "routing.json", tmp_path / "bad.json"
    good.write_text(json.dumps(doc))
    bad.write_text(json.dumps(doc | {"counts": {"7": [1] * 8}}))
    dst = tmp_path / "packed"
    assert pack_cli.main([str(src), str(dst), "--quiet", "--routing", str(good)]) == 0
    assert "routing prior: embedded" in capsys.readouterr().out
    assert read_manifest(dst).routing_prior == {1: [0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0, 3.0]}
    assert inspect_cli.main([str(dst)]) == 0
    assert "routing prior: 10 lookups over MoE layers [1]" in capsys.readouterr().out

    assert pack_cli.main([str(dst), "--clear-routing"]) == 0
    assert f"{dst}: routing prior removed" in capsys.readouterr().out
    assert read_manifest(dst).routing_prior is None
    assert pack_cli.main([str(dst), "--set-routing", str(good)]) == 0
    assert "routing prior embedded, counting 1 MoE layers" in capsys.readouterr().out
    assert read_manifest(dst).routing_prior[1][2] == 7.0

    before = (dst / "manifest.json").read_bytes()
    assert pack_cli.main([str(dst), "--set-routing", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "tiers-pack: error:" in err and str(bad) in err and "layer 7 is not a MoE layer" in err
    assert (dst / "manifest.json").read_bytes() == before
    assert pack_cli.main([str(src), str(tmp_path / "other"), "--quiet", "--routing", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err and not (tmp_path / "other").exists()
    with pytest.raises(SystemExit):  # an argument error: nothing to pack in this mode
        pack_cli.main([str(src), str(dst), "--set-routing", str(good)])
    assert "take one packed checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pack_cli.main([str(src)])
    assert "required: dst" in capsys.readouterr().err


# -- tiers-inspect ---------------------------------------------------------------------------
def _layer_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]


def test_inspect_main_prints_layer_rows(packed_factory, capsys):
    packed = packed_factory(MODEL, ("bf16", "int8"))
    rc = inspect_cli.main([str(packed)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{packed}: {MODEL}, 24 experts in 3 MoE layers")
    assert lines[1].startswith("routing prior: none")
    assert "bf16 KiB" in lines[2] and "int8 dB" in lines[2]
    rows = _layer_rows(out)
    assert [r[0] for r in rows] == ["0", "1", "2"]
    m = read_manifest(packed)
    for r in rows:
        L = int(r[0])
        assert r[1] == "8"
        assert r[2] == f"{m.layers[L].blobs['bf16'].nbytes / 1024:.1f}"
        assert r[3] == "exact"  # bf16 is lossless
        assert r[4] == f"{m.layers[L].blobs['int8'].nbytes / 1024:.1f}"
        assert 30 < float(r[5]) < 60
        assert r[5] == f"{min(e['int8'].sqnr_db for e in m.layers[L].experts):.1f}"


def test_inspect_main_json_parses(packed_factory, capsys):
    packed = packed_factory(MODEL, ("bf16", "int8"))
    rc = inspect_cli.main([str(packed), "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    info = json.loads(out)
    assert info["model_type"] == MODEL
    assert info["precisions"] == ["bf16", "int8"]
    assert info["experts"] == 24
    assert [r["layer"] for r in info["layers"]] == [0, 1, 2]
    for r in info["layers"]:
        assert r["experts"] == 8
        assert set(r["tensors"]) == {"gate_up_proj", "down_proj"}
        assert r["min_sqnr_db"]["bf16"] is None and r["min_sqnr_db"]["int8"] > 30
    m = read_manifest(packed)
    assert info["dense_bytes"] == sum(f["nbytes"] for f in m.dense_files.values()) > 0
    assert info["routing_prior"] is None


@pytest.mark.parametrize("kind", ["empty_dir", "hf_checkpoint", "missing"])
def test_inspect_main_non_packed_dir(kind, tmp_path, capsys, checkpoint_factory):
    target = {"empty_dir": tmp_path, "hf_checkpoint": checkpoint_factory(MODEL), "missing": tmp_path / "nope"}[kind]
    rc = inspect_cli.main([str(target)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "tiers-inspect: error:" in err and str(target) in err
    assert "Traceback" not in err and out == ""


def test_inspect_script_runs_as_subprocess(packed_factory):
    packed = packed_factory(MODEL, ("bf16", "int8"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "tools/inspect.py", str(packed)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{MODEL}, 24 experts in 3 MoE layers" in proc.stdout
    assert [r[0] for r in _layer_rows(proc.stdout)] == ["0", "1", "2"]
