"""uvicorn's h11 protocol with a deadline for a request's headers.

uvicorn drops an idle keep-alive connection after `timeout_keep_alive`, but any byte cancels that
timer and nothing replaces it: a client that sends half a header (or one byte now and then) keeps
its connection, and its file descriptor, forever. Here a connection waiting for a request's headers
has one total deadline, started when it begins waiting (accept, or the end of the previous
response) and not extended by bytes that arrive: past it the connection is closed. Once the headers
are in, the body's own deadline takes over (weightsync/http/limits.py), and the route's time is
the route's.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: h11's own default (16 KiB): the request line and headers together may not exceed it (else 400).
MAX_HEADER_BYTES = 16 << 10


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    class HeaderDeadlineH11(H11Protocol):
        def connection_made(self, transport) -> None:
            self._header_timer = None
            super().connection_made(transport)
            self._watch_headers()

        def handle_events(self) -> None:
            super().handle_events()
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _watch_headers(self) -> None:
            # IDLE on the client's side: no complete request line + headers yet.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._header_timer is None:
                    self._header_timer = self.loop.call_later(header_timeout_s, self._headers_overdue)
            else:
                self._cancel_header_timer()

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineH11
