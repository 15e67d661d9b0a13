"""A TCP proxy that can go away for a while: an S3 endpoint that drops and refuses connections, then comes back."""

from __future__ import annotations

import socket
import struct
import threading
import time


class FlakyProxy:
    """Forwards 127.0.0.1:<port> to an upstream address. `outage(seconds)` resets the open connections and closes
    the listening socket, so new connections are refused, then listens again on the same port. The upstream keeps
    its state, as a real server behind a network fault would."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.down_until = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._serve(self.listener)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def outage(self, seconds: float) -> None:
        """Refuse new connections and reset the open ones for `seconds`, then accept again."""
        with self.lock:
            self.down_until = time.monotonic() + seconds
            victims, self.open = self.open, set()
            self._stop(self.listener)
        for sock in victims:
            self._reset(sock)
        timer = threading.Timer(seconds, self._reopen)
        timer.daemon = True
        timer.start()

    def is_down(self) -> bool:
        return time.monotonic() < self.down_until

    def close(self) -> None:
        with self.lock:
            self.down_until = float("inf")
            victims, self.open = self.open, set()
            self._stop(self.listener)
        for sock in victims:
            self._reset(sock)

    def _reopen(self) -> None:
        with self.lock:
            if self.down_until == float("inf"):
                return
            self.listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the port is ours again
            self._serve(self.listener)

    def _serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    @staticmethod
    def _stop(listener: socket.socket) -> None:
        """shutdown wakes the thread blocked in accept(); close alone would leave the socket listening."""
        try:
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        listener.close()

    def _reset(self, sock: socket.socket) -> None:
        """Close with SO_LINGER 0, so the peer sees a connection reset, not an orderly end."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was stopped by an outage
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            with self.lock:
                self.open -= {src, dst}
