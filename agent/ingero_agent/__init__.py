"""The Ingero node agent: target discovery, eBPF probes, ring-buffer drain, segments."""
