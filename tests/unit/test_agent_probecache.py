"""The compiled-probe cache's own rules: map references found and rewritten, entries kept
only where nobody else can write them. (Loading cached programs: tests/bpf/test_probe_cache.py.)"""

import os
import struct

import pytest

from ingero_agent import probecache


def insn(op, regs=0, off=0, imm=0):
    return struct.pack("<BBhi", op, regs, off, imm)


# r1 = map fd 7 (two slots); r2 = 64-bit constant whose low half looks like fd 7; call; exit
CODE = (insn(0x18, 0x10 | 1, 0, 7) + insn(0) + insn(0x18, 2, 0, 7) + insn(0, 0, 0, 7)
        + insn(0x85, 0, 0, 1) + insn(0x95))


def test_map_fd_loads_are_found_and_plain_constants_are_not():
    assert probecache.map_refs(CODE, {7: "target_tgids"}) == [(0, "target_tgids")]


def test_an_fd_of_no_known_map_or_a_map_value_reference_makes_code_uncacheable():
    assert probecache.map_refs(CODE, {8: "other"}) is None
    assert probecache.map_refs(insn(0x18, 0x20 | 1, 0, 7) + insn(0), {7: "m"}) is None


def test_map_references_are_rewritten_with_the_new_fds_and_nothing_else():
    out = probecache.with_fds(CODE, [(0, "target_tgids")], {"target_tgids": 42}.__getitem__)
    assert probecache.map_refs(out, {42: "target_tgids"}) == [(0, "target_tgids")]
    assert out[8:] == CODE[8:] and out[:4] == CODE[:4]


def test_an_entry_is_read_back_under_its_key_and_the_oldest_beyond_the_cap_go(tmp_path, monkeypatch):
    where = tmp_path / "cache"
    monkeypatch.setattr(probecache, "KEEP", 2)
    for i, k in enumerate("abc"):
        probecache.write(where, k, {"programs": {}, "n": i})
        os.utime(where / f"{k}.json", (i, i))
    probecache.write(where, "d", {"programs": {}, "n": 3})
    assert sorted(p.stem for p in where.glob("*.json")) == ["c", "d"]
    assert probecache.read(where, "d")["n"] == 3
    assert oct(where.stat().st_mode & 0o777) == "0o700"
    assert oct((where / "d.json").stat().st_mode & 0o777) == "0o600"
    assert probecache.read(where, "a") is None


def test_an_entry_others_could_have_written_is_not_used(tmp_path):
    where = tmp_path / "cache"
    probecache.write(where, "k", {"programs": {}})
    (where / "k.json").chmod(0o620)
    assert probecache.read(where, "k") is None
    (where / "k.json").chmod(0o600)
    where.chmod(0o777)
    assert probecache.read(where, "k") is None
    with pytest.raises(OSError, match="not this user's alone"):
        probecache.write(where, "k2", {"programs": {}})


def test_a_symlinked_or_mislabelled_entry_is_not_used(tmp_path):
    where = tmp_path / "cache"
    probecache.write(where, "k", {"programs": {}})
    (where / "k.json").rename(where / "real.json")
    (where / "k.json").symlink_to(where / "real.json")
    assert probecache.read(where, "k") is None
    (where / "k.json").unlink()
    (where / "real.json").rename(where / "other.json")
    (where / "other.json").rename(where / "k2.json")   # an entry stored as "other" under k2's name
    assert probecache.read(where, "k2") is None


def test_the_key_changes_with_the_text_the_flags_and_bcc(monkeypatch):
    k = probecache.key("int x;", ["-DA=1"], "0.26.0")
    assert k == probecache.key("int x;", ["-DA=1"], "0.26.0")
    assert len({k, probecache.key("int y;", ["-DA=1"], "0.26.0"),
                probecache.key("int x;", ["-DA=2"], "0.26.0"),
                probecache.key("int x;", ["-DA=1"], "0.27.0")}) == 4


def test_off_turns_the_cache_off_and_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(probecache.ENV, "off")
    assert probecache.folder() is None
    monkeypatch.setenv(probecache.ENV, str(tmp_path))
    assert probecache.folder() == tmp_path
    monkeypatch.delenv(probecache.ENV)
    assert probecache.folder() == probecache.DEFAULT_DIR


def test_a_second_compile_of_one_entry_waits_for_the_first_at_most_the_lock_wait(tmp_path, monkeypatch):
    import time
    monkeypatch.setattr(probecache, "LOCK_WAIT_S", 1.0)
    with probecache.compiling(tmp_path / "cache", "k"):
        t0 = time.monotonic()
        with probecache.compiling(tmp_path / "cache", "k"):
            waited = time.monotonic() - t0
        with probecache.compiling(tmp_path / "cache", "other"):
            assert time.monotonic() - t0 - waited < 0.9     # another entry: no wait
    assert waited >= 1.0
    t0 = time.monotonic()
    with probecache.compiling(tmp_path / "cache", "k"):      # released: no wait
        assert time.monotonic() - t0 < 0.9


def test_the_agents_tracers_use_the_nodes_cache_or_one_in_the_data_folder(tmp_path, monkeypatch):
    from ingero_agent.api import SessionManager

    monkeypatch.delenv(probecache.ENV, raising=False)
    mgr = SessionManager(tmp_path / "data", "n1", trace_cmd=["true"])
    try:
        monkeypatch.setattr(probecache, "DEFAULT_DIR", tmp_path / "node-cache")
        assert mgr._env()[probecache.ENV] == str(tmp_path / "node-cache")
        (tmp_path / "ro").write_text("")     # a folder that cannot be made (read-only root)
        monkeypatch.setattr(probecache, "DEFAULT_DIR", tmp_path / "ro" / "cache")
        assert mgr._env()[probecache.ENV] == str(mgr.data / "bpf-cache")
        monkeypatch.setenv(probecache.ENV, "off")
        assert mgr._env()[probecache.ENV] == "off"
    finally:
        mgr.shutdown()
