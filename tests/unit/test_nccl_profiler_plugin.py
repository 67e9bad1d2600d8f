"""The profiler plugin's inner parts (agent/nccl_profiler/ingero_profiler.c), no root needed.

Clock: a small C driver includes the plugin's source and feeds its clock fit
(host, device) pairs as NCCL's proxy thread would hand them over: the host
time comes after the GPU time by a latency that is never negative and mostly
tens of microseconds, now and then a fraction of one. The device clock has a
known offset and rate (drift); every conversion is checked against the truth.

Slots and settings: another driver starts operations through the v5 entry
points until the preallocated slots run out.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = r"""
#include "ingero_profiler.c"
int main(int argc, char **argv)
{
    struct clock_fit c;
    memset(&c, 0, sizeof(c));
    atomic_flag_clear(&c.busy);
    c.window_ns = atoll(argv[1]);
    char op;
    unsigned long long a, b;
    while (scanf(" %c %llu", &op, &a) == 2) {
        if (op == 'p' && scanf("%llu", &b) == 1)
            clock_pair(&c, a, b);
        else if (op == 'q')
            printf("%llu\n", (unsigned long long)clock_host(&c, a));
        else if (op == 's')
            printf("%.9f\n", atomic_load(&c.b));
    }
    return 0;
}
"""
SLOTS_DRIVER = r"""
#include "ingero_profiler.c"
static void *start(void *ctx, uint64_t type, void *parent)
{
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = type;
    d.parentObj = parent;
    d.coll.func = "AllReduce";
    d.coll.nChannels = 1;
    d.kernelCh.pTimer = 0;
    void *h = NULL;
    start_event_v5(ctx, &h, &d);
    return h;
}
int main(int argc, char **argv)
{
    void *ctx, *h[64];
    int mask, n = atoi(argv[1]), got = 0;
    ncclResult_t r = init_v5(&ctx, 7, &mask, "c", 1, 2, 0, NULL);
    if (r != ncclSuccess) {
        printf("init %d\n", (int)r);
        return 0;
    }
    for (int i = 0; i < n; i++)
        got += (h[i] = start(ctx, ncclProfileColl, NULL)) != NULL;
    struct ctx *c = ctx;
    printf("started %d dropped %llu\n", got, (unsigned long long)c->dropped);
    /* op 0 finishes (host stop, its one channel starts and stops): its slot is free again */
    stop_event(h[0]);
    void *k = start(ctx, ncclProfileKernelCh, h[0]);
    stop_event(k);
    void *again = start(ctx, ncclProfileColl, NULL);
    int clash = 0;
    for (int i = 1; i < got; i++)
        clash |= again == h[i];
    printf("again %d clash %d\n", again != NULL, clash);
    finalize(ctx);
    return 0;
}
"""
G0 = 1_750_000_000_000_000_000     # a globaltimer reading (Unix-epoch-like ns)
H0 = 5_000_000_000                  # host CLOCK_MONOTONIC at the start
WINDOW_NS = 500_000_000


def build(d: Path, name: str, text: str) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot compile the plugin's drivers")
    (d / f"{name}.c").write_text(text)
    proc = subprocess.run(["gcc", "-O2", "-Wall", f"-I{ROOT / 'bpf'}", f"-I{ROOT / 'agent' / 'nccl_profiler'}", f"-I{ROOT / 'ingero' / 'csrc'}",
                           "-o", str(d / name), str(d / f"{name}.c"), "-lm"], capture_output=True, text=True)
    if proc.returncode and "sys/sdt.h" in proc.stderr:
        pytest.skip("sys/sdt.h is missing: apt-get install systemtap-sdt-dev")
    assert proc.returncode == 0, proc.stderr
    return d / name


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("clock"), "driver", DRIVER)


@pytest.fixture(scope="module")
def slots_driver(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("slots"), "slots", SLOTS_DRIVER)


class Device:
    """GPU clock: g = G0 + (h - H0) * (1 + drift) + jump (after `jump_at`)."""

    def __init__(self, drift: float = 0.0, jump_ns: int = 0, jump_at: int = 1 << 62):
        self.drift, self.jump_ns, self.jump_at = drift, jump_ns, jump_at

    def g(self, h: int) -> int:
        return G0 + round((h - H0) * (1 + self.drift)) + (self.jump_ns if h >= self.jump_at else 0)


def run(driver: Path, dev: Device, seconds: float = 3.0, starved: tuple[float, float] | None = None,
        seed: int = 1) -> list[tuple[int, int]]:
    """A pair every millisecond; after each, the device time of an op that ran 300 us
    earlier is converted. Returns (host truth, converted) per query."""
    rnd = random.Random(seed)
    lines, truth = [], []
    for i in range(int(seconds * 1000)):
        h = H0 + i * 1_000_000
        lat = 100 + rnd.randrange(300) if i % 10 == 0 else rnd.randrange(5_000, 60_000)
        if starved and starved[0] <= (h - H0) / 1e9 < starved[1]:
            lat = rnd.randrange(2_000_000, 4_000_000)     # the proxy thread got no CPU
        lines.append(f"p {h} {dev.g(h - lat)}")
        past = h - 300_000
        lines.append(f"q {dev.g(past)}")
        truth.append(past)
    out = subprocess.run([str(driver), str(WINDOW_NS)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True).stdout.split()
    return list(zip(truth, map(int, out)))


def errors(res, after_s: float = 0.0) -> list[int]:
    return [abs(got - want) for want, got in res if (want - H0) / 1e9 >= after_s]


def test_a_constant_offset_is_recovered_to_the_best_latency(driver):
    err = errors(run(driver, Device()))
    assert max(err) <= 1_000      # the best latencies are 100-400 ns; the rest is the drift estimate's noise


def test_drift_is_fitted_so_conversions_stay_within_microseconds(driver):
    dev = Device(drift=200e-6)    # 200 ppm: 0.2 ms per second apart
    err = errors(run(driver, dev, seconds=6), after_s=1.0)
    assert max(err) <= 2_000
    out = subprocess.run([str(driver), str(WINDOW_NS)], text=True, capture_output=True, check=True,
                         input="".join(f"p {H0 + i * 10**6} {dev.g(H0 + i * 10**6)}\n" for i in range(3000))
                         + "s 0\n").stdout
    # host = g + a + b (g - g_ref): b = 1 / (1 + drift) - 1
    assert float(out) == pytest.approx(1 / (1 + 200e-6) - 1, rel=1e-3)


def test_the_first_buckets_are_short_so_a_new_communicator_converts_well_from_the_start(driver):
    # a slow GPU clock: each window's lowest (host - GPU) pair is its oldest, and a fit
    # without drift would be off by 200 ppm x 0.5 s = 100 us by the end of the first window
    # until the first two buckets (1/16 and 1/8 of a window) are closed there is no drift term
    err = errors(run(driver, Device(drift=-200e-6), seconds=2))
    assert max(err) <= 200e-6 * WINDOW_NS * 3 / 16 + 1_000
    assert max(errors(run(driver, Device(drift=-200e-6), seconds=2), after_s=0.2)) <= 2_000


def test_a_window_where_the_proxy_starves_does_not_tilt_the_fit(driver):
    err = errors(run(driver, Device(drift=50e-6), seconds=6, starved=(2.0, 2.6)), after_s=2.7)
    assert max(err) <= 2_000


def test_a_jump_of_the_gpu_clock_is_forgotten_within_two_windows(driver):
    jump_at = H0 + 3 * 10**9
    res = run(driver, Device(jump_ns=-3_000_000, jump_at=jump_at), seconds=6)
    assert max(errors(res, after_s=3.0 + 2 * WINDOW_NS / 1e9 + 0.01)) <= 2_000


def test_nothing_is_converted_before_the_first_pair(driver):
    out = subprocess.run([str(driver), str(WINDOW_NS)], input=f"q {G0}\n", capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["0"]


def slots(driver: Path, n: int, value: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(driver), str(n)], capture_output=True, text=True, check=True,
                          env={"INGERO_PROFILER_SLOTS": value})


def test_operations_beyond_the_slots_are_dropped_and_counted_never_taking_an_open_ones_slot(slots_driver):
    out = slots(slots_driver, 20, "16").stdout.splitlines()
    assert out == ["started 16 dropped 4", "again 1 clash 0"]


def test_a_bad_setting_turns_the_plugin_off_with_one_line(slots_driver):
    got = slots(slots_driver, 1, "lots")
    assert got.stdout.splitlines() == ["init 4"]          # ncclInvalidArgument: NCCL runs on without it
    assert got.stderr.splitlines() == ["Ingero profiler: INGERO_PROFILER_SLOTS=lots is not a whole number "
                                       "from 16 to 1048576; the plugin is off"]


LINKS_DRIVER = r"""
#include "ingero_profiler.c"
static const char *FUNC[3] = {"Send", "Recv", "AllReduce"};

static void show(int v, int i, void *h)
{
    struct op *o = h;
    printf("v%d %s group %llu stream %llx known %d\n", v, FUNC[i], (unsigned long long)o->rec.group,
           (unsigned long long)o->rec.stream, (o->rec.flags & NCCL_PROF_F_STREAM) != 0);
}

/* As NCCL launches a group of a Send and a Recv, then an AllReduce: per launch a
 * Group event, then its tasks (v4: parentObj is the group). */
static void run_v4(void)
{
    void *ctx, *g = NULL, *h;
    int mask;
    init_v4(&ctx, &mask, "c", 7, 1, 2, 0, NULL);
    for (int i = 0; i < 3; i++) {
        ncclProfilerEventDescr_v4_t d;
        if (i != 1) {
            memset(&d, 0, sizeof(d));
            d.type = ncclProfileGroup;
            start_event_v4(ctx, &g, &d);
        }
        memset(&d, 0, sizeof(d));
        d.type = i < 2 ? ncclProfileP2p : ncclProfileColl;
        d.parentObj = g;
        if (i < 2) d.p2p.func = FUNC[i], d.p2p.peer = 1;
        else d.coll.func = FUNC[i];
        start_event_v4(ctx, &h, &d);
        show(4, i, h);
    }
    finalize(ctx);
}

/* v5: first the calls' API events with their streams (stopped when the call
 * returns), then the launches; a task's parentObj is its API event. */
static void run_v5(void)
{
    void *ctx, *g = NULL, *a[3], *h;
    int mask;
    init_v5(&ctx, 7, &mask, "c", 1, 2, 0, NULL);
    for (int i = 0; i < 3; i++) {
        ncclProfilerEventDescr_v5_t d;
        memset(&d, 0, sizeof(d));
        d.type = i < 2 ? ncclProfileP2pApi : ncclProfileCollApi;
        if (i < 2) d.p2pApi.stream = (void *)(uintptr_t)(0x5000 + i);
        else d.collApi.stream = (void *)(uintptr_t)0x6000;
        start_event_v5(ctx, &a[i], &d);
        stop_event(a[i]);
    }
    for (int i = 0; i < 3; i++) {
        ncclProfilerEventDescr_v5_t d;
        if (i != 1) {
            memset(&d, 0, sizeof(d));
            d.type = ncclProfileGroup;
            start_event_v5(ctx, &g, &d);
        }
        memset(&d, 0, sizeof(d));
        d.type = i < 2 ? ncclProfileP2p : ncclProfileColl;
        d.parentObj = a[i];
        if (i < 2) d.p2p.func = FUNC[i], d.p2p.peer = 1, d.p2p.parentGroup = g;
        else d.coll.func = FUNC[i], d.coll.parentGroup = g;
        start_event_v5(ctx, &h, &d);
        show(5, i, h);
    }
    finalize(ctx);
}

int main(void)
{
    run_v4();
    run_v5();
    return 0;
}
"""


def test_each_operation_carries_its_launchs_group_number_and_v5_its_calls_stream(tmp_path):
    exe = build(tmp_path, "links", LINKS_DRIVER)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["v4 Send group 1 stream 0 known 0", "v4 Recv group 1 stream 0 known 0",
                   "v4 AllReduce group 2 stream 0 known 0",
                   "v5 Send group 1 stream 5000 known 1", "v5 Recv group 1 stream 5001 known 1",
                   "v5 AllReduce group 2 stream 6000 known 1"]


OPEN_DRIVER = r"""
#include "ingero_profiler.c"
#include <arpa/inet.h>
static void pause_ms(int ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}
static void *proxy_event(void *ctx, uint64_t type, void *parent, int a, int b)
{
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = type;
    d.parentObj = parent;
    if (type == ncclProfileProxyOp) {
        d.proxyOp.channelId = 1;
        d.proxyOp.peer = a;
        d.proxyOp.nSteps = 2;
        d.proxyOp.isSend = 1;
    } else {
        d.proxyStep.step = a;
    }
    void *h = NULL;
    start_event_v5(ctx, &h, &d);
    return h;
}
static void step_state(void *st, ncclProfilerEventState_t s, size_t trans)
{
    ncclProfilerEventStateArgs_v5_t a = {.proxyStep = {.transSize = trans}};
    record_state_v5(st, s, &a);
}
/* a TCP connection on the loopback interface: what NCCL's socket transport names in its events */
static int loopback_socket(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int l = socket(AF_INET, SOCK_STREAM, 0), s = socket(AF_INET, SOCK_STREAM, 0);
    bind(l, (struct sockaddr *)&a, sizeof(a));
    listen(l, 1);
    getsockname(l, (struct sockaddr *)&a, &len);
    connect(s, (struct sockaddr *)&a, sizeof(a));
    return s;
}
static void *start(void *ctx, uint64_t type, void *parent, const char *func, uint64_t seq, uint64_t ptimer)
{
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = type;
    d.parentObj = parent;
    if (type == ncclProfileKernelCh) {
        d.kernelCh.pTimer = ptimer;
    } else {
        d.coll.func = func;
        d.coll.seqNumber = seq;
        d.coll.nChannels = 2;
    }
    void *h = NULL;
    start_event_v5(ctx, &h, &d);
    return h;
}
int main(void)
{
    void *ctx, *ctx2;
    int mask;
    init_v5(&ctx, 0xabc, &mask, "c", 1, 4, 3, NULL);
    init_v5(&ctx2, 0xdef, &mask, "d", 1, 2, 1, NULL);
    /* an AllGather that finished, an AllReduce the GPU started on one of its two
     * channels and never finished, a Broadcast launched and not yet on the GPU */
    void *done = start(ctx, ncclProfileColl, NULL, "AllGather", 4, 0);
    stop_event(done);
    for (int ch = 0; ch < 2; ch++) {
        void *k = start(ctx, ncclProfileKernelCh, done, NULL, 0, 1000 + ch);
        record_state_v5(k, ncclProfilerKernelChStop, NULL);
        stop_event(k);
    }
    void *stuck = start(ctx, ncclProfileColl, NULL, "AllReduce", 812, 0);
    stop_event(stuck);
    start(ctx, ncclProfileKernelCh, stuck, NULL, 0, 5000);
    start(ctx, ncclProfileColl, NULL, "Broadcast", 9, 0);
    /* the stuck AllReduce's send to peer 2 on channel 1: two steps, summarised once */
    void *px = proxy_event(ctx, ncclProfileProxyOp, stuck, 2, 0);
    void *st = proxy_event(ctx, ncclProfileProxyStep, px, 0, 0);
    /* each state's time lies between [before, after] of the calls that open and close it */
    uint64_t b[5], a[5];
    b[0] = now_ns();
    step_state(st, ncclProfilerProxyStepSendGPUWait, 100);
    a[0] = now_ns();
    ncclProfilerNetSockDescr_v1_t sock = {.type = ncclProfileSocket, .sock = {.fd = loopback_socket(), .length = 100}};
    ncclProfilerEventDescr_v5_t net = {.type = ncclProfileNetPlugin, .parentObj = st};
    net.netPlugin.id = NCCL_PROFILER_NET_TYPE_SOCK | 1;
    net.netPlugin.data = &sock;
    void *nh = NULL;
    start_event_v5(ctx, &nh, &net);
    pause_ms(20);
    b[1] = now_ns();
    step_state(st, ncclProfilerProxyStepSendWait, 100);
    a[1] = now_ns();
    pause_ms(30);
    b[2] = now_ns();
    stop_event(st);
    a[2] = now_ns();
    st = proxy_event(ctx, ncclProfileProxyStep, px, 1, 0);
    b[3] = now_ns();
    step_state(st, ncclProfilerProxyStepSendWait, 50);
    a[3] = now_ns();
    pause_ms(10);
    b[4] = now_ns();
    stop_event(st);
    a[4] = now_ns();
    stop_event(px);
    /* 40 summaries on the other communicator: more than its ring holds */
    for (int i = 0; i < 40; i++)
        stop_event(proxy_event(ctx2, ncclProfileProxyOp, NULL, i % 2, 0));
    printf("gpu wait %llu %llu net wait %llu %llu\n", (unsigned long long)(b[1] - a[0]),
           (unsigned long long)(a[1] - b[0]), (unsigned long long)(b[2] - a[1] + b[4] - a[3]),
           (unsigned long long)(a[2] - b[1] + a[4] - b[3]));
    printf("ready\n");
    fflush(stdout);
    getchar();
    finalize(ctx);
    printf("finalized\n");
    fflush(stdout);
    getchar();
    finalize(ctx2);
    return 0;
}
"""


def test_the_operations_a_process_holds_open_are_read_from_its_memory_live(tmp_path):
    from ingero_agent.devinflight import Reader, read_all

    exe = build(tmp_path, "open", OPEN_DRIVER)
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "INGERO_PROFILER_PROXY_RING": "16",
                              "INGERO_PROFILER_FILE": str(tmp_path / "sink")})
    try:
        bounds = p.stdout.readline().split()        # gpu wait LO HI net wait LO HI, as the driver saw them
        gpu_lo, gpu_hi, net_lo, net_hi = (int(bounds[i]) for i in (2, 3, 6, 7))
        assert p.stdout.readline() == "ready\n"
        reader = Reader()
        opened, proxy = read_all(reader, [p.pid], 1_000, 2_000, lambda pid: 7)
        got = opened[p.pid]
        by_comm = {}
        for r in got:
            by_comm.setdefault(r["comm_hash"], []).append(r)
        assert sorted(by_comm) == [0xabc, 0xdef]
        idle = by_comm[0xdef]
        assert [(r["op"], r["comm_rank"], r["nranks"], r["rank"]) for r in idle] == [(None, 1, 2, 7)]
        ops = {r["op"]: r for r in by_comm[0xabc] if r["op"]}
        assert sorted(ops) == ["ALL_REDUCE", "BROADCAST"]         # the finished AllGather is gone
        ar, bc = ops["ALL_REDUCE"], ops["BROADCAST"]
        assert (ar["seq"], ar["comm_rank"], ar["nranks"], ar["nchannels"]) == (812, 3, 4, 2)
        assert (ar["channels_started"], ar["channels_stopped"], ar["enqueued"]) == (1, 0, True)
        assert ar["device_start_ns"] is not None and ar["launched_ns"] > 1_000
        assert (bc["seq"], bc["channels_started"], bc["enqueued"], bc["device_start_ns"]) == (9, 0, False, None)
        assert all(r["seen_ns"] == 2_000 for r in got)
        # one summary of the AllReduce's ProxyOp (its steps' waits), the other ring's newest 16
        mine = [x for x in proxy if x["comm_hash"] == 0xabc]
        assert len(mine) == 1
        x = mine[0]
        assert (x["op"], x["seq"], x["channel"], x["is_send"], x["peer"], x["comm_rank"]) == ("ALL_REDUCE", 812, 1,
                                                                                                 True, 2, 3)
        assert (x["net"], x["nic_device"], x["nic_port"], x["bytes"], x["steps"], x["nsteps"]) == (
            "socket", "lo", None, 150, 2, 2)
        assert gpu_lo <= x["send_gpu_wait_ns"] <= gpu_hi and gpu_lo >= 20e6, (x, bounds)
        assert net_lo <= x["send_net_wait_ns"] <= net_hi and net_lo >= 40e6, (x, bounds)
        assert x["recv_net_wait_ns"] == x["recv_flush_wait_ns"] == x["recv_gpu_wait_ns"] == 0
        assert x["duration_ns"] >= 55e6 and x["timestamp_ns"] > 1_000
        other = [x for x in proxy if x["comm_hash"] == 0xdef]
        assert len(other) == 16 and {x["lost"] for x in other} == {24} and {x["peer"] for x in other} == {0, 1}
        assert [x["peer_rank"] for x in other][:2] == [None, 7]     # its rank 1 is this process (rank 7)
        assert read_all(reader, [p.pid], 0, 0, lambda pid: 7)[1] == []      # read once
        # the file sink (a machine without the agent) has the summary as a line too
        sink = [line for line in (tmp_path / "sink").read_text().splitlines()
                if line.startswith("proxy comm=0000000000000abc")]
        assert len(sink) == 1 and sink[0].startswith("proxy ")
        assert {"func=AllReduce", "seq=812", "channel=1", "send=1", "peer=2", "nic=lo", "bytes=150",
                "steps=2/2"} <= set(sink[0].split())
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "finalized\n"
        # a finalized communicator's table is gone (or marked): only the other one is read
        assert [r["comm_hash"] for r in read_all(reader, [p.pid], 0, 0, lambda pid: 7)[0][p.pid]] == [0xdef]
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)
        assert reader.read(p.pid) == [] and read_all(reader, [p.pid], 0, 0, lambda pid: 7) == ({}, [])
    finally:
        p.kill()
        p.wait()
