"""Resolve the ranks of communicators created by ncclCommSplit.

The kernel cannot know a split child's rank: NCCL orders the members of each
color by (key, rank in the parent), which needs every member's view. The
agent records each split in the `comms` table with the parent's hash, the
color and the key; once the traces of all nodes are together, this module
numbers the members and writes rank and nranks into `comms` and into the
child's rows of `nccl_events`. Nested splits resolve level by level. A split
whose parent was not traced on every one of its ranks stays unresolved
(rank -1): a numbering from part of the members would be wrong.
"""

from __future__ import annotations

MAX_SPLIT_DEPTH = 8


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


def resolve_split_ranks(con) -> int:
    """Fill rank/nranks of split children in `comms` and `nccl_events` (real tables).

    Returns how many communicator rows were resolved.
    """
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
    return resolved
