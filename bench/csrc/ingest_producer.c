/* A fast producer of NCCL-shaped records for the ingest benchmark.
 *
 * Uprobes cap a producer near 200 k calls/s per thread, so instead every
 * getppid() of the pump process (raw_syscalls:sys_enter, id 110 on x86-64)
 * emits INGEST_BATCH `struct ingero_nccl_event` records into a ring buffer
 * laid out exactly like the agent's `nccl_events` ring. The agent's drain
 * path (mmap reader, bulk decode, segment writer) then reads them as it reads
 * real NCCL events. Settings: -DPUMP_TGID, -DINGEST_BATCH, -DINGERO_RINGBUF_PAGES. */
#include "ingero.h"

BPF_RINGBUF_OUTPUT(nccl_events, INGERO_RINGBUF_PAGES);
BPF_ARRAY(ingest_lost, u64, 1);
BPF_ARRAY(ingest_seq, u64, 1);

TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((id >> 32) != PUMP_TGID || args->id != 110)
        return 0;
    int zero = 0;
    u64 *seqp = ingest_seq.lookup(&zero);
    u64 *lostp = ingest_lost.lookup(&zero);
    if (!seqp || !lostp)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 seq = *seqp;
    for (int i = 0; i < INGEST_BATCH; i++) {
        struct ingero_nccl_event *e = nccl_events.ringbuf_reserve(sizeof(*e));
        if (!e) {
            __sync_fetch_and_add(lostp, 1);
            continue;
        }
        __builtin_memset(e, 0, sizeof(*e));
        e->ts_ns = now + i;
        e->duration_ns = 1000000 + ((seq + i) & 0xffff) * 37;
        e->cgroup_id = 4242;
        e->comm = 0x55550000 + ((i & 1) << 12);
        e->comm_hash = (i & 1) ? 0x9e3779b97f4a7c15ULL : 0xbf58476d1ce4e5b9ULL;
        e->count = 262144;
        e->pid = id >> 32;
        e->tid = (u32)id;
        e->seq = (u32)((seq + i) >> 1);
        e->rank = 3;
        e->nranks = 1024;
        e->peer = -1;
        e->op = 1 + (i & 1);    /* ALL_REDUCE, ALL_GATHER */
        e->datatype = 7;        /* float32 */
        nccl_events.ringbuf_submit(e, 0);
    }
    *seqp = seq + INGEST_BATCH;
    return 0;
}
