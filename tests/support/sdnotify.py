"""A real sd_notify listener: the unix datagram socket systemd would give a service in NOTIFY_SOCKET."""

from __future__ import annotations

import socket


def received(sock: socket.socket, *, timeout: float = 5.0) -> list[str]:
    sock.settimeout(timeout)
    return sock.recv(4096).decode().split("\n")


def drain(sock: socket.socket) -> list[list[str]]:
    out = []
    sock.settimeout(0.05)
    while True:
        try:
            out.append(sock.recv(4096).decode().split("\n"))
        except TimeoutError:
            return out
