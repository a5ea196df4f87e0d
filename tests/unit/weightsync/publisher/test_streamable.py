"""Issue 49: a tensor that cannot be streamed as declared is refused by Publisher.sync before anything is
sent, naming it, with the version unchanged (before, a sparse tensor of the declared shape passed the
checks, the version moved to 1 and the stream broke on the rollout)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.unit.weightsync.publisher.test_publisher import LOOPBACK, SPEC, tensors
from weightsync.publisher import Publisher


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(4, 3)


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(3), torch.ones(3), torch.ones(3)])


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(4, 3), 0.1, 0, torch.qint8)


def _csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ones(4, 3).to_sparse_csr()


@pytest.fixture
def pub():
    p = Publisher(SPEC, **LOOPBACK).start()
    yield p
    p.close()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: torch.ones(4, 3).to_sparse(), ValueError, r"^a\.weight: layout torch\.sparse_coo, not torch\.strided"),
        (_csr, ValueError, r"^a\.weight: layout torch\.sparse_csr"),
        (_nested, ValueError, r"^a\.weight: a nested tensor"),
        (_quantized, ValueError, r"^a\.weight: a quantized tensor \(torch\.qint8\)"),
        (lambda: torch.ones(4, 3, device="meta"), ValueError, r"^a\.weight: a meta tensor has no values"),
        (_fake, TypeError, r"^a\.weight: a torch\._subclasses\.fake_tensor\.FakeTensor, not a plain torch\.Tensor"),
    ],
    ids=["sparse_coo", "sparse_csr", "nested", "quantized", "meta", "fake"],
)
def test_a_tensor_that_cannot_stream_is_refused_by_name_and_spends_no_version(pub, make, error, match):
    with pytest.raises(error, match=match):
        pub.sync(tensors(**{"a.weight": make()}))
    assert pub.version == 0


def test_strided_views_and_parameters_are_accepted(pub):
    base = torch.arange(12.0).reshape(3, 4)
    for t in (base.t(), torch.ones(3).expand(4, 3), torch.nn.Parameter(torch.ones(4, 3)), torch.ones(8, 6)[::2, ::2]):
        got = pub.source.check(tensors(**{"a.weight": t}))
        assert torch.equal(got["a.weight"], t.detach())
