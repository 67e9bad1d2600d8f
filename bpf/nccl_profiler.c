/* nccl_profiler.c: finished NCCL operations from Ingero's profiler plugin (USDT).
 *
 * Hook: the USDT probe `ingero:nccl_op_v<INGERO_NCCL_PROF_VERSION>` of
 * libnccl-profiler-ingero.so (agent/nccl_profiler), a uprobe at the address
 * its .note.stapsdt gives, attached per library file like the NCCL uprobes.
 * Its one argument is the address of a `struct ingero_nccl_prof_op` in the
 * training process; the plugin forces it into a register, and the note says
 * which. The loader reads the note with bcc's USDT support and attaches the
 * program below named after that register (`ncclprof_<reg>`).
 *
 * For a target process the record is copied into a
 * `struct ingero_nccl_prof_event` (ring buffer `nccl_profiler_events`) with
 * the cgroup, pid, tid and the strings it points to (function, datatype,
 * algorithm, protocol: NCCL's static names; the communicator's name: the
 * plugin's copy). A record of another size (a plugin built for another
 * layout) is counted as lost, never decoded.
 */
#include "ingero.h"

BPF_RINGBUF_OUTPUT(nccl_profiler_events, INGERO_RINGBUF_PAGES);

static __always_inline int ncclprof_emit(u64 rec)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 cgid = bpf_get_current_cgroup_id();
    if (!ingero_is_target(id >> 32, cgid))
        return 0;
    u64 flags = ingero_ring_flags(LOST_NCCL_PROFILER);
    struct ingero_nccl_prof_event *e = nccl_profiler_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        ingero_count_lost(LOST_NCCL_PROFILER);
        return 0;
    }
    if (ingero_read_user(&e->op, sizeof(e->op), (void *)rec) != 0 ||
        e->op.size != sizeof(e->op) || e->op.version != INGERO_NCCL_PROF_VERSION) {
        nccl_profiler_events.ringbuf_discard(e, 0);
        ingero_count_lost(LOST_NCCL_PROFILER);
        return 0;
    }
    e->ts_ns = bpf_ktime_get_ns();
    e->cgroup_id = cgid;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->func[0] = e->datatype[0] = e->algo[0] = e->proto[0] = e->comm_name[0] = 0;
    if (e->op.func)
        ingero_read_user_str(e->func, sizeof(e->func), (void *)e->op.func);
    if (e->op.datatype)
        ingero_read_user_str(e->datatype, sizeof(e->datatype), (void *)e->op.datatype);
    if (e->op.algo)
        ingero_read_user_str(e->algo, sizeof(e->algo), (void *)e->op.algo);
    if (e->op.proto)
        ingero_read_user_str(e->proto, sizeof(e->proto), (void *)e->op.proto);
    if (e->op.comm_name)
        ingero_read_user_str(e->comm_name, sizeof(e->comm_name), (void *)e->op.comm_name);
    nccl_profiler_events.ringbuf_submit(e, flags);
    return 0;
}

/* One entry program per general register the note may name (bcc's names,
 * which are struct pt_regs fields on x86-64; the loader's PROFILER_REGS).
 * INGERO_NCCLPROF_REGS (-D): 1 on x86-64, where these names exist. */
#if INGERO_NCCLPROF_REGS && !INGERO_MAPS_ONLY   /* the programs: bpf/ingero.h */
#define NCCLPROF_REG(r) \
    int ncclprof_##r(struct pt_regs *ctx) { return ncclprof_emit(ctx->r); }
NCCLPROF_REG(ax)
NCCLPROF_REG(bx)
NCCLPROF_REG(cx)
NCCLPROF_REG(dx)
NCCLPROF_REG(si)
NCCLPROF_REG(di)
NCCLPROF_REG(bp)
NCCLPROF_REG(r8)
NCCLPROF_REG(r9)
NCCLPROF_REG(r10)
NCCLPROF_REG(r11)
NCCLPROF_REG(r12)
NCCLPROF_REG(r13)
NCCLPROF_REG(r14)
NCCLPROF_REG(r15)
#endif
