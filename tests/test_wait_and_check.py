"""Waiting for a booting VM (--wait), probing from scripts (--check), and the
Python API the command line is built on."""

import os
import re
import socket
import threading
import time

import pytest

import vsock_proxy
from conftest import FAKE_BANNER, run_proxy, serve_unix, unix_listener


def appear_later(path, delay):
    """A socket file that appears `delay` seconds from now, then echoes once."""
    def serve():
        time.sleep(delay)
        listener = unix_listener(path)
        conn, _ = listener.accept()
        with conn, listener:
            try:
                conn.sendall(b"up\n")
            except BrokenPipeError:
                pass                    # --check hangs up without reading
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


# --- --wait -------------------------------------------------------------------

def test_wait_connects_once_the_socket_appears(tmp_path):
    path = str(tmp_path / "booting.sock")
    appear_later(path, 0.7)
    result = run_proxy("--wait", "10", "unix" + path, input=b"")
    assert (result.returncode, result.stdout, result.stderr) == (0, b"up\n", b"")


def test_wait_retries_a_muxer_until_the_guest_answers(muxer):
    mux = muxer("firecracker", "late", late_delay=0.8, late_mode="silent")
    result = run_proxy("--wait", "10", "--timeout", "0.3", "vsock-mux" + mux.path, input=b"")
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout == FAKE_BANNER
    assert mux.connections >= 2


def test_wait_retries_a_muxer_that_closes_while_the_guest_boots(muxer):
    mux = muxer("vhost-device", "late", late_count=3, late_mode="close")
    result = run_proxy("--wait", "10", "vsock-mux" + mux.path, input=b"")
    assert (result.returncode, result.stdout) == (0, FAKE_BANNER), result.stderr
    assert mux.connections == 4


def test_wait_gives_up_on_time_with_the_last_reason(tmp_path):
    path = str(tmp_path / "never.sock")
    started = time.monotonic()
    result = run_proxy("--wait", "1.5", "unix" + path, timeout=20)
    assert time.monotonic() - started < 10          # a bound, not a measurement
    assert result.returncode == 1
    err = result.stderr.decode()
    assert re.fullmatch(r"vsock-proxy: unix%s: no such socket file: %s \(ENOENT\) "
                        r"\(gave up after 1\.[5-9]\d*s and \d+ attempts\)\n"
                        % (re.escape(path), re.escape(path)), err), err


def test_wait_gives_up_on_a_silent_muxer_without_telling_to_wait(muxer):
    mux = muxer("firecracker", "silent")
    result = run_proxy("--wait", "1", "--timeout", "0.3", "vsock-mux" + mux.path, timeout=20)
    assert result.returncode == 1
    err = result.stderr.decode()
    assert re.fullmatch(r"vsock-proxy: vsock-mux%s: no reply to CONNECT 22 within [\d.]+s: "
                        r"the guest's vsock driver may not be up yet "
                        r"\(gave up after [\d.]+s and \d+ attempts\)\n" % re.escape(mux.path), err), err


def test_wait_says_each_attempt_with_verbose(tmp_path):
    path = str(tmp_path / "booting.sock")
    appear_later(path, 0.5)
    result = run_proxy("-v", "--wait", "10", "unix" + path, input=b"")
    assert result.returncode == 0
    lines = result.stderr.decode().splitlines()
    assert lines[0] == "vsock-proxy: connecting to unix socket %s" % path
    assert any(line.startswith("vsock-proxy: attempt 1: unix%s: no such socket file" % path)
               and line.endswith("; retrying") for line in lines)


def test_wait_does_not_retry_permanent_failures(tmp_path, muxer):
    mux = muxer("firecracker", "garbage")
    started = time.monotonic()
    result = run_proxy("--wait", "30", "vsock-mux" + mux.path, timeout=20)
    assert result.returncode == 1 and time.monotonic() - started < 15
    assert mux.connections == 1
    assert "gave up" not in result.stderr.decode()


# --- --check -------------------------------------------------------------------

def test_check_is_silent_and_true_when_the_port_answers(muxer):
    mux = muxer("firecracker")
    result = run_proxy("--check", "vsock-mux" + mux.path)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_check_is_false_with_the_reason_when_it_does_not(muxer):
    mux = muxer("firecracker", "close")
    result = run_proxy("--check", "vsock-mux" + mux.path, "2222")
    assert (result.returncode, result.stdout) == (1, b"")
    assert b"the VM refused port 2222" in result.stderr


def test_check_with_wait_is_the_wait_until_sshd_is_up_idiom(tmp_path):
    path = str(tmp_path / "booting.sock")
    appear_later(path, 0.5)
    result = run_proxy("--check", "--wait", "10", "unix" + path)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_check_with_verbose_says_what_it_reached(muxer):
    mux = muxer("vhost-device")
    result = run_proxy("--check", "-v", "vsock-mux" + mux.path)
    assert result.returncode == 0
    assert result.stderr.decode() == "vsock-proxy: connecting to vsock muxer %s port 22\n" % mux.path


# --- the Python API ------------------------------------------------------------

def test_connect_returns_a_socket_at_the_guest_port(muxer):
    mux = muxer("firecracker")
    with vsock_proxy.connect("vsock-mux" + mux.path, 2222, timeout=3) as sock:
        assert isinstance(sock, socket.socket)
        assert sock.gettimeout() is None
        assert sock.recv(100) == FAKE_BANNER
    assert mux.ports == [2222]


def test_connect_raises_the_message_the_command_prints(muxer):
    mux = muxer("firecracker", "close")
    with pytest.raises(vsock_proxy.ConnectError) as caught:
        vsock_proxy.connect("vsock-mux" + mux.path)
    printed = run_proxy("vsock-mux" + mux.path).stderr.decode()
    assert printed == "vsock-proxy: %s\n" % caught.value


def test_connect_waits_too(tmp_path):
    path = str(tmp_path / "booting.sock")
    appear_later(path, 0.5)
    with vsock_proxy.connect("unix" + path, wait=10) as sock:
        assert sock.recv(10) == b"up\n"


def test_connect_accepts_a_parsed_target(muxer):
    mux = muxer("vhost-device")
    target = vsock_proxy.parse_target("vsock-mux" + mux.path, "2200")
    with vsock_proxy.connect(target) as sock:
        assert sock.recv(100) == FAKE_BANNER
    assert mux.ports == [2200]


def test_errors_share_one_base_class():
    assert issubclass(vsock_proxy.UsageError, vsock_proxy.Error)
    assert issubclass(vsock_proxy.ConnectError, vsock_proxy.Error)
    with pytest.raises(vsock_proxy.Error):
        vsock_proxy.connect("nonsense")


# --- connect()'s arguments: checked before anything is sent ----------------------

def test_connect_sends_nothing_for_a_port_that_is_no_port(muxer):
    mux = muxer("firecracker")
    with pytest.raises(vsock_proxy.UsageError, match="^PORT takes a number from 0 to "
                                                     "4294967294, not -1$"):
        vsock_proxy.connect("vsock-mux" + mux.path, -1)
    assert mux.connections == 0


BAD_SECONDS = [
    ("timeout", 0, "timeout takes a number of seconds, above 0 and below 1000000, "
                   "or None for no deadline; not 0"),
    ("timeout", -1, "; not -1"),
    ("timeout", float("nan"), "; not nan"),
    ("timeout", True, "; not True"),
    ("timeout", "5", "; not '5'"),
    ("timeout", 1e6, "; not 1000000.0"),
    ("wait", -1, "wait takes a number of seconds, 0 or more and below 1000000, "
                 "or None for no deadline; not -1"),
    ("wait", "10", "; not '10'"),
]


@pytest.mark.parametrize("kind", ["unix", "vsock-mux"])
@pytest.mark.parametrize("name, value, message", BAD_SECONDS)
def test_connect_refuses_bad_seconds_alike_for_every_kind(kind, name, value, message, muxer):
    """timeout=0 in particular: 'forever' to a struct timeval, 'do not wait' to a
    Python socket; neither is a timeout, so no kind takes it."""
    mux = muxer("firecracker")
    with pytest.raises(vsock_proxy.UsageError) as caught:
        vsock_proxy.connect(kind + mux.path, **{name: value})
    assert str(caught.value).endswith(message)
    assert mux.connections == 0


def test_connect_timeout_none_means_no_deadline(muxer):
    """As for Python's sockets: here a muxer's reply drips in, and is waited for."""
    mux = muxer("firecracker", "drip", drip_delay=0.05)
    with vsock_proxy.connect("vsock-mux" + mux.path, timeout=None) as sock:
        assert sock.recv(100) == FAKE_BANNER


def test_connect_timeout_none_on_a_unix_socket(tmp_path):
    path = serve_unix(tmp_path, lambda conn: conn.sendall(b"hi"))
    with vsock_proxy.connect("unix" + path, timeout=None) as sock:
        assert sock.recv(10) == b"hi"


def test_connect_wait_none_retries_until_it_connects(tmp_path):
    path = str(tmp_path / "booting.sock")
    appear_later(path, 0.5)
    with vsock_proxy.connect("unix" + path, wait=None) as sock:
        assert sock.recv(10) == b"up\n"


def test_connect_takes_a_bytes_target(tmp_path):
    """Decoded as argv is: a path the locale cannot decode still works."""
    path = os.fsencode(tmp_path) + b"/s\xff.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        with vsock_proxy.connect(b"unix" + path) as sock:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"hi")
            assert sock.recv(10) == b"hi"
