"""Trainer-side weight-bus transports as the sync orchestrator uses them (tcp, nccl, ipc).

Each transport opens a per-sync session that says what to put in PrepareSync for each target,
checks each target's answer, and opens the bucket sender once the targets are prepared.
"""
