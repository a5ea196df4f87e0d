"""The RL training step on the trainer: losses, log-probs, the step itself, checkpoints, RPCs.

Heavy imports (torch, megatron-core) stay inside the modules that need them, so importing
`trainer_svc.train.rpc` from the servicer pulls in neither.
"""
