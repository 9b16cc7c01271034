"""A TCP proxy on loopback that a test can cut: every connection through it breaks and
new ones are refused, as when the network between an aggregator and its database fails;
:meth:`TcpProxy.restore` heals the network (new connections pass again, on the same port).

It pumps bytes in threads of its own, so a caller blocked in a synchronous driver call
on the event-loop thread (psycopg) never waits on it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` until :meth:`cut`.

    Args:
        target: (host, port) to forward to.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def url_for(self, url: str) -> str:
        """``url`` (a ``postgresql://`` URL) with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def _accept(self, listener: socket.socket) -> None:
        while not self._cut.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed: cut
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut.is_set():
                    client.close()
                    upstream.close()
                    return
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def cut(self) -> None:
        """Break every connection and refuse new ones (connection refused)."""
        self._cut.set()
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        """Accept connections again on the same port (the broken ones stay broken)."""
        with self._lock:
            self._listener = socket.create_server(("127.0.0.1", self.port))
            self._cut.clear()
        self._start()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self.cut()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
