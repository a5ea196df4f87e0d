"""Secure by default: a service does not listen beyond loopback without a token, unless told so.

Every listener a service opens (gRPC, HTTP, the TCP bus) is checked at start-up, before it binds.
A loopback address (127.0.0.0/8, ::1, localhost) is always allowed: only processes on the same host
reach it, which is how the local launcher, the demo and the tests run. Any other address (0.0.0.0,
::, a pod IP, a host name) needs a token, or an explicit `insecure: true` (flag `--insecure`, env
`WS_*_INSECURE`), in which case the choice is logged as a WARNING for every exposed listener.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping

from weightsync.config import ConfigError, parse_host_port

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for an address only this host can reach; host names other than localhost count as exposed."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name may resolve anywhere: treat it as reachable from the network


def check_exposure(listeners: Mapping[str, str], token: str, insecure: bool, prog: str) -> list[str]:
    """Refuse (ConfigError) a non-loopback listener without a token unless `insecure`; returns the exposed ones.

    `listeners` maps the config field name to its host:port (e.g. {"grpc_address": "0.0.0.0:50051"}).
    """
    exposed = [f"{name}={addr}" for name, addr in listeners.items() if not is_loopback(parse_host_port(name, addr)[0])]
    if not exposed or token:
        return exposed
    if not insecure:
        raise ConfigError(
            f"{prog} would listen beyond loopback ({', '.join(exposed)}) without a token: anyone who "
            f"reaches it could call every admin RPC. Set auth_token_file (or auth_token), bind to "
            f"127.0.0.1, or pass --insecure (insecure: true) to run unauthenticated on purpose"
        )
    for item in exposed:
        log.warning(
            "INSECURE: %s listens on %s WITHOUT authentication (insecure=true): any client that reaches "
            "it can change weights, export files and run syncs; set auth_token_file",
            prog,
            item,
        )
    return exposed
