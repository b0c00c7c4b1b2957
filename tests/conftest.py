"""Shared pytest harness for vsock-proxy.

Four parts, each usable on its own:

1. Running vsock-proxy from the checkout: ``ROOT``, ``PROXY_ARGV``, ``run_proxy()``,
   ``proxy_process()`` (a live child with bounded-wait stdin/stdout helpers),
   ``serve_unix()`` (a throwaway unix server per test) and the fixtures
   ``proxy_argv``, ``run_proxy`` and ``vsock_proxy_on_path``.
2. A real OpenSSH server, fixture ``sshd`` (session scope): ``sshd -i`` is started
   per connection on a unix socket (the way systemd's ``Accept=yes`` socket does it),
   plus helpers to write ssh_config files and run ssh, scp and sftp against it.
3. A fake hybrid-vsock muxer, fixture ``muxer`` (a factory): speaks the
   ``CONNECT <port>\\n`` / ``OK <n>\\n`` handshake of Firecracker, Cloud Hypervisor
   and vhost-device-vsock, with their quirks and failure modes (NOTES.md section 3).
4. Names for the test sshd as users write them: ``SHIPPED_SNIPPET``, ``slash_free()``
   (``unix%tmp%vm%vm.sock``), fixture ``vm_socket`` (a short path to the sshd) and
   ``require()`` (skip without a program); and README.md's code blocks:
   ``readme_blocks()``, ``readme_block()``, ``readme_commands()``.

Only the standard library and pytest are used. Nothing here opens an AF_VSOCK
connection: that must never happen on the development host (NOTES.md section 6).
"""

import errno
import hashlib
import itertools
import os
import pwd
import re
import select
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROXY_SCRIPT = ROOT / "vsock_proxy.py"
PROXY_ARGV = [sys.executable, str(PROXY_SCRIPT)]

# `import vsock_proxy` in tests must get the checkout, also under a bare `pytest`
# (which, unlike `python -m pytest`, does not put the cwd on sys.path) and when
# an older copy is installed in the venv.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# CI installs openssh; there a missing sshd must fail the run instead of skipping
# half the suite silently.
REQUIRE_SSHD_ENV = "VSOCK_PROXY_REQUIRE_SSHD"


# --------------------------------------------------------------------------
# Small shared utilities
# --------------------------------------------------------------------------

def run_cmd(argv, *, input=b"", timeout=20, stdin=None, **kw):
    """subprocess.run with bytes stdout/stderr captured (unless overridden)."""
    if stdin is not None:
        input = None  # subprocess.run refuses input= together with stdin=
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([str(a) for a in argv], input=input, stdin=stdin,
                          timeout=timeout, **kw)


def close_quietly(sock):
    try:
        sock.close()
    except OSError:
        pass


def shutdown_quietly(sock):
    """shutdown(SHUT_RDWR): wakes any thread blocked in recv/send on sock."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def skip_or_fail(reason):
    if os.environ.get(REQUIRE_SSHD_ENV) == "1":
        pytest.fail(f"{reason} (and {REQUIRE_SSHD_ENV}=1 forbids skipping)")
    pytest.skip(reason)


def relay(a, b, bufsize=65536):
    """Copy bytes both ways between connected sockets a and b.

    When either direction hits EOF or an error, both sockets are shut down
    completely: Firecracker turns a host EOF into a full close of the guest
    stream, there is no half-close. Returns when both directions are done.
    The caller still owns (and closes) both sockets.
    """
    def pump(src, dst):
        try:
            while True:
                data = src.recv(bufsize)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            shutdown_quietly(a)
            shutdown_quietly(b)

    other = threading.Thread(target=pump, args=(b, a), name="relay", daemon=True)
    other.start()
    pump(a, b)
    other.join()


class AcceptLoop:
    """Accept connections on a listening socket in a background thread.

    Each accepted socket is handed to ``handler(conn)``, which owns it from then
    on (and must return quickly: start a thread for long work). ``stop()`` wakes
    the thread at once through a socketpair (no polling interval), joins it and
    closes the listener. Works with any listening socket: AF_UNIX, or AF_VSOCK
    inside the lab VM.
    """

    def __init__(self, listener, handler, name="accept-loop"):
        self.listener = listener
        self._handler = handler
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            readable, _, _ = select.select([self.listener, self._wake_r], [], [])
            if self._wake_r in readable:
                return
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue  # e.g. ECONNABORTED: the client gave up already
            try:
                self._handler(conn)
            except Exception:
                # A handler bug must be visible, but must not kill the server.
                traceback.print_exc()
                close_quietly(conn)

    def stop(self, timeout=5.0):
        if self._stopped:
            return
        self._stopped = True
        self._wake_w.send(b"x")
        self._thread.join(timeout)
        for s in (self.listener, self._wake_r, self._wake_w):
            close_quietly(s)
        if self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name} did not stop")


def unix_listener(path, backlog=16):
    path = str(path)
    if len(path.encode()) >= 108:  # sun_path limit on Linux
        raise ValueError(f"unix socket path too long: {path}")
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(backlog)
    return s


class ThreadedServer:
    """Serve each accepted connection with ``handler(conn, index)`` in its own thread.

    index counts connections from 0 in accept order. conn is closed after the
    handler returns, without draining it: on AF_UNIX, unread input at close
    makes the peer see ECONNRESET, which some tests want. OSError in a handler
    means the peer went away and is ignored; other exceptions are harness or
    test bugs and are collected in ``errors``. stop() shuts down every open
    connection (waking handlers blocked on it) and joins all threads.
    """

    def __init__(self, listener, handler, name="server"):
        self.name = name
        self.connections = 0
        self.errors = []
        self._handler = handler
        self._lock = threading.Lock()
        self._live = set()
        self._threads = []
        self._stopped = False
        self._loop = AcceptLoop(listener, self._accept, name=f"{name}-accept")

    def _accept(self, conn):
        with self._lock:
            if self._stopped:
                conn.close()
                return
            index = self.connections
            self.connections += 1
            self._live.add(conn)
            t = threading.Thread(target=self._run, args=(conn, index),
                                 name=f"{self.name}-conn-{index}", daemon=True)
            self._threads.append(t)
        t.start()

    def _run(self, conn, index):
        try:
            self._handler(conn, index)
        except OSError:
            pass
        except Exception as e:
            self.errors.append(e)
            traceback.print_exc()
        finally:
            # Under the lock, so stop() never shuts down a closed (reused) fd.
            with self._lock:
                self._live.discard(conn)
                close_quietly(conn)

    def stop(self, timeout=5.0):
        if self._stopped:
            return
        self._loop.stop(timeout)
        with self._lock:
            self._stopped = True
            for conn in self._live:
                shutdown_quietly(conn)
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            raise RuntimeError(f"threads did not stop: {stuck}")


# --------------------------------------------------------------------------
# 1. vsock-proxy from the checkout
# --------------------------------------------------------------------------

def run_proxy(*args, input=b"", timeout=20, stdin=None, **kw):
    """Run ``python vsock_proxy.py ARGS...`` from the checkout; bytes captured."""
    return run_cmd([*PROXY_ARGV, *args], input=input, timeout=timeout, stdin=stdin, **kw)


@pytest.fixture
def proxy_argv():
    """[sys.executable, ROOT/vsock_proxy.py] (a fresh list: safe to extend)."""
    return list(PROXY_ARGV)


@pytest.fixture(name="run_proxy")
def run_proxy_fixture():
    """The run_proxy() helper, for tests that prefer fixtures to imports."""
    return run_proxy


def proxy_command_in(snippet):
    """The command of an ssh_config snippet's first ProxyCommand, without
    the arguments it is given."""
    return snippet.split("ProxyCommand ")[1].split(" --fdpass")[0]


def imported_from(directory, python=sys.executable):
    """The snippet's command for an importable vsock_proxy.py in directory,
    as --ssh-config writes it."""
    import vsock_proxy
    return "%s -I -S -c %s %s" % (python, shlex.quote(vsock_proxy.IMPORT_AND_RUN), directory)


class PipInstalled:
    """What pip installed beside this interpreter: the launcher in bin/ and
    vsock_proxy.py in site-packages."""
    command = Path(sys.executable).parent / "vsock-proxy"
    module = Path(sysconfig.get_paths()["purelib"]) / "vsock_proxy.py"

    @classmethod
    def is_current(cls):
        """Installed, and the checkout's code (a copy installed before the
        last edit would test old code)."""
        return (cls.command.exists() and cls.module.exists()
                and cls.module.read_bytes() == PROXY_SCRIPT.read_bytes())


@pytest.fixture
def pip_installed():
    if not PipInstalled.is_current():
        pytest.skip("vsock-proxy is not pip-installed from this checkout beside %s "
                    "(.ci/run installs it)" % sys.executable)
    return PipInstalled


@pytest.fixture(scope="session")
def vsock_proxy_bin_dir(tmp_path_factory):
    """A directory holding an executable ``vsock-proxy``: the launcher if pip
    installed the checkout's code beside this interpreter, else a shell
    wrapper that runs the checkout's vsock_proxy.py."""
    if PipInstalled.is_current():
        return PipInstalled.command.parent
    bindir = tmp_path_factory.mktemp("bin")
    wrapper = bindir / "vsock-proxy"
    wrapper.write_text("#!/bin/sh\nexec {} {} \"$@\"\n".format(
        shlex.quote(sys.executable), shlex.quote(str(PROXY_SCRIPT))))
    wrapper.chmod(0o755)
    return bindir


@pytest.fixture
def vsock_proxy_on_path(vsock_proxy_bin_dir):
    """An environment dict (copy of os.environ) whose PATH starts with vsock_proxy_bin_dir."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(filter(None, [str(vsock_proxy_bin_dir), env.get("PATH")]))
    return env


class StdioProcess:
    """A child process driven through its stdin and stdout, with bounded waits.

    The shapes of stdio that callers give a ProxyCommand (NOTES.md section 7):
    stdio="pipe": two pipes, which is what ssh gives (and what os.splice needs).
    stdio="socket": one socketpair each (two separate sockets, so closing either
    end behaves like closing a pipe). stdio="shared-socket": one socket that is
    both stdin and stdout (ssh with ProxyUseFdpass, socat EXEC:, inetd, systemd
    Accept=yes); our stdin EOF is shutdown(SHUT_WR), our reader going away
    shutdown(SHUT_RD). stdio="pty": a terminal in raw mode as both (a person at
    a shell); it has no EOF but hanging up, which ends both ways at once.
    "nonblocking-pipe" and "nonblocking-shared-socket": the same with O_NONBLOCK
    on the child's file descriptions, as asyncio parents hand them over.
    stderr is always a pipe. Every read takes a timeout and raises
    AssertionError when it runs out, so a stall fails instead of hanging.
    Use as a context manager: on exit our ends are closed and a child still
    running is killed.
    """

    KINDS = ("pipe", "socket", "shared-socket", "pty",
             "nonblocking-pipe", "nonblocking-shared-socket")

    def __init__(self, argv, stdio="pipe", **popen_kw):
        kind = stdio.replace("nonblocking-", "")
        if kind == "pipe":
            child_in, self._stdin = os.pipe()
            self._stdout, child_out = os.pipe()
        elif kind == "socket":
            # Raw descriptors, so all kinds share the os.read/os.write code.
            a, b = socket.socketpair()
            child_in, self._stdin = a.detach(), b.detach()
            a, b = socket.socketpair()
            self._stdout, child_out = a.detach(), b.detach()
        elif kind == "shared-socket":
            a, b = socket.socketpair()
            child_in = child_out = a.detach()
            self._stdin = self._stdout = b.detach()
        elif kind == "pty":
            import pty
            import tty
            self._stdin, child_in = pty.openpty()
            self._stdout, child_out = self._stdin, child_in
            tty.setraw(child_in)
        else:
            raise ValueError(f"stdio must be one of {self.KINDS}, not {stdio!r}")
        if stdio.startswith("nonblocking-"):
            for fd in {child_in, child_out}:
                os.set_blocking(fd, False)
        self.stdio = stdio
        try:
            self.process = subprocess.Popen([str(a) for a in argv], stdin=child_in,
                                            stdout=child_out, stderr=subprocess.PIPE,
                                            **popen_kw)
        except BaseException:
            os.close(self._stdin)
            os.close(self._stdout)
            raise
        finally:
            for fd in {child_in, child_out}:
                os.close(fd)
        self._stderr_buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- stdin / stdout -----------------------------------------------------

    def write(self, data):
        """Write all of data to the child's stdin (blocks while it is full)."""
        view = memoryview(data)
        while view:
            if self._stdin is None:          # closed by another thread meanwhile
                raise BrokenPipeError("stdin was closed while writing")
            view = view[os.write(self._stdin, view):]

    def close_stdin(self):
        """EOF on the child's stdin."""
        self._close_end("_stdin", socket.SHUT_WR)

    def close_stdout(self):
        """Close our reading end: the child's next write fails (EPIPE)."""
        self._close_end("_stdout", socket.SHUT_RD)

    def hang_up(self):
        """Both ends at once: the terminal closes, or the caller dies."""
        if self.stdio == "pty" and self._stdin is not None:
            os.close(self._stdin)
            self._stdin = self._stdout = None
        self.close_stdin()
        self.close_stdout()

    def _close_end(self, name, how):
        """With one descriptor for both ends, shut down one way until the
        other is closed too; a terminal only hangs up, both ways at once."""
        fd = getattr(self, name)
        if fd is None:
            return
        shared = self._stdin == self._stdout
        if shared and self.stdio == "pty":
            raise ValueError("a terminal has no EOF of its own: use hang_up()")
        setattr(self, name, None)
        if not shared:
            os.close(fd)
        else:
            with socket.socket(fileno=os.dup(fd)) as end:
                end.shutdown(how)

    def wait_for_unread_output(self, timeout=10):
        """Until stdout holds bytes we have not read."""
        if not select.select([self._stdout], [], [], timeout)[0]:
            raise AssertionError(f"no output to read within {timeout} s")

    def read_exactly(self, n, timeout=10):
        data = b""
        deadline = time.monotonic() + timeout
        while len(data) < n:
            chunk = self._read(self._stdout, n - len(data), deadline, f"{n} bytes of stdout")
            if not chunk:
                raise AssertionError(f"EOF on stdout after {len(data)} of {n} bytes: {data[:100]!r}")
            data += chunk
        return data

    def read_to_eof(self, timeout=10):
        chunks = []
        deadline = time.monotonic() + timeout
        while True:
            chunk = self._read(self._stdout, 1 << 20, deadline, "EOF on stdout")
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def exchange(self, data, timeout=60):
        """Send data and EOF while reading everything that comes back: both
        directions at once, as a full-duplex peer does.  Returns what came back."""
        writer = threading.Thread(target=lambda: (self.write(data), self.close_stdin()))
        writer.start()
        try:
            return self.read_to_eof(timeout=timeout)
        finally:
            writer.join(timeout)

    # -- stderr and exit ----------------------------------------------------

    def stderr_line(self, timeout=10):
        """The next line of stderr, decoded, without its newline."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._stderr_buf:
            chunk = self._read(self.process.stderr.fileno(), 65536, deadline, "a line on stderr")
            if not chunk:
                raise AssertionError(f"EOF on stderr before a full line: {self._stderr_buf!r}")
            self._stderr_buf += chunk
        line, _, self._stderr_buf = self._stderr_buf.partition(b"\n")
        return line.decode(errors="replace")

    def stderr(self, timeout=10):
        """Everything left on stderr, up to EOF (normally: after wait())."""
        deadline = time.monotonic() + timeout
        while True:
            chunk = self._read(self.process.stderr.fileno(), 65536, deadline, "EOF on stderr")
            if not chunk:
                rest, self._stderr_buf = self._stderr_buf, b""
                return rest
            self._stderr_buf += chunk

    def wait(self, timeout=10):
        """The exit status (negative: killed by that signal)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"still running after {timeout} s (killed)") from None

    def peak_memory_kib(self):
        """Peak resident memory (VmHWM) of the running child, in KiB (Linux)."""
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise AssertionError("no VmHWM: has the process exited already?")

    def close(self):
        self.hang_up()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stderr.close()

    @staticmethod
    def _read(fd, n, deadline, what):
        if fd is None:
            raise AssertionError(f"waiting for {what} on a closed descriptor")
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise AssertionError(f"timed out waiting for {what}")
        try:
            return os.read(fd, n)
        except OSError as exc:
            # The end of the stream too: a terminal whose other side closed
            # (EIO); a socket whose other side closed with our bytes unread,
            # after all of its own (ECONNRESET).
            if exc.errno in (errno.EIO, errno.ECONNRESET):
                return b""
            raise


def proxy_process(args, stdio="pipe", **popen_kw):
    """vsock-proxy from the checkout as a StdioProcess: ``with proxy_process([...], "pipe") as p``."""
    return StdioProcess([*PROXY_ARGV, *args], stdio, **popen_kw)


# Servers made by serve_unix(), stopped after each test by _stop_unix_servers.
_unix_servers = []
def echo(conn):
    """A peer that sends back whatever it gets, until EOF."""
    while True:
        data = conn.recv(1 << 20)
        if not data:
            return
        conn.sendall(data)


def sha256_until_eof(conn):
    """Read conn to EOF; the hex SHA-256 of all it carried."""
    hasher = hashlib.sha256()
    for data in iter(lambda: conn.recv(1 << 20), b""):
        hasher.update(data)
    return hasher.hexdigest()


_unix_server_numbers = itertools.count()


def serve_unix(directory, handler, name=None):
    """Listen on a unix socket in directory; run ``handler(conn)`` per connection.

    Each connection gets its own thread; conn is closed when the handler
    returns, without draining (so unread input resets the peer). Returns the
    socket path as a str. The server stops at the end of the test, and a
    handler exception other than OSError fails the test.
    """
    path = str(Path(directory) / (name or f"srv{next(_unix_server_numbers)}.sock"))
    server = ThreadedServer(unix_listener(path), lambda conn, _index: handler(conn),
                            name="unix-server")
    server.path = path
    _unix_servers.append(server)
    return path


@pytest.fixture(autouse=True)
def _stop_unix_servers():
    yield
    servers = list(_unix_servers)
    del _unix_servers[:]
    errors = []
    for server in servers:
        server.stop()
        errors.extend(server.errors)
        try:
            os.unlink(server.path)
        except FileNotFoundError:
            pass
    assert not errors, f"serve_unix handler errors: {errors!r}"


# --------------------------------------------------------------------------
# 2. A real sshd, one `sshd -i` per connection
# --------------------------------------------------------------------------

def _find_sshd():
    if os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd"
    # sshd insists on an absolute path; which() returns one.
    return shutil.which("sshd", path=os.pathsep.join(
        [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"]))


def _account_locked(user):
    """True if /etc/shadow marks user's password as locked ("!...").

    With UsePAM no, sshd refuses even key logins to such an account
    ("User root not allowed because account is locked").
    """
    try:
        with open("/etc/shadow") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == user:
                    return rest.startswith("!")
    except OSError:
        pass
    return False


def write_ssh_client_config(path, *, user, identity, known_hosts, extra=""):
    """Write an ssh_config: the caller's text first, then generic defaults.

    ssh_config keeps the first value it obtains for each option, so the
    caller's Host blocks (ProxyCommand, ...) must come before ``Host *``,
    and they can override any default below.
    """
    extra = textwrap.dedent(extra).strip("\n")
    defaults = textwrap.dedent(f"""\
        Host *
            User {user}
            IdentityFile "{identity}"
            IdentitiesOnly yes
            IdentityAgent none
            BatchMode yes
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            StrictHostKeyChecking yes
            UserKnownHostsFile "{known_hosts}"
            GlobalKnownHostsFile /dev/null
            UpdateHostKeys no
            CheckHostIP no
            ControlMaster no
            ControlPath none
            ForwardAgent no
            ForwardX11 no
            LogLevel ERROR
            ConnectTimeout 20
        """)
    path = Path(path)
    path.write_text(f"{extra}\n\n{defaults}" if extra else defaults)
    return path


class SshServer:
    """Throwaway OpenSSH server; see the ``sshd`` fixture."""

    BANNER_PREFIX = b"SSH-2.0-OpenSSH"

    def __init__(self, directory, sshd_path):
        self.dir = Path(directory)
        self.sshd_path = sshd_path
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.host_key = self.dir / "host_ed25519"
        self.user_key = self.dir / "id_ed25519"
        self.authorized_keys = self.dir / "authorized_keys"
        self.known_hosts = self.dir / "known_hosts"
        self.config_path = self.dir / "sshd_config"
        self.log_path = self.dir / "sshd.log"
        self.socket_path = str(self.dir / "sshd.sock")
        self._children = []
        self._loops = []
        self._lock = threading.Lock()
        self._config_numbers = itertools.count(1)
        self._log_file = None

    # -- setup / teardown ---------------------------------------------------

    def start(self):
        for key in (self.host_key, self.user_key):
            run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name,
                     "-f", key], check=True)
        shutil.copy(f"{self.user_key}.pub", self.authorized_keys)
        # Pin the host key for every host name instead of turning checking off:
        # a login then proves we reached *this* sshd. The pattern "*" also matches
        # the "[name]:port" form ssh looks up for non-default ports.
        host_pub = Path(f"{self.host_key}.pub").read_text().strip()
        self.known_hosts.write_text(f"* {host_pub}\n")
        self.config_path.write_text(textwrap.dedent(f"""\
            HostKey {self.host_key}
            AuthorizedKeysFile {self.authorized_keys}
            PubkeyAuthentication yes
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            PidFile none
            PermitRootLogin yes
            PrintMotd no
            PrintLastLog no
            Subsystem sftp internal-sftp
            # The log goes to sshd.log (-E), never to the connection, so it may
            # as well say who logged in and from where.
            LogLevel VERBOSE
            """))
        # sshd running as root wants its privilege separation directory.
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        except PermissionError:
            pass  # not root: sshd does not need it then
        check = run_cmd([self.sshd_path, "-t", "-f", self.config_path], timeout=30)
        if check.returncode != 0:
            pytest.fail(f"sshd -t rejected the test config:\n{check.stderr.decode(errors='replace')}")
        self._log_file = open(self.log_path, "ab")
        self.serve_on(unix_listener(self.socket_path))
        return self

    def close(self):
        problems = []
        for loop in self._loops:
            try:
                loop.stop()
            except RuntimeError as e:
                problems.append(str(e))
        with self._lock:
            children, self._children = self._children, []
        for proc in children:
            if proc.poll() is None:
                proc.terminate()
        for proc in children:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_file:
            self._log_file.close()
        if problems:
            raise RuntimeError("; ".join(problems))

    # -- serving ------------------------------------------------------------

    def spawn_sshd(self, conn):
        """Run ``sshd -i`` with the connected socket conn as its stdin and stdout.

        Takes ownership of conn: the parent's copy is closed here, so the
        connection ends when sshd exits. Returns the Popen (also reaped at
        session end).
        """
        try:
            proc = subprocess.Popen(
                [self.sshd_path, "-i", "-f", str(self.config_path), "-E", str(self.log_path)],
                stdin=conn.fileno(), stdout=conn.fileno(), stderr=self._log_file,
                close_fds=True)
        finally:
            conn.close()
        with self._lock:
            # poll() reaps the children that have exited: no zombie pile-up.
            self._children = [p for p in self._children if p.poll() is None]
            self._children.append(proc)
        return proc

    spawn_on = spawn_sshd

    def serve_on(self, listener):
        """Serve ``sshd -i`` for every connection accepted on listener.

        listener is any listening socket (e.g. AF_VSOCK bound to CID 1 inside
        the lab VM); it is closed when the loop stops (loop.stop() or session end).
        """
        loop = AcceptLoop(listener, self.spawn_sshd, name=f"sshd-accept-{len(self._loops)}")
        self._loops.append(loop)
        return loop

    def mux_backend(self, conn, reply):
        """FakeMuxer backend: the guest port is a real ``sshd -i``.

        The reply line and sshd's first output (its banner) go out in ONE send,
        the way a real muxer often delivers them in a single segment; then bytes
        are relayed both ways until either side closes.
        """
        ours, theirs = socket.socketpair()
        proc = self.spawn_sshd(theirs)
        try:
            ours.settimeout(10)
            first = ours.recv(65536)
            ours.settimeout(None)
            conn.sendall(reply + first)
            if first:
                relay(conn, ours)
        finally:
            ours.close()  # sshd sees EOF and exits
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()

    # -- client side --------------------------------------------------------

    def write_ssh_config(self, path, extra=""):
        """write_ssh_client_config() with this server's user, key and known_hosts."""
        return write_ssh_client_config(path, user=self.user, identity=self.user_key,
                                       known_hosts=self.known_hosts, extra=extra)

    def ssh_config(self, extra="", path=None):
        """write_ssh_config() to a fresh file in the server directory (or path)."""
        if path is None:
            path = self.dir / f"ssh_config.{next(self._config_numbers)}"
        return self.write_ssh_config(path, extra)

    def ssh(self, host, *remote_cmd, config, input=b"", timeout=60, extra_args=(), **kw):
        """``ssh -F config [extra_args] host remote_cmd...``; bytes captured."""
        return run_cmd(["ssh", "-F", config, *extra_args, host, *remote_cmd],
                       input=input, timeout=timeout, **kw)

    def scp(self, *args, config, timeout=60, **kw):
        """``scp -F config args...`` (OpenSSH 9 scp speaks sftp underneath)."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        return run_cmd(["scp", "-F", config, *args], timeout=timeout, **kw)

    def sftp(self, host, batch_commands, *, config, timeout=60, extra_args=(), **kw):
        """``sftp -F config -b - host`` with batch_commands fed on stdin."""
        return run_cmd(["sftp", "-F", config, *extra_args, "-b", "-", host],
                       input=batch_commands.encode(), timeout=timeout, **kw)

    def read_log(self):
        """sshd's log so far (handy in assertion messages)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real sshd serving ``sshd -i`` per connection on ``sshd.socket_path``.

    Skips when sshd or ssh is missing, unless VSOCK_PROXY_REQUIRE_SSHD=1.
    """
    sshd_path = _find_sshd()
    missing = [name for name, found in (("sshd", sshd_path),
                                        ("ssh", shutil.which("ssh")),
                                        ("ssh-keygen", shutil.which("ssh-keygen")))
               if not found]
    if missing:
        skip_or_fail(f"OpenSSH not installed (missing: {', '.join(missing)})")
    user = pwd.getpwuid(os.getuid()).pw_name
    if _account_locked(user):
        skip_or_fail(f"account {user!r} is locked ('!' in /etc/shadow): sshd with "
                     f"UsePAM no refuses it; unlock with: usermod -p '*' {user}")
    server = SshServer(tmp_path_factory.mktemp("sshd"), sshd_path)
    try:
        server.start()
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------
# 3. A fake hybrid-vsock muxer (Firecracker / Cloud Hypervisor / vhost-device)
# --------------------------------------------------------------------------

FAKE_BANNER = b"SSH-2.0-FakeGuest\r\n"
FIRST_HOST_PORT = 1 << 30  # Firecracker/Cloud Hypervisor: host ports in [2^30, 2^31)
MAX_LINE = 64  # longer CONNECT lines are refused (real muxers cap them too)
GARBAGE_REPLY = b"HTTP/1.0 400 Bad Request\r\n"
ESCAPE_REPLY = b"\x1b]0;pwned\x07\x1b[31mERR\n"
OVERLONG_REPLY = b"OK " + b"9" * 100  # no newline, connection kept open
CONNECT_RE = re.compile(rb"CONNECT ([0-9]{1,10})\n")


def banner_echo_backend(conn, reply):
    """Default guest: reply + banner in ONE send, echo until EOF, then close."""
    conn.sendall(reply + FAKE_BANNER)
    echo(conn)


def _hold_open(conn):
    """Keep the connection open, swallowing input, until the client or stop() ends it."""
    while conn.recv(65536):
        pass


def _drain(conn):
    """Read and return whatever is queued, without waiting."""
    chunks = []
    while True:
        try:
            data = conn.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _peek(conn):
    try:
        return conn.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return b""


class FakeMuxer:
    """Protocol-faithful fake of a hybrid vsock muxer; see the ``muxer`` fixture.

    Records, one entry per connection in the order the lines were read:
      received_before_reply  bytes received before the reply would go out
                             (the CONNECT line plus anything sent within ``grace``)
      line_in_one_recv       True if the first read already held the whole line
      ports                  the parsed port of each valid CONNECT line
    connections              number of accepted connections
    errors                   unexpected exceptions in handler threads (harness bugs)
    Threads are named "muxer-...".
    """

    FLAVOURS = ("firecracker", "cloud-hypervisor", "vhost-device")
    BEHAVIOURS = ("ok", "drip", "close", "reset", "garbage", "overlong",
                  "silent", "escape", "late")
    LATE_MODES = ("close", "silent", "reset")

    def __init__(self, path, flavour="firecracker", behaviour="ok", backend=None, *,
                 grace=0.05, drip_delay=0.005, late_count=0, late_delay=0.0,
                 late_mode="close"):
        if flavour not in self.FLAVOURS:
            raise ValueError(f"unknown flavour {flavour!r}")
        if behaviour not in self.BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}")
        if late_mode not in self.LATE_MODES:
            raise ValueError(f"unknown late_mode {late_mode!r}")
        if behaviour == "late" and not (late_count or late_delay):
            late_count = 1
        self.path = str(path)
        self.flavour = flavour
        self.behaviour = behaviour
        self.backend = backend or banner_echo_backend
        self.grace = grace
        self.drip_delay = drip_delay
        self.late_count = late_count
        self.late_delay = late_delay
        self.late_mode = late_mode

        self.received_before_reply = []
        self.line_in_one_recv = []
        self.ports = []

        self._lock = threading.Lock()
        self._host_ports = itertools.count(FIRST_HOST_PORT)
        self._started = time.monotonic()
        self._server = ThreadedServer(unix_listener(self.path), self._handle, name="muxer")

    @property
    def connections(self):
        return self._server.connections

    @property
    def errors(self):
        return self._server.errors

    # -- public -------------------------------------------------------------

    def wait_connections(self, n, timeout=5.0):
        """Wait until n connections were accepted and their line was read."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.received_before_reply) >= n:
                    return
            time.sleep(0.005)
        raise AssertionError(f"muxer saw {len(self.received_before_reply)} of {n} connections")

    def stop(self):
        """Stop accepting, end every open connection, join all threads."""
        self._server.stop()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- internals ----------------------------------------------------------

    def _handle(self, conn, index):
        behaviour = self._behaviour_for(index)
        if behaviour == "reset":
            self._reset(conn)
            return
        try:
            line = self._read_line(conn)
            port = self._parse(line)
            if port is not None:  # else malformed or split line: just close
                self._respond(conn, behaviour, port)
        finally:
            # Unread input at close() turns the peer's EOF into ECONNRESET on
            # AF_UNIX; drain so that "close" really means EOF.
            try:
                _drain(conn)
            except OSError:
                pass

    def _behaviour_for(self, index):
        if self.behaviour != "late":
            return self.behaviour
        early = index < self.late_count or (
            time.monotonic() - self._started < self.late_delay)
        return self.late_mode if early else "ok"

    def _record(self, received, one_recv, port):
        with self._lock:
            self.received_before_reply.append(received)
            self.line_in_one_recv.append(one_recv)
            if port is not None:
                self.ports.append(port)

    @staticmethod
    def _parse(line):
        m = CONNECT_RE.fullmatch(line) if line else None
        if m and int(m.group(1)) < 2**32:
            return int(m.group(1))
        return None

    def _read_line(self, conn):
        """Read the CONNECT line the way this flavour does; record what arrived.

        Returns the line (ending in newline) or None when the muxer drops the
        connection.
        """
        if self.flavour == "vhost-device":
            # One read of whatever is there: a line split across writes is an
            # error, and bytes after the newline are consumed and lost.
            first = conn.recv(4096)
            nl = first.find(b"\n")
            if nl < 0:
                self._record(first, False, None)
                return None
            time.sleep(self.grace)
            received = first + _drain(conn)
            line = first[:nl + 1]
            self._record(received, True, self._parse(line))
            return line
        # Firecracker / Cloud Hypervisor read byte by byte up to the newline:
        # a split line is fine, and bytes after it stay queued for the guest.
        first = conn.recv(MAX_LINE, socket.MSG_PEEK)
        line = b""
        while not line.endswith(b"\n") and len(line) < MAX_LINE:
            byte = conn.recv(1)
            if not byte:
                break
            line += byte
        time.sleep(self.grace)
        received = line + _peek(conn)
        self._record(received, b"\n" in first, self._parse(line))
        return line if line.endswith(b"\n") else None

    def _reply_for(self, port):
        if self.flavour == "vhost-device":
            return b"OK %d\n" % port
        return b"OK %d\n" % next(self._host_ports)

    def _respond(self, conn, behaviour, port):
        if behaviour == "ok":
            self.backend(conn, self._reply_for(port))
        elif behaviour == "drip":
            reply = self._reply_for(port)
            for i in range(len(reply) - 1):
                conn.sendall(reply[i:i + 1])
                time.sleep(self.drip_delay)
            # The last byte travels with the guest's first bytes: a reader must
            # stop exactly at the newline even then.
            self.backend(conn, reply[-1:])
        elif behaviour == "close":
            pass  # EOF without a reply: nothing listens on that guest port
        elif behaviour == "garbage":
            conn.sendall(GARBAGE_REPLY)
        elif behaviour == "escape":
            conn.sendall(ESCAPE_REPLY)
        elif behaviour == "overlong":
            conn.sendall(OVERLONG_REPLY)
            _hold_open(conn)
        elif behaviour == "silent":
            _hold_open(conn)  # guest driver not up yet: never answers
        else:
            raise AssertionError(f"unhandled behaviour {behaviour!r}")

    def _reset(self, conn):
        """Close so that the client gets ECONNRESET.

        SO_LINGER {1, 0} is what makes a TCP close an RST, but AF_UNIX ignores
        it: there the peer sees ECONNRESET when a socket is closed with unread
        data in its receive queue. So the line is only peeked at (recorded,
        left unread) before the close.
        """
        first = conn.recv(MAX_LINE, socket.MSG_PEEK)
        time.sleep(self.grace)
        received = _peek(conn)
        line = received[:received.find(b"\n") + 1] if b"\n" in received else None
        self._record(received, b"\n" in first, self._parse(line))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture
def muxer(tmp_path_factory, request):
    """Factory: ``muxer(flavour="firecracker", behaviour="ok", backend=None, **options)``.

    flavour   "firecracker" | "cloud-hypervisor" (reply "OK <host port>\\n", ports
              from 1073741824 up) | "vhost-device" (reply "OK <guest port>\\n";
              drops split CONNECT lines; discards bytes sent before the reply)
    behaviour "ok" | "drip" | "close" | "reset" | "garbage" | "overlong" |
              "silent" | "escape" | "late" (late_mode for the first late_count
              connections or the first late_delay seconds, then "ok")
    backend   None (banner + echo), "sshd" (a real sshd -i, via the sshd
              fixture) or a callable(conn, reply) that must send reply itself
    options   grace, drip_delay, late_count, late_delay, late_mode
    Returns a started FakeMuxer (``.path``, ``.connections``, ...); all are
    stopped at teardown, which also fails the test on handler errors.
    """
    made = []

    def make(flavour="firecracker", behaviour="ok", backend=None, **options):
        if backend == "sshd":
            backend = request.getfixturevalue("sshd").mux_backend
        # mktemp keeps the path short: AF_UNIX paths are limited to 107 bytes.
        path = tmp_path_factory.mktemp("mux") / "mux.sock"
        m = FakeMuxer(path, flavour, behaviour, backend, **options)
        made.append(m)
        return m

    yield make
    errors = []
    for m in made:
        m.stop()
        errors.extend(m.errors)
    assert not errors, f"fake muxer handler errors: {errors!r}"


# --------------------------------------------------------------------------
# 4. Names for the test sshd as users write them, and README.md's commands
# --------------------------------------------------------------------------

SHIPPED_SNIPPET = ROOT / "ssh_config.d" / "vsock-proxy.conf"


def slash_free(kind, path):
    """The spelling of KIND/PATH without '/' (scp, rsync and git take it for
    a host name): 'unix%tmp%vm%vm.sock' for unix and /tmp/vm/vm.sock."""
    assert "%" not in path, path
    return "%s%%%s" % (kind, path.lstrip("/").replace("/", "%"))


@pytest.fixture
def vm_socket(sshd):
    """A short path that leads to the test sshd (a symlink in a fresh
    directory under /tmp): ControlPath %h and the names built from it stay
    well below the 107 bytes AF_UNIX allows."""
    import tempfile
    directory = tempfile.mkdtemp(prefix="vm", dir="/tmp")
    path = os.path.join(directory, "vm.sock")
    os.symlink(sshd.socket_path, path)
    yield path
    shutil.rmtree(directory)


def require(*programs):
    """Skip (or, under VSOCK_PROXY_REQUIRE_SSHD=1, fail) without these programs."""
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        skip_or_fail("not installed: %s" % ", ".join(missing))


README = ROOT / "README.md"
# A fenced code block and the HTML comment on the line before it (the
# reader does not see it): "<!-- run: ID -->", and a test runs the block
# through readme_block("ID"); or "<!-- not run: REASON -->".
README_BLOCK = re.compile(r"^(?:<!-- (run|not run): (.*?) -->\n)?```[^\n]*\n(.*?)^```$",
                          re.M | re.S)


def readme_blocks():
    """[(line number, "run" | "not run" | None, ID or reason, body)] for
    every fenced code block in README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2), m.group(3))
            for m in README_BLOCK.finditer(text)]


def readme_block(block_id):
    """The body of the README block marked <!-- run: block_id -->."""
    bodies = [body for _, kind, value, body in readme_blocks()
              if kind == "run" and value == block_id]
    assert len(bodies) == 1, "README.md has %d blocks marked run: %s" % (len(bodies), block_id)
    return bodies[0]


def readme_commands(block_id):
    """The commands of a README block, one per line, without blank lines and
    comments (a '#' line, or '  # ...' after a command)."""
    commands = []
    for line in readme_block(block_id).splitlines():
        command = line.split("  #")[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands
