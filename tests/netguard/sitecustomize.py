"""Test-only network guard, imported by every Python process started with this directory on PYTHONPATH and
NLAC_NETGUARD_LOG set (tests/gcs_emulator.py does): a socket connection or name lookup for anything but this host
(127.0.0.0/8, ::1, localhost, Unix sockets) is written to that file and refused, so a library that would look for
credentials or a metadata server, or reach a real endpoint, fails the test instead of going out or timing out.
Native code (tensorstore's curl, gRPC) is not seen here; the tests read its own log lines for that."""

import ipaddress
import os
import sys

_LOG = os.environ.get("NLAC_NETGUARD_LOG")


def _local(host) -> bool:
    if host is None or host in ("", b"", "localhost", b"localhost"):
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = str(host).strip("[]").split("%")[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.endswith(".localhost")


def _hook(event, args):
    if event == "socket.connect":
        addr = args[1]
        host = addr[0] if isinstance(addr, tuple) else None  # a str/bytes address: a Unix socket
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if _local(host):
        return
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(f"pid {os.getpid()}: {event} {host!r} ({' '.join(sys.argv)[:200]})\n")
    raise OSError(f"netguard: {event} to {host!r} refused (tests reach 127.0.0.1 only)")


if _LOG:
    sys.addaudithook(_hook)
