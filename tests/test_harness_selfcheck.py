"""Self-checks for the shared harness in conftest.py.

None of these run vsock_proxy.py: they prove the fixtures with plain sockets,
socat and OpenSSH, so a harness bug cannot hide behind a proxy bug.
"""

import os
import shutil
import signal
import socket
import sys
import threading
import time

import pytest

from conftest import (ESCAPE_REPLY, FAKE_BANNER, GARBAGE_REPLY, OVERLONG_REPLY,
                      PROXY_ARGV, ROOT, StdioProcess, echo, run_cmd, serve_unix,
                      unix_listener)

needs_socat = pytest.mark.skipif(shutil.which("socat") is None, reason="socat not installed")
BOTH_STDIO = pytest.mark.parametrize("stdio", ["pipe", "socket"])

CONNECT_22 = b"CONNECT 22\n"


# -- client helpers ------------------------------------------------------------

def mux_connect(m, send=CONNECT_22, timeout=5):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(m.path)
    if send:
        s.sendall(send)
    return s


def read_to_eof(s):
    chunks = []
    while True:
        data = s.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def socat_config(sshd, host="h", socket_path=None):
    return sshd.ssh_config(f"""
        Host {host}
            ProxyCommand socat - UNIX-CONNECT:{socket_path or sshd.socket_path}
        """)


# -- 1. running vsock-proxy ------------------------------------------------------

def test_proxy_argv_points_at_checkout(proxy_argv):
    assert proxy_argv == PROXY_ARGV
    assert proxy_argv == [sys.executable, str(ROOT / "vsock_proxy.py")]
    assert (ROOT / "tests" / "conftest.py").is_file()


def test_run_cmd_captures_bytes_and_feeds_input():
    r = run_cmd([sys.executable, "-c",
                 "import sys; d = sys.stdin.buffer.read(); "
                 "sys.stdout.buffer.write(d[::-1]); sys.stderr.write('err')"],
                input=b"abc")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"cba", b"err")


def test_vsock_proxy_on_path_finds_an_executable_first(vsock_proxy_on_path):
    first_dir = vsock_proxy_on_path["PATH"].split(os.pathsep)[0]
    found = shutil.which("vsock-proxy", path=vsock_proxy_on_path["PATH"])
    assert found == os.path.join(first_dir, "vsock-proxy")
    assert os.access(found, os.X_OK)
    if first_dir != os.path.dirname(sys.executable):  # our wrapper, not an install
        assert str(ROOT / "vsock_proxy.py") in open(found).read()


def test_checkout_comes_before_installed_packages_on_sys_path():
    site = [i for i, p in enumerate(sys.path) if p.endswith("-packages")]
    assert sys.path.index(str(ROOT)) < min(site, default=len(sys.path))


def test_serve_unix_serves_each_connection(tmp_path):
    path = serve_unix(tmp_path, echo)
    for word in (b"one", b"two"):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(word)
            assert s.recv(100) == word


def test_serve_unix_closes_without_draining(tmp_path):
    path = serve_unix(tmp_path, lambda conn: conn.recv(1))
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"x" * 100)
        with pytest.raises(ConnectionResetError):
            s.recv(100)


@BOTH_STDIO
def test_stdio_process_roundtrip_and_eof(stdio):
    with StdioProcess(["cat"], stdio) as child:
        child.write(b"hello")
        assert child.read_exactly(5) == b"hello"
        child.close_stdin()
        assert child.read_to_eof() == b""
        assert child.wait() == 0
        assert child.stderr() == b""


@BOTH_STDIO
def test_stdio_process_stderr_lines(stdio):
    with StdioProcess(["sh", "-c", "echo one >&2; echo two >&2; exec cat"], stdio) as child:
        assert child.stderr_line() == "one"
        child.close_stdin()
        assert child.wait() == 0
        assert child.stderr() == b"two\n"


def test_stdio_process_reads_are_bounded():
    with StdioProcess(["cat"]) as child:
        with pytest.raises(AssertionError, match="timed out"):
            child.read_exactly(1, timeout=0.2)
        assert child.peak_memory_kib() > 0


@BOTH_STDIO
def test_stdio_process_close_stdout_breaks_the_pipe(stdio):
    with StdioProcess(["yes"], stdio) as child:
        assert child.read_exactly(4) == b"y\ny\n"
        child.close_stdout()
        # A pipe gives EPIPE (SIGPIPE). A socket closed with unread data gives
        # the writer ECONNRESET or EPIPE, depending on whether data was queued.
        expected = {-signal.SIGPIPE} if stdio == "pipe" else {-signal.SIGPIPE, 1}
        assert child.wait() in expected


# -- 2. sshd -------------------------------------------------------------------

def test_ssh_config_puts_caller_blocks_before_defaults(sshd):
    cfg = sshd.ssh_config("""
        Host special
            User nobody
            ConnectTimeout 3
        """)
    effective = run_cmd(["ssh", "-G", "-F", cfg, "special"]).stdout.decode()
    assert "user nobody" in effective.splitlines()
    assert "connecttimeout 3" in effective.splitlines()
    other = run_cmd(["ssh", "-G", "-F", cfg, "other"]).stdout.decode()
    assert f"user {sshd.user}" in other.splitlines()


@needs_socat
def test_sshd_login_through_socat_proxycommand(sshd):
    r = sshd.ssh("h", "echo hello; id -un", config=socat_config(sshd))
    assert r.returncode == 0, (r.stderr, sshd.read_log())
    assert r.stdout == f"hello\n{sshd.user}\n".encode()


@needs_socat
def test_sshd_sees_a_non_tcp_peer(sshd):
    # Peer "UNKNOWN 65535" as in OpenSSH's regress suite; but on an AF_UNIX
    # socket sshd reports its local address as the socket path (the regress
    # suite's "UNKNOWN 65535 UNKNOWN 65535" comes from pipes, not sockets).
    r = sshd.ssh("h", 'printf %s "$SSH_CONNECTION"', config=socat_config(sshd))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"UNKNOWN 65535 {sshd.socket_path} 65535".encode()


@needs_socat
def test_sshd_stdin_roundtrip(sshd):
    payload = os.urandom(1 << 20)
    r = sshd.ssh("h", "cat", config=socat_config(sshd), input=payload)
    assert r.returncode == 0, r.stderr
    assert r.stdout == payload


@needs_socat
def test_scp_roundtrip(sshd, tmp_path):
    cfg = socat_config(sshd)
    src, back = tmp_path / "src", tmp_path / "back"
    src.write_bytes(os.urandom(100_000))
    assert sshd.scp(src, f"h:{tmp_path}/remote", config=cfg).returncode == 0
    r = sshd.scp(f"h:{tmp_path}/remote", back, config=cfg)
    assert r.returncode == 0, r.stderr
    assert back.read_bytes() == src.read_bytes()


@needs_socat
def test_sftp_batch(sshd, tmp_path):
    (tmp_path / "f").write_text("sftp works\n")
    r = sshd.sftp("h", f"cd {tmp_path}\nget f {tmp_path}/g\n", config=socat_config(sshd))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g").read_text() == "sftp works\n"


def test_serve_on_another_listener(sshd, tmp_path_factory):
    path = tmp_path_factory.mktemp("other") / "l.sock"
    loop = sshd.serve_on(unix_listener(path))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(path))
            assert s.recv(100).startswith(sshd.BANNER_PREFIX)
    finally:
        loop.stop()


def test_spawn_sshd_on_socketpair_exits_on_eof(sshd):
    ours, theirs = socket.socketpair()
    proc = sshd.spawn_sshd(theirs)
    assert theirs.fileno() == -1  # the parent's copy is closed
    ours.settimeout(10)
    assert ours.recv(100).startswith(sshd.BANNER_PREFIX)
    ours.close()
    assert proc.wait(timeout=10) is not None


# -- 3. the fake muxer: replies --------------------------------------------------

@pytest.mark.parametrize("flavour", ["firecracker", "cloud-hypervisor"])
def test_muxer_host_port_reply_and_banner_in_one_segment(muxer, flavour):
    m = muxer(flavour)
    with mux_connect(m) as s:
        assert s.recv(4096) == b"OK 1073741824\n" + FAKE_BANNER
    assert len(b"OK 1073741824\n") == 14
    assert (m.ports, m.received_before_reply, m.line_in_one_recv) == ([22], [CONNECT_22], [True])


def test_muxer_host_ports_count_up(muxer):
    m = muxer()
    replies = []
    for _ in range(2):
        with mux_connect(m) as s:
            replies.append(s.recv(4096))
    assert replies == [b"OK 1073741824\n" + FAKE_BANNER, b"OK 1073741825\n" + FAKE_BANNER]
    assert m.connections == 2


def test_muxer_vhost_device_replies_guest_port(muxer):
    m = muxer("vhost-device")
    with mux_connect(m, b"CONNECT 2222\n") as s:
        assert s.recv(4096) == b"OK 2222\n" + FAKE_BANNER
    assert m.ports == [2222]


def test_muxer_echoes_until_eof_then_closes(muxer):
    m = muxer()
    with mux_connect(m) as s:
        s.recv(4096)
        s.sendall(b"ping")
        assert s.recv(4096) == b"ping"
        s.shutdown(socket.SHUT_WR)
        assert read_to_eof(s) == b""


def test_muxer_rejects_malformed_line(muxer):
    m = muxer()
    with mux_connect(m, b"CONNECT x\n") as s:
        assert read_to_eof(s) == b""
    assert m.ports == [] and m.received_before_reply == [b"CONNECT x\n"]


# -- the fake muxer: line handling quirks ----------------------------------------

def test_muxer_vhost_device_drops_split_line(muxer):
    m = muxer("vhost-device")
    with mux_connect(m, b"CONNECT ") as s:
        time.sleep(0.1)
        try:
            s.sendall(b"22\n")
        except BrokenPipeError:
            pass
        assert read_to_eof(s) == b""
    assert m.line_in_one_recv == [False] and m.ports == []


def test_muxer_firecracker_accepts_split_line(muxer):
    m = muxer("firecracker")
    with mux_connect(m, b"CONNECT ") as s:
        time.sleep(0.1)
        s.sendall(b"22\n")
        assert s.recv(4096).startswith(b"OK 1073741824\n")
    assert m.line_in_one_recv == [False] and m.ports == [22]


def test_muxer_vhost_device_loses_bytes_sent_before_reply(muxer):
    m = muxer("vhost-device")
    with mux_connect(m, CONNECT_22 + b"early") as s:
        assert s.recv(4096) == b"OK 22\n" + FAKE_BANNER
        s.sendall(b"late")
        assert s.recv(4096) == b"late"  # "early" never reached the guest
    assert m.received_before_reply == [CONNECT_22 + b"early"]


def test_muxer_firecracker_keeps_bytes_sent_before_reply(muxer):
    m = muxer("firecracker")
    with mux_connect(m, CONNECT_22 + b"early") as s:
        s.shutdown(socket.SHUT_WR)
        assert read_to_eof(s) == b"OK 1073741824\n" + FAKE_BANNER + b"early"
    assert m.received_before_reply == [CONNECT_22 + b"early"]


# -- the fake muxer: failure behaviours ------------------------------------------

def test_muxer_drip_sends_reply_bytewise(muxer):
    m = muxer(behaviour="drip")
    with mux_connect(m) as s:
        data = s.recv(4096)
        assert len(data) < len(b"OK 1073741824\n")  # not the whole line at once
        while not data.endswith(FAKE_BANNER):
            data += s.recv(4096)
        assert data == b"OK 1073741824\n" + FAKE_BANNER


def test_muxer_close_gives_eof(muxer):
    m = muxer(behaviour="close")
    with mux_connect(m) as s:
        assert s.recv(4096) == b""
    assert m.ports == [22]


def test_muxer_reset_gives_econnreset(muxer):
    m = muxer(behaviour="reset")
    with mux_connect(m) as s:
        with pytest.raises(ConnectionResetError):
            s.recv(4096)
    assert m.received_before_reply == [CONNECT_22]


@pytest.mark.parametrize("behaviour,reply", [("garbage", GARBAGE_REPLY),
                                             ("escape", ESCAPE_REPLY)])
def test_muxer_bad_reply_then_close(muxer, behaviour, reply):
    m = muxer(behaviour=behaviour)
    with mux_connect(m) as s:
        assert read_to_eof(s) == reply


def test_muxer_overlong_reply_stays_open(muxer):
    m = muxer(behaviour="overlong")
    with mux_connect(m, timeout=0.3) as s:
        data = b""
        while len(data) < len(OVERLONG_REPLY):
            data += s.recv(4096)
        assert data == OVERLONG_REPLY
        with pytest.raises(socket.timeout):
            s.recv(4096)


def test_muxer_silent_never_answers(muxer):
    m = muxer(behaviour="silent")
    with mux_connect(m, timeout=0.3) as s:
        with pytest.raises(socket.timeout):
            s.recv(4096)
    assert m.ports == [22]


def test_muxer_late_by_count(muxer):
    m = muxer(behaviour="late", late_count=2)
    for _ in range(2):
        with mux_connect(m) as s:
            assert s.recv(4096) == b""
    with mux_connect(m) as s:
        assert s.recv(4096) == b"OK 1073741824\n" + FAKE_BANNER


def test_muxer_late_by_delay(muxer):
    m = muxer(behaviour="late", late_delay=0.3, late_mode="reset")
    with mux_connect(m) as s:
        with pytest.raises(ConnectionResetError):
            s.recv(4096)
    time.sleep(0.3)
    with mux_connect(m) as s:
        assert s.recv(4096).startswith(b"OK ")


def test_muxer_stop_ends_open_connections_and_threads(muxer):
    m = muxer(behaviour="silent")
    s = mux_connect(m)
    m.wait_connections(1)
    m.stop()
    assert s.recv(4096) == b""
    s.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("muxer-")]
    assert not os.path.exists(m.path)


def test_muxer_custom_backend(muxer):
    def backend(conn, reply):
        conn.sendall(reply + b"custom")

    m = muxer("vhost-device", backend=backend)
    with mux_connect(m) as s:
        assert read_to_eof(s) == b"OK 22\ncustom"


# -- the fake muxer with a real sshd behind it -----------------------------------

def test_muxer_sshd_backend_reply_and_banner_in_one_recv(muxer):
    m = muxer(backend="sshd")
    with mux_connect(m, timeout=10) as s:
        data = s.recv(4096)
    assert data.startswith(b"OK 1073741824\nSSH-2.0-OpenSSH"), data
    assert data.endswith(b"\r\n")


@needs_socat
def test_muxer_sshd_backend_full_login(muxer, sshd):
    # Without vsock-proxy: the CONNECT line goes first, and ssh skips the
    # "OK ..." line because clients ignore text before the server's banner.
    # Only Firecracker keeps ssh's banner, which it sends before the reply.
    m = muxer("firecracker", backend=sshd.mux_backend)
    cfg = sshd.ssh_config(f"""
        Host m
            ProxyCommand sh -c '{{ printf "CONNECT 22\\n"; exec cat; }} | exec socat - UNIX-CONNECT:{m.path}'
        """)
    r = sshd.ssh("m", "echo via-muxer", config=cfg)
    assert r.returncode == 0, (r.stderr, sshd.read_log())
    assert r.stdout == b"via-muxer\n"
