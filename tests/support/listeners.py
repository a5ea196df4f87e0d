"""The TCP addresses a process listens on, read from /proc (what `ss -ltnp` shows for its pid)."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct


def _addr(hex_addr: str, v6: bool) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if v6:
        # /proc prints the address as four host-order 32-bit words
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, raw)
    else:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    return f"{ip}:{int(port, 16)}"


def listening(pid: int | str = "self") -> list[str]:
    """host:port of every TCP socket in LISTEN state owned by `pid`."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        for line in open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                out.append(_addr(f[1], v6))
    return out


def exposed(addresses: list[str]) -> list[str]:
    """The listen addresses another host could reach (anything but loopback)."""
    return [a for a in addresses if not ipaddress.ip_address(a.rsplit(":", 1)[0].strip("[]")).is_loopback]
