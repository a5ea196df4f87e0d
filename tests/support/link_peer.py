"""A raw peer of a rollout's sync link, for tests that drive its handshake by hand."""

from __future__ import annotations

import socket
import time

from weightsync.control.sync_link import LINK_MAGIC, NONCE_BYTES, link_mac, recv_exact


def link_handshake(address: str, token: str | None) -> socket.socket:
    """A connection to the link at `address` that sent the magic and read the rollout's nonce; with a
    `token`, it also sent the MAC of that nonce (the rollout's answer is left for the caller to read)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(LINK_MAGIC)
    nonce = recv_exact(sock, NONCE_BYTES, time.monotonic() + 5)
    if token is not None:
        sock.sendall(link_mac(token, nonce))
    return sock
