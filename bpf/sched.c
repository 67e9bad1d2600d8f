/* sched.c: off-CPU intervals of target threads.
 *
 * Hooks: sched:sched_switch, sched:sched_wakeup.
 *
 * When a target thread leaves the CPU (sched_switch, `current` is still the
 * previous task, so the cgroup filter applies to it) its switch-out time and
 * reason are kept by tid. prev_state on 4.14+ kernels is not the raw task
 * state: a preempted task reports TASK_REPORT_MAX (0x100 on 6.x), otherwise
 * the state is reduced to one reported bit (1 << (task_state_index - 1)):
 * 0 running (yield), 0x1 TASK_INTERRUPTIBLE, 0x2 TASK_UNINTERRUPTIBLE,
 * 0x80 TASK_REPORT_IDLE (TASK_IDLE sleepers), ... So:
 *   (state & 0xff) == 0      still runnable (preempted / yielded) -> OFFCPU_RUNQUEUE
 *   state & 0x2              uninterruptible (I/O, page fault, D-state lock) -> OFFCPU_IO
 *   anything else            voluntary sleep -> OFFCPU_SLEEP
 * sched_wakeup notes when a sleeping thread became runnable again; when the
 * thread switches back in, off_ns = now - switch-out and runq_ns = now -
 * wake (the whole interval for a runnable switch-out).
 *
 * Every interval is summed in the kernel into `sched_totals` by (tgid,
 * reason): the time a thread spent in the reason's state (an interval's
 * runnable tail counts under runqueue), and the number of intervals that
 * began with that reason. Only intervals of at least INGERO_SCHED_MIN_NS
 * become events.
 */
#include "ingero.h"

#define INGERO_TASK_UNINTERRUPTIBLE 0x2

BPF_RINGBUF_OUTPUT(sched_events, INGERO_RINGBUF_PAGES);

struct offcpu_start {
    u64 ts;
    u64 wake_ts;       /* 0 until sched_wakeup */
    u64 cgroup_id;
    u32 tgid;
    u32 reason;
};
BPF_TABLE("lru_hash", u32, struct offcpu_start, offcpu_start, 65536);

struct sched_total_key {
    u32 tgid;
    u32 reason;
};
struct sched_total_val {
    u64 total_ns;
    u64 intervals;
};
BPF_HASH(sched_totals, struct sched_total_key, struct sched_total_val, 16384);

static __always_inline void sched_add_total(u32 tgid, u32 reason, u64 ns, u64 intervals)
{
    struct sched_total_key k = {.tgid = tgid, .reason = reason};
    struct sched_total_val *v = sched_totals.lookup(&k);
    if (!v) {
        struct sched_total_val zero = {};
        sched_totals.insert(&k, &zero);
        v = sched_totals.lookup(&k);
        if (!v)
            return;
    }
    __sync_fetch_and_add(&v->total_ns, ns);
    __sync_fetch_and_add(&v->intervals, intervals);
}

static __always_inline void sched_switch_in(u32 tid, u64 now)
{
    struct offcpu_start *s = offcpu_start.lookup(&tid);
    if (!s)
        return;
    struct offcpu_start st = *s;
    offcpu_start.delete(&tid);
    if (now < st.ts)
        return;
    u64 off = now - st.ts;
    u64 runq = off;
    if (st.reason != OFFCPU_RUNQUEUE)
        runq = (st.wake_ts && st.wake_ts <= now) ? now - st.wake_ts : 0;
    if (runq > off)
        runq = off;
    if (st.reason == OFFCPU_RUNQUEUE) {
        sched_add_total(st.tgid, OFFCPU_RUNQUEUE, off, 1);
    } else {
        sched_add_total(st.tgid, st.reason, off - runq, 1);
        if (runq)
            sched_add_total(st.tgid, OFFCPU_RUNQUEUE, runq, 0);
    }
    if (off < INGERO_SCHED_MIN_NS)
        return;
    struct ingero_sched_event e = {};
    e.ts_ns = st.ts;
    e.off_ns = off;
    e.runq_ns = runq;
    e.cgroup_id = st.cgroup_id;
    e.pid = st.tgid;
    e.tid = tid;
    e.reason = st.reason;
    if (sched_events.ringbuf_output(&e, sizeof(e), ingero_ring_flags(LOST_SCHED)) != 0)
        ingero_count_lost(LOST_SCHED);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 next = args->next_pid;
    if (next)
        sched_switch_in(next, now);

    u32 prev = args->prev_pid;
    if (!prev)
        return 0;  /* the idle task */
    u64 id = bpf_get_current_pid_tgid();
    u64 cgid = bpf_get_current_cgroup_id();
    if (!ingero_current_is_target(id >> 32, cgid))
        return 0;
    long state = args->prev_state;
    struct offcpu_start st = {.ts = now, .cgroup_id = cgid, .tgid = id >> 32};
    if ((state & 0xff) == 0)
        st.reason = OFFCPU_RUNQUEUE;
    else if (state & INGERO_TASK_UNINTERRUPTIBLE)
        st.reason = OFFCPU_IO;
    else
        st.reason = OFFCPU_SLEEP;
    offcpu_start.update(&prev, &st);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    u32 tid = args->pid;
    struct offcpu_start *s = offcpu_start.lookup(&tid);
    if (s && !s->wake_ts)
        s->wake_ts = bpf_ktime_get_ns();
    return 0;
}
