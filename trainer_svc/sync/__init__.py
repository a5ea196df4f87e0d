"""Sync orchestration on the trainer: plan → prepare → stream → commit | abort.

orchestrator.py runs a Sync call (plan the manifest, retry an attempt, report); attempt.py is one
pass over the targets, one method per phase; rollout_calls.py reaches a rollout (sync link or gRPC);
link_client.py is the trainer's end of the sync link; multisender.py lets every owner rank stream;
registry.py is the fleet view; phases.py times the phases.
"""

from trainer_svc.sync.orchestrator import SyncInProgress, SyncOrchestrator

__all__ = ["SyncInProgress", "SyncOrchestrator"]
