"""The door's listening socket, bound one way wherever it is bound (preflight's check that the port is free, the
door itself): an IPv6 address ("::1", "::") gets an IPv6 socket, "::" taking IPv4 too where the system can."""

from __future__ import annotations

import socket


def listen(host: str, port: int, backlog: int | None = None) -> socket.socket:
    """A socket listening on host:port (SO_REUSEADDR: a door started again at once gets its port back)."""
    if ":" in host:  # an IPv6 address
        dual = host == "::" and socket.has_dualstack_ipv6()
        return socket.create_server((host, port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=dual)
    return socket.create_server((host, port), backlog=backlog)


def host_port(host: str, port: int) -> str:
    """host:port as a URL or an HTTP Host header writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
