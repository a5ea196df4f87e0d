"""The delta codec: a bucket as the words that changed since a base copy of it.

- `codec`: encode on the trainer, apply on a rollout (batched torch ops, on the buffers' device);
- `payload`: a delta payload's layout, shared by both codecs;
- `codec_triton` (with its kernels, `kernels_triton`): the same codec as fused Triton kernels for
  buckets on a CUDA GPU (bitmap kind only).

The ends that call it: the trainer's base, offer and delta channel (weightsync/publisher/delta_sync.py)
and the rollout's copy of its committed buckets and the sparse write into the engine
(rollout_svc/sync/delta_base.py, rollout_svc/sync/sparse_write.py).
"""
