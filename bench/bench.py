#!/usr/bin/env python3
"""Benchmark vsock-proxy's relay against socat and a direct socket, on this machine.

    python3 bench/bench.py [--quick] [--only SECTIONS] [--rounds N] [--size MiB] [--pings N]
                           [--start-ups N] [--logins N] [--proxy CMD] [--no-ssh] [--json FILE]

A server process (this file run with --serve) listens on AF_UNIX sockets in a temporary
directory: sink (counts uploaded bytes), source (sends bytes), echo, and an sshd -i per
connection. Each relay under test is spawned the way ssh spawns a ProxyCommand -- stdin and
stdout are two pipes -- with the target `unix/PATH`, and measured for:

  * upload / download throughput (bytes through the relay's stdin / stdout pipes),
  * CPU seconds per GB of the relay child (getrusage RUSAGE_CHILDREN delta around its reaping),
  * 1-byte ping-pong round-trip time p50 / p99, unpinned and with everything on one CPU,
  * wall time of a short connection (spawn, connect, one echo line, exit),
  * start-up per install route (`--check`) against its interpreter's `-c 'import _socket'`,
  * ssh login wall time through each install route's `--ssh-config` ProxyCommand (as ssh
    runs the snippet: --fdpass), a minimal Python fdpass (the floor), vsock-proxy's relay
    and socat.

Tools are interleaved round-robin inside each round (the machine is small and noisy), and the
report gives medians, ratios (also per round, paired) and PASS/FAIL against the project's
performance goals.
Standard library only.
"""

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY_SCRIPT = os.path.join(ROOT, "vsock_proxy.py")
# What users run: the console script pip installed beside this interpreter
# (it imports the byte-compiled module); else the checkout's file as a script.
INSTALLED = os.path.join(os.path.dirname(sys.executable), "vsock-proxy")
DEFAULT_PROXY = [INSTALLED] if os.path.exists(INSTALLED) else [sys.executable, PROXY_SCRIPT]

MiB = 1 << 20
GB = 1e9                     # throughput and CPU/GB use decimal units: MB/s, s/GB
IO_CHUNK = MiB               # bench-side read/write size: large, so Python is not the bottleneck
READY = b"R"                 # sink and source send this on accept, so timing starts after relay start-up
ECHO_LINE = b"ping\n"

SINK, SOURCE, ECHO, SSHD = "sink.sock", "source.sock", "echo.sock", "sshd.sock"
# What a run measures (--only picks some): throughput and CPU per GB, round trips (unpinned
# and on one CPU), short connections (also the start-up CPU that CPU per GB leaves out),
# start-up per install route, ssh logins.
SECTIONS = ["transfer", "rtt", "short", "startup", "ssh"]
CONNECT_TIMEOUT = 10         # seconds for a relay to start and connect (~0.1 s normally)
GIVE_UP_AFTER = 2            # failures of one test and tool before its remaining runs are skipped

# The one-file stdlib connector that the short-connection goal compares against.
PY_CONNECTOR = (
    "import socket,sys\n"
    "s=socket.socket(socket.AF_UNIX)\n"
    "s.connect(sys.argv[1])\n"
    "s.sendall(b'ping\\n')\n"
    "sys.stdout.buffer.write(s.makefile('rb').readline())\n"
)

REFERENCE = "socat-b65536"   # the tool the goals compare against

# Goals, as ratios of vsock-proxy to the reference (see main docstring / README).
GOAL_THROUGHPUT_X = 2.0      # upload and download >= 2.0x socat -b 65536
GOAL_CPU_X = 0.5             # CPU per GB <= 0.5x socat -b 65536
GOAL_RTT_X = 1.0             # ping-pong p50 (unpinned, paired per round) <= socat -b 65536's
GOAL_SHORT_X = 1.3           # short connection <= 1.3x the stdlib Python connector
GOAL_SSH_MS = 8.0            # ssh login via --fdpass (the snippet's way) <= socat's + 8 ms
GOAL_START_UP_X = 1.25       # `--check` <= 1.25x its interpreter's `-c 'import _socket'`


# --------------------------------------------------------------------------------------------
# Server process: sink, source, echo and sshd sockets
# --------------------------------------------------------------------------------------------

def set_socket_timeouts(sock, seconds):
    """Kernel-side timeouts keep the socket blocking (no extra poll() per call) yet never hang."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_line(sock, limit=64):
    """Read one short header line byte by byte, so no payload byte is consumed with it."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte or len(line) > limit:
            raise ConnectionError("no header line")
        line += byte
    return line


def serve_sink(conn):
    """Upload target: 'R', then read '<N>\\n' and N bytes; answer 'OK <count>\\n'."""
    conn.sendall(READY)
    expected = int(recv_line(conn))
    buf = bytearray(IO_CHUNK)
    got = 0
    while got < expected:
        n = conn.recv_into(buf, min(IO_CHUNK, expected - got))
        if n == 0:
            break
        got += n
    conn.sendall(b"OK %d\n" % got)


def serve_source(conn):
    """Download origin: 'R', then read '<N>\\n' and send N bytes, then close."""
    conn.sendall(READY)
    remaining = int(recv_line(conn))
    block = memoryview(b"\xa5" * IO_CHUNK)
    while remaining:
        remaining -= conn.send(block[:min(IO_CHUNK, remaining)])


def serve_echo(conn):
    """Echo everything until EOF, then close (a relay sees EOF and exits)."""
    buf = bytearray(65536)
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            return
        conn.sendall(memoryview(buf)[:n])


def accept_loop(listener, handler):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle_connection, args=(conn, handler), daemon=True).start()


def handle_connection(conn, handler):
    with conn:
        set_socket_timeouts(conn, 120)
        try:
            handler(conn)
        except (OSError, ValueError):
            pass   # the bench reports the failure from its side


def sshd_accept_loop(listener, sshd_argv, log):
    """Like systemd's Accept=yes socket: one `sshd -i` per connection on the accepted socket."""
    while True:
        conn, _ = listener.accept()
        with conn:
            proc = subprocess.Popen(sshd_argv, stdin=conn.fileno(), stdout=conn.fileno(),
                                    stderr=log)
        threading.Thread(target=proc.wait, daemon=True).start()   # reap it


def run_server(directory, sshd_argv):
    """Entry point of the server process. Exits when its stdin (a pipe from the bench) closes."""
    handlers = {SINK: serve_sink, SOURCE: serve_source, ECHO: serve_echo}
    for name, handler in handlers.items():
        listener = listen_unix(os.path.join(directory, name))
        threading.Thread(target=accept_loop, args=(listener, handler), daemon=True).start()
    if sshd_argv:
        listener = listen_unix(os.path.join(directory, SSHD))
        log = open(os.path.join(directory, "sshd.log"), "ab")
        threading.Thread(target=sshd_accept_loop, args=(listener, sshd_argv, log),
                         daemon=True).start()
    os.write(1, b"READY\n")
    while os.read(0, 1024):   # the bench never writes; EOF means the bench is gone
        pass
    os._exit(0)


def listen_unix(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    return listener


class ServerProcess:
    """The sink/source/echo/sshd server as a separate process, so it does not share our GIL."""

    def __init__(self, directory, sshd_argv):
        argv = [sys.executable, os.path.abspath(__file__), "--serve", directory]
        if sshd_argv:
            argv += ["--sshd", shlex.join(sshd_argv)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        WATCHDOG.arm(self.proc, 15)   # only for the start-up handshake below
        line = self.proc.stdout.readline()
        WATCHDOG.disarm(self.proc)
        if line != b"READY\n":
            self.stop()
            raise RuntimeError("bench server did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc)   # also any sshd left behind
        self.proc.wait()


# --------------------------------------------------------------------------------------------
# Child processes: spawning, deadlines, CPU accounting
# --------------------------------------------------------------------------------------------

def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_gone(pgid, grace):
    """True once no live process is left in process group pgid (within grace seconds)."""
    deadline = time.monotonic() + grace
    while group_has_live_process(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def group_has_live_process(pgid):
    """Zombies do not count: orphans are reaped by PID 1, which in a container or a small VM
    init can take seconds. Reads /proc; elsewhere any member, zombie or not, counts."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False
    for pid in pids:
        try:
            with open("/proc/%s/stat" % pid, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, process_group = fields[0], int(fields[2])
        if process_group == pgid and state not in (b"Z", b"X"):
            return True
    return False


class Watchdog:
    """Kills a child's process group at its deadline, so every blocking read, write and wait
    in the bench ends. Blocking calls keep the timed paths free of extra poll() calls."""

    def __init__(self):
        self.lock = threading.Lock()
        self.deadlines = {}   # Popen -> monotonic deadline
        self.fired = set()
        self.thread = None   # started on first use: the server process never needs it

    def arm(self, proc, seconds):
        with self.lock:
            self.deadlines[proc] = time.monotonic() + seconds
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True)
                self.thread.start()

    def disarm(self, proc):
        with self.lock:
            self.deadlines.pop(proc, None)
            fired = proc in self.fired
            self.fired.discard(proc)
        return fired

    def kill_all(self):
        with self.lock:
            procs = list(self.deadlines)
        for proc in procs:
            kill_group(proc)

    def _run(self):
        while True:
            time.sleep(0.25)   # deadlines are coarse; rare wake-ups keep the GIL quiet
            now = time.monotonic()
            with self.lock:
                late = [p for p, d in self.deadlines.items() if d < now and p.returncode is None]
                for proc in late:
                    self.fired.add(proc)
                    del self.deadlines[proc]
            for proc in late:
                kill_group(proc)


WATCHDOG = Watchdog()


class Failure(Exception):
    """One measurement failed (the relay crashed, hung, or returned wrong data)."""


def spawn(argv, timeout, stderr, stdin=subprocess.PIPE, env=None):
    """Start a child with stdin/stdout pipes, as ssh starts a ProxyCommand, under a deadline.
    Its own session lets the watchdog kill it together with anything it started."""
    proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                            bufsize=0, start_new_session=True, env=env)
    WATCHDOG.arm(proc, timeout)
    return proc


def process_cpu_ns(pid):
    """CPU time (user+sys, ns) process pid has used so far, read from its CPU-time clock
    (Linux: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)), or None where there is none. Unlike
    rusage it can be read while the process runs, so start-up and warm-up stay out."""
    try:
        return time.clock_gettime_ns((~pid << 3) | 2)
    except (OSError, OverflowError):
        return None


def reap(proc, threads=()):
    """Wait for the child (bounded by the watchdog) and return its CPU seconds (user+sys).
    The RUSAGE_CHILDREN delta across this one waitpid() is exactly this child's usage:
    nothing else is reaped concurrently (the server is reaped only at the very end, and
    sshd and ssh's ProxyCommand are not our children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for thread in threads:   # they end once the child is gone (EPIPE); join before closing fds
        thread.join()
    for pipe in (proc.stdin, proc.stdout):
        if pipe:
            pipe.close()
    if WATCHDOG.disarm(proc):
        raise Failure("timed out (killed)")  # Relay adds how long
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


class Relay:
    """`with Relay(argv, timeout, stderr) as relay:` runs one child. Leaving the block
    normally waits for it to exit by itself and sets relay.cpu; an exception kills it first.
    Threads appended to relay.threads are joined before its pipes are closed. Anything the
    child left running in its session is killed afterwards; relay.lingered tells whether
    something was still there `linger_grace` seconds after the child exited."""

    def __init__(self, argv, timeout, stderr, linger_grace=0.0, **kwargs):
        self.proc = spawn(argv, timeout, stderr, **kwargs)
        self.timeout = timeout
        self.linger_grace = linger_grace
        self.threads = []
        self.cpu = None
        self.exited_at = None   # perf_counter() just after the child was reaped
        self.lingered = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            kill_group(self.proc)
            try:
                reap(self.proc, self.threads)
            except Failure as timeout:   # the real cause of whatever went wrong inside
                raise Failure("%s after %.0f s" % (timeout, self.timeout)) from exc
            return False
        self.cpu = reap(self.proc, self.threads)
        self.exited_at = time.perf_counter()
        if self.linger_grace:
            self.lingered = not group_gone(self.proc.pid, self.linger_grace)
        kill_group(self.proc)
        return False

    @property
    def stdin_fd(self):
        return self.proc.stdin.fileno()

    @property
    def stdout_fd(self):
        return self.proc.stdout.fileno()

    @property
    def returncode(self):
        return self.proc.returncode


def read_exactly(fd, n, buf):
    """Read n bytes from fd into the reusable buffer; returns the count actually read."""
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[:min(len(buf), n - got)]])
        if k == 0:
            break
        got += k
    return got


def read_line_fd(fd, limit=64):
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def write_all(fd, data, total):
    """Write `total` bytes by repeating the `data` block; a 1 MiB os.write into a pipe is one
    syscall that sleeps while the relay drains it."""
    view = memoryview(data)
    remaining = total
    while remaining:
        remaining -= os.write(fd, view[:min(len(view), remaining)])


def write_in_thread(fd, header, payload, total):
    """Upload writer. A thread, so the main thread can read the reply; errors end it quietly
    (EPIPE when the relay died -- the main thread sees and reports that)."""
    def run():
        try:
            os.write(fd, header)
            write_all(fd, payload, total)
        except OSError:
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------------------------
# Tools under test
# --------------------------------------------------------------------------------------------

class Tool:
    """A way to reach a unix socket: a relay command (argv built from the socket path),
    a direct in-process socket (argv_for is None), or the Python connector."""

    def __init__(self, key, label, argv_for):
        self.key, self.label, self.argv_for = key, label, argv_for

    @property
    def is_direct(self):
        return self.argv_for is None


def proxy_commands(proxy):
    """(relay argv_for, label). --proxy CMD gets 'unix/PATH' appended, unless it contains
    {path} or {target}: then it is a stand-in template (e.g. socat), which has no --fdpass
    mode and no --ssh-config snippet."""
    base = shlex.split(proxy) if proxy else DEFAULT_PROXY
    if is_template(proxy):
        def relay(path):
            return [a.format(path=path, target="unix/" + path) for a in base]
        return relay, "vsock-proxy (stand-in)"
    return lambda path: base + ["unix/" + path], "vsock-proxy"


def is_template(proxy):
    return bool(proxy) and ("{path}" in proxy or "{target}" in proxy)


def check_proxy(proxy, workdir):
    """Return None if the proxy answers --version, else a one-line reason."""
    if proxy is None and not os.path.exists(DEFAULT_PROXY[-1]):
        return "%s does not exist" % DEFAULT_PROXY[-1]
    if is_template(proxy):
        return None
    argv = (shlex.split(proxy) if proxy else DEFAULT_PROXY) + ["--version"]
    return command_output(argv, workdir)[1]


def command_output(argv, workdir):
    """(stdout, None) if argv runs and exits 0, else (None, a one-line reason)."""
    try:
        out = subprocess.run(argv, capture_output=True, timeout=15, cwd=workdir,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "%s: %s" % (shlex.join(argv), e)
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace").strip().splitlines()
        return None, "%s exited %d: %s" % (shlex.join(argv), out.returncode,
                                           err[-1] if err else "")
    return out.stdout, None


def make_tools(proxy_relay, proxy_label, proxy_ok):
    socat_b = lambda path: ["socat", "-b", "65536", "-", "UNIX-CONNECT:" + path]
    socat = lambda path: ["socat", "-", "UNIX-CONNECT:" + path]
    tools = []
    if proxy_ok:
        tools.append(Tool("vsock-proxy", proxy_label, proxy_relay))
    tools += [Tool("socat-b65536", "socat -b 65536", socat_b),
              Tool("socat", "socat", socat),
              Tool("direct", "direct socket (limit)", None)]
    return tools


# --------------------------------------------------------------------------------------------
# Measurements. Each returns a dict of numbers or raises Failure.
# --------------------------------------------------------------------------------------------

class Bench:
    """The four relay measurements against the server's sockets in `directory`. Every method
    takes a Tool and returns one sample (a dict) or raises Failure."""

    def __init__(self, directory, size, pings, log_dir, server_pid=None):
        self.dir = directory
        self.server_pid = server_pid
        self.size = size
        self.pings = pings
        self.log_dir = log_dir
        self.payload = b"\x5a" * IO_CHUNK
        self.buf = bytearray(IO_CHUNK)
        self.transfer_timeout = 30 + size / 20e6   # generous: a 20 MB/s relay still finishes

    def path(self, name):
        return os.path.join(self.dir, name)

    def connect_direct(self, name):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        set_socket_timeouts(sock, self.transfer_timeout)
        sock.connect(self.path(name))
        return sock

    def relay(self, tool, socket_name, timeout, stderr):
        return Relay(tool.argv_for(self.path(socket_name)), timeout, stderr)

    def wait_ready(self, relay):
        """The server's ready byte: the relay has started and connected. Only now does the
        transfer get its long deadline; a relay that never connects is killed sooner."""
        expect(os.read(relay.stdout_fd, 1), READY, "ready byte")
        WATCHDOG.arm(relay.proc, self.transfer_timeout)

    # ---- throughput -------------------------------------------------------------------------

    def upload(self, tool):
        header = b"%d\n" % self.size
        if tool.is_direct:
            with self.connect_direct(SINK) as sock:
                expect(sock.recv(1), READY, "ready byte")
                cpu0, start = machine_cpu_jiffies(), time.perf_counter()
                sock.sendall(header)
                write_all(sock.fileno(), self.payload, self.size)
                reply = sock.makefile("rb").readline()
                elapsed, cpu1 = time.perf_counter() - start, machine_cpu_jiffies()
            expect(reply, b"OK %d\n" % self.size, "sink byte count")
            return throughput_result(self.size, elapsed, busy=busy_fraction(cpu0, cpu1))
        with stderr_capture(self.log_dir, tool.key) as err:
            with self.relay(tool, SINK, CONNECT_TIMEOUT, err) as relay:
                self.wait_ready(relay)
                cpu0, start = machine_cpu_jiffies(), time.perf_counter()
                relay.threads.append(
                    write_in_thread(relay.stdin_fd, header, self.payload, self.size))
                reply = read_line_fd(relay.stdout_fd)
                elapsed, cpu1 = time.perf_counter() - start, machine_cpu_jiffies()
                expect(reply, b"OK %d\n" % self.size, "sink byte count")
                relay.threads[0].join()   # done: the sink has counted every byte
                relay.proc.stdin.close()  # EOF; the sink has closed too, so the relay exits
        return throughput_result(self.size, elapsed, relay, busy_fraction(cpu0, cpu1))

    def download(self, tool):
        header = b"%d\n" % self.size
        if tool.is_direct:
            with self.connect_direct(SOURCE) as sock:
                expect(sock.recv(1), READY, "ready byte")
                cpu0, start = machine_cpu_jiffies(), time.perf_counter()
                sock.sendall(header)
                got = read_exactly(sock.fileno(), self.size, self.buf)
                elapsed, cpu1 = time.perf_counter() - start, machine_cpu_jiffies()
            check_count(got, self.size)
            return throughput_result(self.size, elapsed, busy=busy_fraction(cpu0, cpu1))
        with stderr_capture(self.log_dir, tool.key) as err:
            with self.relay(tool, SOURCE, CONNECT_TIMEOUT, err) as relay:
                self.wait_ready(relay)
                cpu0, start = machine_cpu_jiffies(), time.perf_counter()
                os.write(relay.stdin_fd, header)
                got = read_exactly(relay.stdout_fd, self.size, self.buf)
                elapsed, cpu1 = time.perf_counter() - start, machine_cpu_jiffies()
                check_count(got, self.size)
                relay.proc.stdin.close()   # the source has closed; now the relay may exit
                if read_exactly(relay.stdout_fd, 1, self.buf):   # waits for EOF
                    raise Failure("more bytes than the source sent")
        return throughput_result(self.size, elapsed, relay, busy_fraction(cpu0, cpu1))

    # ---- latency ----------------------------------------------------------------------------

    def pingpong(self, tool):
        """1-byte round trips through the relay to the echo server, after a warm-up; the
        bench, the server and the relay free to run on any CPU, as ssh, a proxy and a VM do."""
        return self._pingpong(tool)

    def pingpong_pinned(self, tool):
        """The same with all three on one CPU, where placement noise is gone."""
        with one_cpu_for(self.server_pid):
            return self._pingpong(tool)

    def _pingpong(self, tool):
        warmup = max(50, self.pings // 10)
        if tool.is_direct:
            with self.connect_direct(ECHO) as sock:
                samples = ping_loop(sock.fileno(), sock.fileno(), warmup, self.pings)
        else:
            with stderr_capture(self.log_dir, tool.key) as err:
                deadline = CONNECT_TIMEOUT + self.pings / 1000   # 1 ms per round trip at worst
                with self.relay(tool, ECHO, deadline, err) as relay:
                    ping_loop(relay.stdin_fd, relay.stdout_fd, warmup, 0)
                    cpu_before = process_cpu_ns(relay.proc.pid)
                    samples = ping_loop(relay.stdin_fd, relay.stdout_fd, 0, self.pings)
                    cpu_after = process_cpu_ns(relay.proc.pid)
                    relay.proc.stdin.close()
                    read_exactly(relay.stdout_fd, 1, self.buf)   # wait for EOF
        samples.sort()
        result = {"rtt_p50_us": percentile(samples, 0.50) / 1e3,
                  "rtt_p99_us": percentile(samples, 0.99) / 1e3}
        if not tool.is_direct and cpu_before is not None and cpu_after is not None:
            result["rtt_cpu_us"] = (cpu_after - cpu_before) / self.pings / 1e3
        return result

    # ---- short connection -------------------------------------------------------------------

    def short_connection(self, tool, connector=False):
        """Wall time: spawn, connect, one echo line, exit. A relay is told to finish the way
        a finished client does it: EOF on its stdin (the echo server then closes too)."""
        if tool.is_direct:
            start = time.perf_counter()
            with self.connect_direct(ECHO) as sock:
                sock.sendall(ECHO_LINE)
                line = sock.makefile("rb").readline()
            elapsed = time.perf_counter() - start
            expect(line, ECHO_LINE, "echo")
            return {"short_ms": elapsed * 1e3}
        with stderr_capture(self.log_dir, tool.key) as err:
            start = time.perf_counter()
            with self.relay(tool, ECHO, CONNECT_TIMEOUT, err) as relay:
                if not connector:
                    os.write(relay.stdin_fd, ECHO_LINE)
                line = read_line_fd(relay.stdout_fd)
                relay.proc.stdin.close()
                rest = read_exactly(relay.stdout_fd, 1, self.buf)   # EOF: it is done
            elapsed = relay.exited_at - start
            expect(line, ECHO_LINE, "echo")
            if rest:
                raise Failure("unexpected output after the echo")
            if relay.returncode != 0:
                raise Failure("exit status %d after the echo" % relay.returncode)
        return {"short_ms": elapsed * 1e3, "short_cpu_ms": relay.cpu * 1e3}


class stderr_capture:
    """The child's stderr goes to a file; a failure inside the block gets its last line
    appended, so the report says *why* a relay failed."""

    def __init__(self, log_dir, key):
        self.file = open(os.path.join(log_dir, key + ".stderr"), "w+b")

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, tb):
        with self.file:
            if exc_type is None or not issubclass(exc_type, (Failure, OSError, ValueError)):
                return False
            self.file.seek(0)
            lines = self.file.read()[-2000:].decode(errors="replace").strip().splitlines()
        if lines:
            raise Failure("%s; its stderr: %s" % (exc or exc_type.__name__,
                                                  " / ".join(lines[-2:]))) from exc
        return False


def check_count(got, wanted):
    if got != wanted:
        raise Failure("transferred %d of %d bytes" % (got, wanted))


def expect(got, wanted, what):
    if got != wanted:
        raise Failure("bad %s: %r (wanted %r)" % (what, got[:40], wanted[:40]))


def machine_cpu_jiffies():
    """(busy, total) CPU time of the whole machine from /proc/stat, or None off Linux.
    Tells whether a transfer was limited by the relay or by the machine's cores: the bench,
    the server and the relay all copy data and share them."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    total = sum(fields[:8])   # guest time is already counted in user
    return total - idle, total


def busy_fraction(before, after):
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def throughput_result(size, elapsed, relay=None, busy=None):
    result = {"mbps": size / elapsed / 1e6, "seconds": elapsed, "bytes": size,
              "machine_busy": busy}
    if relay is not None:
        result["cpu_s"] = relay.cpu
        result["cpu_per_gb"] = relay.cpu / (size / GB)
        result["exit_status"] = relay.returncode
    return result


@contextlib.contextmanager
def one_cpu_for(server_pid):
    """Run the latency test with the bench, the server (every thread) and the relay (a child
    started inside, which inherits it) on one CPU. Spread over two cores, where the scheduler
    happens to put the three processes of a round trip changed the median two-fold between
    rounds and tools (about 30 or 70 us for the same relay); on one CPU a round trip costs
    what its hops cost."""
    if not hasattr(os, "sched_setaffinity") or server_pid is None:
        yield
        return
    before = {}
    for task in [0] + [int(t) for t in os.listdir("/proc/%d/task" % server_pid)]:
        try:
            before[task] = os.sched_getaffinity(task)
        except ProcessLookupError:
            pass       # a connection's thread that has just ended
    cpu = min(before[0])
    try:
        for task in before:
            try:
                os.sched_setaffinity(task, {cpu})
            except ProcessLookupError:
                pass
        yield
    finally:
        for task, cpus in before.items():
            try:
                os.sched_setaffinity(task, cpus)
            except OSError:
                pass   # a server thread that has ended


def ping_loop(wfd, rfd, warmup, count):
    """Blocking 1-byte write/read pairs; returns round-trip times in ns (timed part only)."""
    write, read, clock = os.write, os.read, time.perf_counter_ns
    for _ in range(warmup):
        write(wfd, b"x")
        if read(rfd, 1) != b"x":
            raise Failure("ping-pong: lost the echo during warm-up")
    samples = []
    for _ in range(count):
        t0 = clock()
        write(wfd, b"x")
        got = read(rfd, 1)
        samples.append(clock() - t0)
        if got != b"x":
            raise Failure("ping-pong: lost the echo")
    return samples


def percentile(sorted_values, q):
    """Nearest-rank percentile of an already sorted list."""
    rank = max(1, int(-(-q * len(sorted_values) // 1)))
    return sorted_values[rank - 1]


# --------------------------------------------------------------------------------------------
# The --ssh-config snippet's ProxyCommand, per install route
# --------------------------------------------------------------------------------------------

LAUNCHER = os.path.join(ROOT, "vsock-proxy")


def pip_route(proxy, proxy_ok):
    """(command argv, label) of the relay under test as users installed it (pip's command
    beside this interpreter, or --proxy CMD), or None for a stand-in or a broken proxy."""
    if not proxy_ok or is_template(proxy):
        return None
    command = shlex.split(proxy) if proxy else DEFAULT_PROXY
    if command == [INSTALLED]:
        return command, "pip (bin/vsock-proxy)"
    return command, "vsock-proxy under test (`%s`)" % shlex.join(command)


def compile_module():
    """What a system-wide install does beside the launcher: cache vsock_proxy.py's byte code,
    so the launcher imports it instead of compiling 8 ms of source at every start."""
    import py_compile
    py_compile.compile(PROXY_SCRIPT, doraise=False)


class Snippet:
    """The first ProxyCommand that `COMMAND --ssh-config` prints: what ssh runs at every login
    through the snippet. `line` is the value as printed; `words` its shell words, with ssh's
    '%n', '%p' and '%%' still in them. `problem` says why there is none."""

    def __init__(self, key, label, argv, workdir):
        self.key, self.label, self.argv = key, label, argv
        self.line, self.words = None, None
        stdout, self.problem = command_output(argv, workdir)
        if self.problem:
            return
        self.line = proxy_command_of(os.fsdecode(stdout))
        if self.line is None:
            self.problem = "%s printed no ProxyCommand line" % shlex.join(argv)
            return
        try:
            self.words = shlex.split(self.line)
        except ValueError as e:
            self.problem = "cannot split its ProxyCommand (%s): %s" % (e, self.line)
            return
        if "%n" not in self.words:
            self.problem = "no '%%n' word in its ProxyCommand: %s" % self.line
            self.words = None

    def ssh_command(self, socket_path, fdpass=True):
        """The ProxyCommand for `ssh -o`, '%n' replaced by the target (ssh expands '%p' and
        '%%' as it would in the snippet); without --fdpass it is the relay."""
        target = ssh_escape("unix/" + socket_path)
        words = [target if w == "%n" else w for w in self.words
                 if fdpass or w != "--fdpass"]
        return shlex.join(words)

    def check_argv(self, socket_path):
        """The same command run directly (no ssh, no shell) as `--check unix/PATH` in place of
        `--fdpass '%n' %p`: start, connect, exit. ssh's '%%' becomes '%' as ssh would make it."""
        argv = []
        for word in self.words:
            if word == "%n":
                argv.append("unix/" + socket_path)
            elif word == "--fdpass":
                argv.append("--check")
            elif word != "%p":
                argv.append(word.replace("%%", "%"))
        if "--check" not in argv:
            argv.insert(argv.index("unix/" + socket_path), "--check")
        return argv

    def interpreter(self):
        """The Python the command starts: its first word, or the one that program's '#!'
        line names."""
        if not self.words:
            return None
        first = self.words[0].replace("%%", "%")
        return first if "python" in os.path.basename(first) else interpreter_of(first)


def proxy_command_of(text):
    """The value of the first ProxyCommand line in an ssh_config text (keyword case-insensitive,
    'ProxyCommand cmd' or 'ProxyCommand=cmd'), or None."""
    for line in text.splitlines():
        match = re.match(r"\s*ProxyCommand(?:\s*=\s*|\s+)(\S.*?)\s*$", line, re.IGNORECASE)
        if match:
            return match.group(1)
    return None


def ssh_escape(text):
    """ssh expands %-tokens in a ProxyCommand; a literal '%' is '%%'."""
    return text.replace("%", "%%")


def snippets_for(proxy, proxy_ok, workdir):
    """{route key: Snippet}: 'pip' (the relay under test, as the README's per-user install
    gives it; absent for a stand-in) and 'system' (the checkout's launcher beside vsock_proxy.py
    with its byte code, run by this interpreter: the system-wide install)."""
    snippets = {}
    pip = pip_route(proxy, proxy_ok)
    if pip:
        snippets["pip"] = Snippet("pip", pip[1], pip[0] + ["--ssh-config"], workdir)
    snippets["system"] = Snippet("system", "system-wide (vsock_proxy.py with its byte code)",
                                 [sys.executable, LAUNCHER, "--ssh-config"], workdir)
    return snippets


# --------------------------------------------------------------------------------------------
# Start-up per install route
# --------------------------------------------------------------------------------------------

FLOOR_CODE = "import _socket"    # the least a Python ProxyCommand does: start, load _socket
NO_SITE = ("-I", "-S")           # a floor without site, environment and user site-packages


def interpreter_of(program):
    """The interpreter a script's '#!' line names (pip writes the venv's python there), or
    None for a binary, a stand-in, or an '#!/usr/bin/env' line."""
    try:
        with open(program, "rb") as f:
            first = f.readline(300)
    except OSError:
        return None
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    return words[0] if words and "python" in os.path.basename(words[0]) else None


class Route:
    """One install route of the start-up test: argv_for(socket path) runs `--check unix/PATH`
    (start, connect, close, exit). The goal compares it with `interpreter` running
    `*floor_flags -c 'import _socket'` (no interpreter: no ratio)."""

    def __init__(self, key, label, argv_for, interpreter, floor_flags=(), judged=True):
        self.key, self.label, self.argv_for = key, label, argv_for
        self.interpreter, self.floor_flags = interpreter, tuple(floor_flags)
        self.judged = judged       # an install route the goal applies to

    @property
    def floor(self):
        return floor_key(self.interpreter, self.floor_flags) if self.interpreter else None


def start_up_routes(proxy, proxy_ok, snippets):
    """A Route per way of installing vsock-proxy, plus the pip route's snippet command, which
    ssh runs as it is at every login: against the interpreter's floor without site (-I -S),
    the least that command's own interpreter can do."""
    check = lambda command: lambda path: command + ["--check", "unix/" + path]
    routes = []
    pip = pip_route(proxy, proxy_ok)
    if pip:
        command, label = pip
        interpreter = interpreter_of(command[0]) if len(command) == 1 else None
        routes.append(Route("pip", label, check(command), interpreter))
    snippet = snippets.get("pip")
    if snippet and snippet.words:
        routes.append(Route("snippet", "%s: the snippet's ProxyCommand, `--check` in place of "
                            "`--fdpass '%%n' %%p`" % snippet.label, snippet.check_argv,
                            snippet.interpreter(), NO_SITE))
    routes.append(Route("launcher", "system-wide: the launcher beside vsock_proxy.py "
                        "(byte code cached)", check([sys.executable, LAUNCHER]), sys.executable))
    # Shown, not judged: `python3 vsock_proxy.py` typed by hand, compiled at every start;
    # no install route's snippet runs it so.
    routes.append(Route("script", "`python3 vsock_proxy.py`, a script: compiled at every "
                        "start (for reference)", check([sys.executable, PROXY_SCRIPT]),
                        sys.executable, judged=False))
    return routes


def floor_key(interpreter, flags=()):
    return "floor " + " ".join((interpreter,) + tuple(flags))


def run_start_up(routes, socket_path, runs, results, progress):
    """Wall time from spawn to exit, every command and floor interleaved, order rotated."""
    compile_module()
    commands = [(r.key, r.argv_for(socket_path)) for r in routes]
    floors = [(r.interpreter, r.floor_flags) for r in routes if r.interpreter]
    floors.append((sys.executable, NO_SITE))   # the bench's python without site, for reference
    for interpreter, flags in dict.fromkeys(floors):
        commands.append((floor_key(interpreter, flags),
                         [interpreter, *flags, "-c", FLOOR_CODE]))
    commands.append(("socat", ["socat", "-u", "/dev/null", "UNIX-CONNECT:" + socket_path]))
    for i in range(runs + 1):          # the first run of each only warms the caches
        for key, argv in rotated(commands, i):
            results.record("start-up", key, wall_ms, argv, keep=i > 0, round=i)
    progress("start-up runs done")


def wall_ms(argv):
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=10)
    except subprocess.TimeoutExpired:
        raise Failure("no exit within 10 s")
    elapsed = (time.perf_counter() - start) * 1e3
    if done.returncode != 0:
        raise Failure("exit status %d: %s" % (done.returncode,
                                              done.stderr.decode(errors="replace").strip()))
    return {"wall_ms": elapsed}


def start_up_ratios(routes, results):
    """{route key: median over runs of (command / its interpreter's floor in the same run)}."""
    return {r.key: results.paired_ratio("start-up", r.key, r.floor, "wall_ms")
            if r.floor else None for r in routes}


def start_up_table(routes, results, ratios):
    median = lambda key: results.median("start-up", key, "wall_ms")
    lines = ["| install route | `--check` ms | its interpreter's floor | floor ms | ratio |",
             "|---|---:|---|---:|---:|"]
    for r in routes:
        floor = "`%s -c 'import _socket'`" % " ".join(("python",) + r.floor_flags)
        lines.append("| %s | %s | %s | %s | %s |" % (
            r.label, fmt(median(r.key), 1), floor if r.floor else "—",
            fmt(median(r.floor), 1) if r.floor else "—",
            "—" if ratios[r.key] is None else "%.2fx" % ratios[r.key]))
    lines.append("| socat connecting (`socat -u /dev/null UNIX-CONNECT:...`) | %s | — | — | — |"
                 % fmt(median("socat"), 1))
    lines.append("| the bench's python, for reference | — | `python -I -S -c 'import _socket'`"
                 " | %s | — |" % fmt(median(floor_key(sys.executable, NO_SITE)), 1))
    return lines


# --------------------------------------------------------------------------------------------
# ssh login through a real sshd -i
# --------------------------------------------------------------------------------------------

class SshFixture:
    """Throw-away keys and configs for `sshd -i` (one per connection, behind sshd.sock) and a
    matching `ssh -F` client config with host alias 'bench'."""

    def __init__(self, directory):
        self.dir = directory
        self.ssh = shutil.which("ssh")
        self.sshd = shutil.which("sshd") or next(
            (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None)
        self.keygen = shutil.which("ssh-keygen")

    def missing(self):
        """A reason why the ssh section cannot run, or None."""
        for name, path in (("ssh", self.ssh), ("sshd", self.sshd), ("ssh-keygen", self.keygen)):
            if not path:
                return "%s not found" % name
        if not os.path.isdir("/run/sshd"):
            # sshd's privilege separation needs it (Debian creates it at service start).
            try:
                os.makedirs("/run/sshd", mode=0o755)
            except OSError as e:
                return "/run/sshd missing and cannot be created: %s" % e
        return None

    def create(self):
        d = self.dir
        for key in ("host_key", "user_key"):
            subprocess.run([self.keygen, "-q", "-t", "ed25519", "-N", "", "-f",
                            os.path.join(d, key)], check=True, timeout=30,
                           stdin=subprocess.DEVNULL)
        shutil.copy(os.path.join(d, "user_key.pub"), os.path.join(d, "authorized_keys"))
        with open(os.path.join(d, "host_key.pub")) as f:
            host_pub = " ".join(f.read().split()[:2])
        write_file(os.path.join(d, "known_hosts"), "bench %s\n" % host_pub)
        write_file(os.path.join(d, "sshd_config"), "\n".join([
            "HostKey %s/host_key" % d,
            "AuthorizedKeysFile %s/authorized_keys" % d,
            "StrictModes no", "UsePAM no", "PidFile none",
            "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PrintMotd no", "PrintLastLog no", "UseDNS no", "X11Forwarding no",
            "Subsystem sftp internal-sftp", "LogLevel ERROR", ""]))
        write_file(os.path.join(d, "ssh_config"), "\n".join([
            "Host bench",
            "  User %s" % current_user(),
            "  IdentityFile %s/user_key" % d,
            "  IdentitiesOnly yes", "  IdentityAgent none",
            "  HostKeyAlias bench",
            "  UserKnownHostsFile %s/known_hosts" % d, "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes", "  UpdateHostKeys no", "  CheckHostIP no",
            "  BatchMode yes", "  ControlMaster no", "  ControlPath none",
            "  ConnectTimeout 10",   # bounds the wait for the banner when a proxy hangs
            # The default post-quantum kex (sntrup761x25519) costs ~140 ms of CPU per login
            # on the dev VM, and its spread hides the few ms between ProxyCommands.
            "  KexAlgorithms curve25519-sha256",
            "  LogLevel ERROR", ""]))

    def sshd_argv(self):
        return [self.sshd, "-i", "-e", "-f", os.path.join(self.dir, "sshd_config")]

    def login_argv(self, proxy_command, fdpass):
        """The sftp subsystem, not a command: sshd serves it in-process (internal-sftp), so
        no login shell runs (root's ~/.bashrc took ~115 ms on the dev VM), and sftp-server
        ends the session at the EOF of ssh's stdin (/dev/null)."""
        argv = [self.ssh, "-F", os.path.join(self.dir, "ssh_config"),
                "-o", "ProxyCommand=" + proxy_command]
        if fdpass:
            argv += ["-o", "ProxyUseFdpass=yes"]
        return argv + ["-s", "bench", "sftp"]


def current_user():
    import pwd
    return pwd.getpwuid(os.getuid()).pw_name


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def ssh_login(fixture, variant, log_dir):
    """Wall time of `ssh -F cfg -o ProxyCommand=... -s bench sftp`, in ms."""
    argv = fixture.login_argv(variant["command"], variant["fdpass"])
    env = dict(os.environ, SHELL="/bin/sh")   # ssh runs the ProxyCommand via $SHELL -c
    env.pop("SSH_AUTH_SOCK", None)
    with stderr_capture(log_dir, "ssh-" + variant["key"]) as err:
        start = time.perf_counter()
        # ssh HUPs a relaying ProxyCommand as it exits and does not wait for it: a proxy
        # that is still there a second later is a leak worth reporting.
        with Relay(argv, 30, err, linger_grace=1.0, stdin=subprocess.DEVNULL, env=env) as ssh:
            output = read_exactly(ssh.stdout_fd, 1, bytearray(1))   # EOF when ssh exits
        elapsed = ssh.exited_at - start
        if ssh.returncode != 0 or output:
            raise Failure("ssh exited %d" % ssh.returncode)
    return {"login_ms": elapsed * 1e3, "proxy_lingered": ssh.lingered}


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------

class Results:
    """Samples and errors per (section, tool key). After GIVE_UP_AFTER errors a (section, tool)
    is skipped, so a broken relay costs a few timeouts, not one per remaining run."""

    def __init__(self):
        self.samples = {}
        self.errors = {}
        self.skipped = {}

    def record(self, section, key, func, *args, keep=True, round=None, rep=None):
        """Run func(*args); keep its result as a sample (tagged with its round, and its
        repetition within the round if a section repeats) unless keep is False (warm-up runs,
        whose errors still count)."""
        if len(self.errors.get((section, key), ())) >= GIVE_UP_AFTER:
            self.skipped[(section, key)] = self.skipped.get((section, key), 0) + 1
            return None
        try:
            value = func(*args)
        except (Failure, OSError, ValueError) as e:
            self.errors.setdefault((section, key), []).append(str(e) or type(e).__name__)
            return None
        if keep:
            if round is not None:
                value["round"] = round
            if rep is not None:
                value["rep"] = rep
            self.samples.setdefault((section, key), []).append(value)
        return value

    def by_turn(self, section, key, field):
        return {turn(s): s[field] for s in self.samples.get((section, key), ())
                if s.get(field) is not None and "round" in s}

    def median(self, section, key, field):
        values = self.values(section, key, field)
        return statistics.median(values) if values else None

    def values(self, section, key, field):
        return [s[field] for s in self.samples.get((section, key), [])
                if s.get(field) is not None]

    def paired_ratio(self, section, key, reference, field):
        """Median over turns (a round, and its repetition where a section repeats) of key's
        value / reference's value in the same turn. Turns move together (the machine's state, where the scheduler puts the processes: on a
        2-core VM a relay's RTT p50 moves between ~30 and ~70 us from round to round, and
        the other tools with it), so the ratio within a turn is steadier than the ratio of
        two medians."""
        ref = self.by_turn(section, reference, field)
        ratios = [s[field] / ref[turn(s)] for s in self.samples.get((section, key), ())
                  if s.get(field) is not None and ref.get(turn(s))]
        return statistics.median(ratios) if ratios else None

    def paired_difference(self, section, key, reference, field):
        """Median over turns of key's value minus reference's value in the same turn."""
        ref = self.by_turn(section, reference, field)
        differences = [s[field] - ref[turn(s)] for s in self.samples.get((section, key), ())
                       if s.get(field) is not None and turn(s) in ref]
        return statistics.median(differences) if differences else None


def turn(sample):
    """Which samples of different tools ran side by side: the same round (and repetition)."""
    return sample.get("round"), sample.get("rep")


def rotated(items, round_index):
    """Round-robin start position, so no tool always runs first (or right after another)."""
    k = round_index % len(items)
    return items[k:] + items[:k]


def run_rounds(bench, tools, connector, rounds, short_reps, rtt_reps, sections, results,
               progress):
    """Each sample is tagged with its round, so that tools can be compared within a round.
    Round trips are repeated rtt_reps times per round, each repetition interleaved and paired
    on its own: a pair of round-trip runs differs by several percent from turn to turn, and
    a goal about a few percent needs many pairs."""
    for r in range(rounds):
        started = time.monotonic()
        tests = []
        if "transfer" in sections:
            tests += [("upload", bench.upload, 1), ("download", bench.download, 1)]
        if "rtt" in sections:
            tests += [("rtt", bench.pingpong, rtt_reps),
                      ("rtt-pinned", bench.pingpong_pinned, rtt_reps)]
        for offset, (section, test, reps) in enumerate(tests):
            for rep in range(reps):
                for tool in rotated(tools, r + offset + rep):
                    results.record(section, tool.key, test, tool, round=r, rep=rep)
        if "short" in sections:
            short_tools = tools + [connector]
            for rep in range(short_reps):
                for tool in rotated(short_tools, r + rep):
                    results.record("short", tool.key, bench.short_connection, tool,
                                   tool is connector, round=r)
        progress("round %d/%d done in %.1f s" % (r + 1, rounds, time.monotonic() - started))


def warm_up(bench, tools, connector, sections, results):
    """Page in binaries and the page cache before anything is recorded (samples discarded;
    a failure here already counts against that tool's test)."""
    small = Bench(bench.dir, min(bench.size, 4 * MiB), 100, bench.log_dir)
    for tool in tools:
        if "transfer" in sections:
            results.record("upload", tool.key, small.upload, tool, keep=False)
            results.record("download", tool.key, small.download, tool, keep=False)
        results.record("short", tool.key, small.short_connection, tool, keep=False)
    results.record("short", connector.key, small.short_connection, connector, True, keep=False)


def run_ssh(fixture, variants, logins, results, log_dir, progress):
    compile_module()   # the system-wide route imports vsock_proxy.py's byte code
    for variant in variants:   # one warm-up login each, discarded
        results.record("ssh", variant["key"], ssh_login, fixture, variant, log_dir, keep=False)
    for i in range(logins):
        for variant in rotated(variants, i):
            results.record("ssh", variant["key"], ssh_login, fixture, variant, log_dir,
                           round=i)
    progress("ssh logins done")


# The least any Python ProxyCommand can cost with --fdpass: start the interpreter without site,
# connect, hand the socket to ssh, exit without teardown. Run as `python -I -S FILE PATH`.
FDPASS_FLOOR = """\
import _socket, sys, posix
s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
s.connect(sys.argv[1])
_socket.socket(fileno=1).sendmsg([b"\\0"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                             s.fileno().to_bytes(4, sys.byteorder))])
posix._exit(0)
"""


def ssh_variants(snippets, proxy_relay, proxy_label, proxy_ok, socket_path, workdir):
    """The ProxyCommands the ssh section logs in through, as {key, label, command (the string
    given to ssh -o ProxyCommand=), fdpass, snippet (the line it came from, or None)}: each
    install route's --ssh-config snippet as ssh runs it, the Python floor, the relay under
    test (the pip route's snippet without --fdpass) and socat."""
    variants = []

    def add(key, label, command, fdpass, snippet=None):
        variants.append({"key": key, "label": label, "command": command, "fdpass": fdpass,
                         "snippet": snippet.line if snippet else None,
                         "route": snippet.label if snippet else None})
    pip, system = snippets.get("pip"), snippets.get("system")
    if pip and pip.words:
        add("snippet-pip", "%s: the snippet (--fdpass)" % pip.label,
            pip.ssh_command(socket_path), True, pip)
    if system and system.words:
        add("snippet-system", "%s: the snippet (--fdpass)" % system.label,
            system.ssh_command(socket_path), True, system)
    floor_file = os.path.join(workdir, "fdpass_floor.py")
    write_file(floor_file, FDPASS_FLOOR)
    add("python-floor", "Python floor: a minimal fdpass, `python -I -S` (the least any "
        "Python ProxyCommand can cost)",
        ssh_escape(shlex.join([sys.executable, "-I", "-S", floor_file, socket_path])), True)
    if pip and pip.words:
        add("vsock-proxy", "%s: the snippet without --fdpass (relay)" % pip.label,
            pip.ssh_command(socket_path, fdpass=False), False, pip)
    elif proxy_ok:   # a stand-in, or a proxy whose --ssh-config failed: its plain relay
        add("vsock-proxy", "%s, relay" % proxy_label,
            ssh_escape(shlex.join(proxy_relay(socket_path))), False)
    add("socat", "socat (relay)",
        ssh_escape(shlex.join(["socat", "-", "UNIX-CONNECT:" + socket_path])), False)
    return variants


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def fmt(value, digits=0):
    if value is None:
        return "—"
    return "%.*f" % (digits, value)


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize(results, tools, connector):
    """Median per tool and metric: throughput and CPU per round, RTT per-round percentiles,
    short connections over all samples.

    CPU per GB is marginal: the relay's median CPU for a short connection (start-up, connect,
    one echo, exit) is subtracted from each transfer's CPU first. Otherwise a fixed ~40 ms
    Python start-up would count as per-GB cost and the figure would depend on --size.
    The raw figure (start-up included) is kept as *_cpu_per_gb_raw."""
    rows = {}
    for tool in tools + [connector]:
        k = tool.key
        fixed_ms = results.median("short", k, "short_cpu_ms")
        rows[k] = {
            "label": tool.label,
            "upload_mbps": results.median("upload", k, "mbps"),
            "download_mbps": results.median("download", k, "mbps"),
            "upload_cpu_per_gb": marginal_cpu_per_gb(results, "upload", k, fixed_ms),
            "download_cpu_per_gb": marginal_cpu_per_gb(results, "download", k, fixed_ms),
            "upload_cpu_per_gb_raw": results.median("upload", k, "cpu_per_gb"),
            "download_cpu_per_gb_raw": results.median("download", k, "cpu_per_gb"),
            "startup_cpu_ms": fixed_ms,
            "upload_machine_busy": results.median("upload", k, "machine_busy"),
            "download_machine_busy": results.median("download", k, "machine_busy"),
            "rtt_p50_us": results.median("rtt", k, "rtt_p50_us"),
            "rtt_p99_us": results.median("rtt", k, "rtt_p99_us"),
            "rtt_cpu_us": results.median("rtt", k, "rtt_cpu_us"),
            "rtt_pinned_p50_us": results.median("rtt-pinned", k, "rtt_p50_us"),
            "rtt_pinned_p99_us": results.median("rtt-pinned", k, "rtt_p99_us"),
            # Paired: this tool / socat -b 65536 within each turn, then the median.
            "rtt_p50_x_socat_b65536": results.paired_ratio("rtt", k, REFERENCE, "rtt_p50_us"),
            "rtt_pinned_p50_x_socat_b65536": results.paired_ratio("rtt-pinned", k, REFERENCE,
                                                                  "rtt_p50_us"),
            "short_ms": results.median("short", k, "short_ms"),
        }
    return rows


def marginal_cpu_per_gb(results, section, key, fixed_ms):
    samples = [s for s in results.samples.get((section, key), []) if "cpu_s" in s]
    if not samples or fixed_ms is None:
        return None
    return statistics.median(max(0.0, s["cpu_s"] - fixed_ms / 1e3) / (s["bytes"] / GB)
                             for s in samples)


METRICS = [  # (field, header, digits, higher is better)
    ("upload_mbps", "upload MB/s", 0, True),
    ("download_mbps", "download MB/s", 0, True),
    ("upload_cpu_per_gb", "CPU s/GB up", 3, False),
    ("download_cpu_per_gb", "CPU s/GB down", 3, False),
    ("startup_cpu_ms", "start+exit CPU ms", 1, False),
    ("rtt_p50_us", "RTT p50 µs", 1, False),
    ("rtt_p99_us", "RTT p99 µs", 1, False),
    ("rtt_pinned_p50_us", "RTT p50 µs, 1 CPU", 1, False),
    ("rtt_cpu_us", "relay CPU µs per round trip", 1, False),
    ("short_ms", "short conn ms", 1, False),
]


def main_table(rows, order):
    lines = ["| relay | " + " | ".join(h for _, h, _, _ in METRICS) + " |",
             "|---|" + "---:|" * len(METRICS)]
    for key in order:
        row = rows[key]
        cells = [fmt(row[f], d) for f, _, d, _ in METRICS]
        lines.append("| %s | %s |" % (row["label"], " | ".join(cells)))
    return lines


def ratio_table(rows, results, subject, references):
    refs = [r for r in references if r in rows]
    lines = ["| metric (better) | " + " | ".join("%s / %s" % (rows[subject]["label"],
                                                             rows[r]["label"]) for r in refs) + " |",
             "|---|" + "---:|" * len(refs)]
    for field, header, _, higher in METRICS:
        cells = [fmt(ratio(rows[subject][field], rows[r][field]), 2) + "x" if
                 ratio(rows[subject][field], rows[r][field]) is not None else "—" for r in refs]
        lines.append("| %s (%s) | %s |" % (header, "higher" if higher else "lower",
                                          " | ".join(cells)))
    for section, header in (("rtt", "RTT p50"), ("rtt-pinned", "RTT p50, 1 CPU")):
        cells = [results.paired_ratio(section, subject, r, "rtt_p50_us") for r in refs]
        lines.append("| %s, median of paired ratios (lower) | %s |" % (
            header, " | ".join("—" if c is None else "%.3fx" % c for c in cells)))
    return lines


def busy_line(rows, order, cpus):
    parts = []
    for key in order:
        up, down = rows[key]["upload_machine_busy"], rows[key]["download_machine_busy"]
        if up is not None or down is not None:
            parts.append("%s %s / %s" % (rows[key]["label"], percent(up), percent(down)))
    return ("Machine CPU busy during transfers, up / down (100%% = all %s cores; near 100%% "
            "the cores, not the relay, set the pace): %s." % (cpus, "; ".join(parts)))


def percent(fraction):
    return "—" if fraction is None else "%.0f%%" % (fraction * 100)


def ssh_table(results, variants, workdir):
    lines = ["| ProxyCommand | login ms median | − socat, per login | min | max | n | command |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lingering = []
    for v in variants:
        values = results.values("ssh", v["key"], "login_ms")
        extra = results.paired_difference("ssh", v["key"], "socat", "login_ms")
        command = "`%s`" % shorten_command(v["command"], workdir).replace("|", "\\|")
        if values:
            lines.append("| %s | %.1f | %s | %.1f | %.1f | %d | %s |" % (
                v["label"], statistics.median(values),
                "—" if v["key"] == "socat" or extra is None else "%+.1f" % extra,
                min(values), max(values), len(values), command))
        else:
            lines.append("| %s | — | — | — | — | 0 | %s |" % (v["label"], command))
        lingered = sum(1 for s in results.samples.get(("ssh", v["key"]), ())
                       if s.get("proxy_lingered"))
        if lingered:
            lingering.append("%s: %d of %d" % (v["label"], lingered, len(values)))
    if lingering:
        lines += ["", "ProxyCommand still running 1 s after ssh exited (then killed): "
                  + "; ".join(lingering)]
    return lines


def shorten_command(command, workdir):
    """For the table: the temporary directory as $TMP, the checkout as $CHECKOUT, and a long
    `-c` program as '…' (the JSON has every command in full)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    short = []
    for i, word in enumerate(words):
        if i and words[i - 1] == "-c" and len(word) > 16:
            word = "'…'"
        short.append(word.replace(workdir, "$TMP").replace(ROOT, "$CHECKOUT"))
    return " ".join(short)


def goals(rows, results, start_up, variants, ssh_ran):
    """List of (status, text). status is PASS, FAIL or N/A (not measured). start_up is
    [(label, ratio)] per install route; variants are the ssh section's."""
    p, s, c = rows.get("vsock-proxy"), rows["socat-b65536"], rows["python-connector"]
    checks = []

    def check(name, value, reference, limit, at_least, note=""):
        r = ratio(value, reference) if p else None
        if r is None:
            checks.append(("N/A", "%s (not measured)" % name))
            return
        ok = r >= limit if at_least else r <= limit
        checks.append(("PASS" if ok else "FAIL", "%s: %.2fx%s" % (name, r, note)))

    g = lambda f: p[f] if p else None
    check("upload throughput >= %.1fx socat -b 65536" % GOAL_THROUGHPUT_X,
          g("upload_mbps"), s["upload_mbps"], GOAL_THROUGHPUT_X, True)
    check("download throughput >= %.1fx socat -b 65536" % GOAL_THROUGHPUT_X,
          g("download_mbps"), s["download_mbps"], GOAL_THROUGHPUT_X, True)
    for direction in ("upload", "download"):
        raw = ratio(g(direction + "_cpu_per_gb_raw"), s[direction + "_cpu_per_gb_raw"])
        check("%s CPU per GB <= %.1fx socat -b 65536" % (direction, GOAL_CPU_X),
              g(direction + "_cpu_per_gb"), s[direction + "_cpu_per_gb"], GOAL_CPU_X, False,
              "" if raw is None else " (start-up included: %.2fx)" % raw)
    rtt_x = g("rtt_p50_x_socat_b65536")
    if rtt_x is None:
        checks.append(("N/A", "ping-pong RTT p50, unpinned (not measured)"))
    else:
        checks.append(("PASS" if rtt_x <= GOAL_RTT_X else "FAIL",
                       "ping-pong RTT p50, unpinned, <= %.1fx socat -b 65536 (median of the "
                       "ratios of runs side by side): %.3fx" % (GOAL_RTT_X, rtt_x)))
    check("short connection <= %.1fx stdlib Python connector" % GOAL_SHORT_X,
          g("short_ms"), c["short_ms"], GOAL_SHORT_X, False)
    for label, value in start_up:
        name = "start-up, %s, <= %.2fx its interpreter's -c 'import _socket'" % (
            label, GOAL_START_UP_X)
        if value is None:
            checks.append(("N/A", "%s (not measured)" % name))
        else:
            checks.append(("PASS" if value <= GOAL_START_UP_X else "FAIL",
                           "%s: %.2fx" % (name, value)))
    # The goal is the pip route's (the README's per-user install); the system-wide route's
    # snippet is judged by the same rule on its own line.
    routes = {v["key"]: v["route"] for v in variants}
    for key in ("snippet-pip", "snippet-system"):
        name = "ssh login via --fdpass (the snippet's way) <= socat's + %.0f ms, route: %s" % (
            GOAL_SSH_MS, routes.get(key) or {"snippet-pip": "pip",
                                            "snippet-system": "system-wide"}[key])
        extra = results.paired_difference("ssh", key, "socat", "login_ms")
        if not ssh_ran or key not in routes or extra is None:
            checks.append(("N/A", "%s (not measured)" % name))
        else:
            checks.append(("PASS" if extra <= GOAL_SSH_MS else "FAIL",
                           "%s: %+.1f ms (median of per-login differences)" % (name, extra)))
    return checks


def environment():
    def output_lines(argv):
        try:
            out = subprocess.run(argv, capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ["missing"]
        return (out.stdout + out.stderr).decode(errors="replace").strip().splitlines() or ["?"]
    socat = next((" ".join(line.split()[:3]) for line in output_lines(["socat", "-V"])
                  if line.startswith("socat version")), "socat ?")
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": "%s (%s)" % (platform.python_version(), sys.executable),
        "socat": socat,
        "ssh": output_lines(["ssh", "-V"])[0],
        # Context for the short-connection and ssh rows: how much of a Python child's life is
        # the interpreter itself, and how much of that is site (and any .pth files).
        "python_c_pass_ms": start_up_ms([sys.executable, "-c", "pass"]),
        "python_S_c_pass_ms": start_up_ms([sys.executable, "-S", "-c", "pass"]),
    }


def start_up_ms(argv, runs=7):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, metavar="N", help="interleaved rounds (default 10, quick 2)")
    ap.add_argument("--size", type=int, metavar="MiB", help="MiB per transfer (default 1024, quick 32)")
    ap.add_argument("--pings", type=int, metavar="N",
                    help="timed round trips per tool and round (default 2000, quick 500)")
    ap.add_argument("--rtt-reps", type=int, metavar="N",
                    help="round-trip runs per tool and round, unpinned and pinned each "
                         "(default 5, quick 1)")
    ap.add_argument("--short-reps", type=int, metavar="N",
                    help="short connections per tool and round (default 3, quick 2)")
    ap.add_argument("--start-ups", type=int, metavar="N",
                    help="start-up runs per install route (default 20, quick 5)")
    ap.add_argument("--logins", type=int, metavar="N", help="ssh logins per variant (default 20, quick 3)")
    ap.add_argument("--only", metavar="SECTIONS",
                    help="comma-separated subset of %s (default: all)" % ",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small sizes and rounds, a smoke run")
    ap.add_argument("--proxy", metavar="CMD",
                    help="vsock-proxy command (default: %s); 'unix/PATH' is appended for "
                         "the relay, and 'CMD --ssh-config' gives the snippet's ProxyCommand; "
                         "or put {path} / {target} in CMD for a stand-in like socat"
                         % shlex.join(DEFAULT_PROXY))
    ap.add_argument("--no-ssh", action="store_true", help="skip the ssh login section")
    ap.add_argument("--json", metavar="FILE", help="also write all samples and medians here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)   # internal: the server process
    ap.add_argument("--sshd", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {"rounds": 2 if quick else 10, "size": 32 if quick else 1024,
                "pings": 500 if quick else 2000, "rtt_reps": 1 if quick else 5,
                "short_reps": 2 if quick else 3,
                "start_ups": 5 if quick else 20, "logins": 3 if quick else 20}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.rounds, args.size, args.pings, args.rtt_reps, args.short_reps,
           args.start_ups) < 1 \
            or args.logins < 0:
        ap.error("counts and sizes must be positive")
    args.sections = SECTIONS if args.only is None else args.only.split(",")
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error("unknown section %s; the sections are %s" % (
            ", ".join(sorted(unknown)), ", ".join(SECTIONS)))
    if args.no_ssh or args.logins == 0:
        args.sections = [name for name in args.sections if name != "ssh"]
    return args


def short_tempdir():
    """AF_UNIX paths are limited to 107 bytes: fall back to /tmp when TMPDIR is long."""
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="vsock-bench-", dir=base)


def main(argv):
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    if args.serve:
        run_server(args.serve, shlex.split(args.sshd) if args.sshd else None)
        return 0
    if not shutil.which("socat"):
        print("bench: socat is required (apt-get install socat)", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    command = shlex.join(getattr(sys, "orig_argv", ["python3", "bench/bench.py"] + argv))
    progress = lambda msg: print("# " + msg, file=sys.stderr, flush=True)
    tmp = short_tempdir()
    server = None
    began = time.monotonic()
    try:
        log_dir = os.path.join(tmp, "logs")
        os.mkdir(log_dir)
        proxy_problem = check_proxy(args.proxy, tmp)
        proxy_relay, proxy_label = proxy_commands(args.proxy)
        proxy_ok = proxy_problem is None
        if not proxy_ok:
            progress("vsock-proxy not measured: " + proxy_problem)
        tools = make_tools(proxy_relay, proxy_label, proxy_ok)
        connector = Tool("python-connector", "stdlib Python connector (baseline)",
                         lambda path: [sys.executable, "-c", PY_CONNECTOR, path])

        fixture, ssh_note = None, None
        if "ssh" not in args.sections:
            ssh_note = "skipped (not among the sections run)"
        else:
            fixture = SshFixture(tmp)
            ssh_note = fixture.missing()
            if ssh_note:
                ssh_note, fixture = "skipped: " + ssh_note, None
            else:
                fixture.create()

        server = ServerProcess(tmp, fixture.sshd_argv() if fixture else None)
        bench = Bench(tmp, args.size * MiB, args.pings, log_dir, server.proc.pid)
        results = Results()
        warm_up(bench, tools, connector, args.sections, results)
        run_rounds(bench, tools, connector, args.rounds, args.short_reps, args.rtt_reps,
                   args.sections, results, progress)
        snippets = {}
        if "startup" in args.sections or fixture:
            snippets = snippets_for(args.proxy, proxy_ok, tmp)
            for snippet in snippets.values():
                if snippet.problem:
                    progress("no snippet for the %s route: %s" % (snippet.key, snippet.problem))
        routes = start_up_routes(args.proxy, proxy_ok, snippets)
        if "startup" in args.sections:
            run_start_up(routes, os.path.join(tmp, ECHO), args.start_ups, results, progress)

        variants = []
        if fixture:
            variants = ssh_variants(snippets, proxy_relay, proxy_label, proxy_ok,
                                    os.path.join(tmp, SSHD), tmp)
            run_ssh(fixture, variants, args.logins, results, log_dir, progress)
        elapsed = time.monotonic() - began

        report = build_report(args, command, results, tools, connector, variants, fixture,
                              ssh_note, proxy_ok, proxy_problem, snippets, routes, tmp,
                              elapsed)
        print("\n".join(report["lines"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report["data"], f, indent=2)
        return 0
    finally:
        WATCHDOG.kill_all()
        if server:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def build_report(args, command, results, tools, connector, variants, fixture, ssh_note,
                 proxy_ok, proxy_problem, snippets, routes, workdir, elapsed):
    rows = summarize(results, tools, connector)
    order = [t.key for t in tools] + [connector.key]
    env = environment()
    lines = ["## vsock-proxy relay benchmark", "",
             "Command: `%s`" % command, "",
             "Machine: Linux %s, %s CPUs, Python %s, %s, %s. Run took %.0f s; load "
             "average %.2f at the start, %.2f at the end (other work on the machine moves "
             "every figure: compare within one run)." % (
                 env["kernel"], env["cpus"], env["python"], env["socat"], env["ssh"], elapsed,
                 args.load_before, os.getloadavg()[0]),
             "",
             "Interpreter alone: `python -c pass` %s ms, `python -S -c pass` %s ms (wall)." % (
                 fmt(env["python_c_pass_ms"], 1), fmt(env["python_S_c_pass_ms"], 1)),
             "",
             "Medians over %d interleaved rounds; %d MiB per transfer through the relay's "
             "stdin/stdout pipes to AF_UNIX sink/source sockets; CPU = relay child user+sys "
             "per 10^9 bytes, minus the same tool's start+exit CPU (its median over the short "
             "connections); RTT = %d runs per round of %d 1-byte round trips each, the "
             "bench, the echo server and the relay free to run on any CPU, and again all on "
             "one CPU; short conn = spawn, connect, one echo line, exit (%d per round). "
             "MB = 10^6 bytes. Sections run: %s." % (
                 args.rounds, args.size, args.rtt_reps, args.pings, args.short_reps,
                 ", ".join(args.sections)), ""]
    if args.quick:
        lines += ["**Smoke run (--quick)**: transfers this small make CPU/GB (start-up is most "
                  "of the relay's CPU) and the ratios too noisy to judge the goals by.", ""]
    lines += main_table(rows, order)
    lines += ["", busy_line(rows, order, env["cpus"]), ""]
    if proxy_ok:
        lines.append("Ratios, vsock-proxy / other:")
        lines.append("")
        lines += ratio_table(rows, results, "vsock-proxy", ["socat-b65536", "socat", "direct"])
        lines.append("")
    else:
        lines += ["vsock-proxy not measured: %s" % proxy_problem, ""]

    start_up = []
    if "startup" in args.sections:
        ratios = start_up_ratios(routes, results)
        start_up = [(r.label, ratios[r.key]) for r in routes if r.judged]
        lines.append("Start-up per install route: wall ms from spawn to exit of `--check "
                     "unix/PATH` against a listening socket, median of %d interleaved runs; "
                     "ratio = median of the per-run ratios to the same interpreter's "
                     "`-c 'import _socket'` (for the snippet's command: without site, "
                     "`-I -S`, as the least that command could cost):" % args.start_ups)
        lines.append("")
        lines += start_up_table(routes, results, ratios)
        lines.append("")

    ssh_medians = {}
    lines.append("ssh login wall time (`ssh -F cfg -o KexAlgorithms=curve25519-sha256 -o "
                 "ProxyCommand=... -s bench sftp < /dev/null`: the sftp subsystem, served "
                 "in-process by the per-connection `sshd -i` behind a unix socket, so no "
                 "shell runs; %d logins each, interleaved; − socat = median of the "
                 "differences to the socat login of the same turn; the snippets' commands "
                 "are their routes' `--ssh-config` ProxyCommand with `%%n` = unix/$TMP/%s):"
                 % (args.logins, SSHD))
    lines.append("")
    if fixture:
        lines += ssh_table(results, variants, workdir)
        for v in variants:
            values = results.values("ssh", v["key"], "login_ms")
            ssh_medians[v["key"]] = statistics.median(values) if values else None
    else:
        lines.append("ssh section %s" % ssh_note)
    lines.append("")
    problems = [s for s in snippets.values() if s.problem]
    if problems:
        lines += ["No --ssh-config snippet (its rows are missing):", ""]
        lines += ["- %s: %s" % (s.label, s.problem) for s in problems]
        lines.append("")

    odd_exits = {}
    for (section, key), samples in results.samples.items():
        for s in samples:
            if s.get("exit_status", 0) != 0:
                odd_exits.setdefault((section, key), []).append(s["exit_status"])
    if odd_exits:
        lines += ["Relays that exited non-zero after a complete transfer:", ""]
        for (section, key), codes in sorted(odd_exits.items()):
            lines.append("- %s / %s: exit status %s" % (section, key, sorted(set(codes))))
        lines.append("")

    if results.errors:
        lines += ["Errors (first per test and tool, with the last lines of the child's stderr):", ""]
        for (section, key), errs in sorted(results.errors.items()):
            skipped = results.skipped.get((section, key))
            lines.append("- %s / %s: %d failed%s, first: %s" % (
                section, key, len(errs), ", %d more skipped" % skipped if skipped else "",
                errs[0]))
        lines.append("")

    checks = goals(rows, results, start_up, variants, fixture is not None)
    lines += ["### Goals", ""]
    lines += ["- %s %s" % (status, text) for status, text in checks]
    floor_extra = results.paired_difference("ssh", "python-floor", "socat", "login_ms")
    if fixture and floor_extra is not None:
        lines += ["", "For reference, the Python floor's login (a minimal fdpass run by "
                  "`python -I -S`, the least any Python ProxyCommand can cost) − socat's: "
                  "%+.1f ms (median of per-login differences)." % floor_extra]

    data = {
        "command": command, "environment": env, "seconds": elapsed,
        "options": {k: getattr(args, k) for k in ("rounds", "size", "pings", "rtt_reps",
                                                  "short_reps", "start_ups", "logins", "proxy",
                                                  "quick", "sections")},
        "medians": rows, "ssh_medians_ms": ssh_medians,
        "ssh_variants": variants,
        "ssh_floor_minus_socat_ms": results.paired_difference("ssh", "python-floor", "socat",
                                                              "login_ms"),
        "snippets": {key: {"argv": s.argv, "proxy_command": s.line, "problem": s.problem}
                     for key, s in snippets.items()},
        "start_up_routes": [{"key": r.key, "label": r.label,
                             "argv": r.argv_for(os.path.join(workdir, ECHO)),
                             "floor": r.floor} for r in routes],
        "goals": [{"status": s, "goal": t} for s, t in checks],
        "samples": {"%s/%s" % k: v for k, v in results.samples.items()},
        "errors": {"%s/%s" % k: v for k, v in results.errors.items()},
        "proxy_problem": proxy_problem, "ssh_note": ssh_note,
    }
    return {"lines": lines, "data": data}


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
