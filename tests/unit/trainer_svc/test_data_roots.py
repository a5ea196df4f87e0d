"""Admin file operations (ExportHf, SaveCheckpoint, LoadWeights) stay inside the trainer's data root."""

from __future__ import annotations

import os

import grpc
import pytest

from tests.support.local_apps import start_trainer
from weightsync.control.client import channel, trainer_stub
from weightsync.v1 import trainer_pb2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    base = tmp_path_factory.mktemp("roots")
    root = base / "data"
    root.mkdir()
    app = start_trainer(validate=True, data_root=str(root))
    yield app, base, root, trainer_stub(channel(app.grpc.address), "", 120)
    app.stop()


def _refused(call, req, root) -> str:
    with pytest.raises(grpc.RpcError) as ei:
        call(req)
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED, ei.value.details()
    assert str(root) in ei.value.details() and "data_root" in ei.value.details()
    return ei.value.details()


def test_export_outside_the_root_is_refused(trainer):
    app, base, root, stub = trainer
    for path in (str(base / "outside"), str(root / ".." / "outside"), "../outside", "/tmp/../" + str(base / "x")):
        _refused(stub.ExportHf, trainer_pb2.ExportHfRequest(out_dir=path), root)
    assert not (base / "outside").exists() and not (base / "x").exists()  # before: written, parents created
    # a symlink planted inside the root that points outside is followed, then refused
    os.symlink(base, root / "escape")
    _refused(stub.ExportHf, trainer_pb2.ExportHfRequest(out_dir="escape/y"), root)
    assert not (base / "y").exists()
    # inside the root (absolute or relative to it) works
    resp = stub.ExportHf(trainer_pb2.ExportHfRequest(out_dir="exports/v1"))
    assert resp.num_tensors > 0 and (root / "exports" / "v1" / "config.json").is_file()
    # the reply names where it landed: a relative path is taken from the data root, not the client's cwd
    assert resp.out_dir == os.path.realpath(root / "exports" / "v1")


def test_load_and_checkpoint_outside_the_root_are_refused(trainer):
    app, base, root, stub = trainer
    _refused(stub.LoadWeights, trainer_pb2.LoadWeightsRequest(hf_path="/etc"), root)
    _refused(stub.LoadWeights, trainer_pb2.LoadWeightsRequest(hf_path="../../"), root)
    _refused(stub.SaveCheckpoint, trainer_pb2.SaveCheckpointRequest(dir=str(base / "ckpt")), root)
    assert not (base / "ckpt").exists()
    stub.ExportHf(trainer_pb2.ExportHfRequest(out_dir=str(root / "w")))
    v = app.actor.version
    resp = stub.LoadWeights(trainer_pb2.LoadWeightsRequest(hf_path="w"))
    assert resp.version == v + 1 and resp.hf_path == os.path.realpath(root / "w")
