/* sched.c: off-CPU intervals of target threads.
 *
 * Hook: sched:sched_switch, nothing else (a raw tracepoint with INGERO_RAW_TP: see
 * sched_reported_state). It runs for every context switch of
 * the machine; `current` is the task leaving the CPU (prev), so the target
 * filter applies to it, and only its own state is read or written: neither
 * the incoming task nor a woken one is ever looked up.
 *
 * When a target thread leaves the CPU, a pending record is kept in the
 * thread's own slot: the switch-out time, the kernel's per-task counters then
 * (se.sum_exec_runtime: CPU time; sched_info.run_delay: time spent runnable
 * on a runqueue, CONFIG_SCHED_INFO), and the reason, from prev_state. On
 * 4.14+ kernels prev_state is not the raw task state: a preempted task
 * reports TASK_REPORT_MAX (0x100 on 6.x), otherwise the state is reduced to
 * one reported bit (1 << (task_state_index - 1)): 0 running (yield), 0x1
 * TASK_INTERRUPTIBLE, 0x2 TASK_UNINTERRUPTIBLE, 0x80 TASK_REPORT_IDLE
 * (TASK_IDLE sleepers), ... So:
 *   (state & 0xff) == 0      still runnable (preempted / yielded) -> OFFCPU_RUNQUEUE
 *   state & 0x2              uninterruptible (I/O, page fault, D-state lock) -> OFFCPU_IO
 *   anything else            voluntary sleep -> OFFCPU_SLEEP
 *
 * The interval is closed at the thread's NEXT switch-out (whether or not it
 * is still a target), when it has run exactly once since: it ran
 *   ran  = sum_exec_runtime now - at the switch-out
 * so it came back at now - ran, and
 *   off  = (now - ran) - switch-out
 *   runq = run_delay now - at the switch-out, at most off (the part spent
 *          runnable after the wake-up); the whole of off for a runnable
 *          switch-out, as the kernel may not queue-account a task preempted
 *          in a sleeping state.
 * So an interval is recorded when its thread next leaves the CPU, not when it
 * returns; an interval whose thread has not left the CPU again by the time
 * tracing stops (a thread that runs on, or one still off CPU) is not recorded.
 *
 * Clocks: the switch-out time is bpf_ktime_get_ns() (CLOCK_MONOTONIC, as
 * every event); sum_exec_runtime and run_delay count rq clock ns (sched_clock).
 * Only their differences are used, and a duration from one nanosecond clock
 * subtracted from a CLOCK_MONOTONIC time is off by the two clocks' rate
 * difference over that duration (NTP slews CLOCK_MONOTONIC by at most 500
 * ppm, usually a few ppm), never by their offset. sum_exec_runtime counts
 * the task clock, which leaves out interrupt time (CONFIG_IRQ_TIME_ACCOUNTING)
 * and hypervisor steal time (CONFIG_PARAVIRT_TIME_ACCOUNTING) spent while the
 * thread ran: those make `ran` short and `off` long by as much (runq is not
 * affected; the reason's own share absorbs it).
 *
 * The offsets of the two fields in struct task_struct come from the running
 * kernel's BTF (-D INGERO_TASK_SUM_EXEC_OFF / INGERO_TASK_RUN_DELAY_OFF, see
 * ingero_agent/kbtf.py): bcc's headers need not be the running kernel's.
 *
 * Every interval is summed in the kernel into `sched_totals` by (tgid,
 * reason): the time a thread spent in the reason's state (an interval's
 * runnable tail counts under runqueue), and the number of intervals that
 * began with that reason. Only intervals of at least INGERO_SCHED_MIN_NS
 * become events.
 */
#include "ingero.h"

#define INGERO_TASK_UNINTERRUPTIBLE 0x2

#ifndef INGERO_TASK_SUM_EXEC_OFF   /* no kernel BTF: bcc's headers are the kernel's own */
#include <linux/sched.h>
#define INGERO_TASK_SUM_EXEC_OFF offsetof(struct task_struct, se.sum_exec_runtime)
#define INGERO_TASK_RUN_DELAY_OFF offsetof(struct task_struct, sched_info.run_delay)
#endif

BPF_RINGBUF_OUTPUT(sched_events, INGERO_RINGBUF_PAGES);

/* A target thread's last switch-out, until its next one (ts 0: none). */
struct sched_pending {
    u64 ts;            /* bpf_ktime_get_ns() at the switch-out */
    u64 exec;          /* se.sum_exec_runtime then */
    u64 delay;         /* sched_info.run_delay then */
    u64 cgroup_id;
    u32 tgid;
    u32 reason;
};

#if INGERO_TASK_STORAGE
/* One slot per thread that reaches the hook, in its task-local storage (freed
 * by the kernel with the thread): the pending record and the thread's target
 * verdict (as ingero_current_is_target caches it, kept here so a switch costs
 * one storage lookup, not two). */
struct sched_slot {
    struct sched_pending p;
    struct ingero_verdict v;
};
BPF_TASK_STORAGE(sched_slots, struct sched_slot);
#else
/* Pending records by tid; only the current thread's is ever looked up. LRU:
 * a thread that exits with one leaves it behind. */
BPF_TABLE("lru_hash", u32, struct sched_pending, sched_pending, 65536);
#endif

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

/* The current task's sum_exec_runtime and run_delay. */
static __always_inline void sched_counters(u64 *exec, u64 *delay)
{
#if INGERO_TASK_STORAGE
    char *t = (char *)bpf_get_current_task_btf();   /* direct (BTF) loads */
    *exec = *(u64 *)(t + INGERO_TASK_SUM_EXEC_OFF);
    *delay = *(u64 *)(t + INGERO_TASK_RUN_DELAY_OFF);
#else
    char *t = (char *)bpf_get_current_task();
    bpf_probe_read_kernel(exec, sizeof(*exec), t + INGERO_TASK_SUM_EXEC_OFF);
    bpf_probe_read_kernel(delay, sizeof(*delay), t + INGERO_TASK_RUN_DELAY_OFF);
#endif
}

/* Close the current thread's pending interval (see the top of this file). */
static __always_inline void sched_close(struct sched_pending *p, u32 tid, u64 now, u64 exec, u64 delay)
{
    if (now < p->ts || exec < p->exec)
        return;             /* not this thread's record (hash: a reused tid) */
    u64 ran = exec - p->exec;
    u64 off = now - p->ts;
    off = ran < off ? off - ran : 0;
    u64 runq = off;
    if (p->reason != OFFCPU_RUNQUEUE) {
        runq = delay >= p->delay ? delay - p->delay : 0;
        if (runq > off)
            runq = off;
    }
    if (p->reason == OFFCPU_RUNQUEUE) {
        sched_add_total(p->tgid, OFFCPU_RUNQUEUE, off, 1);
    } else {
        sched_add_total(p->tgid, p->reason, off - runq, 1);
        if (runq)
            sched_add_total(p->tgid, OFFCPU_RUNQUEUE, runq, 0);
    }
    if (off < INGERO_SCHED_MIN_NS)
        return;
    struct ingero_sched_event e = {};
    e.ts_ns = p->ts;
    e.off_ns = off;
    e.runq_ns = runq;
    e.cgroup_id = p->cgroup_id;
    e.pid = p->tgid;
    e.tid = tid;
    e.reason = p->reason;
    if (sched_events.ringbuf_output(&e, sizeof(e), ingero_ring_flags(LOST_SCHED)) != 0)
        ingero_count_lost(LOST_SCHED);
}

/* Open a pending record: the current (target) thread leaves the CPU now. */
static __always_inline void sched_open(struct sched_pending *p, u64 now, u64 exec, u64 delay,
                                       u64 cgid, u32 tgid, long state)
{
    p->ts = now;
    p->exec = exec;
    p->delay = delay;
    p->cgroup_id = cgid;
    p->tgid = tgid;
    if ((state & 0xff) == 0)
        p->reason = OFFCPU_RUNQUEUE;
    else if (state & INGERO_TASK_UNINTERRUPTIBLE)
        p->reason = OFFCPU_IO;
    else
        p->reason = OFFCPU_SLEEP;
}

#if INGERO_RAW_TP
/* prev_state as the tracepoint reports it (__trace_sched_switch_state and
 * __task_state_index, include/linux/sched.h, 6.1+): TASK_REPORT_MAX when preempted, else
 * the highest bit of (state | exit_state) & TASK_REPORT, with TASK_IDLE reported as
 * TASK_REPORT_IDLE and TASK_RTLOCK_WAIT / TASK_FROZEN as TASK_UNINTERRUPTIBLE. prev is the
 * current task. */
#define INGERO_TASK_REPORT 0x7f
#define INGERO_TASK_IDLE 0x402          /* TASK_UNINTERRUPTIBLE | TASK_NOLOAD */
#define INGERO_TASK_RTLOCK_WAIT 0x1000
#define INGERO_TASK_FROZEN 0x8000
static __always_inline long sched_reported_state(u64 preempt, u32 state)
{
    if (preempt)
        return 0x100;                   /* TASK_REPORT_MAX */
    int exit_state = 0;
#if INGERO_TASK_STORAGE
    exit_state = *(int *)((char *)bpf_get_current_task_btf() + INGERO_TASK_EXIT_STATE_OFF);
#else
    bpf_probe_read_kernel(&exit_state, sizeof(exit_state),
                          (char *)bpf_get_current_task() + INGERO_TASK_EXIT_STATE_OFF);
#endif
    u32 s = (state | exit_state) & INGERO_TASK_REPORT;
    if ((state & INGERO_TASK_IDLE) == INGERO_TASK_IDLE)
        s = INGERO_TASK_REPORT + 1;     /* TASK_REPORT_IDLE */
    if (state & (INGERO_TASK_RTLOCK_WAIT | INGERO_TASK_FROZEN))
        s = INGERO_TASK_UNINTERRUPTIBLE;
    s |= s >> 1;
    s |= s >> 2;
    s |= s >> 4;
    return s - (s >> 1);                /* the highest bit */
}
/* (bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state) */
#define SCHED_PREV_STATE() sched_reported_state(ctx->args[0], (u32)ctx->args[3])
#else
#define SCHED_PREV_STATE() (args->prev_state)
#endif

#if !INGERO_MAPS_ONLY   /* the program: bpf/ingero.h */
/* prev, the task leaving the CPU, is the current task. */
INGERO_TRACEPOINT(sched, sched_switch)
{
    u32 tid = bpf_get_current_pid_tgid();
    if (!tid)
        return 0;  /* the idle task */
    u64 cgid = bpf_get_current_cgroup_id();
    u64 now, exec, delay;
#if INGERO_TASK_STORAGE
    struct sched_slot *s = sched_slots.task_storage_get(bpf_get_current_task_btf(), 0,
                                                        BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!s)
        return 0;  /* no memory, or a nested program holds the task's storage */
    u32 target = ingero_cached_verdict(&s->v, cgid);
    if (!target && !s->p.ts)
        return 0;
    now = bpf_ktime_get_ns();
    sched_counters(&exec, &delay);
    if (s->p.ts) {
        sched_close(&s->p, tid, now, exec, delay);
        s->p.ts = 0;
    }
    if (target)
        sched_open(&s->p, now, exec, delay, cgid, bpf_get_current_pid_tgid() >> 32, SCHED_PREV_STATE());
#else
    u64 id = bpf_get_current_pid_tgid();
    int target = ingero_is_target(id >> 32, cgid);
    struct sched_pending *p = sched_pending.lookup(&tid);
    if (!p && !target)
        return 0;
    now = bpf_ktime_get_ns();
    sched_counters(&exec, &delay);
    if (p)
        sched_close(p, tid, now, exec, delay);
    if (p && target) {
        sched_open(p, now, exec, delay, cgid, id >> 32, SCHED_PREV_STATE());   /* in place */
    } else if (target) {
        struct sched_pending st = {};
        sched_open(&st, now, exec, delay, cgid, id >> 32, SCHED_PREV_STATE());
        sched_pending.update(&tid, &st);
    } else {
        sched_pending.delete(&tid);
    }
#endif
    return 0;
}
#endif /* !INGERO_MAPS_ONLY */
