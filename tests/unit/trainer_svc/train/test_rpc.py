"""The training RPCs over a real in-process gRPC server: validation at the boundary, step, checkpoint."""

import threading
from concurrent import futures

import grpc
import pytest

from tests.support.train_requests import make_request
from trainer_svc.train.rpc import TrainingServicerMixin
from weightsync.v1 import trainer_pb2, trainer_pb2_grpc


class _Servicer(TrainingServicerMixin, trainer_pb2_grpc.TrainerServicer):
    def __init__(self, actor):
        self.actor = actor
        self.actor_lock = threading.Lock()


@pytest.fixture
def stub(monkeypatch, tmp_path):
    from trainer_svc.actor.hf.actor import HfActor
    from weightsync.models import resolve_model

    monkeypatch.setenv("WS_TRAINER_LR", "1e-3")
    monkeypatch.setenv("WS_TRAINER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    actor = HfActor(resolve_model("tiny-qwen2")[0], seed=1)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trainer_pb2_grpc.add_TrainerServicer_to_server(_Servicer(actor), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    server.stop(0)


def _err(call, req):
    with pytest.raises(grpc.RpcError) as e:
        call(req, timeout=30)
    return e.value.code(), e.value.details()


def test_bad_requests_are_invalid_argument_naming_the_field(stub):
    T = trainer_pb2
    assert _err(stub.TrainStep, T.TrainStepRequest()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "samples: empty; send at least one TrainSample",
    )
    s = T.TrainSample(prompt_ids=[1, 2], response_ids=[3, 999])
    code, msg = _err(stub.TrainStep, T.TrainStepRequest(samples=[s]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "samples[0].response_ids" in msg and "999" in msg
    s = T.TrainSample(prompt_ids=[1] * 500, response_ids=[3] * 20)
    code, msg = _err(stub.ComputeLogprobs, T.ComputeLogprobsRequest(samples=[s]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_position_embeddings 512" in msg
    s = T.TrainSample(prompt_ids=[1], response_ids=[3, 4], rollout_logprobs=[-1.0])
    code, msg = _err(stub.TrainStep, T.TrainStepRequest(samples=[s]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "samples[0].rollout_logprobs: 1 values for 2" in msg
    s = T.TrainSample(prompt_ids=[1], response_ids=[3, 4])
    code, msg = _err(stub.TrainStep, T.TrainStepRequest(samples=[s], loss=T.LossConfig(aggregation="sum")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "loss.aggregation" in msg


def test_step_logprobs_checkpoint_over_grpc(stub, tmp_path):
    req = make_request()
    rows = stub.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(samples=req.samples), timeout=60)
    assert rows.version == 1 and [len(r.logprobs) for r in rows.rows] == [len(s.response_ids) for s in req.samples]
    r1 = stub.TrainStep(req, timeout=60)
    assert (r1.version, r1.step) == (2, 1) and r1.metrics["lr"] == pytest.approx(1e-3)
    ck = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
    assert (ck.step, ck.version) == (1, 2) and ck.dir.endswith("step_00000001")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000001"
    # model and optimizer state are the trainer's alone, like its exports
    written = [tmp_path / "ckpt" / "latest", *(tmp_path / "ckpt" / "step_00000001").iterdir()]
    assert written[1:] and {oct(f.stat().st_mode & 0o777) for f in written} == {"0o600"}


def test_init_training_resumes_eagerly(monkeypatch, tmp_path):
    from trainer_svc.actor.hf.actor import HfActor
    from trainer_svc.train.checkpoint import save_checkpoint
    from trainer_svc.train.step import train_step
    from weightsync.models import resolve_model

    monkeypatch.setenv("WS_TRAINER_LR", "1e-3")
    a = HfActor(resolve_model("tiny-qwen2")[0], seed=1)
    s = _Servicer(a)
    assert s.init_training() is False
    train_step(a, make_request())
    save_checkpoint(a, str(tmp_path))

    from trainer_svc.config import TrainerConfig

    b = _Servicer(HfActor(resolve_model("tiny-qwen2")[0], seed=5))
    assert b.init_training(TrainerConfig.from_flat(lr=1e-3, checkpoint_dir=str(tmp_path), resume=True)) is True
    assert (b.actor.step, b.actor.version) == (1, 2)


def test_save_checkpoint_format_is_validated(stub):
    code, msg = _err(stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(format="zip"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "format: 'zip'" in msg and "torch_dist" in msg
    # a Megatron distributed checkpoint needs a Megatron model; this servicer holds a transformers one
    code, msg = _err(stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(format="torch_dist"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "backend=megatron" in msg
