/* tcp.c: TCP retransmits, resets and state changes of target connections.
 *
 * Hooks (tracepoints only; kprobes are not assumed):
 *   tcp:tcp_retransmit_skb   IPv4 and IPv6, fires in softirq/timer context
 *   tcp:tcp_send_reset, tcp:tcp_receive_reset
 *   sock:inet_sock_set_state state changes of TCP sockets
 *   sock:sock_send_length, sock:sock_recv_length (when the kernel has them)
 *                            and inet_sock_set_state -> SYN_SENT (connect):
 *                            process context, learn who owns a socket
 *   tcp:tcp_destroy_sock     forget the owner
 *
 * Attribution is by connection, not by the task on the CPU: a retransmit
 * runs from a timer or softirq, where `current` is whoever was interrupted.
 * `sock_owners` maps the struct sock address to the target task that sent,
 * received or connected on it (filled only for target tasks, or for every
 * task with INGERO_TARGET_ALL). An event is emitted when its socket has a
 * target owner (owner_src OWNER_SOCKET), when the current task owns it in
 * process context (OWNER_CURRENT), when its local address (saddr) is a
 * target pod IP (`target_ips`, filled from user space; OWNER_NONE, user
 * space matches the address: in Kubernetes a pod IP lives only in that pod's
 * network namespace, so the local end of the connection is the pod), or
 * always with INGERO_TARGET_ALL. The remote address is not matched: a
 * connection *to* a target pod from elsewhere is not the pod's own.
 *
 * With INGERO_RAW_TP they are raw tracepoints, reading the socket (and the reset's packet)
 * as the tracepoints do; the events are the same.
 *
 * Settings (from the loader, which reads the kernel's tracepoint formats):
 *   INGERO_HAVE_TCP_SEND_RESET, INGERO_HAVE_TCP_RECEIVE_RESET,
 *   INGERO_HAVE_TCP_DESTROY_SOCK, INGERO_HAVE_SOCK_LENGTH: the tracepoint
 *     exists (sock_send_length/sock_recv_length are recent; without them
 *     owners are learned at connect() and, with INGERO_HAVE_TCP_RCV_SPACE_ADJUST,
 *     at a socket's reads: accepted connections get an owner too).
 *   INGERO_TCP_RESET_SOCKADDR: tcp_send_reset stores sockaddr_in/_in6 in
 *     saddr/daddr (recent kernels); else the older sport/dport/family layout.
 *   INGERO_DECLARE_SK_RST_REASON: see below.
 */
#include "ingero.h"

#ifndef INGERO_HAVE_SOCK_LENGTH
#define INGERO_HAVE_SOCK_LENGTH 1
#endif
#ifndef INGERO_HAVE_TCP_SEND_RESET
#define INGERO_HAVE_TCP_SEND_RESET 1
#endif
#ifndef INGERO_HAVE_TCP_RECEIVE_RESET
#define INGERO_HAVE_TCP_RECEIVE_RESET 1
#endif
#ifndef INGERO_HAVE_TCP_RCV_SPACE_ADJUST
#define INGERO_HAVE_TCP_RCV_SPACE_ADJUST 0
#endif
#ifndef INGERO_HAVE_TCP_DESTROY_SOCK
#define INGERO_HAVE_TCP_DESTROY_SOCK 1
#endif
#ifndef INGERO_TCP_RESET_SOCKADDR
#define INGERO_TCP_RESET_SOCKADDR 1
#endif

#define INGERO_IPPROTO_TCP 6
#define INGERO_AF_INET 2
#define INGERO_AF_INET6 10
#define INGERO_TCP_SYN_SENT 2

/* 6.10+ kernels give tcp_send_reset a `reason` field of an enum that the
 * (older) headers bcc compiles against may not declare; the loader sets this
 * when the tracepoint's format names the enum. Only its size (4) matters. */
#ifdef INGERO_DECLARE_SK_RST_REASON
enum sk_rst_reason { INGERO_SK_RST_REASON_UNUSED = 0 };
#endif

BPF_RINGBUF_OUTPUT(tcp_events, INGERO_RINGBUF_PAGES);

struct sock_owner {
    u64 cgroup_id;
    u32 tgid;
    u32 tid;
};
BPF_TABLE("lru_hash", u64, struct sock_owner, sock_owners, 65536);

/* A target pod address: IPv4 in the first 4 bytes, family AF_INET/AF_INET6. */
struct ip_key {
    u8 addr[16];
    u32 family;
};
BPF_HASH(target_ips, struct ip_key, u8, INGERO_MAX_TARGETS);

static __always_inline void tcp_note_owner(u64 sk)
{
    if (!sk)
        return;
    u64 id = bpf_get_current_pid_tgid();
    u64 cgid = bpf_get_current_cgroup_id();
    if (!ingero_current_is_target(id >> 32, cgid))
        return;
    struct sock_owner *cur = sock_owners.lookup(&sk);
    if (cur && cur->tgid == (u32)(id >> 32) && cur->tid == (u32)id)
        return;
    struct sock_owner o = {.cgroup_id = cgid, .tgid = id >> 32, .tid = (u32)id};
    sock_owners.update(&sk, &o);
}

static __always_inline int tcp_ip_is_target(const u8 *addr, u16 family)
{
    struct ip_key k = {};
    k.family = family;
    if (family == INGERO_AF_INET) {
        __builtin_memcpy(k.addr, addr, 4);
    } else if (addr[0] == 0 && addr[1] == 0 && addr[2] == 0 && addr[3] == 0 && addr[4] == 0 &&
               addr[5] == 0 && addr[6] == 0 && addr[7] == 0 && addr[8] == 0 && addr[9] == 0 &&
               addr[10] == 0xff && addr[11] == 0xff) {
        /* IPv4-mapped IPv6 (::ffff:a.b.c.d, a dual-stack socket talking IPv4):
         * matches the pod's IPv4 address */
        k.family = INGERO_AF_INET;
        __builtin_memcpy(k.addr, addr + 12, 4);
    } else {
        __builtin_memcpy(k.addr, addr, 16);
    }
    return target_ips.lookup(&k) != 0;
}

/* Decides whether `e` (addresses, ports, kind filled in) is a target event,
 * fills in the owner and sends it. `in_process` says the current task is
 * the socket's user (connect). */
static __always_inline void tcp_submit(struct ingero_tcp_event *e, int in_process)
{
    u64 sk = e->skaddr;
    struct sock_owner *o = sk ? sock_owners.lookup(&sk) : 0;
    if (o) {
        e->owner_src = OWNER_SOCKET;
        e->pid = o->tgid;
        e->tid = o->tid;
        e->cgroup_id = o->cgroup_id;
    } else if (in_process) {
        u64 id = bpf_get_current_pid_tgid();
        u64 cgid = bpf_get_current_cgroup_id();
        if (ingero_current_is_target(id >> 32, cgid)) {
            e->owner_src = OWNER_CURRENT;
            e->pid = id >> 32;
            e->tid = (u32)id;
            e->cgroup_id = cgid;
        }
    }
    if (e->owner_src == OWNER_NONE && !INGERO_TARGET_ALL && !tcp_ip_is_target(e->saddr, e->family))
        return;
    e->ts_ns = bpf_ktime_get_ns();
    if (tcp_events.ringbuf_output(e, sizeof(*e), ingero_ring_flags(LOST_TCP)) != 0)
        ingero_count_lost(LOST_TCP);
}

/* Copies addresses from a tracepoint's saddr/daddr (v4) or _v6 fields. */
#define TCP_COPY_ADDRS(e, args)                                                   \
    do {                                                                          \
        if ((e).family == INGERO_AF_INET6) {                                      \
            bpf_probe_read_kernel((e).saddr, 16, (void *)(args)->saddr_v6);       \
            bpf_probe_read_kernel((e).daddr, 16, (void *)(args)->daddr_v6);       \
        } else {                                                                  \
            bpf_probe_read_kernel((e).saddr, 4, (void *)(args)->saddr);           \
            bpf_probe_read_kernel((e).daddr, 4, (void *)(args)->daddr);           \
        }                                                                         \
    } while (0)

#if !INGERO_MAPS_ONLY   /* the programs: bpf/ingero.h */
#if INGERO_RAW_TP
/* Raw tracepoints: the arguments are the kernel's (TP_PROTO), so the fields the
 * tracepoints format are read here as their TP_fast_assign reads them
 * (include/trace/events/tcp.h, sock.h), at offsets from the running kernel's BTF
 * (-D INGERO_SK_*_OFF, INGERO_INET_*_OFF, INGERO_SKB_*_OFF; see ingero_agent/probes.py). */
#define TCP_READ(dst, base, off) bpf_probe_read_kernel(&(dst), sizeof(dst), (char *)(base) + (off))
#define INGERO_TCPF_NOT_FULL ((1 << 6) | (1 << 12))   /* TCP_TIME_WAIT, TCP_NEW_SYN_RECV */

/* family, ports and addresses of socket `sk` (TP_STORE_ADDRS: v4 in saddr/daddr) */
static __always_inline void tcp_from_sk(struct ingero_tcp_event *e, u64 sk)
{
    u16 family = 0, sport = 0, dport = 0;
    TCP_READ(family, sk, INGERO_SK_FAMILY_OFF);
    TCP_READ(sport, sk, INGERO_INET_SPORT_OFF);
    TCP_READ(dport, sk, INGERO_SK_DPORT_OFF);
    e->family = family;
    e->sport = bpf_ntohs(sport);
    e->dport = bpf_ntohs(dport);
    if (family == INGERO_AF_INET6) {
        TCP_READ(e->saddr, sk, INGERO_SK_V6_SADDR_OFF);
        TCP_READ(e->daddr, sk, INGERO_SK_V6_DADDR_OFF);
    } else {
        bpf_probe_read_kernel(e->saddr, 4, (char *)sk + INGERO_INET_SADDR_OFF);
        bpf_probe_read_kernel(e->daddr, 4, (char *)sk + INGERO_SK_DADDR_OFF);
    }
}

static __always_inline u8 tcp_sk_state(u64 sk)
{
    u8 state = 0;
    TCP_READ(state, sk, INGERO_SK_STATE_OFF);
    return state;
}

static __always_inline u16 tcp_sk_protocol(u64 sk)
{
    u16 protocol = 0;
    TCP_READ(protocol, sk, INGERO_SK_PROTOCOL_OFF);
    return protocol;
}

/* The packet `skb` answered with a reset, its 4-tuple reversed (TP_STORE_ADDR_PORTS_SKB with
 * the entry's daddr and saddr swapped): the local end is the packet's destination. */
static __always_inline void tcp_from_skb(struct ingero_tcp_event *e, u64 skb)
{
    u64 head = 0, data = 0;
    u16 nh = 0;
    TCP_READ(head, skb, INGERO_SKB_HEAD_OFF);
    TCP_READ(data, skb, INGERO_SKB_DATA_OFF);
    TCP_READ(nh, skb, INGERO_SKB_NH_OFF);
    u8 iph[40] = {};
    u16 ports[2] = {};                  /* the TCP header's source, dest (skb->data) */
    bpf_probe_read_kernel(iph, sizeof(iph), (void *)(head + nh));
    bpf_probe_read_kernel(ports, sizeof(ports), (void *)data);
    e->sport = bpf_ntohs(ports[1]);
    e->dport = bpf_ntohs(ports[0]);
    if ((iph[0] >> 4) == 6) {           /* ipv6hdr: saddr at 8, daddr at 24 */
        e->family = INGERO_AF_INET6;
        __builtin_memcpy(e->saddr, iph + 24, 16);
        __builtin_memcpy(e->daddr, iph + 8, 16);
    } else {                            /* iphdr: saddr at 12, daddr at 16 */
        e->family = INGERO_AF_INET;
        __builtin_memcpy(e->saddr, iph + 16, 4);
        __builtin_memcpy(e->daddr, iph + 12, 4);
    }
}

RAW_TRACEPOINT_PROBE(tcp_retransmit_skb)     /* (sk, skb, ...) */
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_RETRANSMIT;
    e.skaddr = ctx->args[0];
    tcp_from_sk(&e, e.skaddr);
    e.state = tcp_sk_state(e.skaddr);
    tcp_submit(&e, 0);
    return 0;
}

#if INGERO_HAVE_TCP_RECEIVE_RESET
RAW_TRACEPOINT_PROBE(tcp_receive_reset)      /* (sk) */
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_RECEIVE_RESET;
    e.skaddr = ctx->args[0];
    tcp_from_sk(&e, e.skaddr);
    tcp_submit(&e, 0);
    return 0;
}
#endif

#if INGERO_HAVE_TCP_SEND_RESET
RAW_TRACEPOINT_PROBE(tcp_send_reset)         /* (sk or NULL, skb or NULL, ...) */
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_SEND_RESET;
    e.skaddr = ctx->args[0];
    u64 skb = ctx->args[1];
    if (e.skaddr) {
        e.state = tcp_sk_state(e.skaddr);
        if (!((1 << e.state) & INGERO_TCPF_NOT_FULL))    /* sk_fullsock */
            tcp_from_sk(&e, e.skaddr);
        else if (skb)
            tcp_from_skb(&e, skb);
    } else if (skb) {
        tcp_from_skb(&e, skb);
    }
    tcp_submit(&e, 0);
    return 0;
}
#endif

RAW_TRACEPOINT_PROBE(inet_sock_set_state)    /* (sk, oldstate, newstate) */
{
    u64 sk = ctx->args[0];
    if (tcp_sk_protocol(sk) != INGERO_IPPROTO_TCP)
        return 0;
    int newstate = (int)ctx->args[2];
    int connecting = newstate == INGERO_TCP_SYN_SENT;
    if (connecting)
        tcp_note_owner(sk);  /* connect(): the caller owns the socket */
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_STATE;
    e.skaddr = sk;
    tcp_from_sk(&e, sk);
    e.state = newstate;
    e.oldstate = (int)ctx->args[1];
    tcp_submit(&e, connecting);
    return 0;
}

#if INGERO_HAVE_TCP_DESTROY_SOCK
RAW_TRACEPOINT_PROBE(tcp_destroy_sock)       /* (sk) */
{
    u64 sk = ctx->args[0];
    sock_owners.delete(&sk);
    return 0;
}
#endif

#if INGERO_HAVE_SOCK_LENGTH
RAW_TRACEPOINT_PROBE(sock_send_length)       /* (sk, ret, flags) */
{
    if (tcp_sk_protocol(ctx->args[0]) == INGERO_IPPROTO_TCP)
        tcp_note_owner(ctx->args[0]);
    return 0;
}

RAW_TRACEPOINT_PROBE(sock_recv_length)       /* (sk, ret, flags) */
{
    if (tcp_sk_protocol(ctx->args[0]) == INGERO_IPPROTO_TCP)
        tcp_note_owner(ctx->args[0]);
    return 0;
}
#elif INGERO_HAVE_TCP_RCV_SPACE_ADJUST
RAW_TRACEPOINT_PROBE(tcp_rcv_space_adjust)   /* (sk) */
{
    tcp_note_owner(ctx->args[0]);
    return 0;
}
#endif

#else /* perf-event tracepoints: their formatted fields */

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_RETRANSMIT;
    e.skaddr = (u64)args->skaddr;
    e.family = args->family;
    e.sport = args->sport;
    e.dport = args->dport;
    e.state = args->state;
    TCP_COPY_ADDRS(e, args);
    tcp_submit(&e, 0);
    return 0;
}

#if INGERO_HAVE_TCP_RECEIVE_RESET
TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_RECEIVE_RESET;
    e.skaddr = (u64)args->skaddr;
    e.family = args->family;
    e.sport = args->sport;
    e.dport = args->dport;
    TCP_COPY_ADDRS(e, args);
    tcp_submit(&e, 0);
    return 0;
}

#endif

#if INGERO_HAVE_TCP_SEND_RESET
TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_SEND_RESET;
    e.skaddr = (u64)args->skaddr;
    e.state = args->state;
#if INGERO_TCP_RESET_SOCKADDR
    /* saddr/daddr hold a struct sockaddr_in or sockaddr_in6:
     * u16 family; __be16 port; then the v4 address at +4, or flowinfo at +4
     * and the v6 address at +8. */
    u8 sa[28] = {};
    u8 da[28] = {};
    bpf_probe_read_kernel(sa, sizeof(sa), (void *)args->saddr);
    bpf_probe_read_kernel(da, sizeof(da), (void *)args->daddr);
    e.family = sa[0] | (sa[1] << 8);
    e.sport = (sa[2] << 8) | sa[3];
    e.dport = (da[2] << 8) | da[3];
    if (e.family == INGERO_AF_INET6) {
        __builtin_memcpy(e.saddr, sa + 8, 16);
        __builtin_memcpy(e.daddr, da + 8, 16);
    } else {
        __builtin_memcpy(e.saddr, sa + 4, 4);
        __builtin_memcpy(e.daddr, da + 4, 4);
    }
#else
    e.family = args->family;
    e.sport = args->sport;
    e.dport = args->dport;
    TCP_COPY_ADDRS(e, args);
#endif
    tcp_submit(&e, 0);
    return 0;
}

#endif

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != INGERO_IPPROTO_TCP)
        return 0;
    u64 sk = (u64)args->skaddr;
    int connecting = args->newstate == INGERO_TCP_SYN_SENT;
    if (connecting)
        tcp_note_owner(sk);  /* connect(): the caller owns the socket */
    struct ingero_tcp_event e = {};
    e.kind = TCP_EV_STATE;
    e.skaddr = sk;
    e.family = args->family;
    e.sport = args->sport;
    e.dport = args->dport;
    e.state = args->newstate;
    e.oldstate = args->oldstate;
    TCP_COPY_ADDRS(e, args);
    tcp_submit(&e, connecting);
    return 0;
}

#if INGERO_HAVE_TCP_DESTROY_SOCK
TRACEPOINT_PROBE(tcp, tcp_destroy_sock)
{
    u64 sk = (u64)args->skaddr;
    sock_owners.delete(&sk);
    return 0;
}
#endif

#if INGERO_HAVE_SOCK_LENGTH
TRACEPOINT_PROBE(sock, sock_send_length)
{
    if (args->protocol == INGERO_IPPROTO_TCP)
        tcp_note_owner((u64)args->sk);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
    if (args->protocol == INGERO_IPPROTO_TCP)
        tcp_note_owner((u64)args->sk);
    return 0;
}
#elif INGERO_HAVE_TCP_RCV_SPACE_ADJUST
/* Without sock_*_length: tcp_rcv_space_adjust runs in tcp_recvmsg, in the
 * context of the task reading the socket, so a passive (accepted) connection
 * gets its owner at its first read, not only active ones at connect(). */
TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    tcp_note_owner((u64)args->skaddr);
    return 0;
}
#endif
#endif /* INGERO_RAW_TP */
#endif /* !INGERO_MAPS_ONLY */
