"""A real virtio-vsock guest on CID 3: what users meet and the loopback cannot show.

The lab VM ("L1", ../shared/vsocklab/run-in-vm.sh) boots a nested guest ("L2",
../shared/vsocklab/guest/) with `-device vhost-vsock-pci,guest-cid=3`: a real
host-to-guest path (vhost-vsock in L1, the virtio transport in L2), a guest
whose driver is not up yet while it boots, and a VM that can disappear.  The
guest serves `sshd -i` on vsock port 22 and an echo (`cat`) on port 7; the
image, built by .ci/run, lives in .guest/ (git-ignored).

Safety: outside the lab VM, a connect to CID 3 or 9 would leave the machine
(to its own hypervisor).  So these tests run only where the kernel command
line has `vsocklab=1` and /dev/vhost-vsock exists, checked from files before
any AF_VSOCK socket is created, and use only CID 3 (the guest) and CID 9 (no
such VM: L1 has no other vsock device).  VSOCK_PROXY_REQUIRE_GUEST=1 (set by
.ci/run) turns the skip into a failure.

The guest is slow (TCG inside TCG: minutes to boot, tens of seconds per ssh
login), so it boots once for the whole file.  The boot is one story, told by
the `guest` fixture, which records what each step saw; the first tests state
what it must have seen.  Tests that stop the guest come last.  Every wait is
bounded and generous; nothing is timed.
"""

import hashlib
import os
import re
import select
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import (PROXY_ARGV, ROOT, proxy_process, run_cmd, run_proxy,
                      write_ssh_client_config)

GUEST_CID = 3
NO_SUCH_CID = 9
SSH_PORT = 22
ECHO_PORT = 7
UNUSED_PORT = 1234
HALF_CLOSE_PORT = 1101     # helpers the tests start in the guest (guest_helpers)
DIGEST_PORT = 1102
GUEST_DIR = ROOT / ".guest"
IMAGE = GUEST_DIR / "image"
USER_KEY = GUEST_DIR / "id_ed25519"
LAB_GUEST = ROOT.parent / "shared" / "vsocklab" / "guest"
# The guest waits this long after boot before its services listen, so that
# "driver up, nothing listening" lasts long enough to be seen for sure.
SERVICES_DELAY = 30
# Generous bounds for double emulation: a guest boot (3 to 5 minutes measured),
# an ssh login (20 to 90 s), and "at once" (an answer that needs no timeout).
BOOT_LIMIT = 1200
LOGIN_LIMIT = 600
PROMPT_LIMIT = 60
BOTH_PATHS = pytest.mark.parametrize("stdio", ["pipe", "socket"])


def real_guest_missing():
    """Why these tests cannot run here, or None.  Reads files only: no
    AF_VSOCK socket may exist before this has said yes."""
    try:
        with open("/proc/cmdline") as f:
            in_lab_vm = "vsocklab=1" in f.read().split()
    except OSError:
        in_lab_vm = False
    if not in_lab_vm:
        return ("not inside the vsocklab VM: here CID %d would be this machine's own "
                "hypervisor's (CI runs these in the lab VM)" % GUEST_CID)
    if not os.path.exists("/dev/vhost-vsock"):
        return ("no /dev/vhost-vsock: boot the lab VM with "
                "VSOCKLAB_MODPROBE='vsock_loopback vhost_vsock' VSOCKLAB_MEM=3G")
    needed = [IMAGE / "initrd.cpio", IMAGE / "kernel", IMAGE / "ssh_host_ed25519_key.pub",
              USER_KEY, LAB_GUEST / "start-guest.sh", LAB_GUEST / "stop-guest.sh"]
    missing = [str(path) for path in needed if not path.exists()]
    if missing:
        return "no guest image (missing %s): .ci/run builds it" % ", ".join(missing)
    return None


_missing = real_guest_missing()
if _missing and os.environ.get("VSOCK_PROXY_REQUIRE_GUEST") == "1":
    raise RuntimeError("VSOCK_PROXY_REQUIRE_GUEST=1 but " + _missing)
pytestmark = [pytest.mark.guest, pytest.mark.skipif(bool(_missing), reason=_missing or "")]


# --------------------------------------------------------------------------
# The guest and its boot
# --------------------------------------------------------------------------

class Guest:
    """The nested guest, run from a directory of its own: links to the image,
    and start-guest.sh's console.log, qemu.log and qemu.pid."""

    def __init__(self, run_dir):
        self.dir = Path(run_dir)
        for name in ("kernel", "initrd.cpio"):
            (self.dir / name).symlink_to(IMAGE / name)
        self.boot = None

    def start(self, delay):
        run_cmd([LAB_GUEST / "start-guest.sh", "--cid", GUEST_CID, "--delay", delay, self.dir],
                timeout=120, check=True)

    def stop(self):
        run_cmd([LAB_GUEST / "stop-guest.sh", self.dir], timeout=120, check=True)

    def running(self):
        return (self.dir / "qemu.pid").exists()

    def console(self):
        """The guest's console so far: init's and sshd's log lines."""
        try:
            return (self.dir / "console.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_console(self, text, timeout=BOOT_LIMIT):
        deadline = time.monotonic() + timeout
        while text not in self.console():
            if time.monotonic() > deadline:
                raise AssertionError("the guest's console did not say %r within %d s:\n%s"
                                     % (text, timeout, self.tail()))
            time.sleep(0.5)

    def tail(self, lines=40):
        """For failure messages."""
        return "\n".join(self.console().splitlines()[-lines:])


class BootRecord:
    """What each step of the boot saw (see the guest fixture): the --check
    results check_before, check_booting, check_idle and check_listening; the
    console after the two checks whose state it proves
    (console_after_booting_check, console_after_idle_check); and the waiting
    relay's wait_stdout, wait_status and wait_stderr (its -v log)."""


# Lines the guest's init writes to its console, in this order:
INIT_STARTED = "init started"                     # the kernel is up; no vsock driver yet
DRIVER_UP = "guestdelay=%d" % SERVICES_DELAY      # modules loaded; nothing listens yet
SERVICES_STARTING = "starting services"           # socat and sshd are being started
ECHO_LISTENING = "listening on AF=40 cid:4294967295 port:%d\n" % ECHO_PORT   # socat's log


def check(port=SSH_PORT):
    """vsock-proxy --check vsock/3 PORT; returns the CompletedProcess."""
    return run_proxy("--check", "vsock/%d" % GUEST_CID, str(port), timeout=PROMPT_LIMIT)


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    """Boot the guest once, recording what --check and --wait see on the way.

    1. no VM yet: --check;
    2. a `-v --wait` relay to port 22 is started, and the guest once that has
       made its first attempt;
    3. right after QEMU has opened the vhost device, the guest's kernel is
       still booting: --check (the console proves it had not reached init);
    4. the vsock driver is up and nothing listens (init waits SERVICES_DELAY
       seconds): --check (the console proves the services had not started);
    5. the waiting relay reaches sshd (its banner); the echo port listens
       too (socat says so on the console); then --check.
    Yields the running Guest, with the record in guest.boot.
    """
    assert real_guest_missing() is None      # never a CID outside the lab VM
    machine = Guest(tmp_path_factory.mktemp("guest"))
    boot = machine.boot = BootRecord()
    boot.check_before = check()

    waiter_log = machine.dir / "wait.stderr"
    with open(waiter_log, "wb") as log:
        waiter = subprocess.Popen(
            [*PROXY_ARGV, "-v", "--wait", str(BOOT_LIMIT), "vsock/%d" % GUEST_CID, str(SSH_PORT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    try:
        deadline = time.monotonic() + PROMPT_LIMIT
        while "attempt 1:" not in waiter_log.read_text():
            assert time.monotonic() < deadline, "--wait made no attempt: " + waiter_log.read_text()
            time.sleep(0.1)

        machine.start(SERVICES_DELAY)
        boot.check_booting = check()
        boot.console_after_booting_check = machine.console()

        machine.wait_for_console(DRIVER_UP)
        boot.check_idle = check()
        boot.console_after_idle_check = machine.console()

        ready, _, _ = select.select([waiter.stdout], [], [], BOOT_LIMIT)
        assert ready, "--wait did not connect within %d s:\n%s" % (BOOT_LIMIT, machine.tail())
        # No input: sshd gets EOF after its banner and hangs up.
        boot.wait_stdout, _ = waiter.communicate(b"", timeout=PROMPT_LIMIT)
        boot.wait_status = waiter.returncode
        boot.wait_stderr = waiter_log.read_text()
        machine.wait_for_console(ECHO_LISTENING)

        boot.check_listening = check()
        yield machine
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
        if machine.running():
            machine.stop()


@pytest.fixture
def running_guest(guest):
    if not guest.running():
        pytest.fail("the guest was stopped by an earlier test: tests that stop it must come "
                    "last in this file")
    return guest


@pytest.fixture
def stopped_guest(guest):
    """The guest after it was stopped (by an earlier test, or here)."""
    if guest.running():
        guest.stop()
    return guest


def no_vm_line(cid):
    return ("vsock-proxy: vsock/%d: no VM with CID %d (ENODEV): is the VM running, with a "
            "vsock device and this CID?\n" % (cid, cid))


def nothing_listening_line(port):
    return ("vsock-proxy: vsock/%d: nothing is listening on vsock port %d (ECONNRESET): is "
            "sshd listening on vsock port %d in the guest?\n" % (GUEST_CID, port, port))


NO_ANSWER_LINE = ("vsock-proxy: vsock/%d: no answer within 5s (ETIMEDOUT): the guest may "
                  "still be booting; try --wait 60\n" % GUEST_CID)


# --------------------------------------------------------------------------
# Booting: what --check and --wait see
# --------------------------------------------------------------------------

def test_check_before_the_guest_starts_says_there_is_no_vm(guest):
    result = guest.boot.check_before
    assert (result.returncode, result.stdout, result.stderr.decode()) == (
        1, b"", no_vm_line(GUEST_CID))


def test_check_while_the_guest_boots_says_no_answer(guest):
    boot = guest.boot
    assert INIT_STARTED not in boot.console_after_booting_check, (
        "precondition: the guest's kernel should still have been booting")
    result = boot.check_booting
    assert (result.returncode, result.stdout, result.stderr.decode()) == (1, b"", NO_ANSWER_LINE)


def test_check_while_nothing_listens_says_so(guest):
    boot = guest.boot
    assert SERVICES_STARTING not in boot.console_after_idle_check, (
        "precondition: the guest's services should not have started yet")
    result = boot.check_idle
    assert (result.returncode, result.stdout, result.stderr.decode()) == (
        1, b"", nothing_listening_line(SSH_PORT))


def test_check_succeeds_once_sshd_listens(guest):
    result = guest.boot.check_listening
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_wait_started_before_the_guest_reaches_its_sshd(guest):
    boot = guest.boot
    assert re.fullmatch(rb"SSH-2\.0-OpenSSH_\S+( \S+)?\r\n", boot.wait_stdout), boot.wait_stdout
    assert boot.wait_status == 0, boot.wait_stderr


# Each attempt --wait reports, by boot phase, in the order the phases come.
BOOT_PHASES = [
    ("no VM yet", "vsock/3: no VM with CID 3 (ENODEV): is the VM running, with a vsock "
                  "device and this CID?"),
    ("kernel booting", "vsock/3: no answer within 5s (ETIMEDOUT): the guest may still be "
                       "booting"),
    ("nothing listening", "vsock/3: nothing is listening on vsock port 22 (ECONNRESET): is "
                          "sshd listening on vsock port 22 in the guest?"),
]


def test_wait_reports_each_boot_phase_in_order(guest):
    """Every attempt is one of the three phases (a phase may be absent, none
    may be misclassified), and the phases never go backwards."""
    phases = []
    for line in guest.boot.wait_stderr.splitlines():
        if (line == "vsock-proxy: connecting to vsock CID 3 port 22"
                or line.startswith("vsock-proxy: relaying with ")):
            continue
        match = re.fullmatch(r"vsock-proxy: attempt \d+: (.*); retrying", line)
        assert match, "not an attempt: %r" % line
        known = [i for i, (_, text) in enumerate(BOOT_PHASES) if text == match.group(1)]
        assert known, "an attempt that is no boot phase: %r" % line
        phases.append(known[0])
    assert phases, "--wait made no failed attempt"
    assert phases == sorted(phases), [BOOT_PHASES[i][0] for i in phases]


# --------------------------------------------------------------------------
# The running guest: ssh, scp, connect errors, relaying
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guest_ssh(guest, tmp_path_factory):
    """How to ssh into the guest: its host key pinned for every host name
    (a login then proves we reached this guest), the key .ci/run generated."""
    directory = tmp_path_factory.mktemp("guest-ssh")
    known_hosts = directory / "known_hosts"
    key_type, key = (IMAGE / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    known_hosts.write_text("* %s %s\n" % (key_type, key))
    return GuestSsh(directory, known_hosts)


class GuestSsh:
    """ssh_config files for the guest, and ssh and scp with them."""

    def __init__(self, directory, known_hosts):
        self.dir, self.known_hosts = directory, known_hosts
        self._configs = 0

    def config(self, extra=""):
        """An ssh_config for the guest: extra first, then the defaults; the
        banner may take long under emulation."""
        self._configs += 1
        return write_ssh_client_config(
            self.dir / ("ssh_config.%d" % self._configs), user="root", identity=USER_KEY,
            known_hosts=self.known_hosts, extra=extra + "\nHost *\n    ConnectTimeout %d\n"
            % LOGIN_LIMIT)

    def pinned(self):
        """Command-line options that override a config's host-key policy
        (the shipped snippet does not pin: CIDs are reused)."""
        return ["-o", "StrictHostKeyChecking=yes", "-o", "UserKnownHostsFile=%s" % self.known_hosts]

    def ssh(self, config, *args, input=b"", env=None):
        return run_cmd(["ssh", "-F", config, *args], input=input, timeout=LOGIN_LIMIT, env=env)

    def scp(self, config, *args, env=None):
        return run_cmd(["scp", "-F", config, *args], stdin=subprocess.DEVNULL,
                       timeout=LOGIN_LIMIT, env=env)


def snippet_config(guest_ssh):
    return guest_ssh.config("Include %s\n" % (ROOT / "ssh_config.d" / "vsock-proxy.conf"))


def test_ssh_through_the_shipped_snippet(running_guest, guest_ssh, vsock_proxy_on_path):
    result = guest_ssh.ssh(snippet_config(guest_ssh), *guest_ssh.pinned(), "vsock/3", "uname -n",
                           env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"vsock-guest\n"), result.stderr


def test_ssh_through_a_relay_proxycommand_carries_stdin(running_guest, guest_ssh,
                                                       vsock_proxy_on_path):
    config = guest_ssh.config("Host vsock/*\n    ProxyCommand vsock-proxy %n %p\n")
    payload = os.urandom(256 << 10)
    result = guest_ssh.ssh(config, "vsock/3", "uname -n; sha256sum", input=payload,
                           env=vsock_proxy_on_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"vsock-guest\n%s  -\n" % hashlib.sha256(payload).hexdigest().encode()


def test_scp_there_and_back_keeps_every_byte(running_guest, guest_ssh, vsock_proxy_on_path,
                                             tmp_path):
    """The `vsock%3:` form that scp needs, through the shipped snippet."""
    original = tmp_path / "original.bin"
    original.write_bytes(os.urandom(1 << 20))
    config = snippet_config(guest_ssh)
    up = guest_ssh.scp(config, *guest_ssh.pinned(), original, "vsock%3:/tmp/payload.bin",
                       env=vsock_proxy_on_path)
    assert up.returncode == 0, up.stderr
    down = guest_ssh.scp(config, *guest_ssh.pinned(), "vsock%3:/tmp/payload.bin",
                         tmp_path / "back.bin", env=vsock_proxy_on_path)
    assert down.returncode == 0, down.stderr
    assert (hashlib.sha256((tmp_path / "back.bin").read_bytes()).hexdigest()
            == hashlib.sha256(original.read_bytes()).hexdigest())


def test_port_with_nothing_listening_is_reset_at_once(running_guest):
    """The guest's kernel answers at once: well inside the (long) timeout."""
    result = run_proxy("--timeout", "300", "vsock/3", str(UNUSED_PORT), timeout=PROMPT_LIMIT)
    assert (result.returncode, result.stderr.decode()) == (1, nothing_listening_line(UNUSED_PORT))


def test_check_of_a_port_with_nothing_listening_fails(running_guest):
    result = check(UNUSED_PORT)
    assert (result.returncode, result.stdout, result.stderr.decode()) == (
        1, b"", nothing_listening_line(UNUSED_PORT))


def test_cid_without_a_vm_is_enodev_at_once(running_guest):
    """With a real guest on CID 3, CID 9 still has no VM behind it."""
    result = run_proxy("--timeout", "300", "vsock/9", str(SSH_PORT), timeout=PROMPT_LIMIT)
    assert (result.returncode, result.stderr.decode()) == (1, no_vm_line(NO_SUCH_CID))


@BOTH_PATHS
def test_echo_port_returns_every_byte(running_guest, stdio):
    payload = os.urandom(256 << 10)
    with proxy_process(["vsock/3", str(ECHO_PORT)], stdio) as proxy:
        echoed = proxy.exchange(payload, timeout=LOGIN_LIMIT)
        assert proxy.wait(PROMPT_LIMIT) == 0
        assert proxy.stderr() == b""
    assert hashlib.sha256(echoed).hexdigest() == hashlib.sha256(payload).hexdigest()


# --------------------------------------------------------------------------
# How a conversation ends, on this transport
# --------------------------------------------------------------------------
# The guest's own services hold the vsock socket themselves (socat's EXEC with
# nofork): they close it whole, never half.  For the other endings the tests
# start two socat listeners in the guest over one ssh login (through socat,
# not the code under test):
#   HALF_CLOSE_PORT  sends the guest's host key and half-closes (its file is
#                    at EOF), writes what it receives after that to the guest's
#                    console, and closes HALF_CLOSE_LINGER seconds later
#                    (socat -t);
#   DIGEST_PORT      reads to EOF, then answers the SHA-256 of what it got
#                    (busybox sha256sum) and closes.
# (A script that closes its stdout cannot half-close through socat 1.7.4: the
# socat process keeps a copy of the pipe's write end, so only the script's
# exit, and then socat's own close, ends the stream.)
HALF_CLOSE_LINGER = 10
GUEST_HELPERS = r"""
cd /tmp
setsid socat -t %(linger)d VSOCK-LISTEN:%(half)d,fork,reuseaddr \
    'OPEN:/etc/ssh/ssh_host_ed25519_key.pub!!OPEN:/dev/console' </dev/null >/dev/null 2>&1 &
setsid socat -t 600 VSOCK-LISTEN:%(digest)d,fork,reuseaddr EXEC:sha256sum \
    </dev/null >/dev/null 2>&1 &
""" % {"linger": HALF_CLOSE_LINGER, "half": HALF_CLOSE_PORT, "digest": DIGEST_PORT}


def wait_until_listening(port, timeout=BOOT_LIMIT):
    """Connect to the guest's port until something accepts (socat takes tens
    of seconds to start in the guest), then hang up."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as probe:
            probe.settimeout(30)
            try:
                probe.connect((GUEST_CID, port))
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError("nothing listened on vsock port %d within %d s: %s"
                                         % (port, timeout, exc))
        time.sleep(1)


@pytest.fixture(scope="module")
def guest_helpers(guest, guest_ssh):
    config = guest_ssh.config("Host vsock-guest\n    ProxyCommand socat - VSOCK-CONNECT:%d:%d\n"
                              % (GUEST_CID, SSH_PORT))
    result = guest_ssh.ssh(config, "vsock-guest", GUEST_HELPERS)
    assert result.returncode == 0, result.stderr
    for port in (HALF_CLOSE_PORT, DIGEST_PORT):
        wait_until_listening(port)
    return guest


@BOTH_PATHS
def test_guest_half_closing_then_closing_ends_the_relay_while_stdin_stays_open(
        running_guest, guest_helpers, stdio):
    """While the guest has only half-closed, stdin still reaches it; its full
    close then ends the relay, though our stdin never ends (vsock shows no
    POLLHUP for a peer's close while our side is still open)."""
    host_key = (IMAGE / "ssh_host_ed25519_key.pub").read_bytes()
    token = "after the half-close, %s %d" % (stdio, os.getpid())
    with proxy_process(["vsock/3", str(HALF_CLOSE_PORT)], stdio) as proxy:
        assert proxy.read_to_eof(timeout=PROMPT_LIMIT) == host_key
        proxy.write(token.encode() + b"\n")
        assert proxy.wait(HALF_CLOSE_LINGER + PROMPT_LIMIT) == 0
        assert proxy.stderr() == b""
    running_guest.wait_for_console(token, timeout=PROMPT_LIMIT)


@BOTH_PATHS
def test_our_stdin_ending_first_lets_the_guest_answer_then_close(running_guest, guest_helpers,
                                                                 stdio):
    payload = os.urandom(1 << 20)
    with proxy_process(["vsock/3", str(DIGEST_PORT)], stdio) as proxy:
        proxy.write(payload)
        proxy.close_stdin()
        answer = proxy.read_to_eof(timeout=LOGIN_LIMIT)
        assert proxy.wait(PROMPT_LIMIT) == 0
        assert proxy.stderr() == b""
    assert answer == b"%s  -\n" % hashlib.sha256(payload).hexdigest().encode()


class EndlessEcho:
    """A relay to the echo port, fed and drained without end (as a live ssh
    session is) from the moment the echo flows until the relay exits."""

    def __init__(self, stdio):
        self.proxy = proxy_process(["vsock/3", str(ECHO_PORT)], stdio)
        threading.Thread(target=self._feed, daemon=True).start()
        self.proxy.read_exactly(64 << 10, timeout=LOGIN_LIMIT)
        threading.Thread(target=self._drain, daemon=True).start()

    def _feed(self):
        chunk = os.urandom(64 << 10)
        try:
            while True:
                self.proxy.write(chunk)
        except OSError:
            pass                            # the relay has gone

    def _drain(self):
        try:
            self.proxy.read_to_eof(timeout=BOOT_LIMIT)
        except (AssertionError, OSError):
            pass                            # the test has given up


def test_guest_dying_mid_transfer_ends_the_relay_with_a_reset(running_guest):
    """The VM disappears (its QEMU is killed) while both relay paths carry
    data both ways.  The kernel resets the orphaned connections: poll says
    POLLERR (no POLLHUP), recv ECONNRESET, send EPIPE.  Stops the guest."""
    transfers = [EndlessEcho("pipe"), EndlessEcho("socket")]
    try:
        running_guest.stop()
        for transfer in transfers:
            assert transfer.proxy.wait(PROMPT_LIMIT) == 1
            error = transfer.proxy.stderr().decode()
            assert error.startswith("vsock-proxy: vsock/3: connection reset by the peer "
                                    "(ECONNRESET)"), error
            assert error.count("\n") == 1 and error.endswith("\n"), error
    finally:
        for transfer in transfers:
            transfer.proxy.close()


# --------------------------------------------------------------------------
# After the guest has stopped
# --------------------------------------------------------------------------

def test_stopped_guest_is_no_vm_at_once(stopped_guest):
    result = run_proxy("--timeout", "300", "vsock/3", str(SSH_PORT), timeout=PROMPT_LIMIT)
    assert (result.returncode, result.stderr.decode()) == (1, no_vm_line(GUEST_CID))


def test_check_after_the_guest_stopped_says_there_is_no_vm(stopped_guest):
    result = check()
    assert (result.returncode, result.stdout, result.stderr.decode()) == (
        1, b"", no_vm_line(GUEST_CID))
