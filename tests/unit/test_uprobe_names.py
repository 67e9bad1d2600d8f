"""bcc's uprobe event names, shortened for tracefs (ingero_agent/uprobe_names.py)."""

from __future__ import annotations

import re

from ingero_agent.uprobe_names import MAX_EVENT_NAME, ShortNames, install

LONG = b"/proc/4194303/root/usr/local/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"


def test_names_fit_tracefs_and_are_tracefs_identifiers_for_container_paths():
    names = ShortNames(tracer_pid=4194303)
    for prefix, pid in ((b"p", -1), (b"r", -1), (b"p", 4194303)):
        n = names(prefix, LONG, 0xFFFFFFFFFFFF, pid)
        assert len(n + b"_bcc_4194303") <= MAX_EVENT_NAME, n     # bcc appends _bcc_<pid>
        assert re.fullmatch(rb"[A-Za-z_][A-Za-z0-9_]*", n), n


def test_attach_and_detach_agree_and_distinct_probes_get_distinct_names():
    names = ShortNames(tracer_pid=77)
    a = names(b"p", LONG, 0x10, -1)
    assert names(b"p", LONG, 0x10, -1) == a                       # detach finds the attach's name
    others = {names(b"r", LONG, 0x10, -1), names(b"p", LONG, 0x20, -1),
              names(b"p", LONG + b".other", 0x10, -1), names(b"p", LONG, 0x10, 5)}
    assert a not in others and len(others) == 4
    # Two tracers on one node name the same probe differently (tracefs names are global).
    assert ShortNames(tracer_pid=78)(b"p", LONG, 0x10, -1) != a


def test_install_replaces_bccs_namer_on_that_object_only():
    class FakeBPF:
        def _get_uprobe_evname(self, prefix, path, addr, pid):
            return b"%s_%s_0x%x" % (prefix, path, addr)

    b, other = FakeBPF(), FakeBPF()
    names = install(b)
    assert b._get_uprobe_evname(b"p", LONG, 1, -1) == names(b"p", LONG, 1, -1)
    assert other._get_uprobe_evname(b"p", b"x", 1, -1) == b"p_x_0x1"


def test_remove_stale_asks_tracefs_to_remove_only_this_pids_events(tmp_path):
    (tmp_path / "uprobe_events").write_text(
        "p:uprobes/p_ingero_42_0_0x10 /lib/x.so:0x0000000000000010\n"
        "r:uprobes/r_ingero_42_0_0x10 /lib/x.so:0x0000000000000010\n"
        "p:uprobes/p_ingero_420_0_0x10 /lib/x.so:0x0000000000000010\n"
        "p:uprobes/p_other_42_0_0x10 /lib/x.so:0x0000000000000010\n")
    from ingero_agent.uprobe_names import remove_stale
    assert remove_stale(42, tmp_path) == ["uprobes/p_ingero_42_0_0x10", "uprobes/r_ingero_42_0_0x10"]
    # A plain file keeps what was written: the removal commands tracefs would execute.
    assert (tmp_path / "uprobe_events").read_text().splitlines()[-2:] == [
        "-:uprobes/p_ingero_42_0_0x10", "-:uprobes/r_ingero_42_0_0x10"]
    assert remove_stale(42, tmp_path / "missing") == []


def test_remove_left_retries_an_event_tracefs_refused_while_it_was_busy(tmp_path, monkeypatch):
    # tracefs as a model: a removal command deletes the line, except that the first one for
    # each event fails with EBUSY (its perf event closed but not yet released)
    import errno

    from ingero_agent import uprobe_names
    events = tmp_path / "uprobe_events"
    events.write_text("p:uprobes/p_ingero_42_0_0x10 /lib/x.so:0x10\n"
                      "r:uprobes/r_ingero_42_0_0x10_42 /lib/x.so:0x10\n"
                      "p:uprobes/p_ingero_42_1_0x20 /lib/y.so:0x20\n")
    refused = set()

    def write(path, command):
        name = command.strip()[2:]
        if name not in refused:
            refused.add(name)
            raise OSError(errno.EBUSY, "busy")
        path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines()
                                if ln.split()[0].partition(":")[2] != name))

    monkeypatch.setattr(uprobe_names, "write_events", write)
    left = uprobe_names.remove_left([b"p_ingero_42_0_0x10", b"r_ingero_42_0_0x10_42"], pause_s=0,
                                    tracefs=tmp_path)
    assert left == 0 and refused == {"uprobes/p_ingero_42_0_0x10", "uprobes/r_ingero_42_0_0x10_42"}
    assert events.read_text() == "p:uprobes/p_ingero_42_1_0x20 /lib/y.so:0x20\n"   # not ours: kept
    # never released: given up after the tries, and said how many are left
    refused.clear()
    monkeypatch.setattr(uprobe_names, "write_events", lambda p, c: (_ for _ in ()).throw(OSError(errno.EBUSY, "")))
    assert uprobe_names.remove_left([b"p_ingero_42_1_0x20"], tries=3, pause_s=0, tracefs=tmp_path) == 1
    assert uprobe_names.remove_left([b"x"], tracefs=tmp_path / "missing") == 0
