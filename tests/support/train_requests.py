"""Training requests for the trainer tests (and the torchrun worker tests/support/_mp_worker.py)."""

import torch

from weightsync.v1 import trainer_pb2


def make_request(seed=0, n_groups=4, group=4, prompt_len=5, resp_len=6, vocab=256, **loss):
    """A fixed GRPO batch with a learnable reward (fraction of response tokens < 32), varied lengths."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n_groups * group):
        p = torch.randint(0, vocab, (prompt_len + i % 3,), generator=g).tolist()
        r = torch.randint(0, vocab, (resp_len - i % 2,), generator=g).tolist()
        samples.append(
            trainer_pb2.TrainSample(
                prompt_ids=p,
                response_ids=r,
                group_id=i // group,
                reward=sum(t < 32 for t in r) / len(r) + 0.1 * (i % group),
            )
        )
    lc = trainer_pb2.LossConfig(algorithm="grpo", **loss)
    return trainer_pb2.TrainStepRequest(samples=samples, loss=lc)
