"""The probe families: what each one records, through which kernel hooks, into which table.

This is the one list of families. The agent, the operator, the CLIs, the schema's
``nodes`` counters and the merge keys derive theirs from ``FAMILIES``; a test
checks the CRD's ``probes`` enum and bpf/ingero.h's ``LOST_*`` slots against it.

A family is its entry here plus its code: per ring, ``bpf/<ring>.c`` with its record
struct in bpf/ingero.h, the record's dtype in ``ingero_agent.records`` (named by the
struct), its decoder in ``ingero_agent.decode`` (registered for the ring) and its
table in ``ingero.schema`` (docs/tracing.md, "Adding a probe family").
"""

from __future__ import annotations

from dataclasses import dataclass

EVENT_KEY = ("node", "session_id", "event_id")   # a recorded event's identity (schema.py)


@dataclass(frozen=True)
class Ring:
    """One BPF ring buffer of a family and the event table its records become."""
    name: str          # the decoder's key; nodes.events_<name>, nodes.lost_<name>
    struct: str        # the C struct of its records (bpf/ingero.h)
    table: str         # its ring buffer map in bpf/ingero.h and its event table (schema.py)
    lost_slot: int     # its per-CPU lost counter (LOST_<NAME> in bpf/ingero.h)
    prefer: str = "rank DESC NULLS LAST"   # which copy of a repeated event a merge keeps

    @property
    def source(self) -> str:
        """Its probes' BPF file in bpf/."""
        return f"{self.name}.c"


@dataclass(frozen=True)
class Family:
    """A probe family: what ``--probes`` / a TraceSession's ``spec.probes`` names."""
    name: str
    rings: tuple[Ring, ...]
    required_tracepoints: tuple[str, ...] = ()     # the family cannot work without them
    optional_tracepoints: tuple[tuple[str, str], ...] = ()   # (tracepoint, -D flag compiling its hook in)
    # Fields its raw tracepoint programs read from kernel structs: (-D flag, struct, member path)
    raw_tp_fields: tuple[tuple[str, str, str], ...] = ()


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("nccl", (
        Ring("nccl", "ingero_nccl_event", "nccl_events", 0,
             prefer="rank DESC NULLS LAST, nranks DESC NULLS LAST"),
        # the records of Ingero's NCCL profiler plugin, read by a USDT probe
        Ring("nccl_profiler", "ingero_nccl_prof_event", "nccl_profiler_events", 3),
    )),
    Family("tcp", (Ring("tcp", "ingero_tcp_event", "tcp_events", 1),),
           required_tracepoints=("tcp/tcp_retransmit_skb", "sock/inet_sock_set_state"),
           optional_tracepoints=(("tcp/tcp_send_reset", "INGERO_HAVE_TCP_SEND_RESET"),
                                 ("tcp/tcp_receive_reset", "INGERO_HAVE_TCP_RECEIVE_RESET"),
                                 ("tcp/tcp_destroy_sock", "INGERO_HAVE_TCP_DESTROY_SOCK"),
                                 ("sock/sock_send_length", "INGERO_HAVE_SOCK_LENGTH"),
                                 ("tcp/tcp_rcv_space_adjust", "INGERO_HAVE_TCP_RCV_SPACE_ADJUST")),
           raw_tp_fields=(("INGERO_SK_FAMILY_OFF", "sock", "__sk_common.skc_family"),
                          ("INGERO_SK_STATE_OFF", "sock", "__sk_common.skc_state"),
                          ("INGERO_SK_DPORT_OFF", "sock", "__sk_common.skc_dport"),
                          ("INGERO_SK_DADDR_OFF", "sock", "__sk_common.skc_daddr"),
                          ("INGERO_SK_V6_SADDR_OFF", "sock", "__sk_common.skc_v6_rcv_saddr"),
                          ("INGERO_SK_V6_DADDR_OFF", "sock", "__sk_common.skc_v6_daddr"),
                          ("INGERO_SK_PROTOCOL_OFF", "sock", "sk_protocol"),
                          ("INGERO_INET_SPORT_OFF", "inet_sock", "inet_sport"),
                          ("INGERO_INET_SADDR_OFF", "inet_sock", "inet_saddr"),
                          ("INGERO_SKB_HEAD_OFF", "sk_buff", "head"),
                          ("INGERO_SKB_DATA_OFF", "sk_buff", "data"),
                          ("INGERO_SKB_NH_OFF", "sk_buff", "network_header"))),
    Family("sched", (Ring("sched", "ingero_sched_event", "sched_events", 2),),
           required_tracepoints=("sched/sched_switch",),
           raw_tp_fields=(("INGERO_TASK_EXIT_STATE_OFF", "task_struct", "exit_state"),)),
)}
NAMES: tuple[str, ...] = tuple(FAMILIES)
# Every ring, in lost-counter order (the nodes table's columns follow it).
RINGS: dict[str, Ring] = {r.name: r for r in sorted((r for f in FAMILIES.values() for r in f.rings),
                                                      key=lambda r: r.lost_slot)}


def rings_of(families) -> tuple[Ring, ...]:
    """The rings of the named families, in registry order."""
    return tuple(r for f in FAMILIES.values() if f.name in families for r in f.rings)
