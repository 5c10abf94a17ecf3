"""shared/systemd_notify.py against a unix datagram socket standing in for systemd's: a path and
an abstract-namespace (`@`) address, nothing at all without $NOTIFY_SOCKET, and a socket nobody
listens on costs a log line, never an exception."""

import os
import socket
import uuid

import pytest

from shared import systemd_notify


@pytest.fixture
def listener(tmp_path, monkeypatch):
    """A bound datagram socket at a path, named in $NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_ready_and_stopping_reach_the_socket(listener):
    assert systemd_notify.ready("serving tiny as n1")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving tiny as n1"
    assert systemd_notify.stopping()
    assert listener.recv(4096) == b"STOPPING=1"


def test_an_abstract_socket_is_named_with_an_at_sign(monkeypatch):
    name = f"cortex-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd_notify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not systemd_notify.ready()
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not a unix socket: not ours to reach
    assert not systemd_notify.stopping()


def test_a_socket_nobody_listens_on_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert not systemd_notify.ready()
    assert "could not tell systemd 'READY=1'" in caplog.text
    assert not os.path.exists(tmp_path / "gone")
