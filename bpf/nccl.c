/* nccl.c: NCCL host API calls of target processes (uprobes + uretprobes).
 *
 * Hooks: entry and return of ncclAllReduce, ncclAllGather, ncclReduceScatter,
 * ncclBroadcast, ncclBcast, ncclReduce, ncclSend, ncclRecv, ncclGroupStart,
 * ncclGroupEnd, ncclCommInitRank, ncclCommInitRankConfig, ncclCommInitAll,
 * ncclCommSplit, ncclCommDestroy and ncclCommAbort. The loader attaches the
 * entry program `nccl_enter_<name>` and the shared return program
 * `nccl_return` (ncclCommInitAll: `nccl_return_init_all`) to every one of
 * these symbols a library exports.
 *
 * At entry the arguments go into a per-thread frame (keyed by pid_tgid); at
 * return one `struct ingero_nccl_event` leaves through the `nccl_events` ring
 * buffer with duration and return code.
 *
 * Arguments follow the x86-64 SysV ABI (the loader refuses other machines):
 * integer/pointer arguments in rdi, rsi, rdx, rcx, r8, r9, then on the stack
 * at SP+8, SP+16 at entry (SP holds the return address). ncclUniqueId is a
 * 128-byte struct passed BY VALUE: it is classed MEMORY, so it is copied onto
 * the stack at SP+8 and takes no register; the int arguments after it move
 * up (ncclCommInitRank: rdi=comm*, rsi=nranks, rdx=rank; the Config variant
 * adds rcx=config).
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
 *   - Destroy/Abort remove the entry at return.
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

BPF_RINGBUF_OUTPUT(nccl_events, INGERO_RINGBUF_PAGES);

struct nccl_frame {
    u64 ts;
    u64 cgroup_id;
    u64 comm;          /* handle; for InitRank/InitAll/Split the output pointer */
    u64 count;
    u64 stream;
    u64 hash;
    u64 parent_hash;
    u32 seq;
    s32 rank;
    s32 nranks;
    s32 peer;
    s32 color;
    s32 key;
    u64 sp;            /* stack pointer at entry: tells nested calls and stale frames apart */
    u8 op;
    u8 datatype;
    u8 redop;
    u8 flags;
};
/* Plain preallocated hashes, not LRU: an LRU lookup costs ~9% more per probed
 * call (bench/uprobe_cost.py). Entries of a thread that dies inside a call are
 * removed at its exit (sched_process_exit below), so the maps do not fill up. */
BPF_HASH(nccl_frames, u64, struct nccl_frame, 16384);
/* ncclGroupStart depth per thread. */
BPF_HASH(nccl_group_depth, u64, u32, 16384);

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
};
BPF_HASH(nccl_comms, struct nccl_comm_key, struct nccl_comm_val, 65536);

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
    if (bpf_probe_read_user(w, sizeof(w), uid) != 0)
        return 0;
    u64 h = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        h = ingero_splitmix64(h ^ w[i]);
    return h;
}

static __always_inline u64 nccl_stack_arg(struct pt_regs *ctx, int n)
{
    /* n-th stack argument (1-based) at entry: SP + 8*n */
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * n));
    return v;
}

/* Starts a frame; 0 when the call is not traced (not a target, or nested).
 *
 * Nesting is judged by the stack pointer, not by a counter: a call made
 * inside an open one runs deeper (lower SP) on the same thread's stack. An
 * open frame at or below the current SP belongs to a call whose return we
 * never saw (thread unwound by longjmp): it is stale and replaced, so one
 * lost return cannot silence a thread for good. (Until such a call comes,
 * calls made deeper than the lost one, e.g. with stack-passed arguments,
 * still look nested: the same rule the kernel uses to drop stale uretprobe
 * instances.) */
static __always_inline int nccl_begin(struct pt_regs *ctx, struct nccl_frame *f, u8 op)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 cgid = bpf_get_current_cgroup_id();
    if (!ingero_is_target(id >> 32, cgid))
        return 0;
    u64 sp = PT_REGS_SP(ctx);
    struct nccl_frame *open = nccl_frames.lookup(&id);
    if (open && sp < open->sp)
        return 0;
    f->sp = sp;
    f->ts = bpf_ktime_get_ns();
    f->cgroup_id = cgid;
    f->op = op;
    f->rank = -1;
    f->nranks = -1;
    f->peer = -1;
    u32 *depth = nccl_group_depth.lookup(&id);
    if (depth && *depth > 0)
        f->flags |= NCCL_F_IN_GROUP;
    return 1;
}

static __always_inline void nccl_save(struct nccl_frame *f)
{
    u64 id = bpf_get_current_pid_tgid();
    nccl_frames.update(&id, f);
}

/* Looks up a communicator for a call on it and takes the next seq number. */
static __always_inline void nccl_on_comm(struct nccl_frame *f, u64 comm, int p2p)
{
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32, .comm = comm};
    f->comm = comm;
    struct nccl_comm_val *v = nccl_comms.lookup(&k);
    if (!v) {
        struct nccl_comm_val unknown = {.rank = -1, .nranks = -1, .flags = NCCL_F_COMM_UNKNOWN};
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

/* A thread that exits (or is killed) inside an NCCL call or group leaves its
 * frame and group depth behind: drop them. */
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    nccl_frames.delete(&id);
    nccl_group_depth.delete(&id);
    return 0;
}

/* ---- entry programs, one per signature --------------------------------- */

/* ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream) */
int nccl_enter_ncclAllReduce(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_ALL_REDUCE))
        return 0;
    f.count = PT_REGS_PARM3(ctx);
    f.datatype = PT_REGS_PARM4(ctx);
    f.redop = PT_REGS_PARM5(ctx);
    f.stream = nccl_stack_arg(ctx, 1);
    nccl_on_comm(&f, PT_REGS_PARM6(ctx), 0);
    nccl_save(&f);
    return 0;
}

/* ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream) */
int nccl_enter_ncclAllGather(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_ALL_GATHER))
        return 0;
    f.count = PT_REGS_PARM3(ctx);
    f.datatype = PT_REGS_PARM4(ctx);
    f.stream = PT_REGS_PARM6(ctx);
    nccl_on_comm(&f, PT_REGS_PARM5(ctx), 0);
    nccl_save(&f);
    return 0;
}

/* ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream) */
int nccl_enter_ncclReduceScatter(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_REDUCE_SCATTER))
        return 0;
    f.count = PT_REGS_PARM3(ctx);
    f.datatype = PT_REGS_PARM4(ctx);
    f.redop = PT_REGS_PARM5(ctx);
    f.stream = nccl_stack_arg(ctx, 1);
    nccl_on_comm(&f, PT_REGS_PARM6(ctx), 0);
    nccl_save(&f);
    return 0;
}

/* ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream) */
int nccl_enter_ncclBroadcast(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_BROADCAST))
        return 0;
    f.count = PT_REGS_PARM3(ctx);
    f.datatype = PT_REGS_PARM4(ctx);
    f.peer = PT_REGS_PARM5(ctx);
    f.stream = nccl_stack_arg(ctx, 1);
    nccl_on_comm(&f, PT_REGS_PARM6(ctx), 0);
    nccl_save(&f);
    return 0;
}

/* ncclBcast(buff, count, datatype, root, comm, stream) */
int nccl_enter_ncclBcast(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_BROADCAST))
        return 0;
    f.flags |= NCCL_F_BCAST_ALIAS;
    f.count = PT_REGS_PARM2(ctx);
    f.datatype = PT_REGS_PARM3(ctx);
    f.peer = PT_REGS_PARM4(ctx);
    f.stream = PT_REGS_PARM6(ctx);
    nccl_on_comm(&f, PT_REGS_PARM5(ctx), 0);
    nccl_save(&f);
    return 0;
}

/* ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream):
 * comm and stream are the 1st and 2nd stack arguments. */
int nccl_enter_ncclReduce(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_REDUCE))
        return 0;
    f.count = PT_REGS_PARM3(ctx);
    f.datatype = PT_REGS_PARM4(ctx);
    f.redop = PT_REGS_PARM5(ctx);
    f.peer = PT_REGS_PARM6(ctx);
    f.stream = nccl_stack_arg(ctx, 2);
    nccl_on_comm(&f, nccl_stack_arg(ctx, 1), 0);
    nccl_save(&f);
    return 0;
}

/* ncclSend(sendbuff, count, datatype, peer, comm, stream); ncclRecv alike */
static __always_inline int nccl_enter_p2p(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, op))
        return 0;
    f.count = PT_REGS_PARM2(ctx);
    f.datatype = PT_REGS_PARM3(ctx);
    f.peer = PT_REGS_PARM4(ctx);
    f.stream = PT_REGS_PARM6(ctx);
    nccl_on_comm(&f, PT_REGS_PARM5(ctx), 1);
    nccl_save(&f);
    return 0;
}

int nccl_enter_ncclSend(struct pt_regs *ctx) { return nccl_enter_p2p(ctx, OP_SEND); }
int nccl_enter_ncclRecv(struct pt_regs *ctx) { return nccl_enter_p2p(ctx, OP_RECV); }

/* ncclGroupStart(void) / ncclGroupEnd(void): a per-thread depth. */
int nccl_enter_ncclGroupStart(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_GROUP_START))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 one = 1;
    u32 *depth = nccl_group_depth.lookup(&id);
    if (depth)
        *depth += 1;
    else
        nccl_group_depth.update(&id, &one);
    nccl_save(&f);
    return 0;
}

int nccl_enter_ncclGroupEnd(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_GROUP_END))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 *depth = nccl_group_depth.lookup(&id);
    f.flags &= ~NCCL_F_IN_GROUP;
    if (depth && *depth > 0) {
        *depth -= 1;
        if (*depth > 0)
            f.flags |= NCCL_F_IN_GROUP;  /* closes an inner group */
    }
    nccl_save(&f);
    return 0;
}

/* ncclCommInitRank(comm*, nranks, ncclUniqueId id, rank): id at SP+8 */
static __always_inline int nccl_enter_init_rank(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, op))
        return 0;
    f.comm = PT_REGS_PARM1(ctx);      /* where the new handle will be written */
    f.nranks = PT_REGS_PARM2(ctx);
    f.rank = PT_REGS_PARM3(ctx);
    f.hash = ingero_hash_uid((void *)(PT_REGS_SP(ctx) + 8));
    nccl_save(&f);
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
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_COMM_INIT_ALL))
        return 0;
    f.comm = PT_REGS_PARM1(ctx);
    f.nranks = PT_REGS_PARM2(ctx);
    f.count = (u32)f.nranks;
    u64 tgid = bpf_get_current_pid_tgid() >> 32;
    f.hash = ingero_splitmix64(tgid ^ ingero_splitmix64(f.comm ^ ingero_splitmix64(f.ts)));
    nccl_save(&f);
    return 0;
}

/* ncclCommSplit(comm, color, key, newcomm*, config*) */
int nccl_enter_ncclCommSplit(struct pt_regs *ctx)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, OP_COMM_SPLIT))
        return 0;
    f.color = PT_REGS_PARM2(ctx);
    f.key = PT_REGS_PARM3(ctx);
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32,
                              .comm = PT_REGS_PARM1(ctx)};
    struct nccl_comm_val *parent = nccl_comms.lookup(&k);
    if (parent && !(parent->flags & NCCL_F_COMM_UNKNOWN)) {
        u32 n = parent->splits;
        parent->splits = n + 1;
        f.parent_hash = parent->hash;
        f.hash = ingero_splitmix64(parent->hash ^ ingero_splitmix64((u32)f.color) ^ n);
    } else {
        f.flags |= NCCL_F_COMM_UNKNOWN;
    }
    f.comm = PT_REGS_PARM4(ctx);      /* where the new handle will be written */
    nccl_save(&f);
    return 0;
}

/* ncclCommDestroy(comm) / ncclCommAbort(comm) */
static __always_inline int nccl_enter_comm_end(struct pt_regs *ctx, u8 op)
{
    struct nccl_frame f = {};
    if (!nccl_begin(ctx, &f, op))
        return 0;
    struct nccl_comm_key k = {.tgid = bpf_get_current_pid_tgid() >> 32,
                              .comm = PT_REGS_PARM1(ctx)};
    f.comm = k.comm;
    struct nccl_comm_val *v = nccl_comms.lookup(&k);
    if (v) {
        f.hash = v->hash;
        f.rank = v->rank;
        f.nranks = v->nranks;
        f.flags |= (u8)v->flags;
    } else {
        f.flags |= NCCL_F_COMM_UNKNOWN;
    }
    nccl_save(&f);
    return 0;
}

int nccl_enter_ncclCommDestroy(struct pt_regs *ctx) { return nccl_enter_comm_end(ctx, OP_COMM_DESTROY); }
int nccl_enter_ncclCommAbort(struct pt_regs *ctx) { return nccl_enter_comm_end(ctx, OP_COMM_ABORT); }

/* ---- return: one program for every symbol ------------------------------- */

static __always_inline void nccl_emit(struct nccl_frame *f, u64 now, s32 ret, u64 comm)
{
    struct ingero_nccl_event e = {};
    u64 id = bpf_get_current_pid_tgid();
    e.ts_ns = f->ts;
    e.duration_ns = now - f->ts;
    e.cgroup_id = f->cgroup_id;
    e.comm = comm;
    e.comm_hash = f->hash;
    e.count = f->count;
    e.stream = f->stream;
    e.parent_hash = f->parent_hash;
    e.pid = id >> 32;
    e.tid = (u32)id;
    e.seq = f->seq;
    e.rank = f->rank;
    e.nranks = f->nranks;
    e.peer = f->peer;
    e.ret = ret;
    e.color = f->color;
    e.key = f->key;
    e.op = f->op;
    e.datatype = f->datatype;
    e.redop = f->redop;
    e.flags = f->flags;
    if (nccl_events.ringbuf_output(&e, sizeof(e), ingero_ring_flags(LOST_NCCL)) != 0)
        ingero_count_lost(LOST_NCCL);
}

/* Takes the thread's frame at return; 0 when there is none to report. After
 * the return SP is the entry SP + 8 (the return address is popped); a nested
 * call's return is still deeper than its outer call's entry. */
static __always_inline int nccl_end(struct pt_regs *ctx, struct nccl_frame *f)
{
    u64 id = bpf_get_current_pid_tgid();
    struct nccl_frame *open = nccl_frames.lookup(&id);
    if (!open || PT_REGS_SP(ctx) < open->sp + 8)
        return 0;
    *f = *open;
    nccl_frames.delete(&id);
    return 1;
}

int nccl_return(struct pt_regs *ctx)
{
    struct nccl_frame f;
    if (!nccl_end(ctx, &f))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    s32 ret = PT_REGS_RC(ctx);
    u64 handle = 0;

    switch (f.op) {
    case OP_COMM_INIT_RANK:
    case OP_COMM_INIT_RANK_CONFIG:
    case OP_COMM_SPLIT:
        bpf_probe_read_user(&handle, sizeof(handle), (void *)f.comm);
        if (ret == 0 && handle && !(f.flags & NCCL_F_COMM_UNKNOWN))
            nccl_put_comm(handle, f.hash, f.rank, f.nranks);
        nccl_emit(&f, now, ret, handle);
        return 0;
    case OP_COMM_DESTROY:
    case OP_COMM_ABORT: {
        struct nccl_comm_key k = {.tgid = id >> 32, .comm = f.comm};
        nccl_comms.delete(&k);
        break;
    }
    }
    nccl_emit(&f, now, ret, f.comm);
    return 0;
}

/* ncclCommInitAll's own return program: one record per communicator created. */
int nccl_return_init_all(struct pt_regs *ctx)
{
    struct nccl_frame f;
    if (!nccl_end(ctx, &f))
        return 0;
    u64 now = bpf_ktime_get_ns();
    s32 ret = PT_REGS_RC(ctx);
    u32 ndev = f.count;
    u64 comms = f.comm;
    for (u32 i = 0; i < INGERO_NCCL_INITALL_MAX && i < ndev; i++) {
        u64 handle = 0;
        bpf_probe_read_user(&handle, sizeof(handle), (void *)(comms + 8 * i));
        if (ret == 0 && handle)
            nccl_put_comm(handle, f.hash, i, ndev);
        f.rank = i;
        nccl_emit(&f, now, ret, handle);
    }
    return 0;
}
