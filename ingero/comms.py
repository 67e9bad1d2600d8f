"""Resolve what the kernel cannot know of a communicator: the ranks of those created
by ncclCommSplit, and one identity for the members of one made by ncclCommGrow.

The kernel cannot know a split child's rank: NCCL orders the members of each
color by (key, rank in the parent), which needs every member's view. The
agent records each split in the `comms` table with the parent's hash, the
color and the key; once the traces of all nodes are together, this module
numbers the members and writes rank and nranks into `comms` and into the
child's rows of `nccl_events`. Nested splits resolve level by level. A split
whose parent was not traced on every one of its ranks stays unresolved
(rank -1): a numbering from part of the members would be wrong.

Likewise the global rank of a proxy summary's peer (`nccl_proxy.peer_rank`): a
tracer knows it only for peers on its own node; the merged trace knows every
traced process's rank in each of NCCL's communicators (`nccl_device_inflight`).
"""

from __future__ import annotations

MAX_SPLIT_DEPTH = 8
GROW_SALT = 0x47524F5700000000       # bpf/nccl.c NCCL_GROW_SALT
_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """bpf/nccl.c ingero_splitmix64."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


# ncclCommGrow (bpf/nccl.c): new ranks and the coordinator (the existing rank that passes
# the grow id) hash the id; the other existing ranks get no id and take
# splitmix64(parent ^ GROW_SALT ^ n), n the parent's grow number, recorded in `color`.
# The coordinator's row says which id hash that (parent, n) stands for.
def grow_links(con) -> list[tuple[int, int, int]]:
    """(derived hash, id hash, parent hash) of every grow whose coordinator was traced."""
    rows = con.execute("""
        SELECT DISTINCT parent_hash, color, comm_id_hash FROM comms
        WHERE op = 'COMM_GROW' AND coalesce(parent_hash, 0) <> 0 AND color IS NOT NULL
          AND comm_id_hash <> 0""").fetchall()
    links: dict[int, tuple[int, int]] = {}
    for parent, n, h in rows:
        derived = _splitmix64(parent ^ GROW_SALT ^ (n & 0xFFFFFFFF))
        if h != derived:
            links.setdefault(derived, (h, parent))
    used: set[int] = set()
    out = []
    for d, (h, p) in sorted(links.items()):
        if h not in used:          # a grow id names one grow (NCCL consumes it)
            used.add(h)
            out.append((d, h, p))
    return out


def _values(links: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"({d}::UBIGINT, {h}::UBIGINT, {p}::UBIGINT)" for d, h, p in links)


def with_grow_ids(events_sql: str, links: list[tuple[int, int, int]]) -> str:
    """`events_sql` (nccl_events rows) with the members of grown communicators under the
    grow id's hash (and the new ranks' grow rows under the parent), as a query: for an
    artifact whose nccl_events is a view (resolve_grow_ids updates a table)."""
    if not links:
        return events_sql
    v = _values(links)
    return f"""
        SELECT e.* REPLACE (coalesce(g.id_hash, e.comm_id_hash) AS comm_id_hash,
                            CASE WHEN e.op = 'COMM_GROW' AND coalesce(e.parent_hash, 0) = 0
                                 THEN coalesce(j.parent, e.parent_hash) ELSE e.parent_hash END AS parent_hash)
        FROM ({events_sql}) e
        LEFT JOIN (VALUES {v}) g(derived, id_hash, parent) ON e.comm_id_hash = g.derived
        LEFT JOIN (VALUES {v}) j(derived, id_hash, parent) ON e.comm_id_hash = j.id_hash"""


def resolve_grow_ids(con) -> int:
    """Give every member of a grown communicator the grow id's hash, in `comms` and in
    `nccl_events` (tables), and the new ranks' grow rows the parent's hash. A grow whose
    coordinator was not traced keeps two identities (existing ranks, new ranks).
    Returns how many communicator rows changed identity."""
    links = grow_links(con)
    if not links:
        return 0
    v = _values(links)
    n = 0
    for table in ("comms", "nccl_events"):
        k = con.execute(f"""
            UPDATE {table} SET comm_id_hash = g.id_hash
            FROM (VALUES {v}) g(derived, id_hash, parent)
            WHERE {table}.comm_id_hash = g.derived""").fetchone()[0]
        con.execute(f"""
            UPDATE {table} SET parent_hash = g.parent
            FROM (VALUES {v}) g(derived, id_hash, parent)
            WHERE {table}.comm_id_hash = g.id_hash AND {table}.op = 'COMM_GROW'
              AND coalesce({table}.parent_hash, 0) = 0""")
        if table == "comms":
            n = k
    return n


# Split children whose rank is known, one row per process and communicator: what the
# events of a split communicator (recorded with rank -1) take their rank and size from.
RESOLVED_SPLITS = """
    SELECT node, pid, comm_id_hash, any_value(rank) AS rank, any_value(nranks) AS nranks
    FROM comms WHERE op = 'COMM_SPLIT' AND rank >= 0 GROUP BY ALL"""


def with_split_ranks(events_sql: str) -> str:
    """`events_sql` (nccl_events rows) with the ranks of resolved split children filled in,
    as a query: for an artifact whose nccl_events is a view (resolve_split_ranks updates
    a table)."""
    return f"""
        SELECT e.* REPLACE (CASE WHEN e.rank < 0 AND s.pid IS NOT NULL THEN s.rank ELSE e.rank END AS rank,
                            CASE WHEN e.rank < 0 AND s.pid IS NOT NULL THEN s.nranks ELSE e.nranks END AS nranks)
        FROM ({events_sql}) e
        LEFT JOIN ({RESOLVED_SPLITS}) s
          ON s.node IS NOT DISTINCT FROM e.node AND s.pid = e.pid AND s.comm_id_hash = e.comm_id_hash"""


def resolve_proxy_peers(con) -> int:
    """Fill `nccl_proxy.peer_rank` where the peer's process was traced (real tables; a trace
    without the tables is left alone). Returns how many rows were filled."""
    import duckdb

    try:
        return con.execute("""
            UPDATE nccl_proxy SET peer_rank = m.g
            FROM (SELECT comm_hash, comm_rank, any_value(rank) AS g FROM nccl_device_inflight
                  WHERE rank IS NOT NULL GROUP BY ALL) m
            WHERE nccl_proxy.peer_rank IS NULL AND nccl_proxy.comm_hash = m.comm_hash
              AND nccl_proxy.peer = m.comm_rank""").fetchone()[0]
    except duckdb.CatalogException:
        return 0


def resolve_split_ranks(con) -> int:
    """Fill rank/nranks of split children in `comms` and `nccl_events` (real tables), and the
    proxy summaries' peers (resolve_proxy_peers).

    Grown communicators get their one identity first (resolve_grow_ids).
    Returns how many communicator rows were resolved.
    """
    resolve_grow_ids(con)
    resolved = 0
    for _ in range(MAX_SPLIT_DEPTH):
        n = con.execute("""
            WITH kids AS (
              SELECT c.node, c.pid, c.comm_id_hash, c.split_key, p.rank AS parent_rank
              FROM comms c
              JOIN comms p ON p.node IS NOT DISTINCT FROM c.node AND p.pid = c.pid
                          AND p.comm_id_hash = c.parent_hash AND p.rank >= 0
              -- only when every member of the parent was traced: otherwise the
              -- numbering would silently be wrong, so leave it unknown (-1)
              JOIN (SELECT comm_id_hash, count(DISTINCT (node, pid)) AS seen,
                           any_value(nranks) AS size
                    FROM comms WHERE rank >= 0 GROUP BY comm_id_hash) cov
                ON cov.comm_id_hash = c.parent_hash AND cov.seen = cov.size
              WHERE c.op = 'COMM_SPLIT' AND c.rank < 0),
            numbered AS (
              SELECT node, pid, comm_id_hash,
                     row_number() OVER (PARTITION BY comm_id_hash
                                        ORDER BY split_key, parent_rank) - 1 AS new_rank,
                     count(*) OVER (PARTITION BY comm_id_hash) AS members
              FROM kids)
            UPDATE comms SET rank = numbered.new_rank, nranks = numbered.members
            FROM numbered
            WHERE comms.node IS NOT DISTINCT FROM numbered.node AND comms.pid = numbered.pid
              AND comms.comm_id_hash = numbered.comm_id_hash AND comms.op = 'COMM_SPLIT'
        """).fetchone()[0]
        if not n:
            break
        resolved += n
    # Also when nothing new was resolved here: rows merged from elsewhere may carry
    # resolved communicators while their events still say -1.
    if resolved or con.execute("SELECT count(*) FROM comms WHERE op = 'COMM_SPLIT' AND rank >= 0").fetchone()[0]:
        con.execute(f"""
            UPDATE nccl_events SET rank = c.rank, nranks = c.nranks
            FROM ({RESOLVED_SPLITS}) c
            WHERE nccl_events.node IS NOT DISTINCT FROM c.node AND nccl_events.pid = c.pid
              AND nccl_events.comm_id_hash = c.comm_id_hash AND nccl_events.rank < 0""")
    resolve_proxy_peers(con)
    return resolved
