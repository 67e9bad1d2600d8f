"""Ingero: eBPF tracing of distributed training (NCCL, TCP, scheduler) per rank."""

__version__ = "0.1.0"
