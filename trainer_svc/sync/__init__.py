"""Sync orchestration on the trainer: plan → prepare → stream → commit | abort.

orchestrator.py runs a Sync call (plan the manifest, retry an attempt, report); attempt.py is one
pass over the targets, one method per phase; phases.py times the phases.
"""
from trainer_svc.sync.orchestrator import SyncInProgress, SyncOrchestrator

__all__ = ["SyncInProgress", "SyncOrchestrator"]
