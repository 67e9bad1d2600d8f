/* ingero.h: event records shared by the kernel side (bpf/<family>.c, compiled by bcc)
 * and the user side (ingero_agent/records.py mirrors these layouts as numpy
 * dtypes; tests/unit/test_records.py checks that the two agree).
 *
 * Every record is a fixed size and a multiple of 8 bytes, so the user side can
 * decode a whole span of a ring buffer at once instead of one Python call per
 * record. Keep fields naturally aligned and never reorder them without
 * changing records.py in the same commit.
 *
 * Times are CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns); the agent converts
 * them to wall clock with the offset it records in the `nodes` table.
 *
 * Settings arrive as -D flags from typed config (never by editing this text):
 *   INGERO_TARGET_ALL      1: trace every process; 0: only targets below
 *   INGERO_CGROUP_LEVELS   how many ancestor levels the cgroup filter checks
 *   INGERO_SCHED_MIN_NS    off-CPU intervals shorter than this are only summed
 *   INGERO_RINGBUF_PAGES   ring buffer size per probe family, in pages
 *   INGERO_RAW_TP          1: tracepoints hook as raw tracepoints (see INGERO_TRACEPOINT)
 *   INGERO_MAPS_ONLY       1: the maps without the programs (ingero_agent/probecache.py
 *                          loads the programs compiled before; every program of the
 *                          family files sits inside `#if !INGERO_MAPS_ONLY`, every map outside)
 */
#ifndef INGERO_H
#define INGERO_H

#ifndef INGERO_TARGET_ALL
#define INGERO_TARGET_ALL 0
#endif
#ifndef INGERO_CGROUP_LEVELS
#define INGERO_CGROUP_LEVELS 8
#endif
#ifndef INGERO_SCHED_MIN_NS
#define INGERO_SCHED_MIN_NS 1000000ULL
#endif
#ifndef INGERO_RINGBUF_PAGES
#define INGERO_RINGBUF_PAGES 4096
#endif
#ifndef INGERO_MAPS_ONLY
#define INGERO_MAPS_ONLY 0
#endif

/* ---- NCCL call kinds (ingero_nccl_event.op): ingero.schema.Op ----------- */
#define OP_ALL_REDUCE      1
#define OP_ALL_GATHER      2
#define OP_REDUCE_SCATTER  3
#define OP_BROADCAST       4   /* ncclBroadcast and ncclBcast */
#define OP_REDUCE          5
#define OP_SEND            6
#define OP_RECV            7
#define OP_GROUP_START     8
#define OP_GROUP_END       9
#define OP_COMM_INIT_RANK  10  /* ncclCommInitRank and ncclCommInitRankConfig */
#define OP_COMM_INIT_ALL   11
#define OP_COMM_SPLIT      12
#define OP_COMM_DESTROY    13
#define OP_COMM_ABORT      14
#define OP_COMM_INIT_RANK_CONFIG 15
#define OP_COMM_INIT_RANK_SCALABLE 16  /* ncclCommInitRankScalable (NCCL >= 2.23) */
#define OP_COMM_SHRINK     17  /* ncclCommShrink (NCCL >= 2.27) */
#define OP_COMM_GROW       18  /* ncclCommGrow (NCCL >= 2.29) */
#define OP_GROUP_SIMULATE_END 19  /* ncclGroupSimulateEnd (NCCL >= 2.22) */
#define OP_ALL_TO_ALL      20  /* ncclAlltoAll (NCCL >= 2.28) */
#define OP_GATHER          21  /* ncclGather (NCCL >= 2.28) */
#define OP_SCATTER         22  /* ncclScatter (NCCL >= 2.28) */

/* ncclResult_t values the probes treat as success for identity (nccl.h) */
#define NCCL_SUCCESS       0
#define NCCL_IN_PROGRESS   7   /* ncclInProgress: non-blocking communicators */

/* ingero_nccl_event.flags */
#define NCCL_F_IN_GROUP     1  /* called between ncclGroupStart and ncclGroupEnd */
#define NCCL_F_COMM_UNKNOWN 2  /* communicator created before tracing began */
#define NCCL_F_BCAST_ALIAS  4  /* ncclBcast (in-place) rather than ncclBroadcast */
#define NCCL_F_PENDING      8  /* init/split/shrink returned ncclInProgress before the child
                                  handle was written: `comm` is 0 here; the handle is bound to
                                  this identity at the first call made on it (see nccl.c) */

/* One record per NCCL API call, emitted at return. 104 bytes. */
struct ingero_nccl_event {
    __u64 ts_ns;         /* monotonic time at entry */
    __u64 duration_ns;   /* entry to return */
    __u64 cgroup_id;
    __u64 comm;          /* communicator handle (opaque pointer) */
    __u64 comm_hash;     /* splitmix64 fold of the ncclUniqueId (see nccl.c) */
    __u64 count;         /* elements (COMM_INIT_ALL: ndev) */
    __u64 stream;
    __u64 parent_hash;   /* COMM_SPLIT: the parent communicator's hash */
    __u32 pid;           /* tgid */
    __u32 tid;
    __u32 seq;           /* per-communicator number: collectives and p2p counted apart */
    __s32 rank;          /* -1 when not known in the kernel (split children) */
    __s32 nranks;
    __s32 peer;          /* SEND/RECV peer, BROADCAST/REDUCE root, else -1 */
    __s32 ret;           /* ncclResult_t */
    __s32 color;         /* COMM_SPLIT color, else 0 */
    __s32 key;           /* COMM_SPLIT key, else 0 */
    __u8  op;            /* OP_* */
    __u8  datatype;      /* ncclDataType_t */
    __u8  redop;         /* ncclRedOp_t */
    __u8  flags;         /* NCCL_F_* */
};

/* ---- NCCL profiler plugin (agent/nccl_profiler) ------------------------
 *
 * Ingero's NCCL profiler plugin fills one `struct ingero_nccl_prof_op` per
 * finished collective or point-to-point operation, in its own memory, and
 * fires the USDT probe `ingero:nccl_op_v<INGERO_NCCL_PROF_VERSION>` with its
 * address as the only argument; bpf/nccl_profiler.c copies it into a
 * `struct ingero_nccl_prof_event`. The plugin includes this header for the
 * layout (it is built with -I bpf/). A new layout gets a new version number,
 * so an agent and a plugin of different versions do not meet: the agent looks
 * for the probe name of its own version. */
#define INGERO_NCCL_PROF_VERSION 2

#define NCCL_PROF_COLL 1          /* ingero_nccl_prof_op.kind */
#define NCCL_PROF_P2P  2

/* ingero_nccl_prof_op.flags */
#define NCCL_PROF_F_UNFINISHED 1  /* recorded at finalize: not every kernel channel reported stop */
#define NCCL_PROF_F_STREAM     2  /* `stream` is known (profiler API v5+: the CollApi/P2pApi event's) */

/* Times are CLOCK_MONOTONIC ns (the clock of bpf_ktime_get_ns); *_raw are the
 * GPU's globaltimer ns as NCCL's kernel wrote them. 168 bytes. */
struct ingero_nccl_prof_op {
    __u32 size;            /* sizeof(struct ingero_nccl_prof_op) */
    __u16 version;         /* INGERO_NCCL_PROF_VERSION */
    __u8  kind;            /* NCCL_PROF_COLL / NCCL_PROF_P2P */
    __u8  api;             /* profiler API version NCCL loaded: 4, 5 or 6 */
    __u64 comm_hash;       /* NCCL's commHash (the init's commHash / commId argument) */
    __u64 seq;             /* collectives: NCCL's seqNumber (per communicator and
                              function); p2p: order among this rank's sends to (or
                              receives from) the same peer on this communicator */
    __u64 host_start_ns;   /* NCCL started the op's event (plan launch) */
    __u64 host_stop_ns;    /* NCCL stopped it (enqueued); 0 if it never did */
    __u64 dev_start_ns;    /* first kernel channel started, on the host clock; 0: no device timing */
    __u64 dev_stop_ns;     /* last kernel channel stopped, on the host clock */
    __u64 dev_start_raw;   /* the same two, GPU globaltimer ns */
    __u64 dev_stop_raw;
    __u64 count;           /* elements */
    __u64 func;            /* const char *: NCCL's name ("AllReduce", "Send", ...) */
    __u64 datatype;        /* const char * ("ncclFloat32", ...) */
    __u64 algo;            /* const char * ("RING", ...), 0 for p2p */
    __u64 proto;           /* const char * ("SIMPLE", ...), 0 for p2p */
    __u64 comm_name;       /* const char *: the plugin's copy of commName, 0 if none */
    __u64 dropped;         /* ops of this communicator not recorded so far (slots full) */
    __s32 rank;            /* rank in the communicator */
    __s32 nranks;
    __s32 nnodes;
    __s32 peer;            /* p2p: peer; collectives: root */
    __u32 clock_samples;   /* (host, device) time pairs the conversion was fitted on */
    __u8  nchannels;       /* kernel channels NCCL announced */
    __u8  channels;        /* kernel channels that reported */
    __u8  flags;           /* NCCL_PROF_F_* */
    __u8  _pad;
    __u64 group;           /* NCCL's Group event the op ran under (one per kernel plan: the ops
                              of one ncclGroupStart/End or coalesced launch on this communicator
                              share it), numbered from 1 per communicator; 0: none seen */
    __u64 stream;          /* the cudaStream_t of the op's API call (NCCL_PROF_F_STREAM) */
};

/* ---- Operations in flight (the plugin's table, read live by the agent) ----
 *
 * The plugin keeps each communicator's operation slots in one shared-memory
 * mapping of its own (memfd_create(INGERO_NCCL_PROF_TABLE_NAME): the line
 * "/memfd:ingero-nccl-ops (deleted)" in /proc/<pid>/maps) that begins with a
 * `struct ingero_nccl_prof_table`. A slot whose state word is 1 holds an
 * operation NCCL started and that is not recorded yet: its `struct
 * ingero_nccl_prof_op` is filled from the start (times so far; dev_start_ns
 * once a kernel channel started) and its counters say how many kernel
 * channels started and stopped. The agent reads the mapping through
 * /proc/<pid>/mem at each roll (ingero_agent.devinflight): a collective the
 * GPU started and never finished is seen without any probe having fired. A
 * slot may be read while it is being written: a record whose size or version
 * is wrong is skipped.
 *
 * The same mapping holds a ring of proxy summaries (`proxy`, `nproxy`
 * entries): one `struct ingero_nccl_prof_proxy` per ProxyOp NCCL stopped,
 * numbered from 1 (`proxy_head`: how many were written), that the agent
 * drains at each roll: an entry whose `seq` is not the number it expects was
 * overwritten (counted lost) or is being written (read next time). */
#define INGERO_NCCL_PROF_TABLE_NAME  "ingero-nccl-ops"
#define INGERO_NCCL_PROF_TABLE_MAGIC 0x53504f5245474e49ULL   /* "INGEROPS" */

struct ingero_nccl_prof_table {
    __u64 magic;           /* INGERO_NCCL_PROF_TABLE_MAGIC; 0 once the communicator is finalized */
    __u32 size;            /* sizeof(struct ingero_nccl_prof_table) */
    __u16 version;         /* INGERO_NCCL_PROF_VERSION: the layout of the slots' records */
    __u16 api;             /* profiler API version NCCL loaded */
    __u64 comm_hash;
    __s32 rank;            /* rank in the communicator */
    __s32 nranks;
    __u32 pid;             /* the process that created it (a forked child maps it too) */
    __u32 nslots;
    __u32 slots;           /* offset of slot 0 from the start of this header */
    __u32 stride;          /* bytes from one slot to the next */
    __u32 off_state;       /* in a slot: __u32, 1 while the operation is open */
    __u32 off_started;     /* __s32: kernel channels started */
    __u32 off_stopped;     /* __s32: kernel channels that reported stop */
    __u32 off_rec;         /* struct ingero_nccl_prof_op */
    __u32 proxy;           /* offset of the proxy ring's entry 0 from the start of this header; 0: none */
    __u32 nproxy;          /* its entries */
    __u32 proxy_stride;    /* bytes from one entry to the next */
    __u32 _pad;
    __u64 proxy_head;      /* entries written so far; entry n (from 1) is at (n - 1) % nproxy */
    __u64 proxy_dropped;   /* ProxyOps not summarised: no free slot */
};

/* ingero_nccl_prof_proxy.wait_ns: time in each of NCCL's proxy step states
 * (src/include/plugin/nccl_profiler.h), from the state's record to the next
 * one or to the step's stop. */
#define NCCL_PROXY_SEND_GPU   0   /* ProxyStepSendGPUWait: the send waits for the GPU's data */
#define NCCL_PROXY_SEND_PEER  1   /* ProxyStepSendPeerWait_v4: ... for the receiver's clear-to-send */
#define NCCL_PROXY_SEND_NET   2   /* ProxyStepSendWait: ... for the network to complete it */
#define NCCL_PROXY_RECV_NET   3   /* ProxyStepRecvWait: the receive waits for the network's data */
#define NCCL_PROXY_RECV_FLUSH 4   /* ProxyStepRecvFlushWait: ... for the flush to GPU memory */
#define NCCL_PROXY_RECV_GPU   5   /* ProxyStepRecvGPUWait: ... for the GPU to consume it */
#define NCCL_PROXY_WAITS      6

#define NCCL_PROXY_NET_IB     1   /* ingero_nccl_prof_proxy.net: the NetPlugin events that named the NIC */
#define NCCL_PROXY_NET_SOCKET 2

/* One ProxyOp (an operation's transfers with one peer on one channel, one
 * direction), summarised over its steps. Times CLOCK_MONOTONIC ns. 144 bytes. */
struct ingero_nccl_prof_proxy {
    __u64 seq;             /* its number in the ring (from 1); 0 while it is being written */
    __u64 op_seq;          /* the operation's seq, as in its ingero_nccl_prof_op */
    __u64 func;            /* const char *: the operation's NCCL function name; 0: parent unknown */
    __u64 start_ns;        /* ProxyOp started */
    __u64 stop_ns;         /* ... and stopped */
    __u64 bytes;           /* the steps' transSize, summed */
    __u64 wait_ns[NCCL_PROXY_WAITS];
    __s32 peer;            /* the peer's rank in the communicator */
    __s32 nsteps;          /* steps NCCL announced */
    __s32 steps;           /* steps that stopped */
    __s32 chunk_size;
    __s32 nic_port;        /* -1: unknown (sockets have none; the IB events give no port) */
    __s32 nic_index;       /* IB: NCCL's network device index (the QP events' `device`); -1 */
    __u8  is_send;
    __u8  channel;
    __u8  net;             /* NCCL_PROXY_NET_*; 0: no NetPlugin event seen */
    __u8  _pad[5];
    char  nic_device[16];  /* sockets: the interface of the connection's local address; "": unknown */
};

/* One record per finished NCCL operation seen by the profiler plugin. 288 bytes. */
struct ingero_nccl_prof_event {
    __u64 ts_ns;           /* when the probe fired */
    __u64 cgroup_id;
    __u32 pid;
    __u32 tid;             /* the thread that finished it (NCCL's proxy thread, usually) */
    char  func[16];        /* the strings the op points to, read by the probe */
    char  datatype[16];
    char  algo[16];
    char  proto[16];
    char  comm_name[32];
    struct ingero_nccl_prof_op op;
};

/* ---- TCP -------------------------------------------------------------- */
#define TCP_EV_RETRANSMIT     1  /* tcp:tcp_retransmit_skb */
#define TCP_EV_SEND_RESET     2  /* tcp:tcp_send_reset */
#define TCP_EV_RECEIVE_RESET  3  /* tcp:tcp_receive_reset */
#define TCP_EV_STATE          4  /* sock:inet_sock_set_state */

/* ingero_tcp_event.owner_src: how the owner (pid/cgroup) was found */
#define OWNER_NONE     0  /* not known in the kernel; user space matches by address */
#define OWNER_SOCKET   1  /* socket owner map, filled in process context */
#define OWNER_CURRENT  2  /* the current task (only in process context) */

/* One record per TCP event. 80 bytes. Addresses are in network order; an
 * IPv4 address sits in the first 4 bytes. */
struct ingero_tcp_event {
    __u64 ts_ns;
    __u64 cgroup_id;     /* owner's cgroup, 0 when not known */
    __u64 skaddr;        /* struct sock pointer: identifies the connection */
    __u32 pid;           /* owner's tgid, 0 when not known */
    __u32 tid;
    __u8  saddr[16];
    __u8  daddr[16];
    __u16 sport;         /* host order */
    __u16 dport;
    __u16 family;        /* AF_INET 2, AF_INET6 10 */
    __u8  kind;          /* TCP_EV_* */
    __u8  state;         /* TCP state (new state for TCP_EV_STATE) */
    __u8  oldstate;
    __u8  owner_src;     /* OWNER_* */
    __u8  _pad[6];
};

/* ---- Scheduler -------------------------------------------------------- */
#define OFFCPU_RUNQUEUE 0  /* preempted while runnable: waited for a CPU (incl. CFS throttling) */
#define OFFCPU_IO       1  /* uninterruptible sleep (TASK_UNINTERRUPTIBLE): I/O, page faults, locks */
#define OFFCPU_SLEEP    2  /* voluntary sleep (TASK_INTERRUPTIBLE): waiting on a socket, futex, timer */

/* One record per off-CPU interval of a target thread longer than
 * INGERO_SCHED_MIN_NS. 48 bytes. */
struct ingero_sched_event {
    __u64 ts_ns;         /* when the thread left the CPU */
    __u64 off_ns;        /* until it ran again */
    __u64 runq_ns;       /* part of off_ns spent runnable, waiting for a CPU */
    __u64 cgroup_id;
    __u32 pid;
    __u32 tid;
    __u8  reason;        /* OFFCPU_* */
    __u8  _pad[7];
};

/* Indexes of the per-CPU lost-event counters (map `lost`): each ring's lost_slot in
 * ingero/families.py. */
#define LOST_NCCL  0
#define LOST_TCP   1
#define LOST_SCHED 2
#define LOST_NCCL_PROFILER 3
#define LOST_SLOTS 4

/* ---- Shared maps and the target filter (kernel side only) ---------------
 *
 * The loader (ingero_agent/probes.py) compiles this header together with the
 * family files (nccl.c, tcp.c, sched.c) as one BPF program, so the families
 * share these maps. bcc rewrites map method calls (`m.lookup()`) only in the
 * text it compiles as its main file, which is why the loader inlines this
 * header rather than letting the preprocessor include it; user-space C that
 * only needs the record layouts leaves INGERO_BPF_PROGRAM undefined.
 *
 * Further settings (-D flags):
 *   INGERO_MAX_TARGETS    capacity of the target cgroup / tgid / IP maps
 *   INGERO_EXEC_NOTIFY    1: note execs of target processes in `exec_notes`
 */
#ifdef INGERO_BPF_PROGRAM

#include <uapi/linux/ptrace.h>   /* struct pt_regs for the uprobes */

/* User memory reads: the helpers bpf_probe_read_user(_str) under names of our own. bcc's
 * front end looks every call it compiles of a function named bpf_probe_read_user(_str) up in
 * the kernel's symbols, and each look-up rebuilds a table of all /proc/kallsyms names (bcc
 * 0.26: ~0.07 s of CPU per call site, a third of the NCCL programs' compile). Called through
 * these pointers the helpers are the same instructions and cost the compile nothing; every
 * kernel these probes load on has them (5.5+; ring buffers need 5.8). */
static int (*ingero_read_user)(void *dst, __u32 size, const void *src) =
    (void *)BPF_FUNC_probe_read_user;
static int (*ingero_read_user_str)(void *dst, __u32 size, const void *src) =
    (void *)BPF_FUNC_probe_read_user_str;

/* A tracepoint hook: with INGERO_RAW_TP a raw tracepoint (BPF_RAW_TRACEPOINT_OPEN: an fd,
 * no perf event, so detaching it waits on no global lock; the program gets the
 * tracepoint's TP_PROTO arguments in ctx->args[]), else the tracepoint's perf event (its
 * formatted fields in args->). For hooks whose body reads neither. */
#ifndef INGERO_RAW_TP
#define INGERO_RAW_TP 0
#endif
#if INGERO_RAW_TP
#define INGERO_TRACEPOINT(category, event) RAW_TRACEPOINT_PROBE(event)
#else
#define INGERO_TRACEPOINT(category, event) TRACEPOINT_PROBE(category, event)
#endif

#ifndef INGERO_MAX_TARGETS
#define INGERO_MAX_TARGETS 4096
#endif
#ifndef INGERO_EXEC_NOTIFY
#define INGERO_EXEC_NOTIFY 0
#endif

/* Target cgroup ids (cgroup v2 inode numbers). A task is a target when its
 * own cgroup or one of its ancestors at levels 1..INGERO_CGROUP_LEVELS is in
 * here, so containers created later inside a target pod cgroup are covered. */
BPF_HASH(target_cgroups, u64, u8, INGERO_MAX_TARGETS);
/* Target processes by tgid (`--pid`). */
BPF_HASH(target_tgids, u32, u8, INGERO_MAX_TARGETS);
/* The tracer's own tgid (set by the loader right after the load): never a target, even
 * with INGERO_TARGET_ALL. A map rather than a -D flag, so that every tracer process
 * loads the same compiled program (ingero_agent/probecache.py). */
BPF_ARRAY(self_tgid, u32, 1);
/* Events dropped because a ring buffer was full, per family (LOST_*). */
BPF_PERCPU_ARRAY(lost, u64, LOST_SLOTS);

static __always_inline void ingero_count_lost(int slot)
{
    u64 *n = lost.lookup(&slot);
    if (n)
        (*n)++;
}

/* Reader wake-ups (watermark). The families write records with
 * BPF_RB_NO_WAKEUP, so a quiet ring never wakes the agent; the agent drains
 * on its own schedule (every segment roll) and sleeps in epoll on the ring
 * buffers in between. `ring_produced[slot]` counts the records offered to a
 * family's ring; once it reaches `ring_wake_at[slot]` (set by the agent after
 * each drain to what it had produced then plus a quarter of the ring's
 * capacity) every further record forces a wake-up, so a burst is drained
 * while three quarters of the ring are still free. 0 in ring_wake_at: never
 * wake (a reader that polls). One cache line per family's counter. */
struct ingero_ring_count {
    u64 produced;
    u64 _pad[7];
};
BPF_ARRAY(ring_produced, struct ingero_ring_count, LOST_SLOTS);
BPF_ARRAY(ring_wake_at, u64, LOST_SLOTS);

/* Flags for bpf_ringbuf_output of family `slot`: counts the record. */
static __always_inline u64 ingero_ring_flags(int slot)
{
    struct ingero_ring_count *c = ring_produced.lookup(&slot);
    u64 *at = ring_wake_at.lookup(&slot);
    if (!c || !at)
        return BPF_RB_NO_WAKEUP;
    __sync_fetch_and_add(&c->produced, 1);
    u64 mark = *at;
    return (mark && c->produced >= mark) ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

/* Bumped by the agent after every change of target_tgids / target_cgroups
 * (ingero_agent/probes.py set_targets), so a verdict of ingero_is_target()
 * cached with the value it had is known to be stale (bpf/nccl.c). */
BPF_ARRAY(target_gen, u64, 1);

static __always_inline u64 ingero_target_gen(void)
{
    int zero = 0;
    u64 *g = target_gen.lookup(&zero);
    return g ? *g : 0;
}

/* Is the current task (tgid, cgroup cgid) traced? */
static __always_inline int ingero_is_target(u32 tgid, u64 cgid)
{
    int zero = 0;
    u32 *self = self_tgid.lookup(&zero);
    if (self && *self && tgid == *self)
        return 0;
    if (INGERO_TARGET_ALL)
        return 1;
    if (target_tgids.lookup(&tgid))
        return 1;
    if (target_cgroups.lookup(&cgid))
        return 1;
#pragma unroll
    for (int level = 1; level <= INGERO_CGROUP_LEVELS; level++) {
        u64 anc = bpf_get_current_ancestor_cgroup_id(level);
        if (anc == 0 || anc == cgid)
            break;  /* deeper than the task's own cgroup */
        if (target_cgroups.lookup(&anc))
            return 1;
    }
    return 0;
}

/* ingero_is_target() of the current thread, cached in the thread's own
 * task-local storage where the kernel has it (-D INGERO_TASK_STORAGE, see
 * bpf/nccl.c): the verdict depends only on the tgid (fixed for a thread), the
 * cgroup (checked) and the target maps (target_gen changes with them). The
 * TCP hooks run for every thread of the machine, on every socket read or
 * write (and the sched hook on every context switch: bpf/sched.c keeps the
 * same cache in its own per-thread slot); a cached verdict costs one storage lookup
 * and one array read instead of two hash lookups and the ancestor walk (up to
 * INGERO_CGROUP_LEVELS helper calls and lookups) for a thread that is no
 * target. Every thread that reaches a hook gets a slot, freed by the kernel
 * with the thread; where none can be had (no memory, or a nested program
 * holds the task's storage lock) the filter runs uncached. */
#ifndef INGERO_TASK_STORAGE
#define INGERO_TASK_STORAGE 0
#endif
#if INGERO_TASK_STORAGE
struct ingero_verdict {
    u64 gen;          /* target_gen + 1 when `target` was decided (0: never) */
    u64 cgid;         /* the thread's cgroup then */
    u32 target;
    u32 _pad;
};
BPF_TASK_STORAGE(target_verdicts, struct ingero_verdict);
#endif

#if INGERO_TASK_STORAGE
/* The current thread's cached verdict `v` (in some task-local slot of its own),
 * decided again when the targets changed (target_gen) or the thread moved to
 * another cgroup. The tgid is read only then. */
static __always_inline u32 ingero_cached_verdict(struct ingero_verdict *v, u64 cgid)
{
    u64 gen = ingero_target_gen() + 1;
    if (v->gen != gen || v->cgid != cgid) {
        v->target = ingero_is_target(bpf_get_current_pid_tgid() >> 32, cgid);
        v->gen = gen;
        v->cgid = cgid;
    }
    return v->target;
}
#endif

static __always_inline int ingero_current_is_target(u32 tgid, u64 cgid)
{
#if INGERO_TASK_STORAGE
    struct ingero_verdict *v = target_verdicts.task_storage_get(bpf_get_current_task_btf(), 0,
                                                                BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (v)
        return ingero_cached_verdict(v, cgid);
#endif
    return ingero_is_target(tgid, cgid);
}

#if INGERO_EXEC_NOTIFY
/* A target process started a program (exec): tell the agent at once, so it
 * looks for the program's NCCL library now rather than at its next periodic
 * scan. One record (the tgid) per exec; the ring wakes the agent when it was
 * empty (adaptive wake-up), and a full ring just drops the note: the
 * periodic scans still find the process. */
BPF_RINGBUF_OUTPUT(exec_notes, 1);

#if !INGERO_MAPS_ONLY
INGERO_TRACEPOINT(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!ingero_is_target(id >> 32, bpf_get_current_cgroup_id()))
        return 0;
    u64 tgid = id >> 32;
    exec_notes.ringbuf_output(&tgid, sizeof(tgid), 0);
    return 0;
}
#endif /* !INGERO_MAPS_ONLY */
#endif

#if INGERO_MAPS_ONLY
/* bcc loads a module's BTF, which the task-storage maps are created with, only when the
 * module has a program: this one, never loaded. */
int ingero_maps_only(void *ctx)
{
    return 0;
}
#endif

#endif /* INGERO_BPF_PROGRAM */

#endif /* INGERO_H */
