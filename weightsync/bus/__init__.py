"""The weight bus: plan → pack → move → unpack, independent of the model and of the transport.

Export code yields HF-named tensors; `plan` lays them out in fixed-size flat buckets from
metadata alone; `pack`/`unpack` copy between tensors and bucket buffers; channels move
buffers and nothing else. The CPU (TCP) path and the GPU (NCCL / CUDA IPC) path share all of it.

Words, one per layer:
- transport: tcp, nccl or ipc — one package each (`tcp/`, `nccl/`, `ipc/`), holding both ends.
- sender / receiver: a transport's trainer end (`sender.py`, which opens a *session* per sync,
  see `session.py`) and its rollout end (`receiver.py`).
- channel: the object that moves one sync's bucket bytes (`channel.py`: BucketSender on the
  trainer, BucketReceiver on the rollout), built on the transport's wire or library binding
  (`tcp/wire.py`, `nccl/libnccl.py` + `nccl/group.py`, `ipc/handles.py`).
- registry: `transports.py` names each transport's ends and channel and declares what it can do;
  everything that lists transports or asks what one can do reads it.
This package imports nothing of the services (trainer_svc, rollout_svc) or of weightsync.control.
"""
