"""Ingero operator: the TraceSession CRD driven with kopf, and the whole flow on one machine."""
