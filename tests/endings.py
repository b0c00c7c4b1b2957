"""The relay's termination-and-integrity matrix, shared by test_endings.py
(AF_UNIX) and test_vsock.py (real AF_VSOCK).

One case is a relay path (splice, read/write) x a stdio kind (the shapes in
StdioProcess.KINDS) x an ending (ENDINGS below).  Payloads of random size go
both ways and are checked by hash; the exit status, the stderr line and the
time to exit are checked against EXPECTED, which restates the table in
vsock_proxy.py's relay section for each ending.
"""

import hashlib
import os
import random
import re
import socket
import sys
import threading
import time

from conftest import PROXY_ARGV, PROXY_SCRIPT, StdioProcess

# Python 3.10+ on Linux splices pipes; with posix.splice (os.splice) taken away the same
# program takes its read/write path (the one macOS and Python 3.9 take).
WITHOUT_SPLICE = [sys.executable, "-c",
                  "import posix, runpy, sys; posix.__dict__.pop('splice', None); "
                  "sys.argv[0] = sys.argv[1]; del sys.argv[1]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')",
                  str(PROXY_SCRIPT)]

# Under the lab VM's emulation everything is 10-15 times slower.
SLOWDOWN = 10 if "vsocklab=1" in open("/proc/cmdline").read() else 1
PROMPTLY = 3.0 * SLOWDOWN           # "exits at once": a generous bound, never a timing test
HOLD = 1.0 * SLOWDOWN               # how long a peer that waits holds the connection

UPLOAD_LOST = (r"the peer closed the connection before it took all of stdin( \(EPIPE\))?"
               r"|connection reset by the peer \(ECONNRESET\): not all of stdin was read")
STDOUT_GONE = r"stdout's reader went away before the peer's data was written( \((EPIPE|EIO|ECONNRESET)\))?"


def relay_cases():
    """(path, stdio) pairs: splice only exists for the pipe kinds."""
    cases = [("read/write", kind) for kind in StdioProcess.KINDS]
    if hasattr(os, "splice"):
        cases += [("splice", kind) for kind in StdioProcess.KINDS if kind.endswith("pipe")]
    return cases


def proxy_argv(path, target):
    """target may carry its PORT after a space: "vsock/1 22100"."""
    argv = PROXY_ARGV if path == "splice" else WITHOUT_SPLICE
    return [*argv, "-v", *target.split(" ")]


class Peer:
    """The far side's half of one conversation, run by the server per
    connection: `behaviour(peer, conn)` with the payloads in peer.up (what it
    should receive) and peer.down (what it sends)."""

    def __init__(self, behaviour, up, down):
        self.behaviour, self.up, self.down = behaviour, up, down
        self.received = hashlib.sha256()
        self.received_bytes = 0
        self.got_all = threading.Event()     # all of self.up has arrived
        self.release = threading.Event()     # a holding peer may close now
        self.closed = threading.Event()

    def __call__(self, conn):
        try:
            self.behaviour(self, conn)
        finally:
            self.closed.set()

    def receive(self, conn, limit=None):
        """Receive until EOF, or until `limit` bytes."""
        while limit is None or self.received_bytes < limit:
            want = 1 << 20 if limit is None else min(1 << 20, limit - self.received_bytes)
            data = conn.recv(want)
            if not data:
                break
            self.received.update(data)
            self.received_bytes += len(data)
            if self.received_bytes == len(self.up):
                self.got_all.set()

    def got_the_upload(self):
        return self.received.digest() == hashlib.sha256(self.up).digest()


# -- the peer's behaviours ---------------------------------------------------

def closes_when_done(peer, conn):
    peer.receive(conn, limit=len(peer.up))
    conn.sendall(peer.down)


def half_closes_then_closes(peer, conn):
    conn.sendall(peer.down)
    conn.shutdown(socket.SHUT_WR)
    peer.receive(conn, limit=len(peer.up))


def half_closes_then_resets(peer, conn):
    conn.sendall(peer.down)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)                 # then close with the rest unread


def answers_after_eof(peer, conn):
    peer.receive(conn)
    conn.sendall(peer.down)


def goes_idle_after_eof(peer, conn):
    peer.receive(conn)
    peer.release.wait(30)


def floods(peer, conn):
    chunk = b"x" * 65536
    while not peer.release.is_set():
        conn.sendall(chunk)


def never_reads(peer, conn):
    conn.sendall(peer.down)
    peer.release.wait(30)


# -- our side of each ending ---------------------------------------------------

def write_in_background(proxy, data):
    """Write data to the proxy's stdin while the test goes on; a proxy that
    stops reading (or exits) ends the write with an error, which is fine."""
    def write():
        try:
            proxy.write(data)
        except OSError:
            pass
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


class Ending:
    """One way for a conversation to end: the peer's behaviour, what our side
    does, and the expected result (exit status, stderr pattern or None for
    silence, whether each payload must arrive whole)."""

    def __init__(self, name, behaviour, ours, status, message=None, big_upload=False,
                 down_arrives=True, up_arrives=True, kinds=None):
        self.name, self.behaviour, self.ours = name, behaviour, ours
        self.status, self.message = status, message
        self.big_upload = big_upload
        self.down_arrives, self.up_arrives = down_arrives, up_arrives
        self.kinds = kinds

    def applies_to(self, stdio):
        return self.kinds is None or stdio.replace("nonblocking-", "") in self.kinds


def read_the_download(proxy, peer):
    got = proxy.read_exactly(len(peer.down), timeout=60) if peer.down else b""
    assert hashlib.sha256(got).digest() == hashlib.sha256(peer.down).digest()


def expect_eof_unless_terminal(proxy):
    if proxy.stdio != "pty":        # a terminal cannot be told "end of file"
        assert proxy.read_to_eof(timeout=PROMPTLY) == b""


def ours_stdin_stays_open(proxy, peer):
    """The ssh case: ssh never closes its side first; the peer ends it."""
    write_in_background(proxy, peer.up)
    read_the_download(proxy, peer)
    expect_eof_unless_terminal(proxy)
    return time.monotonic()


def ours_stdin_ends_first(proxy, peer):
    proxy.write(peer.up)
    proxy.close_stdin()
    read_the_download(proxy, peer)
    expect_eof_unless_terminal(proxy)
    return time.monotonic()


def ours_goes_away(proxy, peer):
    """ssh killed: stdin ends and stdout's reader is gone; the peer idles."""
    write_in_background(proxy, peer.up)
    assert peer.got_all.wait(60) or not peer.up
    proxy.hang_up()
    return time.monotonic()


def ours_stops_reading(proxy, peer):
    """stdout's reader goes away while the peer is still sending, with bytes
    it was given still unread: a loss the relay can see.  (Had the reader
    taken all that was written, and the peer sent nothing more yet, exit 0
    would be right: nothing was lost at that moment.)  One descriptor for
    both ends (a terminal, a shared socket) goes away whole: shutdown(SHUT_RD)
    alone is no reader going away (the socket stays connected, the bytes
    already sent stay queued in it)."""
    proxy.read_exactly(65536)
    proxy.wait_for_unread_output()
    if proxy.stdio in ("pty", "shared-socket", "nonblocking-shared-socket"):
        proxy.hang_up()
    else:
        proxy.close_stdout()
    return time.monotonic()


def ours_waits_for_a_peer_that_never_reads(proxy, peer):
    write_in_background(proxy, peer.up)
    read_the_download(proxy, peer)
    time.sleep(HOLD)
    assert proxy.process.poll() is None, "gave up on a peer that still holds the connection"
    peer.release.set()
    return time.monotonic()


ENDINGS = [
    Ending("peer closes", closes_when_done, ours_stdin_stays_open, 0),
    Ending("peer half-closes then closes", half_closes_then_closes, ours_stdin_stays_open, 0),
    Ending("peer half-closes then resets", half_closes_then_resets, ours_stdin_stays_open,
           1, UPLOAD_LOST, big_upload=True, up_arrives=False),
    Ending("our stdin ends first", answers_after_eof, ours_stdin_ends_first, 0,
           kinds=("pipe", "socket", "shared-socket")),
    Ending("our side goes away", goes_idle_after_eof, ours_goes_away, 0,
           down_arrives=False),
    Ending("our stdout's reader goes away", floods, ours_stops_reading, 1, STDOUT_GONE,
           down_arrives=False, up_arrives=False),
    Ending("the peer never reads", never_reads, ours_waits_for_a_peer_that_never_reads,
           1, UPLOAD_LOST, big_upload=True, up_arrives=False),
]


def matrix():
    """pytest parameters: (path, stdio, ending), with readable ids."""
    import pytest
    return [pytest.param(path, stdio, ending, id="%s-%s-%s" % (path, stdio, ending.name.replace(" ", "_")))
            for path, stdio in relay_cases() for ending in ENDINGS if ending.applies_to(stdio)]


def run_case(path, stdio, ending, serve, seed):
    """Run one case against a server made by serve(handler) -> target."""
    rng = random.Random(seed)
    up_size = rng.randrange(1 << 20)
    if ending.big_upload:           # more than any socket and pipe buffers hold
        up_size += 8 << 20
    peer = Peer(ending.behaviour, rng.randbytes(up_size), rng.randbytes(rng.randrange(1 << 20)))
    target = serve(peer)
    try:
        with StdioProcess(proxy_argv(path, target), stdio) as proxy:
            assert proxy.stderr_line().startswith("vsock-proxy: connecting to ")
            method = proxy.stderr_line()
            assert method == ("vsock-proxy: relaying with splice (zero-copy)" if path == "splice"
                              else "vsock-proxy: relaying with read/write")
            ended_at = ending.ours(proxy, peer)
            status = proxy.wait(timeout=PROMPTLY + 30)
            took = time.monotonic() - ended_at
            stderr = proxy.stderr().decode(errors="replace")
    finally:
        peer.release.set()
    assert status == ending.status, "exit %s, stderr %r" % (status, stderr)
    if ending.message is None:
        assert stderr == ""
    else:
        assert re.fullmatch(r"vsock-proxy: \S+: (%s)\n" % ending.message, stderr), stderr
    assert took < PROMPTLY, "exited %.1fs after the conversation ended" % took
    if ending.up_arrives:
        assert peer.got_all.wait(PROMPTLY) or not peer.up
        assert peer.got_the_upload(), "the peer got %d of %d bytes" % (
            peer.received_bytes, len(peer.up))
