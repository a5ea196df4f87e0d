"""The transport registry: the names every service lists, what each transport declares, and that
the declarations agree with the classes they name."""

import json
import subprocess
import sys

import pytest

from weightsync.bus.channel import BucketSender
from weightsync.bus.rollout_end import RolloutEnd
from weightsync.bus.session import Sender
from weightsync.bus.transports import (
    NAMES,
    TRANSPORTS,
    choices,
    multi_sender_names,
    single_sender_names,
    summary,
    transport,
)


def test_the_transports_and_their_capabilities():
    assert NAMES == ("tcp", "nccl", "ipc")
    caps = {
        t.name: (t.multi_sender, t.commit_on_stream, t.checksums_in_band, t.releases_previous, t.one_rank_per_gpu)
        for t in TRANSPORTS.values()
    }
    assert caps == {
        "tcp": (True, False, "all", False, False),
        "nccl": (True, False, "none", True, True),
        "ipc": (False, True, "all", True, False),
    }
    assert multi_sender_names() == ("tcp", "nccl") and single_sender_names() == ("ipc",)
    assert choices() == "tcp, nccl or ipc" and choices(["tcp"]) == "tcp"
    assert summary().startswith("tcp (any host), nccl (")


@pytest.mark.parametrize("name", NAMES)
def test_each_entry_names_its_ends_and_its_channel_declares_what_the_entry_says(name):
    t = TRANSPORTS[name]
    trainer_end, rollout_end, channel = t.trainer_end_class(), t.rollout_end_class(), t.channel_class()
    assert issubclass(trainer_end, Sender) and trainer_end.name == name
    assert issubclass(rollout_end, RolloutEnd) and rollout_end.name == name
    assert issubclass(channel, BucketSender)
    assert (channel.releases_previous, channel.checksums_in_band) == (t.releases_previous, t.checksums_in_band)
    # a channel that carries commits overrides the base's refusal
    assert (channel.commit_on_stream is not BucketSender.commit_on_stream) == t.commit_on_stream


def test_an_unknown_transport_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"^transport='udp' must be tcp, nccl or ipc$"):
        transport("udp")
    with pytest.raises(ValueError, match=r"^SyncRequest.transport='' must be tcp, nccl or ipc$"):
        transport("", "SyncRequest.transport")
    assert transport("nccl") is TRANSPORTS["nccl"]


def test_the_registry_imports_no_transport_and_no_torch():
    code = (
        "import sys, json; import weightsync.bus.transports; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'weightsync.bus.')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["weightsync.bus.transports"]


def test_a_channel_that_carries_no_commit_says_so():
    with pytest.raises(NotImplementedError, match="BucketSender carries no commit"):
        BucketSender().commit("r", None)
