"""ingero_agent.stackscan on a real process: which NCCL API call each thread is inside.

A small library defines ncclAllReduce and ncclSend, each blocking in poll(2) through an
internal function; a program calls ncclAllReduce once (it returns at once), then blocks one
thread inside ncclSend while its main thread waits in pause(2), outside NCCL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ingero_agent.elfsyms import NCCL_SYMBOLS, defined_symbols
from ingero_agent.inflight import thread_state
from ingero_agent.decode import op_name
from ingero_agent.stackscan import StackScanner, _is_call_before, scan_supported, user_sp_pc
from ingero.schema import NCCL_OPS

LIB = r"""
#include <poll.h>
__attribute__((noinline)) static int wait_readable(int fd) {
  struct pollfd p = {fd, POLLIN, 0};
  return poll(&p, 1, -1);
}
int ncclAllReduce(int fd) { return wait_readable(fd) + 1; }
int ncclSend(int fd) { return wait_readable(fd) + 2; }
"""
PROG = r"""
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
int ncclAllReduce(int fd);
int ncclSend(int fd);
static int never[2];
static void *sender(void *a) {
  (void)a;
  printf("%ld\n", (long)syscall(SYS_gettid));
  fflush(stdout);
  ncclSend(never[0]);
  return 0;
}
int main(void) {
  int ready[2];
  if (pipe(never) || pipe(ready) || write(ready[1], "x", 1) != 1) return 1;
  ncclAllReduce(ready[0]);              /* returns at once: its frames are gone */
  pthread_t t;
  pthread_create(&t, 0, sender, 0);
  for (;;) pause();                     /* outside NCCL */
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the fixture library")
    if not scan_supported():
        pytest.skip("the stack scan reads x86-64 call instructions")
    d = tmp_path_factory.mktemp("stackscan")
    (d / "lib.c").write_text(LIB)
    (d / "prog.c").write_text(PROG)
    lib = d / "libnccl.so.2"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-o", str(lib), str(d / "lib.c")], check=True)
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(d / "prog"), str(d / "prog.c"),
                    f"-L{d}", "-l:libnccl.so.2", "-Wl,-rpath,$ORIGIN"], check=True)
    return d / "prog", lib


@pytest.fixture
def blocked(built):
    prog, lib = built
    proc = subprocess.Popen([str(prog)], stdout=subprocess.PIPE, text=True)
    try:
        sender = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while user_sp_pc(Path("/proc"), proc.pid, sender) is None or \
                user_sp_pc(Path("/proc"), proc.pid, proc.pid) is None:   # both blocked
            assert time.monotonic() < deadline, "the fixture's threads never blocked"
            time.sleep(0.01)
        yield proc, sender, lib
    finally:
        proc.kill()
        proc.wait()


def _scan(proc, lib):
    st = os.stat(lib)
    tids = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
    return StackScanner().calls(proc.pid, tids, lib, (st.st_dev, st.st_ino), defined_symbols(lib))


def test_a_thread_blocked_inside_an_nccl_call_is_found_and_one_outside_is_not(blocked):
    proc, sender, lib = blocked
    assert _scan(proc, lib) == {sender: "ncclSend"}


def test_a_stopped_process_still_shows_the_call_its_thread_is_inside(blocked):
    proc, sender, lib = blocked
    proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while thread_state(Path("/proc"), proc.pid, sender) not in ("T", "t"):
            assert time.monotonic() < deadline, "the fixture never stopped"
            time.sleep(0.01)
        assert _scan(proc, lib) == {sender: "ncclSend"}
    finally:
        proc.send_signal(signal.SIGCONT)


def test_a_library_that_is_not_mapped_finds_nothing(blocked, tmp_path):
    proc, _, lib = blocked
    other = tmp_path / "copy.so"
    shutil.copy(lib, other)      # the same bytes, another file: not what the process maps
    assert _scan(proc, other) == {}


def test_every_nccl_api_function_has_its_op():
    assert {op_name(f) for f in NCCL_SYMBOLS} <= set(NCCL_OPS.values())
    assert (op_name("ncclAllReduce"), op_name("ncclBcast"), op_name("ncclAlltoAll")) == \
        ("ALL_REDUCE", "BROADCAST", "ALL_TO_ALL")


@pytest.mark.parametrize("code,is_call", [
    (b"\x90\x90\xe8\x01\x02\x03\x04", True),        # call rel32
    (b"\x90\x90\x90\x90\x90\xff\xd0", True),        # call *%rax
    (b"\x90\x90\x90\x90\x41\xff\xd3", True),        # call *%r11
    (b"\x90\x90\x90\x90\xff\x50\x08", True),        # call *0x8(%rax)
    (b"\x90\xff\x15\x01\x02\x03\x04", True),        # call *0x4030201(%rip)
    (b"\x90\x90\x90\x90\x90\xff\xe0", False),       # jmp *%rax
    (b"\x90\x90\x90\x48\x83\xc4\x08", False),       # add $0x8,%rsp
])
def test_only_call_instructions_count_before_a_return_address(code, is_call):
    assert _is_call_before(code) is is_call
