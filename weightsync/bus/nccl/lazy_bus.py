"""The NCCL bus an object uses: the one it was given (a test's stand-in), else the default one,
made on first use so that importing a transport never loads libnccl."""

from __future__ import annotations


class LazyBus:
    _bus = None

    @property
    def bus(self):
        if self._bus is None:
            from weightsync.bus.nccl.group import default_bus

            self._bus = default_bus()
        return self._bus
