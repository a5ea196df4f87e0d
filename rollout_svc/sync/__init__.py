"""A weight sync on the rollout: prepare → receive buckets → commit | abort.

transaction.py is the sync as a transaction; engine_gate.py decides who uses the engine (syncs
exclusively, requests pinned to a version); alarm.py is the prepared sync's deadline; pinning.py
is the trainer this rollout follows and the rollback rule; link_server.py answers the trainer's
sync link.
"""
