#!/usr/bin/env python3
"""vsock-proxy: an OpenSSH ProxyCommand for virtual machines over vsock.

It connects to a VM's sshd over AF_VSOCK, an AF_UNIX socket, or a VMM's
hybrid-vsock muxer socket, and then either hands the connected socket to ssh
(--fdpass, for ``ProxyUseFdpass yes``) or relays ssh's stdin and stdout to it.
The data flows through this file top to bottom: parse the target, connect
(one function per address kind), hand over or relay, report errors.

Standard library only.  Start-up cost matters (ssh waits for the proxy on
every login), so the top imports only small built-in modules; everything
else is imported where it is needed.  The system calls come from posix, the
built-in module that os wraps: importing os builds the collections ABCs,
1.5-2 ms of the 11 ms a login waits for the proxy when Python runs without
site, as the snippet runs it (see this_command); os is imported only where
os.path or os.environ is needed, off the connection path.  Likewise the
command does without the socket module (see Socket); only the Python API's
connect() imports it.
"""

import errno
import posix
import select
import _socket
import stat
import sys
import time

from select import POLLERR, POLLHUP, POLLIN, POLLNVAL, POLLOUT

__version__ = "0.1.0"

DEFAULT_PORT = 22
DEFAULT_TIMEOUT = 5.0
LONGEST = 1e6                     # seconds: timeouts and waits stay below it
FOREVER = float("inf")            # the API's timeout or wait of None: no deadline
VMADDR_CID_ANY = 0xFFFFFFFF       # "any CID": valid for bind(), never a destination
CID_NAMES = {"hypervisor": 0, "local": 1, "host": 2}
LOCAL_SSHD_SOCKET = "/run/ssh-unix-local/socket"   # systemd-ssh-generator's local sshd
UNIX_PATH_MAX = 107               # sizeof(sun_path) - 1 on Linux

HELP = """\
usage: vsock-proxy [OPTIONS] TARGET [PORT]
       vsock-proxy --ssh-config

Connect ssh to a virtual machine over vsock.  Use it as an OpenSSH
ProxyCommand, or on its own to pipe data to a VM's port.

TARGET (the separator after the prefix may be '/' or '%'):
  vsock/CID          AF_VSOCK; CID is a number or hypervisor (0), local (1),
                     host (2).  e.g. vsock/3, vsock%3
  unix/PATH          an AF_UNIX socket that leads to the guest port (vfkit,
                     krunkit, Lima, a socat bridge).  A '/' is put in front
                     unless PATH starts with '/' or './'.  PORT is ignored.
  vsock-mux/PATH     a VMM's hybrid-vsock socket (Firecracker, Cloud
                     Hypervisor, vhost-device-vsock): sends "CONNECT PORT".
  machine/NAME       a VM or container registered with systemd-machined
                     (systemd-vmspawn, systemd-nspawn).
  .host              this host's own sshd on unix/run/ssh-unix-local/socket.
  Without any '/', for scp, rsync and git, which read a '/' before ':' as a
  local path: vsock%3, and unix%run%vm.sock or vsock-mux%run%fc.vsock (after
  unix% and vsock-mux%, every '%' stands for '/' when there is no '/').
PORT                 the guest's vsock port (default 22).

options:
  --fdpass           hand the connected socket to ssh and exit, for
                     "ProxyUseFdpass yes" (fastest: ssh then owns the socket);
                     relays when stdout cannot carry a socket (a client that
                     ignores ProxyUseFdpass).  Without --fdpass, a socket is
                     handed over too when ssh waits for one.
  --timeout SECONDS  deadline for each connection attempt, handshake
                     included (default 5)
  --wait SECONDS     keep retrying while the VM is still booting (no socket
                     yet, nothing listening, no answer) for up to SECONDS
  --check            connect, then close and exit 0 if the guest port
                     answered, 1 (and the reason) if not; quiet on success
  -v, --verbose      say on stderr what is connected to, and how
  --ssh-config       print an ssh_config snippet that runs this installation
  --version          print the version
  -h, --help         show this help

examples:
  ssh vsock/3                          with the snippet Included (see below)
  scp notes.txt vsock%3:/tmp/
  rsync -a src/ unix%run%vm.sock:src/
  ssh -o ProxyCommand='vsock-proxy %n %p' vsock/3
  ssh -o ProxyCommand='vsock-proxy --fdpass %n %p' \\
      -o ProxyUseFdpass=yes unix/run/vm/ssh.sock
  echo hello | vsock-proxy unix/tmp/echo.sock
  vsock-proxy --check --wait 60 vsock-mux/run/firecracker.vsock && ssh ...
  mkdir -p ~/.ssh && vsock-proxy --ssh-config > ~/.ssh/vsock-proxy.conf
      then put "Include ~/.ssh/vsock-proxy.conf" at the top of ~/.ssh/config

exit status: 0 every byte arrived, 1 connecting or delivering failed, 2 usage error.
"""

# Host-key policy, stated once here and in the README: VM addresses are
# ephemeral (CIDs are handed to the next VM, mux sockets and machine names
# come back with every new VM), so pinning their host keys only produces false
# alarms; unix socket paths and the local host are stable and are checked.
SSH_CONFIG = """\
# vsock-proxy: ssh to virtual machines over vsock.
#   ssh vsock/3   ssh unix/run/vm.sock   ssh vsock-mux/run/fc.vsock
#   ssh machine/NAME   ssh .host
#   scp, rsync, git: no '/' in the name: vsock%3:/tmp/  unix%run%vm.sock:/tmp/
# Include this file at the top of ~/.ssh/config (before any "Host *").
# '%n', not %h: ssh lowercases %h, which breaks unix paths with capitals;
# quoted, so that the name reaches vsock-proxy as typed (a '*' in it is not
# a glob); "!*'*": a name with a quote in it (older ssh allows them) is none
# of ours.  The command: as shipped, vsock-proxy from PATH; as printed by
# 'vsock-proxy --ssh-config', that installation's Python and directory, run
# with -I -S (no site, no environment: ssh waits for it at every login).

# VM addresses are reused by other VMs: do not pin their host keys, nor say
# "Permanently added ..." into every scp and rsync (LogLevel ERROR; ssh -v
# still shows everything).
Host vsock/* vsock%* vsock-mux/* vsock-mux%* machine/* machine%* "!*'*"
    ProxyCommand {command} --fdpass '%n' %p
    ProxyUseFdpass yes
    CheckHostIP no
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR

# Socket paths and this host are stable: host keys are checked as usual.
Host unix/* unix%* .host "!*'*"
    ProxyCommand {command} --fdpass '%n' %p
    ProxyUseFdpass yes
    CheckHostIP no
"""


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

class Error(Exception):
    """A failure with the one-line message the command prints."""

    exit_status = 1


class UsageError(Error):
    """The command line or the target is wrong: exit status 2."""

    exit_status = 2


class ConnectError(Error):
    """The target could not be reached: exit status 1.

    ``transient`` marks the failures a booting VM produces, which --wait
    retries: the socket file is not there yet, nothing listens yet, no answer.
    ``hint`` is advice that stops being true once one waits, such as "try
    --wait 60": the message that --wait gives up with leaves it out.
    """

    def __init__(self, message, transient=False, hint=None):
        super().__init__(message)
        self.transient, self.hint = transient, hint

    def __str__(self):
        return self.args[0] + ("; " + self.hint if self.hint else "")


def say_nothing(message):
    """The log when -v is not given."""


def printable(text):
    """Escape control characters, so that bytes from a peer (or a path)
    cannot send escape sequences to the user's terminal.  argv bytes the
    locale cannot decode show as the bytes they are: '\\xff'."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    return "".join(c if c.isprintable() else
                   "\\x%02x" % (ord(c) - 0xDC00) if is_undecodable_byte(c) else
                   repr(c)[1:-1] for c in text)


def shown(value):
    """A value from an API caller, short, for a message (str() of an int
    with more than 4300 digits is an error of its own)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return "an int of %d bits" % value.bit_length()
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def errno_name(exc):
    return errno.errorcode.get(exc.errno, "errno %s" % exc.errno)


def describe_os_error(exc):
    """'Connection refused (ECONNREFUSED)', like systemd's '%m' plus the name."""
    if isinstance(exc, _socket.timeout) or exc.errno is None:
        return str(exc) or type(exc).__name__
    return "%s (%s)" % (exc.strerror or posix.strerror(exc.errno), errno_name(exc))


# ---------------------------------------------------------------------------
# Parsing the target
# ---------------------------------------------------------------------------

class Target:
    """A parsed TARGET.

    kind is "vsock" (address: CID), "unix" or "vsock-mux" (address: socket
    path) or "machine" (address: machine name); port is the guest port
    (None for unix, which reaches exactly one port).  text is the target as
    the user wrote it, for messages.
    """

    __slots__ = ("kind", "address", "port", "text")

    def __init__(self, kind, address, port, text):
        self.kind, self.address, self.port, self.text = kind, address, port, text

    def __eq__(self, other):
        return isinstance(other, Target) and (
            (self.kind, self.address, self.port) ==
            (other.kind, other.address, other.port))

    def __hash__(self):
        return hash((self.kind, self.address, self.port))

    def __repr__(self):
        return "Target(%r, %r, %r)" % (self.kind, self.address, self.port)

    def __str__(self):
        return printable(self.text)

    def describe(self):
        """Where it connects, for -v: 'vsock CID 3 port 22'."""
        if self.kind == "vsock":
            return "vsock CID %d port %d" % (self.address, self.port)
        if self.kind == "unix":
            return "unix socket %s" % printable(self.address)
        if self.kind == "vsock-mux":
            return "vsock muxer %s port %d" % (printable(self.address), self.port)
        return "machine %s port %d" % (printable(self.address), self.port)


def parse_vsock_number(text, what):
    """A CID or port: decimal, 32 bits, and not 4294967295, which vsock
    reserves for "any" (VMADDR_CID_ANY, VMADDR_PORT_ANY): never a destination.
    `what` names it in messages ("PORT", "vsock/x: CID")."""
    if not (text.isascii() and text.isdigit()):
        raise UsageError("%s '%s' is not a decimal number" % (what, printable(text)))
    digits = text.lstrip("0") or "0"
    if len(digits) > 10 or int(digits) > VMADDR_CID_ANY:   # int() only on short text
        shown = text if len(text) <= 12 else text[:12] + "..."
        raise UsageError("%s %s is out of range (0 to %d)"
                         % (what, shown, VMADDR_CID_ANY - 1))
    value = int(digits)
    if value == VMADDR_CID_ANY:
        raise UsageError("%s 4294967295 means 'any' to vsock and is no "
                         "destination (0 to %d)" % (what, VMADDR_CID_ANY - 1))
    return value


def parse_port(port):
    """PORT: the command line's text, or an int from the API under the same
    rules (a bool, or a float such as 22.7, is no port)."""
    if isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 1 << 64:
        port = str(port)               # short enough for str()
    if not isinstance(port, str):
        raise UsageError("PORT takes a number from 0 to %d, not %s"
                         % (VMADDR_CID_ANY - 1, shown(port)))
    return parse_vsock_number(port, "PORT")


def parse_cid(text, target):
    if text in CID_NAMES:
        return CID_NAMES[text]
    if not text:
        raise UsageError("%s: no CID after the prefix, e.g. vsock/3" % printable(target))
    if ":" in text:
        cid, _, rest = text.partition(":")
        raise UsageError(
            "%s: '%s' after the CID is not part of an address; scp and sftp "
            "read a '/' before ':' as a local path: write vsock%%%s:%s"
            % tuple(map(printable, (target, ":" + rest, cid, rest))))
    return parse_vsock_number(text, "%s: CID" % printable(target))


def parse_socket_path(text, target):
    """systemd's rule: the path is absolute unless it starts with './'."""
    if not text:
        raise UsageError("%s: no socket path after the prefix, e.g. %s/run/vm.sock"
                         % (printable(target), target[:-1]))
    path = text if text.startswith(("/", "./")) else "/" + text
    if len(fs_encode(path)) > UNIX_PATH_MAX:
        raise UsageError("%s: the socket path is longer than the %d bytes "
                         "AF_UNIX allows; use a shorter path, or run from its "
                         "directory with unix/./NAME" % (printable(target), UNIX_PATH_MAX))
    return path


def parse_machine_name(text, target):
    if not text or "/" in text:
        raise UsageError("%s: expected machine/NAME with a machine name as "
                         "'machinectl list' shows it" % printable(target))
    return text


def fs_encode(text):
    """os.fsencode, without os: the bytes a path or argument stands for."""
    return text.encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())


def is_undecodable_byte(char):
    """argv bytes that are not valid in the locale's encoding arrive as
    U+DC80..U+DCFF (surrogateescape) and go back to the same bytes in paths."""
    return "\udc80" <= char <= "\udcff"


def parse_target(text, port=DEFAULT_PORT):
    """Parse TARGET ('vsock/3', 'unix%run/vm.sock', ...) into a Target.

    text is a str, or bytes, decoded as os.fsdecode decodes them (and Python
    argv): bytes the locale cannot decode reach a socket path unchanged.
    port is an int or the PORT argument as a string.  Raises UsageError.
    """
    port = parse_port(port)
    if isinstance(text, bytes):
        text = text.decode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())
    if not isinstance(text, str):
        raise UsageError("TARGET takes a str such as 'vsock/3', not %s" % shown(text))
    if not text:
        raise UsageError("empty TARGET; try vsock/CID, unix/PATH, "
                         "vsock-mux/PATH or machine/NAME")
    if any(c.isspace() or not (c.isprintable() or is_undecodable_byte(c))
           for c in text):
        raise UsageError("TARGET '%s' contains white space or control "
                         "characters" % printable(text))
    if text in (".host", "machine/.host", "machine%.host"):
        return Target("unix", LOCAL_SSHD_SOCKET, None, text)
    separator = min((i for i in (text.find("/"), text.find("%")) if i >= 0),
                    default=-1)
    kind, rest = text[:separator], text[separator + 1:]
    if separator < 0 or kind not in ("vsock", "unix", "vsock-mux", "machine"):
        raise UsageError("unknown TARGET '%s'; expected vsock/CID, unix/PATH, "
                         "vsock-mux/PATH, machine/NAME or .host" % printable(text))
    if kind == "vsock":
        return Target(kind, parse_cid(rest, text), port, text)
    if kind in ("unix", "vsock-mux") and text[separator] == "%" and "/" not in rest:
        rest = rest.replace("%", "/")      # the spelling without '/' (see README)
    if kind == "unix":
        return Target(kind, parse_socket_path(rest, text), None, text)
    if kind == "vsock-mux":
        return Target(kind, parse_socket_path(rest, text), port, text)
    return Target(kind, parse_machine_name(rest, text), port, text)


# ---------------------------------------------------------------------------
# Connecting: one function per address kind
# ---------------------------------------------------------------------------

class Socket(_socket.socket):
    """The command's sockets: _socket.socket, the built-in type that the
    socket module's socket.socket extends, plus `with`.  `import socket`
    costs 8-10 ms at every start (it imports selectors and builds enums), as
    much as everything else the command does; connect() hands the Python
    API a socket.socket over the same descriptor."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def timeval(seconds):
    """struct timeval: two C longs, seconds and microseconds (what
    struct.pack("ll") gives, without importing struct: 0.3 ms at every
    connection).  Any time above 0 stays above 0, because 0 means 'forever'
    (to SO_SNDTIMEO), which is what FOREVER becomes."""
    if seconds == FOREVER:
        seconds = 0
    micro = max(round(seconds * 1e6), 1 if seconds > 0 else 0)
    long_size = 8 if sys.maxsize > 1 << 32 else 4     # LP64 or ILP32
    return b"".join(part.to_bytes(long_size, sys.byteorder)
                    for part in divmod(micro, 1000000))


def seconds_text(seconds):
    return "%gs" % round(seconds, 2)


def time_left(deadline):
    """The time left until deadline, at least 1 ms (so that a step that can
    be done at once still is): one deadline bounds a whole exchange."""
    return max(deadline - time.monotonic(), 0.001)


def set_deadline(sock, deadline):
    """Bound sock's next step by deadline (none: FOREVER)."""
    sock.settimeout(None if deadline == FOREVER else time_left(deadline))


def connect_vsock(target, timeout):
    family = getattr(_socket, "AF_VSOCK", None)
    if family is None:
        raise ConnectError(
            "%s: this system has no AF_VSOCK (%s); reach the VM through its "
            "VMM's socket instead: unix/PATH or vsock-mux/PATH"
            % (target, sys.platform))
    try:
        sock = Socket(family, _socket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectError(
            "%s: cannot create an AF_VSOCK socket: %s; is the vsock module "
            "loaded (modprobe vhost_vsock)? Otherwise use unix/ or vsock-mux/"
            % (target, describe_os_error(exc)))
    # The kernel has no "forever" for a vsock connect (0 means its default,
    # 2 s): no deadline becomes the longest timeout we take.
    timeout = min(timeout, LONGEST)
    try:
        set_vsock_connect_timeout(sock, timeout)
        sock.settimeout(timeout)
        sock.connect((target.address, target.port))
        sock.settimeout(None)
        return sock
    except OSError as exc:
        sock.close()
        raise vsock_connect_error(target, exc, timeout)


def set_vsock_connect_timeout(sock, seconds):
    """The kernel gives up on a vsock connect after 2 s by default: make it
    wait as long as we do.  SO_VM_SOCKETS_CONNECT_TIMEOUT (6) takes a struct
    timeval, but Python's setsockopt on an AF_VSOCK socket only passes a
    64-bit integer (EINVAL); a socket object over a dup of the fd that
    believes it is AF_UNIX passes the bytes as they are."""
    with Socket(_socket.AF_UNIX, _socket.SOCK_STREAM,
                fileno=posix.dup(sock.fileno())) as same_socket:
        same_socket.setsockopt(sock.family, 6, timeval(seconds))


def vsock_connect_error(target, exc, timeout):
    """A booting vhost-vsock guest gives, in this order (measured against a
    real one, tests/test_guest.py): ENODEV until its VMM has opened the
    vhost device and set the CID; ETIMEDOUT while firmware and kernel boot
    (the request waits in the device's queue, so an attempt still waiting
    when the guest's driver comes up ends early, with ECONNRESET);
    ECONNRESET, at once, while nothing listens on the port.  A stopped VM
    gives ENODEV at once.  ECONNREFUSED never came from a guest."""
    cid, port = target.address, target.port
    code = errno.ETIMEDOUT if isinstance(exc, _socket.timeout) else exc.errno
    reason = describe_os_error(exc) if code != errno.ETIMEDOUT else \
        "no answer within %s (ETIMEDOUT)" % seconds_text(timeout)
    if code in (errno.ECONNRESET, errno.ECONNREFUSED):
        return ConnectError(
            "%s: nothing is listening on vsock port %d (%s): is sshd listening "
            "on vsock port %d in the guest?" % (target, port, errno_name(exc), port),
            transient=True)
    if code == errno.ENODEV:
        hint = ("is the vsock_loopback module loaded?" if cid == 1 else
                "is the VM running, with a vsock device and this CID?")
        return ConnectError("%s: no VM with CID %d (ENODEV): %s"
                            % (target, cid, hint), transient=True)
    if code == errno.ETIMEDOUT:
        return ConnectError("%s: %s: the guest may still be booting"
                            % (target, reason), transient=True, hint="try --wait 60")
    if code in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return ConnectError("%s: %s: no vsock transport reaches CID %d"
                            % (target, reason, cid), transient=True)
    if code in (errno.EACCES, errno.EPERM):
        return ConnectError("%s: permission denied (%s)" % (target, errno_name(exc)))
    return ConnectError("%s: %s" % (target, reason))


def connect_unix(target, timeout):
    try:
        return open_unix_socket(target.address, timeout)
    except OSError as exc:
        raise unix_connect_error(target, exc, timeout)


def open_unix_socket(path, timeout):
    """A connected, blocking AF_UNIX socket.  A listen backlog that stays
    full for timeout (a burst of connections) raises EAGAIN."""
    sock = Socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # A blocking connect with SO_SNDTIMEO waits for room in a full listen
        # backlog; a non-blocking one fails at once with EAGAIN.  The option
        # is cleared again: it would also limit every later send, and ssh
        # inherits it with --fdpass.
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, timeval(timeout))
        sock.connect(path)
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, timeval(0))
        return sock
    except BaseException:
        sock.close()
        raise


def unix_connect_error(target, exc, timeout):
    path = printable(target.address)
    if exc.errno == errno.ENOENT:
        return ConnectError("%s: no such socket file: %s (ENOENT)%s"
                            % (target, path, missing_path_hint(target)),
                            transient=True)
    if exc.errno == errno.ECONNREFUSED and not is_socket_file(target.address):
        return ConnectError("%s: %s is not a socket" % (target, path))
    if exc.errno == errno.ECONNREFUSED:
        return ConnectError(
            "%s: nothing accepts connections on %s (ECONNREFUSED): the VM or "
            "the service behind the socket is not running" % (target, path),
            transient=True)
    if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT):
        return ConnectError("%s: %s stayed busy for %s (its listen backlog "
                            "is full)" % (target, path, seconds_text(timeout)),
                            transient=True)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConnectError(
            "%s: permission denied on %s (%s): run as a user who may open it "
            "(its owner or group, or sudo)" % (target, path, errno_name(exc)))
    return ConnectError("%s: cannot connect to %s: %s"
                        % (target, path, describe_os_error(exc)))


def is_socket_file(path):
    try:
        return stat.S_ISSOCK(posix.stat(path).st_mode)
    except OSError:
        return True            # gone meanwhile: let ECONNREFUSED speak


def missing_path_hint(target):
    """Why a socket path the user typed may not exist: a mistyped letter case
    (or a ProxyCommand with %h, which ssh lowercases), or scp and sftp
    passing 'HOST:PATH' whole when HOST contains a '/'."""
    other_case = path_in_other_case(target.address)
    if other_case:
        return ("; there is %s, which differs in letter case: check the name "
                "(in a ProxyCommand, use %%n: ssh lowercases %%h)" % printable(other_case))
    host, colon, remote_path = target.text.partition(":")
    if not (colon and "/" in host):
        return ""
    socket_path = target.address.partition(":")[0]
    if "%" in socket_path:      # the spelling without '/' reads '%' as '/'
        cure = "give the socket a Host alias in ssh_config"
    else:
        cure = "write %s%%%s:%s" % (target.kind, socket_path.lstrip("/").replace("/", "%"),
                                    remote_path)
    return "; scp and sftp pass 'HOST:PATH' whole when HOST has a '/': " + printable(cure)


def path_in_other_case(path):
    """The existing path that equals `path` but for letter case, or None."""
    import os
    found = "/" if path.startswith("/") else "."
    for name in path.split("/"):
        if not name or os.path.exists(os.path.join(found, name)):
            found = os.path.join(found, name)
            continue
        try:
            matches = [n for n in os.listdir(found) if n.lower() == name.lower()]
        except OSError:
            return None
        if not matches:
            return None
        found = os.path.join(found, matches[0])
    found = os.path.normpath(found)
    return found if found != os.path.normpath(path) else None


MUX_REPLY_MAX = 32    # "OK 1073741824\n" is 14 bytes; room to show garbage


def connect_vsock_mux(target, timeout):
    """Firecracker / Cloud Hypervisor / vhost-device-vsock hybrid vsock:
    send 'CONNECT <port>\\n', consume exactly the 'OK <n>\\n' reply."""
    deadline = time.monotonic() + timeout
    sock = connect_unix(target, timeout)
    try:
        set_deadline(sock, deadline)
        try:
            # One write: vhost-device-vsock drops a CONNECT line split in two.
            sock.sendall(b"CONNECT %d\n" % target.port)
        except OSError as exc:
            raise ConnectError("%s: the VMM hung up before it took CONNECT %d: "
                               "%s" % (target, target.port, describe_os_error(exc)),
                               transient=True)
        read_mux_reply(sock, target, timeout, deadline)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def read_mux_reply(sock, target, timeout, deadline):
    """Consume the reply line and not one byte more: the guest's first bytes
    (sshd's banner) follow at once, often in the same segment.  Peek, then
    receive exactly the peeked bytes up to and including the newline.  The
    deadline covers the whole line, however slowly it drips in."""
    line = b""
    while not line.endswith(b"\n"):
        if len(line) >= MUX_REPLY_MAX:
            raise ConnectError("%s: the VMM's reply is not 'OK <port>': %s... "
                               "(no newline in %d bytes)"
                               % (target, printable(line), len(line)))
        try:
            if time.monotonic() >= deadline:
                raise _socket.timeout()
            set_deadline(sock, deadline)
            peeked = sock.recv(MUX_REPLY_MAX - len(line), _socket.MSG_PEEK)
            if peeked:
                newline = peeked.find(b"\n")
                line += sock.recv(newline + 1 if newline >= 0 else len(peeked))
        except _socket.timeout:
            got = " after '%s'" % printable(line) if line else ""
            raise ConnectError(
                "%s: no reply to CONNECT %d within %s%s: the guest's vsock "
                "driver may not be up yet"
                % (target, target.port, seconds_text(timeout), got), transient=True,
                hint="try --wait 60")
        except ConnectionResetError:
            raise ConnectError("%s: the VMM reset the connection after CONNECT "
                               "%d: nothing listening on that port in the "
                               "guest?" % (target, target.port), transient=True)
        except OSError as exc:
            raise ConnectError("%s: reading the VMM's reply: %s"
                               % (target, describe_os_error(exc)))
        if not peeked:
            got = " after '%s'" % printable(line) if line else ""
            raise ConnectError(
                "%s: the VM refused port %d%s: nothing listening in the guest, "
                "or the guest is not up" % (target, target.port, got),
                transient=True)
    number = line[3:-1]
    if not (line.startswith(b"OK ") and 1 <= len(number) <= 10 and number.isdigit()):
        raise ConnectError("%s: the VMM's reply to CONNECT %d is not 'OK <port>': "
                           "'%s'" % (target, target.port, printable(line)))


MACHINED_SOCKET = "systemd/machine/io.systemd.Machine"


def machined_runtime_dirs():
    """Where systemd-machined's instances live, the user's first, each with
    the path of its socket.  VSOCK_PROXY_RUN_DIR stands in for /run (tests
    serve a fake machined)."""
    import os
    user = os.environ.get("XDG_RUNTIME_DIR")
    runtime_dirs = [user] if user else []
    runtime_dirs.append(os.environ.get("VSOCK_PROXY_RUN_DIR", "/run"))
    return [(d, os.path.join(d, MACHINED_SOCKET)) for d in runtime_dirs]


def ask_machined(path, target, deadline):
    """Call io.systemd.Machine.List for one machine.  Returns the reply's
    parameters, None for NoSuchMachine.  The deadline covers the whole
    exchange, however slowly the reply drips in: past it, socket.timeout.
    A listen backlog that stays full (machined is busy) raises
    BlockingIOError; another OSError means that nobody listens.  A machined
    that fails during the call (it crashed: ECONNRESET) is a ConnectError,
    as one that sends no complete reply is."""
    import json
    with open_unix_socket(path, time_left(deadline)) as sock:
        call = {"method": "io.systemd.Machine.List",
                "parameters": {"name": target.address}}
        try:
            set_deadline(sock, deadline)
            sock.sendall(json.dumps(call).encode() + b"\0")
            reply = b""
            while b"\0" not in reply:          # Varlink messages end with a NUL
                if time.monotonic() >= deadline:
                    raise _socket.timeout()
                set_deadline(sock, deadline)
                chunk = sock.recv(65536)
                if not chunk or len(reply) > 1 << 20:
                    raise ConnectError("%s: systemd-machined at %s sent no complete "
                                       "reply" % (target, printable(path)))
                reply += chunk
        except _socket.timeout:
            raise
        except OSError as exc:
            raise ConnectError("%s: systemd-machined at %s broke off the call: %s"
                               % (target, printable(path), describe_os_error(exc)))
    try:
        message = json.loads(reply[:reply.index(b"\0")])
        error, parameters = message.get("error"), message.get("parameters")
        if not (error or isinstance(parameters, dict)):
            raise ValueError("no parameters")
    except (ValueError, AttributeError, RecursionError):    # nested too deep
        raise ConnectError("%s: systemd-machined at %s sent a reply that is "
                           "not Varlink JSON" % (target, printable(path)))
    if error == "io.systemd.Machine.NoSuchMachine":
        return None
    if error:
        raise ConnectError("%s: systemd-machined answered %s"
                           % (target, printable(str(error))))
    return parameters


def resolve_machine(target, deadline):
    """machine/NAME -> the vsock/ or unix/ Target that reaches its sshd,
    asking the user's machined first, then the system's (as systemd does)."""
    answered = False
    for runtime_dir, path in machined_runtime_dirs():
        try:
            machine = ask_machined(path, target, deadline)
        except _socket.timeout:
            raise ConnectError("%s: systemd-machined at %s did not answer in time"
                               % (target, printable(path)), transient=True)
        except BlockingIOError:
            raise ConnectError("%s: systemd-machined at %s stayed busy (its "
                               "listen backlog is full)" % (target, printable(path)),
                               transient=True)
        except OSError:
            continue                       # this instance is not running
        answered = True
        if machine is not None:
            return machine_address(target, machine, runtime_dir)
    if not answered:
        sockets = [path for _, path in machined_runtime_dirs()]
        raise ConnectError("%s: systemd-machined is not running (no answer on %s)"
                           % (target, " or ".join(map(printable, sockets))))
    raise ConnectError("%s: systemd-machined knows no machine %s (see "
                       "'machinectl list')" % (target, printable(target.address)),
                       transient=True)


def machine_address(target, machine, runtime_dir):
    """A VM by its vsock CID, else by the sshAddress it registered; an nspawn
    container by the socket systemd-ssh-generator exports for it."""
    cid = machine.get("vSockCid")
    if type(cid) is int and 0 <= cid < VMADDR_CID_ANY:     # not bool
        return Target("vsock", cid, target.port, "%s (vsock/%d)" % (target.text, cid))
    address = machine.get("sshAddress")
    if isinstance(address, str):
        try:
            resolved = parse_target(address, target.port)
        except UsageError:
            resolved = None
        if resolved is not None and resolved.kind != "machine":
            resolved.text = "%s (%s)" % (target.text, address)
            return resolved
    if machine.get("class") == "container" and machine.get("service") == "systemd-nspawn":
        import os
        path = os.path.join(runtime_dir, "systemd/nspawn/unix-export",
                            target.address, "ssh")
        return Target("unix", path, None, "%s (unix%s)" % (target.text, path))
    raise ConnectError("%s: the machine has no vsock CID and no ssh address "
                       "vsock-proxy understands (class %s)"
                       % (target, printable(str(machine.get("class")))))


CONNECTORS = {
    "vsock": connect_vsock,
    "unix": connect_unix,
    "vsock-mux": connect_vsock_mux,
}


def connect_once(target, timeout, log):
    """One attempt; timeout covers all of it, a machined lookup included."""
    if target.kind == "machine":
        deadline = time.monotonic() + timeout
        target = resolve_machine(target, deadline)
        timeout = time_left(deadline)
    log("connecting to %s" % target.describe())
    return CONNECTORS[target.kind](target, timeout)


def connect(target, port=DEFAULT_PORT, *, timeout=DEFAULT_TIMEOUT, wait=0.0,
            log=None):
    """Connect to TARGET and return the connected, blocking socket.socket.

    TARGET is a string ('vsock/3', 'unix/run/vm.sock', 'vsock-mux/PATH',
    'machine/NAME', '.host'; bytes are decoded as os.fsdecode does) or a
    Target from parse_target, whose port is used instead of `port`.  port is
    an int or a decimal string, 0 to 4294967294.  For vsock-mux the
    handshake is done: the socket's first byte is the guest's.

    timeout (seconds above 0) bounds each attempt, handshake and machined
    lookup included; None means no deadline, as for Python's sockets.  With
    wait > 0, failures a booting VM produces are retried until `wait`
    seconds have passed; 0 tries once, None retries until it connects.  A
    timeout of 0 is refused: to Python's sockets it means "do not wait", to
    the kernel's timeouts "forever".

    Raises UsageError for bad arguments, ConnectError if the target cannot
    be reached; the message is the line the command prints.
    """
    import socket
    sock = connect_target(target, port, timeout=timeout, wait=wait, log=log)
    return socket.socket(fileno=sock.detach())


def connect_target(target, port=DEFAULT_PORT, *, timeout=DEFAULT_TIMEOUT,
                   wait=0.0, log=None):
    """connect() for the command: the same connection as a Socket, without
    importing the socket module."""
    timeout = seconds_argument("timeout", timeout, zero_allowed=False)
    wait = seconds_argument("wait", wait, zero_allowed=True)
    if not isinstance(target, Target):
        target = parse_target(target, port)
    log = log or say_nothing
    started = time.monotonic()
    give_up = started + wait
    backoff, attempt = 0.05, 0
    while True:
        attempt += 1
        remaining = give_up - time.monotonic()
        attempt_timeout = timeout if wait <= 0 else min(timeout, max(remaining, 0.05))
        try:
            return connect_once(target, attempt_timeout, log)
        except ConnectError as exc:
            remaining = give_up - time.monotonic()
            if not exc.transient or wait <= 0:
                raise
            if remaining <= 0:
                raise ConnectError("%s (gave up after %s and %d attempts)" % (
                    exc.args[0], seconds_text(time.monotonic() - started), attempt)) from None
            log("attempt %d: %s; retrying" % (attempt, exc.args[0]))
            time.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, 1.0)


def seconds_argument(name, value, zero_allowed):
    """connect()'s timeout or wait: an int or a float (not a bool) below
    LONGEST, or None for no deadline (FOREVER)."""
    if value is None:
        return FOREVER
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (0 <= value if zero_allowed else 0 < value) and value < LONGEST):
        return float(value)
    raise UsageError("%s takes a number of seconds, %s and below %d, or None "
                     "for no deadline; not %s"
                     % (name, "0 or more" if zero_allowed else "above 0", LONGEST,
                        shown(value)))


# ---------------------------------------------------------------------------
# Handing over: fd passing for ProxyUseFdpass
# ---------------------------------------------------------------------------

def hands_over(fdpass, log):
    """Pass the connected socket to ssh (True), or relay (False)?

    --fdpass passes it when stdout can carry it; a client that reads the
    snippet but ignores ProxyUseFdpass (asyncssh) runs its command with
    pipes, where only relaying works.  Without --fdpass, ssh may still be
    waiting for a socket: '-o ProxyCommand=...' replaces the snippet's
    command, but the snippet's ProxyUseFdpass yes still applies."""
    if fdpass:
        if stdout_is_unix_socket():
            return True
        log("stdout is not a unix socket (ProxyUseFdpass is not in effect): "
            "relaying instead of passing the socket")
        return False
    if ssh_waits_for_a_socket():
        log("ssh waits for a socket (ProxyUseFdpass yes): passing it instead "
            "of relaying")
        return True
    return False


def ssh_waits_for_a_socket():
    """ssh with ProxyUseFdpass yes gives its proxy one end of a socketpair as
    both stdin and stdout, and waits for a descriptor on it.  socat EXEC:,
    inetd and systemd's Accept=yes give one socket for both too, so the shape
    alone does not tell: the process at the other end must be ssh."""
    return (same_open_file(0, 1) and stdout_is_unix_socket()
            and peer_process_name(1) == "ssh")


def same_open_file(fd, other):
    """Are fd and other one file (one socket given as both stdin and stdout)?"""
    try:
        a, b = posix.fstat(fd), posix.fstat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def peer_process_name(fd):
    """The name of the process at the other end of the unix socket fd (of a
    socketpair: the process that made it), or None where nothing says."""
    with Socket(fileno=posix.dup(fd)) as sock:
        if sock.family != _socket.AF_UNIX:
            return None
        if hasattr(_socket, "SO_PEERCRED"):            # Linux: pid, uid, gid
            credentials = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
        elif sys.platform == "darwin":                 # SOL_LOCAL, LOCAL_PEERPID
            credentials = sock.getsockopt(0, 2, 4)
        else:
            return None
    pid = int.from_bytes(credentials[:4], sys.byteorder)
    try:
        with open("/proc/%d/comm" % pid) as comm:
            return comm.read().rstrip("\n")
    except OSError:
        pass                    # no /proc (macOS): ask ps
    import os
    import subprocess
    try:
        ps = subprocess.run(["ps", "-o", "comm=", "-p", str(pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            timeout=DEFAULT_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return os.path.basename(ps.stdout.decode(errors="replace").strip()) or None


def stdout_is_unix_socket():
    try:
        if not stat.S_ISSOCK(posix.fstat(1).st_mode):
            return False
        with Socket(fileno=posix.dup(1)) as out:
            return out.family == _socket.AF_UNIX
    except OSError:
        return False


def pass_fd(sock, target):
    """Send the socket to ssh: one NUL data byte plus the fd (SCM_RIGHTS),
    exactly what ssh's mm_receive_fd expects."""
    fds = sock.fileno().to_bytes(4, sys.byteorder)     # a C int array of one
    with Socket(fileno=posix.dup(1)) as out:
        try:
            out.sendmsg([b"\0"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        except (BrokenPipeError, ConnectionResetError):
            raise ConnectError("%s: ssh went away before it took the "
                               "connection (EPIPE)" % target)


# ---------------------------------------------------------------------------
# Relaying: stdin -> socket ("up") and socket -> stdout ("down")
# ---------------------------------------------------------------------------
# The promise: exit 0 means every byte read from stdin was accepted by the
# peer's socket and every byte the peer sent was written to stdout; otherwise
# exit 1 with one line that says which.  And the relay always ends: once the
# conversation is over from either side, it returns at once.
#
# Endings, as relay() applies them:
#
#   what happens                          what the relay does            exit
#   ------------------------------------  -----------------------------  ----
#   stdin ends (EOF; a terminal hangs up) shutdown(SHUT_WR) the socket;  -
#                                         down goes on until the peer's
#                                         EOF
#   the peer's EOF                        end stdout (shutdown(SHUT_WR)  -
#                                         first if it is a socket: it
#                                         may be stdin too); up goes on
#                                         while the peer only half-closed
#   both directions have ended            return                         0
#   the peer closed entirely, stdin open  return; bytes waiting on stdin 0 / 1
#                                         could not be delivered: 1
#   the peer closed with our bytes unread return (AF_UNIX says           1
#     (ECONNRESET)                        ECONNRESET; vsock cannot tell
#                                         this from a clean close)
#   a send fails (EPIPE: the peer closed  stop reading stdin; down       1
#     or stopped reading)                 delivers what the peer sent
#   stdout's reader has gone, nothing     stop writing stdout; return    0 / 1
#     waiting for it                      once stdin has ended too; a
#                                         byte from the peer after that
#                                         is lost, or a socket on stdout
#                                         says its reader left bytes
#                                         unread (ECONNRESET): 1
#   the peer's EOF, and a socket on       return                         1
#     stdout says its reader left bytes
#     unread (ECONNRESET)
#   writing stdout fails with bytes in    return                         1
#     hand (EPIPE, EIO, ENOSPC)
#   silence, or a peer that never reads   wait: the conversation is not  -
#                                         over while both sides hold it
#
# Against a real guest (vhost-vsock, tests/test_guest.py) a peer's half-close
# and close look as on the loopback: no POLLHUP for its close while our side
# is open.  A VM that disappears (its VMM killed) leaves what the loopback
# never shows: the host resets the orphaned connection, poll says POLLERR
# (never POLLHUP), reads fail with ECONNRESET and sends with EPIPE: exit 1,
# "connection reset by the peer".
#
# Every read is forwarded at once: no MSG_MORE, no timers, no batching.

SPLICE_CHUNK = 1 << 20
COPY_CHUNK = 256 * 1024
# Measured with bench/: 64 KiB (the default) -> 256 KiB pipes lift upload
# from 2.1 to 3.2 GB/s; 1 MiB gives 4.1.  Pipe pages count against the user's
# pipe-user-pages-soft (16384 pages, 64 MiB), together with all the user's
# other pipes: a relay's two 256 KiB pipes take 128 pages, so an account can
# run up to 128 relays before we stop enlarging (124 measured, beside ssh's
# and the session's own pipes); past the limit every new pipe of that user
# gets only 8 KiB, so 1 MiB pipes (32 relays) would be too greedy.
PIPE_SIZE = 256 * 1024
SOCKET_SEND_BUFFER = 1 << 20
ENDED = POLLHUP | POLLERR
# vsock reports POLLHUP only once both sides have shut down: after the peer's
# half-close, its full close wakes nobody, so we look every so often.
PEER_CLOSE_PROBE_MS = 200
STDOUT_GONE = "stdout's reader went away before the peer's data was written"


class Pump:
    """One direction of the relay, src -> dst.  `wait` is the (fd, poll
    events) it needs before it can go on, None once it has ended: the event
    it waits for, and POLLHUP and POLLERR, which poll reports whatever it is
    asked, and which the next move turns into EOF or an error.  It moves
    bytes with os.splice when one end is a pipe (Linux, Python 3.10+: no
    copy through Python), else with read and write and a buffer of what the
    destination has not taken yet."""

    def __init__(self, src, dst, splice):
        self.src, self.dst = src, dst
        self.reading, self.writing = (src, POLLIN | ENDED), (dst, POLLOUT | ENDED)
        self.wait = self.reading
        self.pending = b""
        self.move = self.splice if splice else self.copy

    def splice(self, ready_fd):
        """One non-blocking splice; True at EOF.  A blocking one into the
        stdout pipe would hold the pipe's lock while it waits for the socket,
        stalling ssh's read of that pipe, so every splice is
        SPLICE_F_NONBLOCK on a non-blocking socket, after poll said it can
        go.  O_NONBLOCK is never set on stdin or stdout: the flag is shared
        with the process that gave them to us."""
        try:
            moved = posix.splice(self.src, self.dst, SPLICE_CHUNK,
                                 flags=posix.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            # We came because one end was ready; the other one is not.
            self.wait = self.writing if ready_fd == self.src else self.reading
            return False
        self.wait = self.reading
        return moved == 0

    def copy(self, ready_fd):
        """Read if nothing is pending, then write at once; True at EOF.
        BlockingIOError (a non-blocking stdin or stdout: asyncio parents hand
        those over) means "not now": wait for that end, never "the end"."""
        if not self.pending:
            try:
                self.pending = posix.read(self.src, COPY_CHUNK)
            except BlockingIOError:
                return False
            if not self.pending:
                return True
        try:
            written = posix.write(self.dst, self.pending)
        except BlockingIOError:
            written = 0
        self.pending = self.pending[written:]
        self.wait = self.writing if self.pending else self.reading
        return False


def relay(sock, target, log):
    """Relay between stdin/stdout and sock until the conversation is over, as
    the table above says.  Raises Error when a byte could not be delivered."""
    sock.setblocking(False)
    if sock.family == _socket.AF_UNIX:
        # A larger send buffer halves the wake-ups per megabyte uploaded
        # (measured: 1.9 -> 2.9 GB/s); the kernel caps it at wmem_max.
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
    sock_fd = sock.fileno()
    pipes = [fd for fd in (0, 1) if can_splice(fd)]
    grow_pipes(pipes)
    up = Pump(0, sock_fd, 0 in pipes)
    down = Pump(sock_fd, 1, 1 in pipes)
    stdin_is_stdout = same_open_file(0, 1)   # fd 1 is closed once down ends
    log(relay_method(up, down))
    up_lost = None           # why stdin could not all be delivered
    stdout_gone = False
    poller, registered = select.poll(), {}
    settled = None           # (up.wait, down.wait, stdout_gone) the poll is set up for
    while True:
        # Most rounds of an interactive session wait as the last one did:
        # only a change of state needs the ending checks and a new poll set.
        # The keystroke round trip is this loop's cost: with this, the
        # checks after poll in the order of how often they hit, and no
        # stdout watch while stdin is open, the relay's CPU per 1-byte round
        # trip went from 17.1 to 15.8 us (socat -b 65536: 20.7) and its
        # unpinned round trip from 1.02x socat's to 0.98x (bench/, 100
        # interleaved rounds).
        if (up.wait, down.wait, stdout_gone) != settled:
            settled = (up.wait, down.wait, stdout_gone)
            if up.wait is None and (down.wait is None or stdout_gone):
                break
            # Once stdin has ended while down runs, stdout is watched for its
            # reader going away (poll says POLLERR or POLLHUP whatever we ask):
            # with a silent peer, that ends the relay.  While stdin is open it
            # would change nothing, and a third descriptor costs every poll
            # (0.7-0.9 us of system time per round trip).
            # Once down has ended, the socket is watched, for the peer's full
            # close (POLLHUP, on AF_UNIX).
            if down.wait is None:
                watch = (sock_fd, 0)
            elif up.wait is None and not stdout_gone:
                watch = (1, 0)
            else:
                watch = None
            registered = update_poll(poller, registered, (up.wait, down.wait, watch))
            # The peer half-closed: is it gone?  Look every so often.
            timeout = PEER_CLOSE_PROBE_MS if down.wait is None else None
        for fd, events in poller.poll(timeout):
            if down.wait and fd == down.wait[0] and events & down.wait[1]:
                try:
                    ended = down.move(fd)
                except OSError as exc:
                    if not is_end_of_stream(exc, down):
                        raise download_failure(exc, down, sock, target)
                    ended = True
                if ended:
                    down.wait = None
                    if stdout_was_reset():
                        raise stdout_gone_error(target, "ECONNRESET")
                    end_stdout()
            if up.wait and fd == up.wait[0] and events & up.wait[1]:
                try:
                    ended = up.move(fd)
                except OSError as exc:
                    if reset_by_stdouts_reader(exc, up, stdin_is_stdout):
                        raise stdout_gone_error(target, "ECONNRESET")
                    if not is_end_of_stream(exc, up):
                        up_lost = upload_failure(exc, up)
                    ended = True
                if ended:
                    up.wait = None
                    stop_sending(sock)
            if events & POLLNVAL:
                raise Error("%s: cannot wait for descriptor %d with poll() on "
                            "this system; pipe it through cat" % (target, fd))
            if fd == 1 and events & ENDED and down.wait and not down.pending:
                stdout_gone = True
        if down.wait is None and peer_has_closed(sock):
            if up_lost is None and stdin_has_more(up):
                up_lost = "the peer closed the connection before it took all of stdin"
            break
    if up_lost is None:
        up_lost = closed_with_bytes_unread(sock)
    if up_lost:
        raise Error("%s: %s" % (target, up_lost))
    if stdout_gone and stdout_was_reset():
        raise stdout_gone_error(target, "ECONNRESET")
    if stdout_gone and socket_has_more(sock):
        raise Error("%s: %s" % (target, STDOUT_GONE))


def can_splice(fd):
    try:
        return hasattr(posix, "splice") and stat.S_ISFIFO(posix.fstat(fd).st_mode)
    except OSError:
        return False


def relay_method(up, down):
    """For -v: how each direction moves its bytes."""
    if up.move == up.splice and down.move == down.splice:
        return "relaying with splice (zero-copy)"
    if up.move == up.copy and down.move == down.copy:
        return "relaying with read/write"
    return "relaying stdin with %s, stdout with %s" % (
        "splice" if up.move == up.splice else "read/write",
        "splice" if down.move == down.splice else "read/write")


def update_poll(poller, registered, waits):
    """Register the union of the waits; returns {fd: events} as registered.
    Called only when a wait changes: most rounds of an interactive session
    wait as the last one did (this took the keystroke round trip from 1.7x
    socat's to 1.0x, bench/)."""
    wanted = {}
    for fd, event in filter(None, waits):
        wanted[fd] = wanted.get(fd, 0) | event
    for fd in registered.keys() - wanted.keys():
        poller.unregister(fd)
    for fd, events in wanted.items():
        if registered.get(fd) != events:
            poller.register(fd, events)
    return wanted


def grow_pipes(fds):
    """Bigger pipes mean fewer wake-ups per megabyte; the system's limits may
    refuse it, which only costs speed."""
    import fcntl
    for fd in fds:
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass


def failed_reading(exc, pump):
    """Did pump's last move fail on its source's side?  A splice fails on its
    pipe's side only when writing into it with the reader gone (EPIPE); a
    copy that fails with nothing pending failed reading."""
    if pump.move == pump.splice:
        return pump.src != 0 and exc.errno != errno.EPIPE
    return not pump.pending


def is_end_of_stream(exc, pump):
    """Reading errors that only say the stream is over: EIO from a terminal
    that hung up, and ENOTCONN from a vsock socket that we shut down after
    its peer had closed (the kernel then forgets that the close was orderly)."""
    return exc.errno in (errno.EIO, errno.ENOTCONN) and failed_reading(exc, pump)


def reset_by_stdouts_reader(exc, up, stdin_is_stdout):
    """ECONNRESET reading stdin: only a socket that is stdout too (one socket
    for both: socat EXEC:, inetd) is reset under our reads, by a reader that
    closed it with bytes we wrote still unread.  Whatever it sent had been
    read by then (AF_UNIX reports the reset after the queued bytes)."""
    return (stdin_is_stdout and exc.errno == errno.ECONNRESET
            and failed_reading(exc, up))


def upload_failure(exc, up):
    """Why the rest of stdin cannot be delivered, from a failed up.move."""
    if failed_reading(exc, up):
        return "reading stdin: %s" % describe_os_error(exc)
    if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
        return ("the peer closed the connection before it took all of stdin "
                "(%s)" % errno_name(exc))
    return "sending stdin to the peer: %s" % describe_os_error(exc)


def download_failure(exc, down, sock, target):
    """The Error for a failed down.move: the socket's side or stdout's."""
    if failed_reading(exc, down) and exc.errno == errno.ECONNRESET:
        return Error("%s: %s" % (target, reset_message(sock)))
    if failed_reading(exc, down):
        return Error("%s: receiving from the peer: %s" % (target, describe_os_error(exc)))
    if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EIO):
        return stdout_gone_error(target, errno_name(exc))
    return Error("%s: writing the peer's data to stdout: %s"
                 % (target, describe_os_error(exc)))


def stdout_gone_error(target, errno_text):
    return Error("%s: %s (%s)" % (target, STDOUT_GONE, errno_text))


def end_stdout():
    """The peer's EOF, passed on.  When stdout is a socket (one socket may be
    stdin and stdout both: inetd, systemd's Accept=yes, socat EXEC:),
    closing fd 1 does not end the stream while fd 0 holds it: shut it down."""
    try:
        if stat.S_ISSOCK(posix.fstat(1).st_mode):
            with Socket(fileno=posix.dup(1)) as out:
                out.shutdown(_socket.SHUT_WR)
    except OSError:
        pass                   # its reader has gone already
    posix.close(1)


def stop_sending(sock):
    try:
        sock.shutdown(_socket.SHUT_WR)
    except OSError:
        pass                   # the peer has gone already


def peer_has_closed(sock):
    """After the socket's EOF: did the peer close entirely, or only shut down
    its sending side?  A zero-byte send fails (EPIPE) only in the first case;
    poll cannot tell on vsock, which reports POLLHUP only once both sides
    have shut down."""
    try:
        sock.send(b"")
    except OSError:
        return True
    return False


def closed_with_bytes_unread(sock):
    """AF_UNIX marks a peer that closed with our bytes still in its receive
    queue with ECONNRESET (vsock has no such mark)."""
    if sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR) == errno.ECONNRESET:
        return reset_message(sock)
    return None


def reset_message(sock):
    """What a reset means depends on the transport: AF_UNIX resets a peer
    that closed with our bytes unread in its queue, and only after we have
    read all it sent; vsock resets when the VM goes away, cutting both ways."""
    if sock.family == _socket.AF_UNIX:
        return "connection reset by the peer (ECONNRESET): not all of stdin was read"
    return ("connection reset by the peer (ECONNRESET): the VM stopped or "
            "dropped the connection")


def stdin_has_more(up):
    """The peer has gone while stdin is open: is anything waiting there that
    can no longer be delivered?  (Reading it loses nothing more.)"""
    if up.wait is None:
        return False
    if up.pending:
        return True
    poller = select.poll()
    poller.register(0, POLLIN)
    if not poller.poll(0):
        return False
    try:
        return bool(posix.read(0, 1))
    except OSError:
        return False


def stdout_was_reset():
    """A socket on stdout whose reader closed with bytes we wrote still
    unread is reset (ECONNRESET, read with SO_ERROR): a loss, although every
    write succeeded.  A pipe's reader leaves no such mark."""
    try:
        if not stat.S_ISSOCK(posix.fstat(1).st_mode):
            return False
        with Socket(fileno=posix.dup(1)) as out:
            error = out.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
    except OSError:
        return False
    return error == errno.ECONNRESET


def socket_has_more(sock):
    try:
        return bool(sock.recv(1, _socket.MSG_PEEK))
    except OSError:
        return False


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

class Options:
    fdpass = check = verbose = False
    timeout = DEFAULT_TIMEOUT
    wait = 0.0
    target = None


def parse_seconds(option, text):
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < LONGEST or (option == "--timeout" and seconds == 0):
        raise UsageError("%s takes a number of seconds%s, not '%s'"
                         % (option, " above 0" if option == "--timeout" else "",
                            printable(text)))
    return seconds


def parse_command_line(args):
    """Returns Options, or a string to print for --help/--version/--ssh-config.
    Hand-written rather than argparse, which costs milliseconds per login."""
    options, positional = Options(), []
    args = list(args)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            return HELP
        if arg == "--version":
            return "vsock-proxy %s\n" % __version__
        if arg == "--ssh-config":
            return SSH_CONFIG.format(command=this_command())
        if arg == "--fdpass":
            options.fdpass = True
        elif arg == "--check":
            options.check = True
        elif arg in ("-v", "--verbose"):
            options.verbose = True
        elif arg.split("=", 1)[0] in ("--timeout", "--wait"):
            option, has_value, value = arg.partition("=")
            if not has_value:
                if not args:
                    raise UsageError("%s needs a number of seconds" % option)
                value = args.pop(0)
            setattr(options, option[2:], parse_seconds(option, value))
        elif arg == "--":
            positional.extend(args)
            break
        elif arg.startswith("-") and not arg[1:].isdigit():
            raise UsageError("unknown option '%s' (see --help)" % printable(arg))
        else:
            positional.append(arg)
    if not positional:
        raise UsageError("no TARGET given; try vsock-proxy vsock/3, or --help")
    if len(positional) > 2:
        raise UsageError("unexpected argument '%s' after TARGET and PORT"
                         % printable(positional[2]))
    options.target = parse_target(*positional)
    if options.fdpass and options.check:
        raise UsageError("--fdpass and --check do not go together")
    return options


# How the snippet's ProxyCommand loads this file when it is importable: the
# directory named after the code goes on sys.path after the standard
# library, where site would put it (-I keeps the working directory and
# PYTHONPATH off it).
IMPORT_AND_RUN = ("import sys; sys.path.append(sys.argv.pop(1)); "
                  "from vsock_proxy import run; run()")


def this_command():
    """How ssh should run this very installation, for --ssh-config.

    By absolute paths, never through PATH, which differs from user to user
    (a pyenv shim, an older python3 first): the Python running now, with -I
    -S.  ssh waits for the proxy at every login, and site's work (the
    site-packages directories, their .pth files) is a quarter of what
    Python spends before the first line of this file; isolated (-I), no
    PYTHON* variable and no vsock_proxy.py in ssh's working directory can
    change what runs.  Nothing here needs site: this file is imported from
    its own directory, with the byte code that pip or the README's install
    compiled there, or, when it is not named vsock_proxy.py (a copy named
    bin/vsock-proxy), run as a script, which Python compiles at every
    start."""
    import os
    import shlex
    module = os.path.abspath(__file__)
    directory, name = os.path.split(module)
    if name == "vsock_proxy.py":
        command = [sys.executable, "-I", "-S", "-c", IMPORT_AND_RUN, directory]
    else:
        command = [sys.executable, "-I", "-S", module]
    for path in (sys.executable, module):
        if any(c in "'\"\\" or not (c.isprintable() or is_undecodable_byte(c))
               for c in path):
            raise UsageError(
                "--ssh-config: %s has a quote, a backslash or a control character "
                "in its path, which an ssh_config line cannot carry; install "
                "vsock-proxy (and Python) under a plainer path" % printable(path))
    # ssh expands %-tokens in it.
    return " ".join(map(shlex.quote, command)).replace("%", "%%")


def occupy_closed_stdio():
    """If fd 0, 1 or 2 was closed when we were started, the next socket would
    take its number: stdin would read our own socket, stdout would send the
    peer's bytes back to it.  /dev/null stands in for the missing ones."""
    for fd in (0, 1, 2):
        try:
            posix.fstat(fd)
        except OSError:
            posix.open("/dev/null", posix.O_RDWR)     # the lowest free number: fd


def report(message):
    """One line on stderr, and only there: never into ssh's stream on stdout
    (with fd 2 closed at start, Python's sys.stderr is None)."""
    try:
        if sys.stderr:
            sys.stderr.write("vsock-proxy: %s\n" % message)
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def print_text(text):
    """--help, --version, --ssh-config: exit 0 only once all of it is written.
    A reader that left early (EPIPE: '| head -3') wanted no more: exit 1
    without a word, as with other commands in such a pipe.  Anything else (a
    full disk, /dev/full, a closed stdout) is one line."""
    try:
        if sys.stdout is None:         # fd 1 was closed when we started
            raise OSError(errno.EBADF, posix.strerror(errno.EBADF))
        # As bytes: an installation path need not be valid in the locale's
        # encoding, and ssh wants the path's own bytes.
        sys.stdout.buffer.write(fs_encode(text))
        sys.stdout.flush()
    except BrokenPipeError:
        return 1
    except OSError as exc:
        report("cannot write to stdout: %s" % describe_os_error(exc))
        return 1
    return 0


def main(argv=None):
    """Run the command; returns the exit status."""
    options = None
    occupy_closed_stdio()
    if sys.version_info < (3, 9):
        import os
        report("needs Python 3.9 or later, and %s is Python %s: run it as "
               "'PYTHON %s' with a newer Python (--ssh-config, run that way, "
               "prints a snippet that does)" % (
                   sys.executable, sys.version.split()[0], os.path.abspath(sys.argv[0])))
        return 2
    try:
        options = parse_command_line(sys.argv[1:] if argv is None else argv)
        if isinstance(options, str):
            return print_text(options)
        log = report if options.verbose else say_nothing
        pass_socket = not options.check and hands_over(options.fdpass, log)
        sock = connect_target(options.target, timeout=options.timeout,
                              wait=options.wait, log=log)
        with sock:
            if options.check:
                return 0
            if pass_socket:
                pass_fd(sock, options.target)
                return 0
            relay(sock, options.target, log)
            return 0
    except Error as exc:
        report(str(exc))
        return exc.exit_status
    except OSError as exc:
        report("%s: %s" % (options.target if options else "?", describe_os_error(exc)))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:             # a bug: still one line, unless -v
        if options and getattr(options, "verbose", False):
            raise
        report("internal error: %s: %s (run with -v for the traceback, and "
               "please report it)" % (type(exc).__name__, exc))
        return 1


def run():
    """The command's entry point: main(), then exit without tearing the
    interpreter down.  ssh waits for its ProxyCommand to exit before it logs
    in with --fdpass; the teardown would add milliseconds (measured 4-8 ms)
    and has nothing to do: everything is flushed or closed by then."""
    status = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream:
                stream.flush()
        except (OSError, ValueError):
            pass
    posix._exit(status)


if __name__ == "__main__":
    run()
