"""Free TCP ports on the loopback, for the trainer shards' process group.

Owns: ``free_port``. Knows nothing about who listens on it.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on the loopback now (the process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
