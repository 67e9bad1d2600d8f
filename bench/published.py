"""The example queries published for the original Ingero tool.

They must run unchanged on Ingero's tables (ingero/schema.py): tests run them
on real traces, and bench/sqlite_vs_duckdb.py times the join.
"""

TOP_SLOW_CALLS = ("SELECT op, rank, nranks, duration_ns/1e6 AS ms FROM nccl_events "
                  "ORDER BY duration_ns DESC LIMIT 20")

RETRANSMIT_COUNT = "SELECT COUNT(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb'"

# Counts every retransmit on the node inside each slow all-reduce, whoever owns
# it; Ingero's own report attributes retransmits per connection instead.
SLOW_COLLECTIVE_JOIN = """
WITH slow_collectives AS (
  SELECT timestamp_ns, duration_ns, rank, nranks, comm_id_hash, pid
  FROM nccl_events WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000)
SELECT s.rank, s.duration_ns/1e6 AS ms, COUNT(t.timestamp_ns) AS retransmits_in_window
FROM slow_collectives s
LEFT JOIN tcp_events t
  ON t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns
 AND t.event = 'tcp_retransmit_skb'
GROUP BY s.rank, s.duration_ns, s.timestamp_ns ORDER BY ms DESC LIMIT 20;
"""
