"""vsock-mux/PATH: the hybrid-vsock handshake of Firecracker, Cloud Hypervisor
and vhost-device-vsock, against fakes that behave like them (NOTES.md
section 3), failure modes included; and real ssh through such a muxer."""

import socket
import subprocess
import sys

import pytest

from conftest import FAKE_BANNER, ROOT, run_proxy

FLAVOURS = ["firecracker", "cloud-hypervisor", "vhost-device"]


def through(muxer, *args, input=b"ping", timeout=20):
    return run_proxy(*args, "vsock-mux" + muxer.path, input=input, timeout=timeout)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_reply_line_is_consumed_exactly_and_the_guest_bytes_follow(muxer, flavour):
    """The OK line and the guest's banner arrive in one segment: not one
    banner byte may be swallowed with the reply."""
    mux = muxer(flavour)
    result = through(mux)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout == FAKE_BANNER + b"ping"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_connect_line_arrives_whole_and_alone_before_the_reply(muxer, flavour):
    mux = muxer(flavour)
    assert through(mux).returncode == 0
    assert mux.received_before_reply == [b"CONNECT 22\n"]
    assert mux.line_in_one_recv == [True]


def test_reply_dripped_one_byte_at_a_time_is_read_exactly(muxer):
    mux = muxer("firecracker", "drip")
    result = through(mux)
    assert (result.returncode, result.stdout) == (0, FAKE_BANNER + b"ping"), result.stderr


@pytest.mark.parametrize("port", ["0", "22", "1024", "4294967294"])
def test_port_goes_into_the_connect_line(muxer, port):
    mux = muxer("vhost-device")
    result = run_proxy("vsock-mux" + mux.path, port, input=b"")
    assert result.returncode == 0, result.stderr
    assert mux.received_before_reply == [b"CONNECT %s\n" % port.encode()]


def test_fdpass_hands_over_the_socket_positioned_after_the_reply(muxer):
    mux = muxer("firecracker")
    ours, theirs = socket.socketpair()
    with ours:
        process = subprocess.run([sys.executable, str(ROOT / "vsock_proxy.py"), "--fdpass",
                                  "vsock-mux" + mux.path], stdout=theirs.fileno(),
                                 stderr=subprocess.PIPE, timeout=20)
        theirs.close()
        assert (process.returncode, process.stderr) == (0, b"")
        data, fds, _, _ = socket.recv_fds(ours, 1, 1)
    assert data == b"\0" and len(fds) == 1
    with socket.socket(fileno=fds[0]) as guest:
        guest.settimeout(5)
        assert guest.recv(100) == FAKE_BANNER
        guest.sendall(b"echo")
        assert guest.recv(100) == b"echo"


FAILURES = [
    ("close", [], "vsock-proxy: vsock-mux{path}: the VM refused port 22: nothing "
                  "listening in the guest, or the guest is not up\n"),
    ("reset", [], "vsock-proxy: vsock-mux{path}: the VMM reset the connection after "
                  "CONNECT 22: nothing listening on that port in the guest?\n"),
    ("garbage", [], "vsock-proxy: vsock-mux{path}: the VMM's reply to CONNECT 22 is not "
                    "'OK <port>': 'HTTP/1.0 400 Bad Request\\r\\n'\n"),
    ("overlong", [], "vsock-proxy: vsock-mux{path}: the VMM's reply is not 'OK <port>': "
                     "OK 99999999999999999999999999999... (no newline in 32 bytes)\n"),
    ("silent", ["--timeout", "0.5"],
     "vsock-proxy: vsock-mux{path}: no reply to CONNECT 22 within 0.5s: the guest's vsock "
     "driver may not be up yet; try --wait 60\n"),
]


@pytest.mark.parametrize("behaviour, args, message", FAILURES, ids=[f[0] for f in FAILURES])
def test_muxer_failure_is_one_line_and_exit_1(muxer, behaviour, args, message):
    mux = muxer("firecracker", behaviour)
    result = through(mux, *args, timeout=10)
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr.decode() == message.format(path=mux.path)


def test_escape_sequences_from_the_vmm_are_shown_escaped(muxer):
    mux = muxer("firecracker", "escape")
    result = through(mux)
    assert result.returncode == 1
    assert b"\x1b" not in result.stderr and b"\x07" not in result.stderr
    assert b"\\x1b]0;pwned\\x07\\x1b[31mERR\\n" in result.stderr


def test_missing_muxer_socket_is_the_unix_error(tmp_path):
    result = run_proxy("vsock-mux%s/fc.vsock" % tmp_path)
    assert result.returncode == 1
    assert result.stderr.decode() == ("vsock-proxy: vsock-mux%s/fc.vsock: no such socket file: "
                                      "%s/fc.vsock (ENOENT)\n" % (tmp_path, tmp_path))


# --- real ssh through a muxer that fronts a real sshd -i ----------------------

@pytest.mark.parametrize("fdpass", [False, True], ids=["relay", "fdpass"])
@pytest.mark.parametrize("flavour", ["firecracker", "vhost-device"])
def test_ssh_through_a_muxer(sshd, muxer, vsock_proxy_on_path, flavour, fdpass):
    """The muxer sends the OK line and sshd's banner in one segment."""
    mux = muxer(flavour, backend="sshd")
    if fdpass:
        block = "ProxyCommand vsock-proxy --fdpass %n %p\n    ProxyUseFdpass yes"
    else:
        block = "ProxyCommand vsock-proxy %n %p"
    config = sshd.ssh_config("Host vsock-mux/*\n    %s\n" % block)
    result = sshd.ssh("vsock-mux" + mux.path, "echo through the muxer", config=config,
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"through the muxer\n"), result.stderr
    assert mux.received_before_reply == [b"CONNECT 22\n"]


def test_ssh_through_a_muxer_with_the_shipped_snippet(sshd, muxer, vsock_proxy_on_path):
    mux = muxer("cloud-hypervisor", backend="sshd")
    config = sshd.ssh_config("Include %s\n" % (ROOT / "ssh_config.d" / "vsock-proxy.conf"))
    result = sshd.ssh("vsock-mux%" + mux.path.lstrip("/"), "echo snippet", config=config,
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"snippet\n"), result.stderr


def test_deadline_covers_a_reply_that_drips_too_slowly(muxer):
    """Each byte arrives within the timeout, the whole line does not."""
    mux = muxer("firecracker", "drip", drip_delay=0.4)
    result = through(mux, "--timeout", "1", timeout=10)
    assert result.returncode == 1
    assert result.stderr.decode().startswith(
        "vsock-proxy: vsock-mux%s: no reply to CONNECT 22 within 1s after 'OK " % mux.path)
