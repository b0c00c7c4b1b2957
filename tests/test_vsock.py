"""Real AF_VSOCK, end to end, against the kernel's loopback transport (CID 1).

These run wherever vsock_loopback is loaded (natively, or in the lab VM that
CI boots: ../shared/vsocklab/run-in-vm.sh) and are skipped elsewhere.  The
probe sends nothing: binding to CID 1 fails with EADDRNOTAVAIL when there is
no loopback transport, and then no AF_VSOCK connection may be opened at all,
because every CID, 1 included, would go to this machine's own hypervisor.
Only CID 1 is ever used.
"""

import errno
import hashlib
import itertools
import os
import re
import socket
import subprocess
import threading

import pytest

import vsock_proxy
from conftest import ROOT, AcceptLoop, ThreadedServer, echo, proxy_process, run_proxy
from endings import ENDINGS, run_case

LOCAL_CID = 1
SSHD_PORT = 22022        # not 22: a real sshd may own vsock port 22 on this machine
ECHO_PORT = 22023
BYE_PORT = 22024
UNUSED_PORT = 22099
MATRIX_PORTS = itertools.count(22100)
IN_LAB_VM = "vsocklab=1" in open("/proc/cmdline").read()


def loopback_transport_missing():
    """Why AF_VSOCK tests cannot run here, or None if they can."""
    if not hasattr(socket, "AF_VSOCK"):
        return "this system has no AF_VSOCK"
    try:
        with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as probe:
            probe.bind((LOCAL_CID, socket.VMADDR_PORT_ANY))
    except OSError as exc:
        return "no vsock loopback transport (bind to CID 1: %s); CI runs these in the lab VM" % (
            errno.errorcode.get(exc.errno, exc))
    return None


_missing = loopback_transport_missing()
if _missing and os.environ.get("VSOCK_PROXY_REQUIRE_VSOCK") == "1":
    raise RuntimeError("VSOCK_PROXY_REQUIRE_VSOCK=1 but " + _missing)
pytestmark = [pytest.mark.vsock, pytest.mark.skipif(bool(_missing), reason=_missing or "")]


def vsock_listener(port):
    listener = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    listener.bind((socket.VMADDR_CID_ANY, port))
    listener.listen(16)
    return listener


@pytest.fixture(scope="module")
def vsock_sshd(sshd):
    """The shared test sshd, also served per connection on vsock port SSHD_PORT."""
    loop = sshd.serve_on(vsock_listener(SSHD_PORT))
    yield sshd
    loop.stop()


def echo_then_close(conn):
    with conn:
        echo(conn)


@pytest.fixture(scope="module")
def vsock_echo():
    """An echo server on vsock port ECHO_PORT, one thread per connection."""
    loop = AcceptLoop(vsock_listener(ECHO_PORT), lambda conn: threading.Thread(
        target=echo_then_close, args=(conn,), daemon=True).start())
    yield ECHO_PORT
    loop.stop()


@pytest.mark.skipif(not IN_LAB_VM, reason="unloads a kernel module: only in the throw-away lab VM")
def test_cid_without_a_transport_is_enodev():
    """With the loopback transport unloaded, CID 1 has no VM behind it: the
    kernel says ENODEV at once (the lab VM has no other transport).  First in
    this file: the module can only be unloaded while no connection uses it."""
    # busybox, as the lab's own boot: kmod's modprobe needs modules.dep.bin,
    # which the lab's depmod writes only when its host has kmod.
    if subprocess.run(["busybox", "rmmod", "vsock_loopback"]).returncode != 0:
        pytest.skip("vsock_loopback is in use and cannot be unloaded")
    try:
        result = run_proxy("--timeout", "3", "vsock/1", str(UNUSED_PORT), timeout=15)
    finally:
        subprocess.run(["busybox", "modprobe", "vsock_loopback"], check=True)
    assert result.returncode == 1
    assert result.stderr.decode() == (
        "vsock-proxy: vsock/1: no VM with CID 1 (ENODEV): is the vsock_loopback module "
        "loaded?\n")


def snippet_config(sshd):
    return sshd.ssh_config("Include %s\n" % (ROOT / "ssh_config.d" / "vsock-proxy.conf"))


@pytest.mark.parametrize("host", ["vsock/1", "vsock/local", "vsock%1"])
def test_ssh_through_the_shipped_snippet(vsock_sshd, vsock_proxy_on_path, host):
    result = vsock_sshd.ssh(host, "echo over vsock", config=snippet_config(vsock_sshd),
                            extra_args=["-p", str(SSHD_PORT)], env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"over vsock\n"), result.stderr


def test_ssh_in_relay_mode_moves_bulk_data_both_ways(vsock_sshd, vsock_proxy_on_path, tmp_path):
    config = vsock_sshd.ssh_config("Host vsock/*\n    ProxyCommand vsock-proxy %n %p\n"
                                   "    StrictHostKeyChecking no\n"
                                   "    UserKnownHostsFile /dev/null\n")
    upload = os.urandom(8 << 20)
    source = tmp_path / "download.bin"
    source.write_bytes(os.urandom(8 << 20))
    result = vsock_sshd.ssh("vsock/1", "sha256sum; cat %s" % source, config=config,
                            extra_args=["-p", str(SSHD_PORT)], input=upload,
                            env=vsock_proxy_on_path, timeout=120)
    assert result.returncode == 0, result.stderr
    digest, downloaded = result.stdout.split(b"\n", 1)
    assert digest.split()[0].decode() == hashlib.sha256(upload).hexdigest()
    assert downloaded == source.read_bytes()


def test_scp_to_vsock_percent_form(vsock_sshd, vsock_proxy_on_path, tmp_path):
    original = tmp_path / "original.bin"
    original.write_bytes(os.urandom(1 << 20))
    config = snippet_config(vsock_sshd)
    result = vsock_sshd.scp("-P", str(SSHD_PORT), str(original), "vsock%%1:%s/copy.bin" % tmp_path,
                            config=config, env=vsock_proxy_on_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "copy.bin").read_bytes() == original.read_bytes()


@pytest.mark.parametrize("stdio", ["pipe", "socket"])
def test_relay_over_vsock_both_paths(vsock_echo, stdio):
    """splice between a pipe and an AF_VSOCK socket, and the read/write path."""
    payload = os.urandom(4 << 20)
    with proxy_process(["vsock/1", str(vsock_echo)], stdio) as proxy:
        echoed = proxy.exchange(payload)
        assert proxy.wait() == 0
    assert echoed == payload


@pytest.mark.parametrize("stdio", ["pipe", "socket"])
def test_peer_closing_ends_the_relay_while_stdin_stays_open(stdio):
    """vsock reports POLLHUP only once both sides have shut down: the relay
    must notice a peer's full close by itself."""
    loop = AcceptLoop(vsock_listener(BYE_PORT), lambda conn: (conn.sendall(b"bye\n"),
                                                              conn.close()))
    try:
        with proxy_process(["vsock/1", str(BYE_PORT)], stdio) as proxy:
            assert proxy.read_to_eof() == b"bye\n"
            assert proxy.wait() == 0
    finally:
        loop.stop()


def test_fdpass_hands_over_a_vsock_socket(vsock_echo):
    ours, theirs = socket.socketpair()
    with ours:
        result = run_proxy("--fdpass", "vsock/1", str(vsock_echo), stdout=theirs.fileno())
        theirs.close()
        assert (result.returncode, result.stderr) == (0, b"")
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    with socket.socket(fileno=fds[0]) as passed:
        assert passed.family == socket.AF_VSOCK
        passed.sendall(b"ping")
        assert passed.recv(4) == b"ping"


def test_check_succeeds_against_a_listening_port(vsock_echo):
    result = run_proxy("--check", "vsock/1", str(vsock_echo))
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_connect_timeout_none_means_no_deadline_on_vsock_too(vsock_echo):
    with vsock_proxy.connect("vsock/1", vsock_echo, timeout=None) as sock:
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"


def test_port_with_no_listener_is_reset_at_once():
    """The kernel answers a connect to a closed port with a reset, at once:
    well inside the (long) timeout given here."""
    result = run_proxy("--timeout", "30", "vsock/1", str(UNUSED_PORT), timeout=15)
    assert result.returncode == 1
    assert result.stderr.decode() == (
        "vsock-proxy: vsock/1: nothing is listening on vsock port %d (ECONNRESET): is sshd "
        "listening on vsock port %d in the guest?\n" % (UNUSED_PORT, UNUSED_PORT))


def test_wait_gives_up_on_a_port_that_never_opens():
    result = run_proxy("--wait", "1", "vsock/local", str(UNUSED_PORT), timeout=15)
    assert result.returncode == 1
    assert result.stderr.decode().startswith(
        "vsock-proxy: vsock/local: nothing is listening on vsock port %d (ECONNRESET)" % UNUSED_PORT)
    # 1 s, or a little more under the lab's emulation
    assert re.search(r"\(gave up after 1(\.\d+)?s and \d+ attempts\)\n$", result.stderr.decode())


@pytest.fixture
def serve_vsock():
    """serve_vsock(handler) -> "vsock/1:PORT"-style target of a fresh server,
    one thread per connection; stopped after the test."""
    servers = []

    def serve(handler):
        port = next(MATRIX_PORTS)
        servers.append(ThreadedServer(vsock_listener(port), lambda conn, _: handler(conn)))
        return "vsock/1 %d" % port
    yield serve
    for server in servers:
        server.stop()
    assert not [e for server in servers for e in server.errors]


# The stdio kinds do not meet the transport; the endings do.
VSOCK_RELAY_CASES = [("splice", "pipe"), ("read/write", "pipe"), ("read/write", "shared-socket")]


@pytest.mark.parametrize("path, stdio", VSOCK_RELAY_CASES)
@pytest.mark.parametrize("ending", ENDINGS, ids=lambda ending: ending.name.replace(" ", "_"))
def test_relay_over_vsock_ends_as_its_table_says(serve_vsock, request, path, stdio, ending):
    if path == "splice" and not hasattr(os, "splice"):
        pytest.skip("no os.splice in this Python")
    run_case(path, stdio, ending, serve_vsock, seed=request.node.name)
