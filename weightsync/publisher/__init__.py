"""The trainer side of the weight bus: publish a model's tensors to every registered rollout.

Any training process can embed it through `Publisher` (publisher.py: declare the model, start,
`sync(named_tensors)` every step); trainer-svc is another user (its training backend plus this).
host.py is what both run (listeners, metrics, registry, orchestrator, the Trainer service's
fleet RPCs in fleet_servicer.py, the REST mirror in http_api.py); declared.py checks a Publisher's
tensors against its declared model; collective.py is a Publisher over a torch.distributed group
(every rank syncs what it owns, rank 0 serves), commands.py the leader -> ranks channel. A
sync runs plan → prepare → stream → commit | abort: orchestrator.py runs a Sync call (plan the
manifest, retry an attempt, report); attempt.py is one pass over the targets, one method per
phase; rollout_calls.py reaches a rollout (sync link or gRPC); link_client.py is the trainer's end
of the sync link; multisender.py lets every owner rank stream; registry.py is the fleet view;
export_format.py is what the export puts on the wire (dtype, block FP8); phases.py times the phases.
"""

from weightsync.publisher.declared import DeclaredModel
from weightsync.publisher.fleet_servicer import FleetServicer
from weightsync.publisher.host import PublisherHost
from weightsync.publisher.orchestrator import SyncInProgress, SyncOrchestrator
from weightsync.publisher.publisher import Auth, Publisher, SyncFailed
from weightsync.publisher.registry import RolloutRegistry
from weightsync.sync_options import SyncOptions

__all__ = [
    "Auth",
    "DeclaredModel",
    "FleetServicer",
    "Publisher",
    "PublisherHost",
    "RolloutRegistry",
    "SyncFailed",
    "SyncInProgress",
    "SyncOptions",
    "SyncOrchestrator",
]
