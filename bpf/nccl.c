/* nccl.c: NCCL host API calls of target processes (uprobes + uretprobes).
 *
 * Hooks: entry and return of ncclAllReduce, ncclAllGather, ncclReduceScatter,
 * ncclBroadcast, ncclBcast, ncclReduce, ncclSend, ncclRecv, ncclGroupStart,
 * ncclGroupEnd, ncclCommInitRank, ncclCommInitRankConfig, ncclCommInitAll,
 * ncclCommSplit, ncclCommDestroy and ncclCommAbort; and, where the library
 * has them (signatures from NVIDIA's src/nccl.h.in, NCCL 2.30.7):
 * ncclGroupSimulateEnd (2.22), ncclCommInitRankScalable (2.23),
 * ncclCommShrink (2.27), ncclAlltoAll, ncclGather, ncclScatter (2.28) and
 * ncclCommGrow (2.29). The loader attaches the
 * entry program `nccl_enter_<name>` and the shared return program
 * `nccl_return` (ncclCommInitAll: `nccl_return_init_all`) to every one of
 * these symbols a library exports.
 *
 * At entry the arguments go into a per-thread frame (task-local storage, or a
 * hash keyed by pid_tgid on older kernels; see nccl_frames); at return one
 * `struct ingero_nccl_event` is written straight into the `nccl_events` ring
 * buffer with duration and return code.
 *
 * Arguments: where each one is comes from the per-machine table in
 * agent/ingero_agent/abi.py (-D ARG_<function>_<parameter>). On x86-64 (SysV)
 * integer/pointer arguments are in rdi, rsi, rdx, rcx, r8, r9, then on the
 * stack at SP+8, SP+16 at entry (SP holds the return address); ncclUniqueId
 * is a 128-byte struct passed BY VALUE: class MEMORY, copied onto the stack
 * at SP+8, taking no register, so the int arguments after it move up
 * (ncclCommInitRank: rdi=comm*, rsi=nranks, rdx=rank). On aarch64 (AAPCS64
 * rule B.4) the id is copied by the caller and passed BY REFERENCE: a pointer
 * in x2, rank in x3; x0..x7 carry every other probed argument, and the return
 * SP equals the entry SP (INGERO_RET_SP_DELTA 0, 8 on x86-64).
 *
 * Communicators: a map (tgid, handle) -> {hash, rank, nranks, counters}.
 *   - InitRank(Config): hash = fold of the 16 words of the id (see
 *     ingero_hash_uid), identical on every rank of the communicator.
 *   - InitAll: one record per communicator created (rank i of ndev, `count`
 *     = ndev); hash from (tgid, comms pointer, entry time).
 *   - Split: child hash = splitmix64(parent_hash ^ splitmix64((u32)color)
 *     ^ n) where n is the parent's split counter, so every rank of the
 *     parent that splits with the same color gets the same hash. The record
 *     carries the new handle in `comm`, the child hash in `comm_hash`, the
 *     parent's hash, color and key; rank/nranks are -1 (resolved in user
 *     space across ranks).
 *   - InitRankScalable(comm*, nranks, myrank, nId, ncclUniqueId* commIds,
 *     config*): the ids come BY REFERENCE (an array of nId); hash = fold of
 *     the FIRST id. NCCL requires every rank to pass the same ids in the same
 *     order, so ids[0] names the communicator on every rank.
 *   - Shrink(comm, excludeRanksList*, excludeRanksCount, newcomm*, config*,
 *     flags): only the survivors call it. child hash = splitmix64(parent ^
 *     SHRINK_SALT ^ n), n the parent's shrink counter; rank = parent rank
 *     minus the excluded ranks below it, nranks = parent nranks - count
 *     (up to INGERO_NCCL_SHRINK_MAX excluded ranks read; more: rank -1).
 *   - Grow(comm, nRanks, const ncclUniqueId* id, rank, newcomm*, config*):
 *     new ranks (comm NULL) take the fold of *id and their rank argument.
 *     Existing ranks (comm != NULL, rank -1) keep their rank; `parent_hash`
 *     = the parent's, `color` = n, the parent's grow counter. The coordinator
 *     (the existing rank that passes the id, per nccl.h.in) takes the fold of
 *     *id too; the others get no id (NULL) and take splitmix64(parent ^
 *     GROW_SALT ^ n). Once the traces of all nodes meet, ingero/comms.py
 *     finds the coordinator's record by (parent, n) and gives those the id's
 *     identity, so every member of the grown communicator carries one hash.
 *   - Destroy/Abort remove the entry at return.
 *
 * ncclInProgress (7) counts as success for identity. A non-blocking init
 * writes the new handle before returning 7 (NCCL init.cc), so it is read at
 * return as for 0. A non-blocking split/shrink writes the child handle only
 * when its async job finishes: the return then sees NULL, and the identity is
 * parked in `nccl_pending` (per process, INGERO_NCCL_PENDING slots) with the
 * address the handle will be written to. The first traced call on a handle
 * the map does not know (a collective, p2p, a later split, destroy) reads
 * each parked address of its process; the one holding that handle gives the
 * communicator its identity. Nothing runs on the hot path: only a call on an
 * unknown handle looks at the slots. ncclCommGetAsyncError is not probed
 * (PyTorch's watchdog polls it constantly).
 * A call on a handle created before tracing began gets NCCL_F_COMM_UNKNOWN,
 * comm_hash 0, rank/nranks -1, and a sequence counted from its first call.
 *
 * seq: per communicator, collectives and point-to-point counted apart, so
 * the same collective has the same (comm_hash, seq) on every rank.
 *
 * Nesting: NCCL calls its own public functions (ncclBcast -> ncclBroadcast,
 * ncclCommInitAll -> ncclGroupStart/End). A traced call entered while another
 * is open on the same thread (deeper on its stack) is not recorded and does
 * not count.
 */
#include "ingero.h"

#ifndef INGERO_NCCL_INITALL_MAX
#define INGERO_NCCL_INITALL_MAX 16   /* communicators mapped per ncclCommInitAll */
#endif
#ifndef INGERO_NCCL_SHRINK_MAX
#define INGERO_NCCL_SHRINK_MAX 16    /* excluded ranks read per ncclCommShrink (a power of 2) */
#endif
#ifndef INGERO_NCCL_PENDING
#define INGERO_NCCL_PENDING 8        /* parked non-blocking children per process */
#endif
#define NCCL_SHRINK_SALT 0x5348524b00000000ULL  /* "SHRK" */
#define NCCL_GROW_SALT   0x47524f5700000000ULL  /* "GROW" */

BPF_RINGBUF_OUTPUT(nccl_events, INGERO_RINGBUF_PAGES);

struct nccl_frame {
    /* the call: cleared at every traced entry (up to `depth`) */
    u64 ts;
    u64 cgroup_id;
    u64 comm;          /* handle; for InitRank/InitAll/Split the output pointer */
    u64 count;
    u64 stream;
    u64 hash;
    u64 parent_hash;
    u64 sp;            /* stack pointer at entry: tells nested calls and stale frames apart;
                          0 once the call returned (the slot stays, for the next call) */
    u32 seq;
    s32 rank;
    s32 nranks;
    s32 peer;
    s32 color;
    s32 key;
    u8 op;
    u8 datatype;
    u8 redop;
    u8 flags;
    u32 _pad;
    /* the thread: kept across calls */
    u32 depth;         /* ncclGroupStart depth of the thread */
    u32 target;        /* the target filter's verdict for (tgid, target_gen, filter_cgid) */
    u64 filter_gen;    /* target_gen + 1 when `target` was decided (0: never) */
    u64 filter_cgid;   /* the thread's cgroup then */
};
/* One slot per thread, written in place: the entry program fills it, the
 * return program reads it and marks it closed (sp = 0); the thread's group
 * depth lives in the same slot. Where the slot is kept (-D INGERO_TASK_STORAGE
 * from the loader, ingero_agent/probes.py):
 *
 *   1: task-local storage (BPF_MAP_TYPE_TASK_STORAGE, kernel >= 5.11 with BTF):
 *      the slot hangs off the task itself, found through a per-map cache slot
 *      in the task's storage, no hashing, no bucket lock; created on the
 *      thread's first traced call and freed by the kernel when the task goes.
 *   0: a plain preallocated hash keyed by pid_tgid (older kernels, or no
 *      kernel BTF): a thread's first call inserts its slot, later calls
 *      rewrite it in place (a hash update allocates and frees an element and
 *      a delete takes the bucket lock, which cost more than the rest of the
 *      probe); the slot is removed at the thread's exit (sched_process_exit
 *      below). Not LRU: an LRU lookup costs ~9% more per call.
 *
 * bench/uprobe_cost.py --bpf-stats measures the programs' run time per call. */
#if INGERO_TASK_STORAGE   /* its default: bpf/ingero.h */
BPF_TASK_STORAGE(nccl_frames, struct nccl_frame);

/* The current thread's slot; `create`: make a zeroed one if it has none. */
static __always_inline struct nccl_frame *nccl_slot(int create)
{
    return nccl_frames.task_storage_get(bpf_get_current_task_btf(), 0,
                                        create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
}
#else
BPF_HASH(nccl_frames, u64, struct nccl_frame, 16384);

static __always_inline struct nccl_frame *nccl_slot(int create)
{
    u64 id = bpf_get_current_pid_tgid();
    struct nccl_frame *f = nccl_frames.lookup(&id);
    if (f || !create)
        return f;
    struct nccl_frame zero = {};
    nccl_frames.insert(&id, &zero);    /* the thread's first call only */
    return nccl_frames.lookup(&id);
}
#endif

struct nccl_comm_key {
    u32 tgid;
    u32 _pad;
    u64 comm;
};
struct nccl_comm_val {
    u64 hash;
    s32 rank;
    s32 nranks;
    u32 coll_seq;
    u32 p2p_seq;
    u32 splits;
    u32 flags;         /* NCCL_F_COMM_UNKNOWN */
    u32 shrinks;
    u32 grows;
};
BPF_HASH(nccl_comms, struct nccl_comm_key, struct nccl_comm_val, 65536);

/* Children of non-blocking splits/shrinks whose handle was not written yet. */
struct nccl_pending_key {
    u32 tgid;
    u32 slot;
};
struct nccl_pending_val {
    u64 out;           /* user address the child handle will be written to */
    u64 hash;
    s32 rank;
    s32 nranks;
};
BPF_HASH(nccl_pending, struct nccl_pending_key, struct nccl_pending_val, 4096);

static __always_inline u64 ingero_splitmix64(u64 x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* h = 0; for each of the 16 little-endian u64 words w: h = splitmix64(h ^ w) */
static __always_inline u64 ingero_hash_uid(const void *uid)
{
    u64 w[16] = {};
    if (ingero_read_user(w, sizeof(w), uid) != 0)
        return 0;
    u64 h = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        h = ingero_splitmix64(h ^ w[i]);
    return h;
}

/* The 8-byte stack word at SP + off at entry. Where each argument is (register,
 * stack slot, by-value copy) comes from agent/ingero_agent/abi.py as -D flags
 * ARG_<function>_<parameter>, per machine (x86-64 SysV, AAPCS64). */
static __always_inline u64 nccl_stack_word(struct pt_regs *ctx, int off)
{
    u64 v = 0;
    ingero_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + off));
    return v;
}

#ifndef INGERO_RET_SP_DELTA
#error "build through ingero_agent.probes: the argument table (abi.py) gives the -D flags"
#endif

/* Starts a frame in the thread's slot and returns it; NULL when the call is
 * not traced (not a target, or nested). Every entry program then fills the
 * slot in place: nothing after this can decide not to record the call.
 *
 * Nesting is judged by the stack pointer, not by a counter: a call made
 * inside an open one runs deeper (lower SP) on the same thread's stack. An
 * open frame at or below the current SP belongs to a call whose return we
 * never saw (thread unwound by longjmp): it is stale and replaced, so one
 * lost return cannot silence a thread for good. (Until such a call comes,
 * calls made deeper than the lost one, e.g. with stack-passed arguments,
 * still look nested: the same rule the kernel uses to drop stale uretprobe
 * instances.) */
static __always_inline struct nccl_frame *nccl_begin(struct pt_regs *ctx, u8 op)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 cgid = bpf_get_current_cgroup_id();
#if INGERO_TASK_STORAGE
    /* The filter's verdict is cached in the thread's slot: it depends only on
     * the tgid (fixed for a thread), the cgroup (checked) and the target maps
     * (target_gen changes with them), so a thread's calls after its first
     * cost one array read instead of the filter's hash lookups and ancestor
     * walk. Non-target threads get a slot too (freed with the thread). */
    struct nccl_frame *f = nccl_slot(1);
    if (!f)
        return 0;
    u64 gen = ingero_target_gen() + 1;
    if (f->filter_gen != gen || f->filter_cgid != cgid) {
        f->target = ingero_is_target(id >> 32, cgid);
        f->filter_gen = gen;
        f->filter_cgid = cgid;
    }
    if (!f->target)
        return 0;
#else
    if (!ingero_is_target(id >> 32, cgid))
        return 0;
    struct nccl_frame *f = nccl_slot(1);
    if (!f)
        return 0;
#endif
    u64 sp = PT_REGS_SP(ctx);
    if (f->sp && sp < f->sp)
        return 0;
    u32 depth = f->depth;
    __builtin_memset(f, 0, __builtin_offsetof(struct nccl_frame, depth));
    f->sp = sp;
    f->ts = bpf_ktime_get_ns();
    f->cgroup_id = cgid;
    f->op = op;
    f->rank = -1;
    f->nranks = -1;
    f->peer = -1;
    if (depth > 0)
        f->flags = NCCL_F_IN_GROUP;
    return f;
}

/* A handle the map does not know: is it the child of a non-blocking
 * split/shrink parked in nccl_pending? Then it takes the parked identity. */
static __always_inline void nccl_adopt_pending(u32 tgid, u64 comm, struct nccl_comm_val *v)
{
#pragma unroll
    for (u32 i = 0; i < INGERO_NCCL_PENDING; i++) {
        struct nccl_pending_key pk = {.tgid = tgid, .slot = i};
        struct nccl_pending_val *p = nccl_pending.lookup(&pk);
        if (!p)
            continue;
        u64 handle = 0;
        ingero_read_user(&handle, sizeof(handle), (void *)p->out);
        if (handle != comm)
            continue;
        v->hash = p->hash;
        v->rank = p->rank;
        v->nranks = p->nranks;
        v->flags = 0;
        nccl_pending.delete(&pk);
        return;
    }
}

/* Parks a child identity until its handle appears; a full table drops it. */
static __always_inline void nccl_park(u64 out, u64 hash, s32 rank, s32 nranks)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct nccl_pending_val pv = {.out = out, .hash = hash, .rank = rank, .nranks = nranks};
#pragma unroll
    for (u32 i = 0; i < INGERO_NCCL_PENDING; i++) {
        struct nccl_pending_key pk = {.tgid = tgid, .slot = i};
        if (nccl_pending.insert(&pk, &pv) == 0)
            return;
    }
}

/* Looks up a communicator for a call on it and takes the next seq number. */
static __always_inline void nccl_on_comm(struct nccl_frame *f, u64 comm, int p2p)
{
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = comm};
    f->comm = comm;
    struct nccl_comm_val *v = nccl_comms.lookup(&k);
    if (!v) {
        struct nccl_comm_val unknown = {.rank = -1, .nranks = -1, .flags = NCCL_F_COMM_UNKNOWN};
        nccl_adopt_pending(k.tgid, comm, &unknown);
        nccl_comms.insert(&k, &unknown);
        v = nccl_comms.lookup(&k);
        if (!v) {
            f->flags |= NCCL_F_COMM_UNKNOWN;
            return;
        }
    }
    f->hash = v->hash;
    f->rank = v->rank;
    f->nranks = v->nranks;
    f->flags |= (u8)v->flags;
    /* Plain increments: NCCL does not allow concurrent calls on one
     * communicator, so calls on it are already serialized. */
    if (p2p) {
        f->seq = v->p2p_seq;
        v->p2p_seq = f->seq + 1;
    } else {
        f->seq = v->coll_seq;
        v->coll_seq = f->seq + 1;
    }
}

static __always_inline void nccl_put_comm(u64 comm, u64 hash, s32 rank, s32 nranks)
{
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = comm};
    struct nccl_comm_val v = {.hash = hash, .rank = rank, .nranks = nranks};
    nccl_comms.update(&k, &v);
}

#if !INGERO_MAPS_ONLY   /* the programs: bpf/ingero.h */
/* A thread that exits (or is killed) inside an NCCL call or group leaves its
 * frame and group depth behind: drop them (task storage: the kernel does). */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
#if !INGERO_TASK_STORAGE
    nccl_frames.delete(&id);
#endif
    if ((u32)id == (u32)(id >> 32)) {   /* the process itself: its parked children go too */
#pragma unroll
        for (u32 i = 0; i < INGERO_NCCL_PENDING; i++) {
            struct nccl_pending_key pk = {.tgid = id >> 32, .slot = i};
            nccl_pending.delete(&pk);
        }
    }
    return 0;
}

/* ---- entry programs, one per signature --------------------------------- */

/* ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream) */
int nccl_enter_ncclAllReduce(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_ALL_REDUCE);
    if (!f)
        return 0;
    f->count = ARG_ncclAllReduce_count;
    f->datatype = ARG_ncclAllReduce_datatype;
    f->redop = ARG_ncclAllReduce_op;
    f->stream = ARG_ncclAllReduce_stream;
    nccl_on_comm(f, ARG_ncclAllReduce_comm, 0);
    return 0;
}

/* ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream) */
int nccl_enter_ncclAllGather(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_ALL_GATHER);
    if (!f)
        return 0;
    f->count = ARG_ncclAllGather_sendcount;
    f->datatype = ARG_ncclAllGather_datatype;
    f->stream = ARG_ncclAllGather_stream;
    nccl_on_comm(f, ARG_ncclAllGather_comm, 0);
    return 0;
}

/* ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream) */
int nccl_enter_ncclReduceScatter(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_REDUCE_SCATTER);
    if (!f)
        return 0;
    f->count = ARG_ncclReduceScatter_recvcount;
    f->datatype = ARG_ncclReduceScatter_datatype;
    f->redop = ARG_ncclReduceScatter_op;
    f->stream = ARG_ncclReduceScatter_stream;
    nccl_on_comm(f, ARG_ncclReduceScatter_comm, 0);
    return 0;
}

/* ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream) */
int nccl_enter_ncclBroadcast(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_BROADCAST);
    if (!f)
        return 0;
    f->count = ARG_ncclBroadcast_count;
    f->datatype = ARG_ncclBroadcast_datatype;
    f->peer = ARG_ncclBroadcast_root;
    f->stream = ARG_ncclBroadcast_stream;
    nccl_on_comm(f, ARG_ncclBroadcast_comm, 0);
    return 0;
}

/* ncclBcast(buff, count, datatype, root, comm, stream) */
int nccl_enter_ncclBcast(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_BROADCAST);
    if (!f)
        return 0;
    f->flags |= NCCL_F_BCAST_ALIAS;
    f->count = ARG_ncclBcast_count;
    f->datatype = ARG_ncclBcast_datatype;
    f->peer = ARG_ncclBcast_root;
    f->stream = ARG_ncclBcast_stream;
    nccl_on_comm(f, ARG_ncclBcast_comm, 0);
    return 0;
}

/* ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream):
 * comm and stream are the 1st and 2nd stack arguments. */
int nccl_enter_ncclReduce(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_REDUCE);
    if (!f)
        return 0;
    f->count = ARG_ncclReduce_count;
    f->datatype = ARG_ncclReduce_datatype;
    f->redop = ARG_ncclReduce_op;
    f->peer = ARG_ncclReduce_root;
    f->stream = ARG_ncclReduce_stream;
    nccl_on_comm(f, ARG_ncclReduce_comm, 0);
    return 0;
}

/* ncclAlltoAll(sendbuff, recvbuff, count, datatype, comm, stream): count is
 * the elements sent to EACH peer (block j of sendbuff goes to rank j). */
int nccl_enter_ncclAlltoAll(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_ALL_TO_ALL);
    if (!f)
        return 0;
    f->count = ARG_ncclAlltoAll_count;
    f->datatype = ARG_ncclAlltoAll_datatype;
    f->stream = ARG_ncclAlltoAll_stream;
    nccl_on_comm(f, ARG_ncclAlltoAll_comm, 0);
    return 0;
}

/* ncclGather(sendbuff, recvbuff, count, datatype, root, comm, stream) and
 * ncclScatter alike: count is the elements each rank sends (Gather) or
 * receives (Scatter); the root handles nranks x count. */
static __always_inline int nccl_enter_rooted(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame *f = nccl_begin(ctx, op);
    if (!f)
        return 0;
    f->count = ARG_ncclGather_count;
    f->datatype = ARG_ncclGather_datatype;
    f->peer = ARG_ncclGather_root;
    f->stream = ARG_ncclGather_stream;
    nccl_on_comm(f, ARG_ncclGather_comm, 0);
    return 0;
}

int nccl_enter_ncclGather(struct pt_regs *ctx) { return nccl_enter_rooted(ctx, OP_GATHER); }
int nccl_enter_ncclScatter(struct pt_regs *ctx) { return nccl_enter_rooted(ctx, OP_SCATTER); }

/* ncclSend(sendbuff, count, datatype, peer, comm, stream); ncclRecv alike */
static __always_inline int nccl_enter_p2p(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame *f = nccl_begin(ctx, op);
    if (!f)
        return 0;
    f->count = ARG_ncclSend_count;
    f->datatype = ARG_ncclSend_datatype;
    f->peer = ARG_ncclSend_peer;
    f->stream = ARG_ncclSend_stream;
    nccl_on_comm(f, ARG_ncclSend_comm, 1);
    return 0;
}

int nccl_enter_ncclSend(struct pt_regs *ctx) { return nccl_enter_p2p(ctx, OP_SEND); }
int nccl_enter_ncclRecv(struct pt_regs *ctx) { return nccl_enter_p2p(ctx, OP_RECV); }

/* ncclGroupStart(void) / ncclGroupEnd(void): a per-thread depth. */
int nccl_enter_ncclGroupStart(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_GROUP_START);
    if (!f)
        return 0;
    f->depth += 1;
    return 0;
}

/* ncclGroupEnd(void); ncclGroupSimulateEnd(ncclSimInfo_t*) closes the group
 * the same way (it simulates instead of launching). */
static __always_inline int nccl_enter_group_end(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame *f = nccl_begin(ctx, op);
    if (!f)
        return 0;
    f->flags &= ~NCCL_F_IN_GROUP;
    if (f->depth > 0) {
        f->depth -= 1;
        if (f->depth > 0)
            f->flags |= NCCL_F_IN_GROUP;  /* closes an inner group */
    }
    return 0;
}

int nccl_enter_ncclGroupEnd(struct pt_regs *ctx) { return nccl_enter_group_end(ctx, OP_GROUP_END); }
int nccl_enter_ncclGroupSimulateEnd(struct pt_regs *ctx)
{
    return nccl_enter_group_end(ctx, OP_GROUP_SIMULATE_END);
}

/* ncclCommInitRank(comm*, nranks, ncclUniqueId id, rank): id at SP+8 */
static __always_inline int nccl_enter_init_rank(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame *f = nccl_begin(ctx, op);
    if (!f)
        return 0;
    f->comm = ARG_ncclCommInitRank_comm;      /* where the new handle will be written */
    f->nranks = ARG_ncclCommInitRank_nranks;
    f->rank = ARG_ncclCommInitRank_rank;
    f->hash = ingero_hash_uid((void *)(ARG_ncclCommInitRank_commId));
    return 0;
}

int nccl_enter_ncclCommInitRank(struct pt_regs *ctx)
{
    return nccl_enter_init_rank(ctx, OP_COMM_INIT_RANK);
}

/* ncclCommInitRankConfig(comm*, nranks, ncclUniqueId id, rank, config*) */
int nccl_enter_ncclCommInitRankConfig(struct pt_regs *ctx)
{
    return nccl_enter_init_rank(ctx, OP_COMM_INIT_RANK_CONFIG);
}

/* ncclCommInitAll(comm* comms, ndev, const int* devlist) */
int nccl_enter_ncclCommInitAll(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_COMM_INIT_ALL);
    if (!f)
        return 0;
    f->comm = ARG_ncclCommInitAll_comm;
    f->nranks = ARG_ncclCommInitAll_ndev;
    f->count = (u32)f->nranks;
    u64 tgid = bpf_get_current_pid_tgid() >> 32;
    f->hash = ingero_splitmix64(tgid ^ ingero_splitmix64(f->comm ^ ingero_splitmix64(f->ts)));
    return 0;
}

/* ncclCommSplit(comm, color, key, newcomm*, config*) */
int nccl_enter_ncclCommSplit(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_COMM_SPLIT);
    if (!f)
        return 0;
    f->color = ARG_ncclCommSplit_color;
    f->key = ARG_ncclCommSplit_key;
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32,
                              .comm = ARG_ncclCommSplit_comm};
    struct nccl_comm_val *parent = nccl_comms.lookup(&k);
    if (parent && !(parent->flags & NCCL_F_COMM_UNKNOWN)) {
        u32 n = parent->splits;
        parent->splits = n + 1;
        f->parent_hash = parent->hash;
        f->hash = ingero_splitmix64(parent->hash ^ ingero_splitmix64((u32)f->color) ^ n);
    } else {
        f->flags |= NCCL_F_COMM_UNKNOWN;
    }
    f->comm = ARG_ncclCommSplit_newcomm;      /* where the new handle will be written */
    return 0;
}

/* ncclCommInitRankScalable(newcomm*, nranks, myrank, nId, ncclUniqueId* commIds,
 * config*): six register arguments; the ids by reference (r8). */
int nccl_enter_ncclCommInitRankScalable(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_COMM_INIT_RANK_SCALABLE);
    if (!f)
        return 0;
    f->comm = ARG_ncclCommInitRankScalable_newcomm;
    f->nranks = ARG_ncclCommInitRankScalable_nranks;
    f->rank = ARG_ncclCommInitRankScalable_myrank;
    f->count = (u32)ARG_ncclCommInitRankScalable_nId;       /* nId */
    f->hash = ingero_hash_uid((void *)ARG_ncclCommInitRankScalable_commIds);
    return 0;
}

/* ncclCommShrink(comm, int* excludeRanksList, excludeRanksCount, newcomm*,
 * config*, shrinkFlags) */
int nccl_enter_ncclCommShrink(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_COMM_SHRINK);
    if (!f)
        return 0;
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32,
                              .comm = ARG_ncclCommShrink_comm};
    s32 nexcl = ARG_ncclCommShrink_excludeRanksCount;
    u64 list = ARG_ncclCommShrink_excludeRanksList;
    struct nccl_comm_val *parent = nccl_comms.lookup(&k);
    if (parent && !(parent->flags & NCCL_F_COMM_UNKNOWN)) {
        u32 n = parent->shrinks;
        parent->shrinks = n + 1;
        f->parent_hash = parent->hash;
        f->hash = ingero_splitmix64(parent->hash ^ NCCL_SHRINK_SALT ^ n);
        s32 below = 0;
        if (parent->rank >= 0 && parent->nranks > 0 && nexcl >= 0 && nexcl <= INGERO_NCCL_SHRINK_MAX) {
            /* one read of the whole list, then a branch-free count (the size as
             * (n + 1) * 4 with n masked to 0..MAX-1: a bound the verifier keeps
             * whatever the compiler makes of it; MAX is a power of 2) */
            s32 ex[INGERO_NCCL_SHRINK_MAX] = {};
            if (nexcl > 0) {
                u32 n = ((u32)nexcl - 1) & (INGERO_NCCL_SHRINK_MAX - 1);
                ingero_read_user(ex, (n + 1) * 4, (void *)list);
            }
            s32 me = parent->rank;
#pragma unroll
            for (int i = 0; i < INGERO_NCCL_SHRINK_MAX; i++)
                below += (i < nexcl) & (ex[i] < me);
            f->rank = parent->rank - below;
            f->nranks = parent->nranks - nexcl;
        }
    } else {
        f->flags |= NCCL_F_COMM_UNKNOWN;
    }
    f->comm = ARG_ncclCommShrink_newcomm;      /* where the new handle will be written */
    return 0;
}

/* ncclCommGrow(comm, nRanks, const ncclUniqueId* uniqueId, rank, newcomm*, config*) */
int nccl_enter_ncclCommGrow(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_begin(ctx, OP_COMM_GROW);
    if (!f)
        return 0;
    u64 parent_handle = ARG_ncclCommGrow_comm;
    f->nranks = ARG_ncclCommGrow_nRanks;
    if (parent_handle) {               /* an existing rank: keeps its rank */
        struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = parent_handle};
        struct nccl_comm_val *parent = nccl_comms.lookup(&k);
        if (parent && !(parent->flags & NCCL_F_COMM_UNKNOWN)) {
            u32 n = parent->grows;
            parent->grows = n + 1;
            f->parent_hash = parent->hash;
            f->color = (s32)n;             /* the parent's grow number: ingero/comms.py links */
            f->rank = parent->rank;
            u64 uid = ARG_ncclCommGrow_uniqueId;
            /* the coordinator passes the grow id: it takes the id's identity, as the
             * new ranks do; the others that of (parent, n) until the traces meet */
            f->hash = uid ? ingero_hash_uid((void *)uid) : 0;
            if (!f->hash)
                f->hash = ingero_splitmix64(parent->hash ^ NCCL_GROW_SALT ^ n);
        } else {
            f->flags |= NCCL_F_COMM_UNKNOWN;
        }
    } else {                           /* a new rank: the id and its rank */
        u64 uid = ARG_ncclCommGrow_uniqueId;
        f->hash = uid ? ingero_hash_uid((void *)uid) : 0;
        f->rank = ARG_ncclCommGrow_rank;
        if (!uid)
            f->flags |= NCCL_F_COMM_UNKNOWN;
    }
    f->comm = ARG_ncclCommGrow_newcomm;
    return 0;
}

/* ncclCommDestroy(comm) / ncclCommAbort(comm) */
static __always_inline int nccl_enter_comm_end(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame *f = nccl_begin(ctx, op);
    if (!f)
        return 0;
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32,
                              .comm = ARG_ncclCommDestroy_comm};
    f->comm = k.comm;
    struct nccl_comm_val got = {.rank = -1, .nranks = -1, .flags = NCCL_F_COMM_UNKNOWN};
    struct nccl_comm_val *v = nccl_comms.lookup(&k);
    if (v)
        __builtin_memcpy(&got, v, sizeof(got));
    else
        nccl_adopt_pending(k.tgid, k.comm, &got);
    f->hash = got.hash;
    f->rank = got.rank;
    f->nranks = got.nranks;
    f->flags |= (u8)got.flags;
    return 0;
}

int nccl_enter_ncclCommDestroy(struct pt_regs *ctx) { return nccl_enter_comm_end(ctx, OP_COMM_DESTROY); }
int nccl_enter_ncclCommAbort(struct pt_regs *ctx) { return nccl_enter_comm_end(ctx, OP_COMM_ABORT); }

/* ---- return: one program for every symbol ------------------------------- */

/* One record of the call in `f` straight into the ring (reserve, fill, submit:
 * no copy through the stack). */
static __always_inline void nccl_emit(struct nccl_frame *f, u64 now, s32 ret, u64 comm, s32 rank)
{
    u64 flags = ingero_ring_flags(LOST_NCCL);
    struct ingero_nccl_event *e = nccl_events.ringbuf_reserve(sizeof(struct ingero_nccl_event));
    if (!e) {
        ingero_count_lost(LOST_NCCL);
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->ts_ns = f->ts;
    e->duration_ns = now - f->ts;
    e->cgroup_id = f->cgroup_id;
    e->comm = comm;
    e->comm_hash = f->hash;
    e->count = f->count;
    e->stream = f->stream;
    e->parent_hash = f->parent_hash;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->seq = f->seq;
    e->rank = rank;
    e->nranks = f->nranks;
    e->peer = f->peer;
    e->ret = ret;
    e->color = f->color;
    e->key = f->key;
    e->op = f->op;
    e->datatype = f->datatype;
    e->redop = f->redop;
    e->flags = f->flags;
    nccl_events.ringbuf_submit(e, flags);
}

/* The thread's open frame at return, marked closed (its fields stay readable
 * until the thread's next traced call); NULL when there is none to report.
 * After the return SP is the entry SP + 8 (the return address is popped); a
 * nested call's return is still deeper than its outer call's entry. */
static __always_inline struct nccl_frame *nccl_end(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_slot(0);
    if (!f || !f->sp || PT_REGS_SP(ctx) < f->sp + INGERO_RET_SP_DELTA)
        return 0;
    f->sp = 0;                         /* closed; the slot (and group depth) stays */
    return f;
}

int nccl_return(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_end(ctx);
    if (!f)
        return 0;
    u64 now = bpf_ktime_get_ns();
    s32 ret = PT_REGS_RC(ctx);
    u64 handle = 0;

    switch (f->op) {
    case OP_COMM_INIT_RANK:
    case OP_COMM_INIT_RANK_CONFIG:
    case OP_COMM_INIT_RANK_SCALABLE:
    case OP_COMM_SPLIT:
    case OP_COMM_SHRINK:
    case OP_COMM_GROW:
        ingero_read_user(&handle, sizeof(handle), (void *)f->comm);
        if ((ret == NCCL_SUCCESS || ret == NCCL_IN_PROGRESS) && !(f->flags & NCCL_F_COMM_UNKNOWN)) {
            if (handle) {
                nccl_put_comm(handle, f->hash, f->rank, f->nranks);
            } else if (ret == NCCL_IN_PROGRESS && f->comm) {
                nccl_park(f->comm, f->hash, f->rank, f->nranks);
                f->flags |= NCCL_F_PENDING;
            }
        }
        nccl_emit(f, now, ret, handle, f->rank);
        return 0;
    case OP_COMM_DESTROY:
    case OP_COMM_ABORT: {
        struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = f->comm};
        nccl_comms.delete(&k);
        break;
    }
    }
    nccl_emit(f, now, ret, f->comm, f->rank);
    return 0;
}

/* ncclCommInitAll's own return program: one record per communicator created. */
int nccl_return_init_all(struct pt_regs *ctx)
{
    struct nccl_frame *f = nccl_end(ctx);
    if (!f)
        return 0;
    u64 now = bpf_ktime_get_ns();
    s32 ret = PT_REGS_RC(ctx);
    u32 ndev = f->count;
    u64 comms = f->comm;
    u64 hash = f->hash;
    for (u32 i = 0; i < INGERO_NCCL_INITALL_MAX && i < ndev; i++) {
        u64 handle = 0;
        ingero_read_user(&handle, sizeof(handle), (void *)(comms + 8 * i));
        if (ret == 0 && handle)
            nccl_put_comm(handle, hash, i, ndev);
        nccl_emit(f, now, ret, handle, i);
    }
    return 0;
}
#endif /* !INGERO_MAPS_ONLY */
