"""Whether a rollout runs on the trainer's own host, judged from its gRPC address.

`sync_encoding=auto` sends deltas over NCCL only between hosts (publisher/delta_sync.py): there NCCL
runs over the network (100-400 Gb/s, link-bound like TCP), while between GPUs of one host it runs
over NVLink or PCIe, where the trainer's compare and the rollout's apply cost more passes over GPU
memory than the bytes they save. The address is what the trainer knows before PrepareSync: a
loopback address, this host's name, or one of the addresses it resolves to, is this host. A name
that does not resolve here counts as another host (a delta is then offered; the result is still
checked, only the speed is at stake).
"""

from __future__ import annotations

import functools
import ipaddress
import socket


def on_this_host(address: str) -> bool:
    """`address` ("host:port", "[v6]:port", or "unix:...") names this host."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]").lower()
    if host in ("localhost", "") or host in _local_names():
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return False
    return ip.is_loopback or ip.is_unspecified or str(ip) in _local_names()


@functools.lru_cache(maxsize=1)
def _local_names() -> frozenset[str]:
    name = socket.gethostname().lower()
    names = {name, socket.getfqdn().lower()}
    try:
        names |= set(socket.gethostbyname_ex(name)[2])
    except OSError:
        pass
    return frozenset(names)
