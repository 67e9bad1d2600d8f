/* ingero_profiler.c: Ingero's NCCL profiler plugin (libnccl-profiler-ingero.so).
 *
 * Loaded by NCCL inside the training process (NCCL_PROFILER_PLUGIN=<path> or
 * =ingero with the library on the loader path). It asks NCCL for collective,
 * point-to-point, kernel-channel and proxy events, and for every finished operation
 * fires one USDT probe, `ingero:nccl_op_v2`, whose only argument is the
 * address of a `struct ingero_nccl_prof_op` (bpf/ingero.h): communicator
 * (commHash, rank, size, name), NCCL's sequence number, op, count, datatype,
 * algorithm, the host time NCCL launched and enqueued it, when the GPU ran
 * it, the kernel launch (group) it ran in and the stream it was called on.
 * The agent's eBPF side (bpf/nccl_profiler.c) reads the record; with
 * no tracer attached the probe is a single nop and nothing leaves the process.
 *
 * Events (NVIDIA's ABI: nccl_profiler_abi.h, profiler API v4, v5 and v6):
 *   Coll / P2p   start: NCCL launches the op's plan (host); stop: enqueued.
 *   Group        one per kernel plan (src/plugin/profiler.cc: plan->groupEventHandle),
 *                the parent of the plan's Coll/P2p events (v4: their parentObj;
 *                v5+: coll.parentGroup / p2p.parentGroup). The ops of one
 *                ncclGroupStart/End on a communicator, the per-peer sends and
 *                receives of an all-to-all and a coalesced launch share a plan,
 *                so one kernel and one device interval. The plugin numbers the
 *                Group events of a communicator from 1; the record's `group`.
 *   CollApi /    v5+: one per API call, carrying its cudaStream_t; the parentObj of
 *   P2pApi       the op's Coll/P2p event. The record's `stream` (v4 has none).
 * NCCL starts Group and API events as the parents of the events the plugin
 * asks for (Coll, P2p, KernelCh), so the mask names only those.
 *   KernelCh     one per channel the op's kernel runs on, started and stopped
 *                by NCCL's proxy thread when it sees the kernel's per-channel
 *                counters move; the start descriptor and the KernelChStop
 *                state carry the GPU's globaltimer (`pTimer`, ns) of the
 *                kernel's own start and stop on that channel.
 *   ProxyOp      one per operation, channel, peer and direction on the network
 *                transport, started and stopped by NCCL's proxy thread; its
 *                parentObj is the op's Coll/P2p handle.
 *   ProxyStep    one per network transfer of a ProxyOp (its parentObj); its states
 *                (SendGPUWait, SendPeerWait_v4, SendWait; RecvWait, RecvFlushWait,
 *                RecvGPUWait) are timed and summed per ProxyOp: one summary per
 *                ProxyOp, never one record per step (see "Operations in flight").
 *   NetPlugin    from the network plugin, under a step: the socket's fd or the IB
 *                device index, which names the NIC of the ProxyOp.
 * An op is finished when NCCL stopped its host event and every channel it
 * announced (`nChannels`) reported stop. Device start = first channel start,
 * device stop = last channel stop. Ops without channels (nChannels 0) finish
 * at their host stop, without device times; ops still open when the
 * communicator is finalized are recorded then, flagged NCCL_PROF_F_UNFINISHED.
 *
 * GPU time to host time. The GPU's globaltimer and the host's CLOCK_MONOTONIC
 * run apart (offset) and at slightly different rates (drift). Each kernel-
 * channel callback is a pair (h, g): the host time h when the proxy thread
 * handed us the GPU timestamp g. The proxy sees a timestamp only after the
 * GPU wrote it, so h - g = offset + latency, latency >= 0: the lower envelope
 * of h - g over many pairs is the offset. Pairs fall into buckets of host time
 * (a window, INGERO_PROFILER_CLOCK_WINDOW_MS, default 500; the first four
 * buckets last 1/16, 1/8, 1/4 and 1/2 of it, so the drift is known early);
 * each bucket keeps its lowest pair; the last 8 buckets give the fit
 *     host = g + a + b * (g - g_ref)
 * b: the drift, the median of the slopes between consecutive minima of the
 *    closed buckets (a bucket where the proxy starved, or a jump of the GPU
 *    clock, spoils one or two of the six slopes, not the median), clamped to
 *    +-1000 ppm; 0 until two buckets are closed;
 * g_ref: the open bucket's lowest pair;
 * a: the offset, the lower of d - b * (g - g_ref) of the open bucket's and
 *    the last closed bucket's lowest pairs (a jump of the GPU clock is
 *    forgotten within two windows).
 * The error is the best proxy latency in the newest windows (microseconds
 * when the proxy polls freely) plus drift error; the raw GPU stamps are in
 * the record too, for a later refit. The fit is per communicator: one GPU.
 *
 * Cost: operations live in a per-communicator array of slots preallocated at
 * init (INGERO_PROFILER_SLOTS, default 1024), taken by an atomic counter and a
 * compare-and-swap; nothing is allocated or locked per event. A full array
 * drops the op and counts it (`dropped`, in every later record). The clock
 * fit is updated by one thread at a time (a busy flag another thread skips,
 * never waits on) and read lock-free (sequence counter).
 *
 * Operations in flight: the slot array lives in a shared-memory mapping
 * (memfd, one per communicator, made at init) behind a header that describes
 * it (bpf/ingero.h: struct ingero_nccl_prof_table). An open slot's record is
 * filled from the op's start, and its device start from its first kernel
 * channel, so the agent reads which operations NCCL started and never
 * finished, and since when, from the process's memory at each roll: a
 * collective stuck on the GPU while the host waits outside NCCL, even one that
 * was stuck before the agent attached. Nothing more per event. The same
 * mapping holds a ring of proxy summaries (INGERO_PROFILER_PROXY_RING entries
 * per communicator, default 4096; 0: no proxy events), drained by the agent at
 * each roll; a summary costs two clock reads per step state and one ring write.
 *
 * File sink: with INGERO_PROFILER_FILE=<path>, each record is also appended
 * to that file as one line of key=value words (the same fields, the strings
 * spelled out; one write per line; "op ..." per operation, "proxy ..." per
 * proxy summary), for a machine without the eBPF agent
 * (scripts/gpu-check.sh). Built with -DINGERO_PROFILER_NO_USDT (no
 * <sys/sdt.h> there), the USDT probe is left out and the file is the only sink.
 *
 * Bad settings (INGERO_PROFILER_SLOTS, INGERO_PROFILER_CLOCK_WINDOW_MS, a
 * file that cannot be opened): init logs one line and fails, and NCCL runs on
 * without the plugin.
 */
#define _GNU_SOURCE                     /* memfd_create */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <linux/types.h>

#ifdef INGERO_PROFILER_NO_USDT
#define DTRACE_PROBE1(provider, name, arg) ((void)(arg))
#else
/* The record's address goes to the probe in a register (not a stack slot):
 * the agent's BPF program reads it from the register the note names. */
#define STAP_SDT_ARG_CONSTRAINT r
#include <sys/sdt.h>
#endif

#include "ingero.h"
#include "nccl_profiler_abi.h"

#define EXPORT __attribute__((visibility("default")))

_Static_assert(INGERO_NCCL_PROF_VERSION == 2, "rename the probe nccl_op_v2 with the record version");
_Static_assert(sizeof(struct ingero_nccl_prof_op) == 168, "record layout changed: bump its version");
_Static_assert(sizeof(struct ingero_nccl_prof_proxy) == 144, "proxy summary layout changed: bump the version");

#define TAG_OP  0x504f4f5245474e49ULL   /* "INGEROOP": first word of an op handle */
#define TAG_KCH 0x434b4f5245474e49ULL   /* "INGEROKC": handle of an op's kernel-channel events */
#define TAG_GRP 0x50524f5245474e49ULL   /* "INGERORP": handle of a Group event */
#define TAG_API 0x41504f5245474e49ULL   /* "INGEROPA": handle of a CollApi/P2pApi event */
#define TAG_PRX 0x58505f5245474e49ULL   /* "INGER_PX": handle of a ProxyOp event */
#define TAG_STP 0x54535f5245474e49ULL   /* "INGER_ST": handle of a ProxyStep event */
#define PROXY_STEPS 8                   /* NCCL_STEPS (src/include/device.h): steps in flight per ProxyOp */
#define DEFAULT_PROXY_RING 4096
#define NIC_CACHE 64                    /* sockets whose interface is remembered, per communicator */
#define SLOT_FREE 0u
#define SLOT_BUSY 1u
#define ALLOC_TRIES 8                   /* busy slots passed over before an op is dropped */
#define DEFAULT_SLOTS 1024
#define DEFAULT_WINDOW_MS 500
#define CLK_BUCKETS 8
#define CLK_MAX_DRIFT 1e-3              /* |b| above this is a bad fit, not a clock */
#define CLK_WARMUP 4                    /* the first buckets last 1/16, 1/8, 1/4, 1/2 of a window */

struct clock_fit {
    atomic_flag busy;                   /* the writer's flag: a second writer skips its pair */
    int64_t window_ns;                  /* host time covered by one bucket */
    int64_t bucket_h0;                  /* host time the newest bucket began */
    int cur, used;
    uint32_t buckets;                   /* begun so far: the first ones are short (warm-up) */
    struct { int64_t g, d; } pt[CLK_BUCKETS];   /* per bucket: lowest d = h - g, and its g */
    uint32_t pairs;
    /* the published fit; `seq` odd while it is being written */
    _Atomic uint32_t seq;
    _Atomic int64_t a, g_ref;
    _Atomic double b;
    _Atomic uint32_t samples;
};

struct ctx;

/* A Group or API event's handle: what its children read from their parent
 * (the group's number, the call's stream). NCCL stops an API event when the
 * call returns, before the launch starts its ops, so these live in a ring per
 * communicator, reused in turn; a group of more calls than the ring holds may
 * read a later call's stream for its first ones. */
struct link {
    uint64_t tag;                       /* TAG_GRP / TAG_API */
    uint64_t value;                     /* group number / cudaStream_t */
};

struct op {
    uint64_t tag;                       /* TAG_OP */
    uint64_t kch_tag;                   /* TAG_KCH; its address is the kernel-channel handle */
    struct ctx *ctx;
    _Atomic uint32_t state;             /* SLOT_FREE / SLOT_BUSY */
    _Atomic int32_t refs;               /* host stop + one per announced channel */
    _Atomic int32_t started;            /* kernel channels started */
    _Atomic int32_t reported;           /* kernel channels that reported stop */
    _Atomic uint64_t dev_start;         /* earliest channel start (GPU ns) */
    _Atomic uint64_t dev_stop;          /* latest channel stop (GPU ns) */
    struct ingero_nccl_prof_op rec;
};

/* A ProxyOp: NCCL's transfers of one operation with one peer on one channel, one
 * direction; its steps' times in each state are summed into `rec` (one record per
 * ProxyOp, never one per step). All its events come from one proxy thread. */
struct proxy;
struct step {
    uint64_t tag;                       /* TAG_STP */
    struct proxy *p;
    int state;                          /* NCCL_PROXY_* the step is in now; -1: none yet */
    uint64_t since;                     /* ... since then (host ns) */
    uint64_t trans;                     /* its transSize, as last recorded */
};

struct proxy {
    uint64_t tag;                       /* TAG_PRX */
    struct ctx *ctx;
    _Atomic uint32_t state;             /* SLOT_FREE / SLOT_BUSY */
    struct ingero_nccl_prof_proxy rec;
    struct step steps[PROXY_STEPS];     /* NCCL reuses step % NCCL_STEPS */
};

struct ctx {
    uint64_t comm_hash;
    int rank, nranks, nnodes;
    uint8_t api;
    uint32_t nslots;
    struct op *slots;                   /* in `table`'s mapping, after its header */
    struct ingero_nccl_prof_table *table;   /* NULL: the slots are plain memory (no memfd) */
    size_t table_len;
    struct ingero_nccl_prof_proxy *ring;    /* in `table`'s mapping; NULL: no proxy summaries */
    uint32_t nring;
    struct proxy *proxies;              /* [nslots] */
    _Atomic uint64_t next_proxy;
    struct { int fd; char name[16]; } nic[NIC_CACHE];   /* socket -> its interface; fd -1: free */
    pthread_mutex_t nic_mu;
    _Atomic uint64_t next;
    _Atomic uint64_t dropped;
    _Atomic uint64_t *p2p_seq;          /* [2 * nranks]: sends to, receives from each peer */
    struct link *links;                 /* [nslots]: Group and API handles, in turn */
    _Atomic uint64_t next_link;
    _Atomic uint64_t groups;            /* Group events so far */
    ncclDebugLogger_t log;
    struct clock_fit clk;
    char name[64];
};

/* What startEvent needs from a descriptor; the same field names in v4, v5, v6. */
struct ev {
    uint64_t type;
    int64_t net_id;                     /* NetPlugin: the network plugin's id (type and version bits) */
    void *net_data;                     /* ... and its descriptor */
    int channel, nsteps, chunk, is_send, step;   /* ProxyOp / ProxyStep */
    void *parent;                       /* KernelCh: its op; Coll/P2p v5+: the API event */
    void *group;                        /* Coll/P2p: the Group event */
    void *stream;                       /* CollApi/P2pApi: the call's stream */
    uint64_t seq, count, ptimer;
    const char *func, *datatype, *algo, *proto;
    int peer, nch;
};

static _Atomic int sink_fd = -1;        /* INGERO_PROFILER_FILE, opened by the first init */

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- clock fit --------------------------------------------------------- */

static double median(double *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Called when the open bucket got a lower pair (so it has one: index 0 below). */
static void clock_refit(struct clock_fit *c)
{
    int64_t g[CLK_BUCKETS], d[CLK_BUCKETS];
    double slopes[CLK_BUCKETS];
    int n = 0, ns = 0;
    for (int i = 0; i < c->used; i++) {         /* newest first */
        int k = (c->cur - i + CLK_BUCKETS) % CLK_BUCKETS;
        if (c->pt[k].d == INT64_MAX)
            continue;
        g[n] = c->pt[k].g;
        d[n++] = c->pt[k].d;
    }
    if (n == 0)
        return;
    /* drift from closed buckets only: the open one's lowest pair may still be a poor one */
    for (int i = 1; i + 1 < n; i++)
        if (g[i] != g[i + 1])
            slopes[ns++] = (double)(d[i] - d[i + 1]) / (double)(g[i] - g[i + 1]);
    double b = ns ? median(slopes, ns) : 0.0;
    b = fmax(-CLK_MAX_DRIFT, fmin(CLK_MAX_DRIFT, b));
    /* offset: the lower of the open bucket's pair and the last closed one's, carried by b */
    int64_t a = INT64_MAX;
    for (int i = 0; i < n && i < 2; i++) {
        int64_t v = d[i] - llround(b * (double)(g[i] - g[0]));
        if (v < a)
            a = v;
    }
    uint32_t s = atomic_load_explicit(&c->seq, memory_order_relaxed);
    atomic_store_explicit(&c->seq, s + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&c->a, a, memory_order_relaxed);
    atomic_store_explicit(&c->g_ref, g[0], memory_order_relaxed);
    atomic_store_explicit(&c->b, b, memory_order_relaxed);
    atomic_store_explicit(&c->seq, s + 2, memory_order_release);
}

/* A pair: host time h at which the GPU timestamp g was handed to us. */
static void clock_pair(struct clock_fit *c, uint64_t h, uint64_t g)
{
    if (g == 0 || g > INT64_MAX || atomic_flag_test_and_set_explicit(&c->busy, memory_order_acquire))
        return;
    /* the open bucket is number `buckets` (from 1) */
    int64_t len = c->window_ns >> (c->buckets <= CLK_WARMUP ? CLK_WARMUP + 1 - c->buckets : 0);
    if (c->used == 0 || (int64_t)h - c->bucket_h0 >= len) {
        c->cur = (c->cur + 1) % CLK_BUCKETS;
        c->pt[c->cur].d = INT64_MAX;
        c->bucket_h0 = (int64_t)h;
        if (c->used < CLK_BUCKETS)
            c->used++;
        c->buckets++;
    }
    int64_t d = (int64_t)h - (int64_t)g;
    c->pairs++;
    if (d < c->pt[c->cur].d) {
        c->pt[c->cur].d = d;
        c->pt[c->cur].g = (int64_t)g;
        clock_refit(c);
    }
    atomic_store_explicit(&c->samples, c->pairs, memory_order_relaxed);
    atomic_flag_clear_explicit(&c->busy, memory_order_release);
}

/* GPU time g on the host clock; 0 before the first pair. */
static uint64_t clock_host(struct clock_fit *c, uint64_t g)
{
    uint32_t s;
    int64_t a, g_ref;
    double b;
    do {
        s = atomic_load_explicit(&c->seq, memory_order_acquire);
        a = atomic_load_explicit(&c->a, memory_order_relaxed);
        g_ref = atomic_load_explicit(&c->g_ref, memory_order_relaxed);
        b = atomic_load_explicit(&c->b, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
    } while ((s & 1) || s != atomic_load_explicit(&c->seq, memory_order_relaxed));
    if (s == 0 || g == 0 || g > INT64_MAX)
        return 0;
    int64_t h = (int64_t)g + a + llround(b * (double)((int64_t)g - g_ref));
    return h > 0 ? (uint64_t)h : 0;
}

/* ---- operations -------------------------------------------------------- */

static struct op *op_of_kch(void *handle)
{
    return (struct op *)((char *)handle - offsetof(struct op, kch_tag));
}

/* A free slot of an array of `n` slots of `stride` bytes whose state word is at `state`
 * bytes into each, taken in turn (counter `next`); NULL after ALLOC_TRIES busy ones. */
static void *slot_claim(_Atomic uint64_t *next, void *base, size_t stride, uint32_t n, size_t state)
{
    for (int i = 0; i < ALLOC_TRIES; i++) {
        char *s = (char *)base + atomic_fetch_add_explicit(next, 1, memory_order_relaxed) % n * stride;
        uint32_t want = SLOT_FREE;
        if (atomic_compare_exchange_strong_explicit((_Atomic uint32_t *)(s + state), &want, SLOT_BUSY,
                                                    memory_order_acquire, memory_order_relaxed))
            return s;
    }
    return NULL;
}

static struct op *op_alloc(struct ctx *c)
{
    struct op *o = slot_claim(&c->next, c->slots, sizeof(*o), c->nslots, offsetof(struct op, state));
    if (!o)
        atomic_fetch_add_explicit(&c->dropped, 1, memory_order_relaxed);
    return o;
}

/* 1 when `v` became the minimum */
static int atomic_min_u64(_Atomic uint64_t *p, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed);
    while (v < cur)
        if (atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed, memory_order_relaxed))
            return 1;
    return 0;
}

static void atomic_max_u64(_Atomic uint64_t *p, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(p, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

static const char *str_or(uint64_t p, const char *dflt)
{
    return p ? (const char *)(uintptr_t)p : dflt;
}

/* One line per record: the file sink. */
static void sink_write(int fd, const struct ingero_nccl_prof_op *r)
{
    char line[768], stream[24] = "-";
    if (r->flags & NCCL_PROF_F_STREAM)
        snprintf(stream, sizeof(stream), "0x%llx", (unsigned long long)r->stream);
    int n = snprintf(line, sizeof(line),
                     "op api=%u comm=%016llx name=%s rank=%d nranks=%d nnodes=%d kind=%s func=%s seq=%lld "
                     "peer=%d count=%llu datatype=%s algo=%s proto=%s group=%llu stream=%s "
                     "host_start=%llu host_stop=%llu dev_start=%llu dev_stop=%llu dev_start_raw=%llu "
                     "dev_stop_raw=%llu channels=%u nchannels=%u flags=%u clock_samples=%u dropped=%llu\n",
                     r->api, (unsigned long long)r->comm_hash, str_or(r->comm_name, "-"), r->rank, r->nranks,
                     r->nnodes, r->kind == NCCL_PROF_COLL ? "coll" : "p2p", str_or(r->func, "-"),
                     r->seq == UINT64_MAX ? -1LL : (long long)r->seq, r->peer, (unsigned long long)r->count,
                     str_or(r->datatype, "-"), str_or(r->algo, "-"), str_or(r->proto, "-"),
                     (unsigned long long)r->group, stream, (unsigned long long)r->host_start_ns,
                     (unsigned long long)r->host_stop_ns, (unsigned long long)r->dev_start_ns,
                     (unsigned long long)r->dev_stop_ns, (unsigned long long)r->dev_start_raw,
                     (unsigned long long)r->dev_stop_raw, r->channels, r->nchannels, r->flags, r->clock_samples,
                     (unsigned long long)r->dropped);
    if (n > 0 && (size_t)n < sizeof(line) && write(fd, line, (size_t)n) < 0) {
        /* a full disk loses lines, never the job */
    }
}

static void op_finish(struct op *o, uint8_t flags)
{
    struct ctx *c = o->ctx;
    struct ingero_nccl_prof_op *r = &o->rec;
    uint64_t s = atomic_load_explicit(&o->dev_start, memory_order_relaxed);
    uint64_t e = atomic_load_explicit(&o->dev_stop, memory_order_relaxed);
    if (s != UINT64_MAX) {
        r->dev_start_raw = s;
        r->dev_start_ns = clock_host(&c->clk, s);
    }
    if (e != 0) {
        r->dev_stop_raw = e;
        r->dev_stop_ns = clock_host(&c->clk, e);
    }
    r->clock_samples = atomic_load_explicit(&c->clk.samples, memory_order_relaxed);
    r->channels = (uint8_t)atomic_load_explicit(&o->reported, memory_order_relaxed);
    r->flags |= flags;
    r->dropped = atomic_load_explicit(&c->dropped, memory_order_relaxed);
    DTRACE_PROBE1(ingero, nccl_op_v2, r);
    int fd = atomic_load_explicit(&sink_fd, memory_order_relaxed);
    if (fd >= 0)
        sink_write(fd, r);
    atomic_store_explicit(&o->state, SLOT_FREE, memory_order_release);
}

static void op_release(struct op *o)
{
    if (atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) == 1)
        op_finish(o, 0);
}

static void op_begin(struct ctx *c, struct op *o, const struct ev *e)
{
    struct ingero_nccl_prof_op *r = &o->rec;
    memset(r, 0, sizeof(*r));
    r->size = sizeof(*r);
    r->version = INGERO_NCCL_PROF_VERSION;
    r->kind = e->type == ncclProfileColl ? NCCL_PROF_COLL : NCCL_PROF_P2P;
    r->api = c->api;
    r->comm_hash = c->comm_hash;
    r->seq = e->seq;
    r->count = e->count;
    r->func = (uintptr_t)e->func;
    r->datatype = (uintptr_t)e->datatype;
    r->algo = (uintptr_t)e->algo;
    r->proto = (uintptr_t)e->proto;
    r->comm_name = c->name[0] ? (uintptr_t)c->name : 0;
    r->rank = c->rank;
    r->nranks = c->nranks;
    r->nnodes = c->nnodes;
    r->peer = e->peer;
    r->nchannels = (uint8_t)e->nch;
    atomic_store_explicit(&o->started, 0, memory_order_relaxed);
    atomic_store_explicit(&o->reported, 0, memory_order_relaxed);
    atomic_store_explicit(&o->dev_start, UINT64_MAX, memory_order_relaxed);
    atomic_store_explicit(&o->dev_stop, 0, memory_order_relaxed);
    atomic_store_explicit(&o->refs, 1 + e->nch, memory_order_relaxed);
    r->host_start_ns = now_ns();
}

/* Pairing key of a p2p op: its order among this rank's sends to (receives
 * from) the same peer; NCCL gives p2p events no sequence number. */
static uint64_t p2p_seq(struct ctx *c, const struct ev *e)
{
    if (!c->p2p_seq || e->peer < 0 || e->peer >= c->nranks || !e->func)
        return UINT64_MAX;
    int recv = strcmp(e->func, "Recv") == 0;
    return atomic_fetch_add_explicit(&c->p2p_seq[recv * c->nranks + e->peer], 1, memory_order_relaxed);
}

static struct link *link_new(struct ctx *c, uint64_t tag, uint64_t value)
{
    struct link *l = &c->links[atomic_fetch_add_explicit(&c->next_link, 1, memory_order_relaxed) % c->nslots];
    l->tag = tag;
    l->value = value;
    return l;
}

/* The value a Group/API handle carries (and *known = 1 if given), or 0 for another handle. */
static uint64_t link_value(const void *h, uint64_t tag, uint8_t *known)
{
    if (!h || ((const struct link *)h)->tag != tag)
        return 0;
    if (known)
        *known = 1;
    return ((const struct link *)h)->value;
}

/* ---- proxy summaries -------------------------------------------------- */

static struct proxy *proxy_alloc(struct ctx *c)
{
    struct proxy *p = slot_claim(&c->next_proxy, c->proxies, sizeof(*p), c->nslots, offsetof(struct proxy, state));
    if (!p)
        __atomic_fetch_add(&c->table->proxy_dropped, 1, __ATOMIC_RELAXED);
    return p;
}

static int wait_index(ncclProfilerEventState_t state)
{
    switch (state) {
    case ncclProfilerProxyStepSendGPUWait: return NCCL_PROXY_SEND_GPU;
    case ncclProfilerProxyStepSendPeerWait_v4: return NCCL_PROXY_SEND_PEER;
    case ncclProfilerProxyStepSendWait: return NCCL_PROXY_SEND_NET;
    case ncclProfilerProxyStepRecvWait: return NCCL_PROXY_RECV_NET;
    case ncclProfilerProxyStepRecvFlushWait: return NCCL_PROXY_RECV_FLUSH;
    case ncclProfilerProxyStepRecvGPUWait: return NCCL_PROXY_RECV_GPU;
    default: return -1;
    }
}

/* The time since the step entered its state goes to that state. */
static void step_close(struct step *st, uint64_t now)
{
    if (st->state >= 0 && now > st->since)
        st->p->rec.wait_ns[st->state] += now - st->since;
}

/* The ProxyOp's summary into the ring: numbered, then published (`seq` last). */
static void ring_put(struct ctx *c, const struct ingero_nccl_prof_proxy *r)
{
    uint64_t n = __atomic_fetch_add(&c->table->proxy_head, 1, __ATOMIC_RELAXED) + 1;
    struct ingero_nccl_prof_proxy *e = &c->ring[(n - 1) % c->nring];
    __atomic_store_n(&e->seq, 0, __ATOMIC_RELAXED);
    atomic_thread_fence(memory_order_release);
    memcpy((char *)e + sizeof(e->seq), (const char *)r + sizeof(r->seq), sizeof(*r) - sizeof(r->seq));
    __atomic_store_n(&e->seq, n, __ATOMIC_RELEASE);
    int fd = atomic_load_explicit(&sink_fd, memory_order_relaxed);
    if (fd < 0)
        return;
    char line[512];
    const __u64 *w = r->wait_ns;
    int len = snprintf(line, sizeof(line),
                       "proxy comm=%016llx rank=%d func=%s seq=%llu channel=%u send=%u peer=%d net=%u nic=%s "
                       "nic_index=%d bytes=%llu steps=%d/%d start=%llu stop=%llu send_gpu=%llu send_peer=%llu "
                       "send_net=%llu recv_net=%llu recv_flush=%llu recv_gpu=%llu\n",
                       (unsigned long long)c->comm_hash, c->rank, str_or(r->func, "-"),
                       (unsigned long long)r->op_seq, r->channel, r->is_send, r->peer, r->net,
                       r->nic_device[0] ? r->nic_device : "-", r->nic_index, (unsigned long long)r->bytes, r->steps,
                       r->nsteps, (unsigned long long)r->start_ns, (unsigned long long)r->stop_ns,
                       (unsigned long long)w[0], (unsigned long long)w[1], (unsigned long long)w[2],
                       (unsigned long long)w[3], (unsigned long long)w[4], (unsigned long long)w[5]);
    if (len > 0 && (size_t)len < sizeof(line) && write(fd, line, (size_t)len) < 0) {
        /* a full disk loses lines, never the job */
    }
}

/* The interface of a socket's local address ("lo", "eth0", ...), remembered per socket:
 * a connection's first NetPlugin event pays the lookup, later ones a scan of the cache. */
static void nic_of_socket(struct ctx *c, int fd, char out[16])
{
    pthread_mutex_lock(&c->nic_mu);
    int free_at = -1;
    for (int i = 0; i < NIC_CACHE; i++) {
        if (c->nic[i].fd == fd) {
            memcpy(out, c->nic[i].name, 16);
            pthread_mutex_unlock(&c->nic_mu);
            return;
        }
        if (c->nic[i].fd < 0 && free_at < 0)
            free_at = i;
    }
    pthread_mutex_unlock(&c->nic_mu);
    char name[16] = "";
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    struct ifaddrs *ifs = NULL;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) == 0 && getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i && !name[0]; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != ss.ss_family)
                continue;
            int same = ss.ss_family == AF_INET
                ? ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == ((struct sockaddr_in *)&ss)->sin_addr.s_addr
                : ss.ss_family == AF_INET6 && !memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr,
                                                      &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
            if (same)
                snprintf(name, sizeof(name), "%s", i->ifa_name);
        }
        freeifaddrs(ifs);
    }
    memcpy(out, name, 16);
    pthread_mutex_lock(&c->nic_mu);
    if (free_at >= 0 && c->nic[free_at].fd < 0) {
        c->nic[free_at].fd = fd;
        memcpy(c->nic[free_at].name, name, 16);
    }
    pthread_mutex_unlock(&c->nic_mu);
}

/* A NetPlugin event under a step: which NIC its ProxyOp uses (the first one seen). */
static void net_event(struct ctx *c, struct step *st, int64_t id, const void *data)
{
    struct ingero_nccl_prof_proxy *r = &st->p->rec;
    uint32_t type = (uint32_t)id & NCCL_PROFILER_NET_TYPE_MASK;
    if (r->net || !data)
        return;
    if (type == NCCL_PROFILER_NET_TYPE_SOCK && ((const ncclProfilerNetSockDescr_v1_t *)data)->type == ncclProfileSocket) {
        r->net = NCCL_PROXY_NET_SOCKET;
        nic_of_socket(c, ((const ncclProfilerNetSockDescr_v1_t *)data)->sock.fd, r->nic_device);
    } else if (type == NCCL_PROFILER_NET_TYPE_IB && ((const ncclProfilerNetIbDescr_v1_t *)data)->type == ncclProfileQp) {
        r->net = NCCL_PROXY_NET_IB;
        r->nic_index = ((const ncclProfilerNetIbDescr_v1_t *)data)->qp.device;
    }
}

static void proxy_start(struct ctx *c, void **handle, const struct ev *e)
{
    struct proxy *p = proxy_alloc(c);
    if (!p)
        return;
    struct ingero_nccl_prof_proxy *r = &p->rec;
    memset(r, 0, sizeof(*r));
    const struct op *o = e->parent;
    if (o && o->tag == TAG_OP && atomic_load_explicit(&o->state, memory_order_relaxed) == SLOT_BUSY) {
        r->op_seq = o->rec.seq;
        r->func = o->rec.func;
    }
    r->peer = e->peer;
    r->channel = (uint8_t)e->channel;
    r->nsteps = e->nsteps;
    r->chunk_size = e->chunk;
    r->is_send = (uint8_t)(e->is_send != 0);
    r->nic_port = -1;
    r->nic_index = -1;
    for (int i = 0; i < PROXY_STEPS; i++)
        p->steps[i] = (struct step){.tag = TAG_STP, .p = p, .state = -1};
    r->start_ns = now_ns();
    *handle = p;
}

static ncclResult_t start_event(void *context, void **handle, struct ev *e)
{
    struct ctx *c = context;
    *handle = NULL;
    if (!c)
        return ncclSuccess;
    if (e->type == ncclProfileColl || e->type == ncclProfileP2p) {
        struct op *o = op_alloc(c);
        if (!o)
            return ncclSuccess;
        if (e->type == ncclProfileP2p)
            e->seq = p2p_seq(c, e);
        op_begin(c, o, e);
        uint8_t known = 0;
        o->rec.group = link_value(e->group, TAG_GRP, NULL);
        o->rec.stream = link_value(e->parent, TAG_API, &known);
        if (known)
            o->rec.flags |= NCCL_PROF_F_STREAM;
        *handle = o;
    } else if (e->type == ncclProfileGroup) {
        *handle = link_new(c, TAG_GRP, atomic_fetch_add_explicit(&c->groups, 1, memory_order_relaxed) + 1);
    } else if (e->type == ncclProfileCollApi || e->type == ncclProfileP2pApi) {
        *handle = link_new(c, TAG_API, (uintptr_t)e->stream);
    } else if (e->type == ncclProfileKernelCh) {
        struct op *o = e->parent;
        uint64_t h = now_ns();
        if (!o || o->tag != TAG_OP)
            return ncclSuccess;
        /* more channels than announced would free the slot under NCCL's feet */
        if (atomic_fetch_add_explicit(&o->started, 1, memory_order_relaxed) >= o->rec.nchannels)
            return ncclSuccess;
        clock_pair(&c->clk, h, e->ptimer);
        if (e->ptimer && atomic_min_u64(&o->dev_start, e->ptimer))
            o->rec.dev_start_ns = clock_host(&c->clk, e->ptimer);   /* for a reader of the open op */
        *handle = &o->kch_tag;
    } else if (e->type == ncclProfileProxyOp && c->ring) {
        proxy_start(c, handle, e);
    } else if (e->type == ncclProfileProxyStep) {
        struct proxy *p = e->parent;
        if (!p || p->tag != TAG_PRX || e->step < 0)
            return ncclSuccess;
        struct step *st = &p->steps[e->step % PROXY_STEPS];
        st->state = -1;
        st->since = now_ns();
        st->trans = 0;
        *handle = st;
    } else if (e->type == ncclProfileNetPlugin) {
        struct step *st = e->parent;
        if (st && st->tag == TAG_STP)
            net_event(c, st, e->net_id, e->net_data);
    }   /* NetPlugin events get no handle: their stop and updates are not needed */
    return ncclSuccess;
}

static ncclResult_t stop_event(void *handle)
{
    if (!handle)
        return ncclSuccess;
    uint64_t tag = *(uint64_t *)handle;
    if (tag == TAG_OP) {
        struct op *o = handle;
        o->rec.host_stop_ns = now_ns();
        op_release(o);
    } else if (tag == TAG_KCH) {
        op_release(op_of_kch(handle));
    } else if (tag == TAG_STP) {
        struct step *st = handle;
        step_close(st, now_ns());
        st->p->rec.bytes += st->trans;
        st->p->rec.steps++;
        st->state = -1;
    } else if (tag == TAG_PRX) {
        struct proxy *p = handle;
        p->rec.stop_ns = now_ns();
        for (int i = 0; i < PROXY_STEPS; i++)     /* steps NCCL never stopped (an error): their wait so far */
            step_close(&p->steps[i], p->rec.stop_ns);
        ring_put(p->ctx, &p->rec);
        atomic_store_explicit(&p->state, SLOT_FREE, memory_order_release);
    }   /* TAG_GRP, TAG_API: the ring reuses them */
    return ncclSuccess;
}

/* `arg`: the state's argument (KernelChStop: the GPU timer; a proxy step state: transSize). */
static ncclResult_t record_state(void *handle, ncclProfilerEventState_t state, uint64_t arg)
{
    if (handle && *(uint64_t *)handle == TAG_STP) {
        struct step *st = handle;
        int w = wait_index(state);
        uint64_t now = now_ns();
        step_close(st, now);
        if (w >= 0) {
            st->state = w;
            st->since = now;
        }
        if (arg)
            st->trans = arg;
        return ncclSuccess;
    }
    uint64_t ptimer = arg;
    if (!handle || state != ncclProfilerKernelChStop || *(uint64_t *)handle != TAG_KCH)
        return ncclSuccess;
    struct op *o = op_of_kch(handle);
    clock_pair(&o->ctx->clk, now_ns(), ptimer);
    if (ptimer)
        atomic_max_u64(&o->dev_stop, ptimer);
    atomic_fetch_add_explicit(&o->reported, 1, memory_order_relaxed);
    return ncclSuccess;
}

/* ---- init / finalize --------------------------------------------------- */

static void say(ncclDebugLogger_t log, ncclDebugLogLevel level, const char *msg)
{
    if (log)
        log(level, NCCL_PROFILE | NCCL_INIT, __FILE__, __LINE__, "%s", msg);
    else if (level == NCCL_LOG_WARN)
        fprintf(stderr, "%s\n", msg);
}

/* A whole number from the environment in [lo, hi], else `dflt`; 0 on success. */
static int env_number(const char *name, long dflt, long lo, long hi, long *out, ncclDebugLogger_t log)
{
    const char *s = getenv(name);
    *out = dflt;
    if (!s || !*s)
        return 0;
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < lo || v > hi) {
        char msg[256];
        snprintf(msg, sizeof(msg), "Ingero profiler: %s=%.40s is not a whole number from %ld to %ld; "
                 "the plugin is off", name, s, lo, hi);
        say(log, NCCL_LOG_WARN, msg);
        return -1;
    }
    *out = v;
    return 0;
}

/* INGERO_PROFILER_FILE: opened once per process (the first init); 0 on success. */
static int open_sink(ncclDebugLogger_t log)
{
    const char *path = getenv("INGERO_PROFILER_FILE");
    if (!path || !*path || atomic_load(&sink_fd) >= 0)
        return 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        char msg[512];
        snprintf(msg, sizeof(msg), "Ingero profiler: INGERO_PROFILER_FILE=%.300s cannot be opened (%s); "
                 "the plugin is off", path, strerror(errno));
        say(log, NCCL_LOG_WARN, msg);
        return -1;
    }
    int none = -1;
    if (!atomic_compare_exchange_strong(&sink_fd, &none, fd))
        close(fd);                      /* another communicator's init opened it first */
    return 0;
}

/* The slots, after a table header, in a memfd mapping the agent finds in /proc/<pid>/maps;
 * plain memory where memfd_create is refused (then operations in flight are not visible). */
static void slots_alloc(struct ctx *c, uint32_t n, uint32_t nring)
{
    size_t head = (sizeof(struct ingero_nccl_prof_table) + 63) & ~(size_t)63;
    size_t ring = (head + (size_t)n * sizeof(struct op) + 63) & ~(size_t)63;
    size_t len = ring + (size_t)nring * sizeof(struct ingero_nccl_prof_proxy);
    int fd = memfd_create(INGERO_NCCL_PROF_TABLE_NAME, MFD_CLOEXEC);
    void *m = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)len) == 0)
        m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0)
        close(fd);                      /* the mapping keeps the memory */
    if (m == MAP_FAILED) {
        c->slots = calloc(n, sizeof(struct op));
        return;
    }
    c->table = m;
    c->table_len = len;
    c->slots = (struct op *)((char *)m + head);
    if (nring) {
        c->ring = (struct ingero_nccl_prof_proxy *)((char *)m + ring);
        c->nring = nring;
    }
}

static void ctx_free(struct ctx *c)
{
    if (!c)
        return;
    if (c->table)
        munmap(c->table, c->table_len);
    else
        free(c->slots);
    free(c->links);
    free(c->proxies);
    free((void *)c->p2p_seq);
    pthread_mutex_destroy(&c->nic_mu);
    free(c);
}

static ncclResult_t init_common(void **context, int *mask, const char *name, uint64_t hash, int nnodes,
                                int nranks, int rank, ncclDebugLogger_t log, uint8_t api)
{
    long slots, window_ms, nring;
    *context = NULL;
    if (env_number("INGERO_PROFILER_SLOTS", DEFAULT_SLOTS, 16, 1L << 20, &slots, log) ||
        env_number("INGERO_PROFILER_CLOCK_WINDOW_MS", DEFAULT_WINDOW_MS, 1, 600000, &window_ms, log) ||
        env_number("INGERO_PROFILER_PROXY_RING", DEFAULT_PROXY_RING, 0, 1L << 20, &nring, log) ||
        open_sink(log))
        return ncclInvalidArgument;
    struct ctx *c = calloc(1, sizeof(*c));
    if (c) {
        pthread_mutex_init(&c->nic_mu, NULL);
        slots_alloc(c, (uint32_t)slots, (uint32_t)nring);
        c->links = calloc((size_t)slots, sizeof(struct link));
        if (c->ring)
            c->proxies = calloc((size_t)slots, sizeof(struct proxy));
        if (nranks > 0 && nranks <= (1 << 24))
            c->p2p_seq = calloc(2 * (size_t)nranks, sizeof(uint64_t));
    }
    if (!c || !c->slots || !c->links || (c->ring && !c->proxies) || (nranks > 0 && !c->p2p_seq)) {
        say(log, NCCL_LOG_WARN, "Ingero profiler: out of memory for the operation slots; the plugin is off");
        ctx_free(c);
        return ncclSystemError;
    }
    c->comm_hash = hash;
    c->rank = rank;
    c->nranks = nranks;
    c->nnodes = nnodes;
    c->api = api;
    c->log = log;
    c->nslots = (uint32_t)slots;
    for (uint32_t i = 0; i < c->nslots; i++) {
        c->slots[i].tag = TAG_OP;
        c->slots[i].kch_tag = TAG_KCH;
        c->slots[i].ctx = c;
        if (c->proxies)
            c->proxies[i] = (struct proxy){.tag = TAG_PRX, .ctx = c};
    }
    for (int i = 0; i < NIC_CACHE; i++)
        c->nic[i].fd = -1;
    if (c->table)
        *c->table = (struct ingero_nccl_prof_table){
            .size = sizeof(struct ingero_nccl_prof_table), .version = INGERO_NCCL_PROF_VERSION, .api = api,
            .comm_hash = hash, .rank = rank, .nranks = nranks, .pid = (uint32_t)getpid(),
            .nslots = c->nslots, .slots = (uint32_t)((char *)c->slots - (char *)c->table),
            .stride = sizeof(struct op), .off_state = offsetof(struct op, state),
            .off_started = offsetof(struct op, started), .off_stopped = offsetof(struct op, reported),
            .off_rec = offsetof(struct op, rec),
            .proxy = c->ring ? (uint32_t)((char *)c->ring - (char *)c->table) : 0, .nproxy = c->nring,
            .proxy_stride = sizeof(struct ingero_nccl_prof_proxy), .magic = INGERO_NCCL_PROF_TABLE_MAGIC};
    atomic_flag_clear(&c->clk.busy);
    c->clk.window_ns = window_ms * 1000000L;
    if (name && *name)
        snprintf(c->name, sizeof(c->name), "%s", name);
    *mask = ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh
          | (c->ring ? ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileNetPlugin : 0);
    char msg[256];
    snprintf(msg, sizeof(msg), "Ingero profiler: comm %s hash 0x%llx rank %d of %d on %d nodes, profiler "
             "API v%d, %ld slots, %u proxy summaries", c->name[0] ? c->name : "-", (unsigned long long)hash, rank,
             nranks, nnodes, api, slots, c->nring);
    say(log, NCCL_LOG_INFO, msg);
    *context = c;
    return ncclSuccess;
}

static ncclResult_t finalize(void *context)
{
    struct ctx *c = context;
    if (!c)
        return ncclSuccess;
    /* NCCL sends no more events for this communicator: what is open never finished */
    for (uint32_t i = 0; i < c->nslots; i++)
        if (atomic_load_explicit(&c->slots[i].state, memory_order_acquire) == SLOT_BUSY)
            op_finish(&c->slots[i], NCCL_PROF_F_UNFINISHED);
    if (c->table)
        c->table->magic = 0;
    ctx_free(c);
    return ncclSuccess;
}

/* ---- the versioned entry points --------------------------------------- */

/* Where a version's descriptor keeps the group and the stream: v4 has no API
 * events, and a Coll/P2p event's parentObj is its group; v5 and v6 have them,
 * parentObj is the API event and the group is coll.parentGroup/p2p.parentGroup. */
#define LINKS_V4(d, e) ((e).group = (d)->parentObj)
#define LINKS_V5(d, e)                                                                          \
    ((e).group = (e).type == ncclProfileColl ? (d)->coll.parentGroup                           \
               : (e).type == ncclProfileP2p ? (d)->p2p.parentGroup : NULL,                     \
     (e).stream = (e).type == ncclProfileCollApi ? (d)->collApi.stream                         \
                : (e).type == ncclProfileP2pApi ? (d)->p2pApi.stream : NULL)

#define INGERO_START_EVENT(V, LINKS)                                                           \
    static ncclResult_t start_event_##V(void *context, void **handle,                          \
                                        ncclProfilerEventDescr_##V##_t *d)                     \
    {                                                                                          \
        struct ev e = {.type = d->type, .parent = d->parentObj, .peer = -1};                   \
        LINKS(d, e);                                                                           \
        if (e.type == ncclProfileColl) {                                                       \
            e.seq = d->coll.seqNumber;                                                         \
            e.func = d->coll.func;                                                             \
            e.count = d->coll.count;                                                           \
            e.peer = d->coll.root;                                                             \
            e.datatype = d->coll.datatype;                                                     \
            e.nch = d->coll.nChannels;                                                         \
            e.algo = d->coll.algo;                                                             \
            e.proto = d->coll.proto;                                                           \
        } else if (e.type == ncclProfileP2p) {                                                 \
            e.func = d->p2p.func;                                                              \
            e.count = d->p2p.count;                                                            \
            e.peer = d->p2p.peer;                                                              \
            e.datatype = d->p2p.datatype;                                                      \
            e.nch = d->p2p.nChannels;                                                          \
        } else if (e.type == ncclProfileKernelCh) {                                            \
            e.ptimer = d->kernelCh.pTimer;                                                     \
        } else if (e.type == ncclProfileProxyOp) {                                             \
            e.channel = d->proxyOp.channelId;                                                  \
            e.peer = d->proxyOp.peer;                                                          \
            e.nsteps = d->proxyOp.nSteps;                                                      \
            e.chunk = d->proxyOp.chunkSize;                                                    \
            e.is_send = d->proxyOp.isSend;                                                     \
        } else if (e.type == ncclProfileProxyStep) {                                           \
            e.step = d->proxyStep.step;                                                        \
        } else if (e.type == ncclProfileNetPlugin) {                                           \
            e.net_id = d->netPlugin.id;                                                        \
            e.net_data = d->netPlugin.data;                                                    \
        }                                                                                      \
        return start_event(context, handle, &e);                                               \
    }                                                                                          \
    static ncclResult_t record_state_##V(void *handle, ncclProfilerEventState_##V##_t state,   \
                                         ncclProfilerEventStateArgs_##V##_t *args)             \
    {                                                                                          \
        uint64_t arg = !args ? 0 : state == ncclProfilerKernelChStop ? args->kernelCh.pTimer    \
                     : args->proxyStep.transSize;                                              \
        return record_state(handle, state, arg);                                               \
    }

INGERO_START_EVENT(v4, LINKS_V4)
INGERO_START_EVENT(v5, LINKS_V5)
INGERO_START_EVENT(v6, LINKS_V5)

static ncclResult_t init_v4(void **context, int *mask, const char *name, uint64_t hash, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log)
{
    return init_common(context, mask, name, hash, nnodes, nranks, rank, log, 4);
}

static ncclResult_t init_v5(void **context, uint64_t hash, int *mask, const char *name, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log)
{
    return init_common(context, mask, name, hash, nnodes, nranks, rank, log, 5);
}

static ncclResult_t init_v6(void **context, uint64_t hash, int *mask, const char *name, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t log)
{
    return init_common(context, mask, name, hash, nnodes, nranks, rank, log, 6);
}

/* NCCL takes the newest it knows: v6 from NCCL 2.29, v5 in 2.28, v4 in 2.27. */
EXPORT ncclProfiler_v6_t ncclProfiler_v6 = {"Ingero", init_v6, start_event_v6, stop_event, record_state_v6,
                                            finalize};
EXPORT ncclProfiler_v5_t ncclProfiler_v5 = {"Ingero", init_v5, start_event_v5, stop_event, record_state_v5,
                                            finalize};
EXPORT ncclProfiler_v4_t ncclProfiler_v4 = {"Ingero", init_v4, start_event_v4, stop_event, record_state_v4,
                                            finalize};

/* Marks this library for the agent (ingero_agent.elfsyms), which attaches the
 * probe of the record version it returns. */
EXPORT unsigned ingero_nccl_profiler_version(void)
{
    return INGERO_NCCL_PROF_VERSION;
}
