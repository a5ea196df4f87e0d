"""The RL loop driver: generate on the rollouts → reward → TrainStep → Sync, over gRPC.

from weightsync.rl import run_loop, TargetTokensTask
records = run_loop("127.0.0.1:50051", ["127.0.0.1:50061"], TargetTokensTask(vocab_size=256), steps=30)
"""

from weightsync.rl.driver import LoopConfig, StepRecord, run_loop
from weightsync.rl.tasks import TargetTokensTask, Task

__all__ = ["LoopConfig", "StepRecord", "run_loop", "Task", "TargetTokensTask"]
