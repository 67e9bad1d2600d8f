"""NCCL's proxy summaries (``nccl_proxy``, Ingero's profiler plugin): per rank, how long its
transfers waited on the network.

A send step waits for the network (NCCL's ProxyStepSendWait) while the transport has not
completed it: on a lossy or congested link its segments are resent and the step waits
longer. A receive waits for the network's data too (ProxyStepRecvWait), but also while its
peer is late for any reason, so the send side is the one read as network evidence.
"""

from __future__ import annotations

import duckdb


def add_proxy_waits(con, rows: dict) -> None:
    """Set each rank's `net_wait_ms` (model.RankRow): its sends' time waiting on the network
    over the trace, from the plugin's proxy summaries; left None without them."""
    try:
        got = con.execute("""SELECT rank, sum(send_net_wait_ns) / 1e6 FROM nccl_proxy
                             WHERE rank IS NOT NULL GROUP BY rank""").fetchall()
    except duckdb.CatalogException:
        return      # a trace written before the plugin summarised proxy operations
    for rank, ms in got:
        if rank in rows and ms is not None:
            rows[rank].net_wait_ms = round(float(ms), 3)
