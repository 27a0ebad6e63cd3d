"""Free loopback ports, for what a test cannot start on port 0 (a program told its ports
in advance, a run of ports, an address where nothing listens).

A port is found free by binding it, then released, so something else may bind it before
the test's program does: the program then fails loudly (address in use), never silently.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """One loopback port that nothing is bound to."""
    (port,) = free_ports(1)
    return port


def free_ports(
    count: int, *, consecutive: bool = False, below_ephemeral: bool = False
) -> list[int]:
    """``count`` distinct loopback ports that nothing is bound to (all bound at once while
    they are chosen).

    ``consecutive``: a run, ``base, base + 1, ...`` (``tokembed serve --workers N`` gives
    its workers' metrics ports from ``--metrics-port`` up).

    ``below_ephemeral``: below the kernel's ephemeral range, for ports bound long after
    they are chosen (minutes later, after an image build): a port in that range may be
    handed out by the kernel itself meanwhile (a bind to port 0, an outgoing connection),
    one below it only by an explicit bind.
    """
    held: list[socket.socket] = []
    try:
        for _attempt in range(200):
            first = _bound(_candidate(below_ephemeral))
            if first is None:
                continue
            run = [first]
            if consecutive:
                base = first.getsockname()[1]
                for offset in range(1, count):
                    more = _bound(base + offset) if base + offset <= 65535 else None
                    if more is None:
                        break
                    run.append(more)
                if len(run) < count:
                    _close(run)
                    continue
            held += run
            if len(held) >= count:
                return [int(sock.getsockname()[1]) for sock in held[:count]]
        raise RuntimeError(f"no {count} free ports (consecutive={consecutive})")
    finally:
        _close(held)


def _candidate(below_ephemeral: bool) -> int:
    """0 (the kernel chooses, in its ephemeral range) or a port below that range."""
    if not below_ephemeral:
        return 0
    low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    top = min(low, 32768)
    return random.randrange(max(1024, top - 12000), top)


def _bound(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
