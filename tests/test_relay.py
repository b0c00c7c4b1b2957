"""The relay without ssh: what goes in comes out, both ways, with the ends of
the stream and the failures a real session meets.

Every test runs twice: with pipes as stdin/stdout (what ssh gives a
ProxyCommand: the os.splice fast path) and with sockets as stdin/stdout (the
portable read/write path, which macOS and Python 3.9 always take).  Waits are
bounded so that a stall fails the test instead of hanging it; no test times
anything.
"""

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import PROXY_ARGV, echo, proxy_process, run_proxy, serve_unix, sha256_until_eof

BOTH_PATHS = pytest.mark.parametrize("stdio", ["pipe", "socket"])


def expect_path(proxy, stdio):
    """The relay really took the path this run is about."""
    line = proxy.stderr_line()
    splice = stdio == "pipe" and hasattr(os, "splice")      # Python 3.10+
    assert line == ("vsock-proxy: relaying with splice (zero-copy)" if splice
                    else "vsock-proxy: relaying with read/write")


@BOTH_PATHS
def test_bytes_go_both_ways(tmp_path, stdio):
    path = serve_unix(tmp_path, echo)
    with proxy_process(["-v", "unix" + path], stdio) as proxy:
        proxy.stderr_line()                            # "connecting to ..."
        expect_path(proxy, stdio)
        proxy.write(b"hello\n")
        assert proxy.read_exactly(6) == b"hello\n"
        proxy.close_stdin()
        assert proxy.read_to_eof() == b""
        assert proxy.wait() == 0


@BOTH_PATHS
def test_peer_closing_ends_the_relay_while_stdin_stays_open(tmp_path, stdio):
    path = serve_unix(tmp_path, lambda conn: conn.sendall(b"bye\n"))
    with proxy_process(["unix" + path], stdio) as proxy:
        assert proxy.read_to_eof() == b"bye\n"
        assert proxy.wait() == 0


@BOTH_PATHS
def test_server_speaks_first(tmp_path, stdio):
    path = serve_unix(tmp_path, lambda conn: (conn.sendall(b"SSH-2.0-Banner\r\n"), echo(conn)))
    with proxy_process(["unix" + path], stdio) as proxy:
        assert proxy.read_exactly(16) == b"SSH-2.0-Banner\r\n"


@BOTH_PATHS
def test_stdin_eof_half_closes_and_the_reply_still_arrives(tmp_path, stdio):
    def digest_after_eof(conn):
        conn.sendall(sha256_until_eof(conn).encode())
    path = serve_unix(tmp_path, digest_after_eof)
    payload = os.urandom(3 << 20)
    with proxy_process(["unix" + path], stdio) as proxy:
        proxy.write(payload)
        proxy.close_stdin()
        assert proxy.read_to_eof() == hashlib.sha256(payload).hexdigest().encode()
        assert proxy.wait() == 0
        assert proxy.stderr() == b""


@BOTH_PATHS
def test_peer_that_half_closes_first_still_gets_all_of_stdin(tmp_path, stdio):
    received, done = [], threading.Event()

    def greet_then_listen(conn):
        conn.sendall(b"send me everything\n")
        conn.shutdown(socket.SHUT_WR)
        received.append(sha256_until_eof(conn))
        done.set()
    path = serve_unix(tmp_path, greet_then_listen)
    payload = os.urandom(2 << 20)
    with proxy_process(["unix" + path], stdio) as proxy:
        assert proxy.read_to_eof() == b"send me everything\n"
        proxy.write(payload)
        proxy.close_stdin()
        assert proxy.wait() == 0
    assert done.wait(10)       # the peer may still be hashing when the proxy exits
    assert received == [hashlib.sha256(payload).hexdigest()]


@BOTH_PATHS
def test_bulk_data_both_ways_matches_by_hash(tmp_path, stdio):
    download = os.urandom(16 << 20)

    def send_then_digest(conn):
        sender = threading.Thread(target=conn.sendall, args=(download,))
        sender.start()
        digest = sha256_until_eof(conn)
        sender.join()
        conn.sendall(b"|" + digest.encode())
    path = serve_unix(tmp_path, send_then_digest)
    upload = os.urandom(16 << 20)
    with proxy_process(["unix" + path], stdio) as proxy:
        received = proxy.exchange(upload)
        assert proxy.wait() == 0
    assert received[:len(download)] == download
    assert received[len(download):] == b"|" + hashlib.sha256(upload).hexdigest().encode()


@BOTH_PATHS
def test_keystrokes_come_back_one_at_a_time(tmp_path, stdio):
    """Interactive typing: each byte must be forwarded alone and at once.  A
    blocking splice into the stdout pipe would hold the pipe's lock while it
    waits for the next packet, so the reader never sees the reply: this
    ping-pong would then stall at the first round (bounded wait, no timing)."""
    path = serve_unix(tmp_path, echo)
    with proxy_process(["unix" + path], stdio) as proxy:
        for i in range(300):
            key = bytes([32 + i % 90])
            proxy.write(key)
            assert proxy.read_exactly(1, timeout=5) == key


@BOTH_PATHS
def test_peer_reset_mid_stream_is_one_line_and_exit_1(tmp_path, stdio):
    def reset(conn):
        conn.sendall(b"partial")
        conn.recv(1)                 # data arrives and is left unread, then close:
        # on AF_UNIX, closing with unread data resets the peer (ECONNRESET)
    path = serve_unix(tmp_path, reset)
    with proxy_process(["unix" + path], stdio) as proxy:
        assert proxy.read_exactly(7) == b"partial"
        proxy.write(b"xyz" * 1000)
        assert proxy.wait() == 1
        assert proxy.stderr() == (
            b"vsock-proxy: unix%s: connection reset by the peer (ECONNRESET): "
            b"not all of stdin was read\n" % path.encode())


@BOTH_PATHS
def test_stdout_closed_while_the_peer_sends_is_one_line_and_exit_1(tmp_path, stdio):
    """The peer's bytes can no longer be delivered: exit 0 would be a lie."""
    def flood(conn):
        chunk = b"x" * 65536
        try:
            while True:
                conn.sendall(chunk)
        except OSError:
            pass
    path = serve_unix(tmp_path, flood)
    with proxy_process(["unix" + path], stdio) as proxy:
        proxy.read_exactly(65536)
        proxy.close_stdout()
        assert proxy.wait() == 1
        assert proxy.stderr() == (
            b"vsock-proxy: unix%s: stdout's reader went away before the peer's "
            b"data was written (EPIPE)\n" % path.encode())


def test_stdout_socket_closed_with_bytes_unread_before_the_peers_eof_is_exit_1(tmp_path):
    """Every write to stdout succeeded, then its reader closed with some of
    them unread, and the peer's EOF came next: nothing more is written, yet
    the bytes are lost.  A socket on stdout says so (ECONNRESET); a pipe's
    reader leaves no such mark, so only the socket kind can be held to it."""
    release = threading.Event()

    def send_then_close_when_released(conn):
        conn.sendall(b"x" * 1000)
        release.wait(10)
    path = serve_unix(tmp_path, send_then_close_when_released)
    with proxy_process(["unix" + path], "socket") as proxy:
        proxy.wait_for_unread_output()
        proxy.close_stdout()
        release.set()
        assert proxy.wait() == 1
        assert proxy.stderr() == (
            b"vsock-proxy: unix%s: stdout's reader went away before the peer's "
            b"data was written (ECONNRESET)\n" % path.encode())


@pytest.fixture
def hangups_not_ignored():
    """Under nohup SIGHUP is ignored, and a child inherits that through exec
    (the proxy then rightly ignores it too): the proxy is started with the
    default, as from an ssh in a terminal."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@BOTH_PATHS
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_hangup_and_terminate_end_the_proxy_quietly(tmp_path, stdio, signum,
                                                    hangups_not_ignored):
    """ssh sends SIGHUP to its ProxyCommand when the session ends."""
    path = serve_unix(tmp_path, echo)
    with proxy_process(["unix" + path], stdio) as proxy:
        proxy.write(b"ping")
        assert proxy.read_exactly(4) == b"ping"
        proxy.process.send_signal(signum)
        assert proxy.wait() == -signum
        assert proxy.stderr() == b""


@BOTH_PATHS
def test_slow_reader_keeps_the_proxy_memory_bounded(tmp_path, stdio):
    """Backpressure: a fast sender and a reader that stalls.  The sender must
    soon be blocked with little in flight, and the proxy must not have
    buffered what the reader has not taken."""
    sent_mib = []

    def flood(conn):
        chunk = os.urandom(1 << 20)
        for _ in range(256):
            conn.sendall(chunk)
            sent_mib.append(1)
    path = serve_unix(tmp_path, flood)
    with proxy_process(["unix" + path], stdio) as proxy:
        proxy.read_exactly(1 << 20)
        in_flight = wait_until_steady(lambda: len(sent_mib))   # the reader stalls
        peak_kib = proxy.peak_memory_kib()
        total = (1 << 20) + len(proxy.read_to_eof(timeout=60))
    assert total == 256 << 20
    assert in_flight < 16, "the sender got %d MiB out while the reader stalled" % in_flight
    assert peak_kib < 64 * 1024, "proxy grew to %d KiB while the reader stalled" % peak_kib


def wait_until_steady(count, settle=0.5, limit=20):
    """Poll count() until it has not changed for `settle` seconds; its value."""
    deadline = time.monotonic() + limit
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle:
            return now
    raise AssertionError("count still moving after %ss: %d" % (limit, last))


def closing(fd):
    """preexec_fn: start the proxy with fd closed, as some launchers do."""
    return lambda: os.close(fd)


def test_closed_stdin_reads_as_eof(tmp_path):
    path = serve_unix(tmp_path, lambda conn: (conn.sendall(b"banner\n"), echo(conn)))
    result = run_proxy("unix" + path, stdin=None, preexec_fn=closing(0), timeout=10)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"banner\n", b"")


def test_closed_stdout_does_not_send_the_peers_bytes_back(tmp_path):
    received = []

    def banner_then_record(conn):
        conn.sendall(b"banner\n" * 1000)
        received.append(b"".join(iter(lambda: conn.recv(65536), b"")))
    path = serve_unix(tmp_path, banner_then_record)
    proxy = subprocess.Popen(PROXY_ARGV + ["unix" + path], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, preexec_fn=closing(1))
    proxy.stdin.write(b"from stdin")
    proxy.stdin.flush()
    threading.Event().wait(0.5)          # time for the banner to be bounced, were it so
    _, err = proxy.communicate(timeout=10)
    assert (proxy.returncode, err) == (0, b"")
    assert received == [b"from stdin"]


def test_closed_stderr_keeps_messages_out_of_stdout(tmp_path):
    result = run_proxy("unix%s/none.sock" % tmp_path, stderr=None, preexec_fn=closing(2))
    assert (result.returncode, result.stdout) == (1, b"")


@BOTH_PATHS
def test_64_mib_echoed_while_still_sending_neither_side_deadlocks(tmp_path, stdio):
    """The peer echoes as it reads, so both directions are full at once: a
    relay that stops reading one side while it waits to write the other
    would deadlock here."""
    path = serve_unix(tmp_path, echo)
    payload = os.urandom(64 << 20)
    with proxy_process(["unix" + path], stdio) as proxy:
        echoed = proxy.exchange(payload)
        assert proxy.wait() == 0
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


def test_64_connections_in_parallel_each_get_their_own_bytes(tmp_path):
    path = serve_unix(tmp_path, echo)
    payloads = [os.urandom(256 << 10) for _ in range(64)]
    proxies = [subprocess.Popen(PROXY_ARGV + ["unix" + path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for _ in payloads]
    results = [None] * len(proxies)

    def converse(i):
        results[i] = proxies[i].communicate(payloads[i], timeout=60)
    threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(proxies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [p.returncode for p in proxies] == [0] * 64
    assert [r[1] for r in results] == [b""] * 64
    assert [r[0] == payload for r, payload in zip(results, payloads)] == [True] * 64
