"""sd_notify(3) without libsystemd: a `Type=notify` unit (packaging/systemd/) hears READY=1 when the
process serves and STOPPING=1 when it begins a clean stop. systemd names its socket in
`$NOTIFY_SOCKET`: a path, or an abstract-namespace name written with a leading `@`. Without it (a
shell, `cortex up`, compose) every call here does nothing. The node agent says ready once the
models it loads at start are loaded (node_agent/serving/agent.py), the gateway once its lifespan
has started (gateway/server.py)."""

import logging
import os
import socket

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify(state: str) -> bool:
    """Send `state` (newline-separated `KEY=value` lines) to systemd; False when no socket is set,
    its address is not a unix one (e.g. `vsock:`), or the send failed (logged: never fatal)."""
    address = os.environ.get(NOTIFY_SOCKET_ENV, "")
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("could not tell systemd %r through %s: %s", state, address, exc)
        return False
    return True


def ready(status: str = "") -> bool:
    """The service is up: systemd finishes starting the unit (and starts those ordered after it)."""
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def stopping() -> bool:
    """The service has begun a clean stop (SIGTERM): `systemctl status` says so meanwhile."""
    return notify("STOPPING=1")
