"""machine/NAME: systemd-machined resolves the name (Varlink, user instance
first, then the system's) and vsock-proxy connects to what it answers.
The fake machined speaks the real wire format: NUL-terminated JSON messages,
io.systemd.Machine.List with {"name": NAME}, io.systemd.Machine.NoSuchMachine."""

import json
import os
import re
import socket
import threading
import time

import pytest

import vsock_proxy
from conftest import FAKE_BANNER, run_proxy, serve_unix, unix_listener


class FakeMachined:
    """One machined instance under runtime_dir/systemd/machine/io.systemd.Machine,
    knowing `machines`: name -> List reply parameters, or a Varlink error name.

    behaviour "answer" (at once), "drip" (the reply one byte every half
    second: a machined that is busy but alive), "busy" (its listen backlog
    is full: it accepts nobody for busy_for seconds, then answers) or
    "crash" (it closes the connection with the call unread, as a machined
    that dies mid-call does: the caller's read fails with ECONNRESET)."""

    def __init__(self, runtime_dir, machines, behaviour="answer", busy_for=3600):
        self.runtime_dir = runtime_dir
        socket_dir = runtime_dir / "systemd" / "machine"
        socket_dir.mkdir(parents=True)
        self.machines, self.calls, self.behaviour = machines, [], behaviour
        self.reply_override = None          # a whole reply message (bytes: sent as
                                            # they are), to answer malformed
        self.path = str(socket_dir / "io.systemd.Machine")
        # A backlog of 0 holds one waiting connection: when busy, ours fills it.
        self.listener = unix_listener(self.path, backlog=0 if behaviour == "busy" else 16)
        if behaviour == "busy":
            self.waiting = socket.socket(socket.AF_UNIX)
            self.waiting.connect(self.path)
            self.waiting.close()
            self.accepting = threading.Timer(busy_for, self.serve)
            self.accepting.daemon = True
            self.accepting.start()
        else:
            threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                if self.behaviour == "crash":
                    conn.recv(1, socket.MSG_PEEK)       # the call has arrived
                    continue                            # ... and is never read
                request = b""
                while not request.endswith(b"\0"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                if not request.endswith(b"\0"):
                    continue                    # the client gave up
                call = json.loads(request[:-1])
                self.calls.append(call)
                name = call["parameters"]["name"]
                if self.reply_override is not None:
                    reply = self.reply_override
                elif isinstance(self.machines.get(name), str):    # an error to answer
                    reply = {"error": self.machines[name], "parameters": {}}
                elif name in self.machines:
                    reply = {"parameters": self.machines[name]}
                else:
                    reply = {"error": "io.systemd.Machine.NoSuchMachine", "parameters": {}}
                if not isinstance(reply, bytes):
                    reply = json.dumps(reply).encode()
                reply += b"\0"
                try:
                    if self.behaviour == "drip":
                        for i in range(len(reply)):
                            conn.sendall(reply[i:i + 1])
                            time.sleep(0.5)
                    else:
                        conn.sendall(reply)
                except OSError:
                    pass                        # the client gave up

    def close(self):
        if self.behaviour == "busy":
            self.accepting.cancel()
        self.listener.close()


@pytest.fixture
def machined(tmp_path_factory, monkeypatch):
    """Factory: machined("user" | "system", {name: parameters}, **options), the
    options of FakeMachined.  Both runtime directories are pointed at
    temporary ones, so no real machined is asked."""
    dirs = {"user": tmp_path_factory.mktemp("xdg"), "system": tmp_path_factory.mktemp("run")}
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(dirs["user"]))
    monkeypatch.setenv("VSOCK_PROXY_RUN_DIR", str(dirs["system"]))
    started = []

    def start(scope, machines, **options):
        started.append(FakeMachined(dirs[scope], machines, **options))
        return started[-1]
    yield start
    for instance in started:
        instance.close()


def vm(**fields):
    return dict({"name": "fedora", "class": "vm", "service": "systemd-vmspawn"}, **fields)


def test_machine_with_an_ssh_address_on_a_mux_socket_is_reached_through_it(machined, muxer):
    mux = muxer("firecracker")
    machined("system", {"fedora": vm(sshAddress="vsock-mux" + mux.path)})
    result = run_proxy("machine/fedora", "2222", input=b"hi")
    assert (result.returncode, result.stdout) == (0, FAKE_BANNER + b"hi"), result.stderr
    assert mux.ports == [2222]


def test_machine_with_a_unix_ssh_address(machined, muxer):
    mux = muxer("firecracker")
    machined("user", {"fedora": vm(sshAddress="unix" + mux.path)})
    with vsock_proxy.connect("machine%fedora") as sock:
        sock.sendall(b"CONNECT 7\n")
        assert sock.recv(100).startswith(b"OK ")


def test_connect_timeout_none_means_no_deadline_for_a_machine_too(machined, muxer):
    mux = muxer("vhost-device")
    machined("user", {"fedora": vm(sshAddress="vsock-mux" + mux.path)})
    with vsock_proxy.connect("machine/fedora", timeout=None) as sock:
        assert sock.recv(100) == FAKE_BANNER


def test_vsock_cid_comes_first(machined, monkeypatch):
    """A VM with a CID is reached over AF_VSOCK (checked without connecting)."""
    machined("system", {"fedora": vm(vSockCid=42, sshAddress="unix/nowhere")})
    deadline = time.monotonic() + 5
    target = vsock_proxy.resolve_machine(vsock_proxy.parse_target("machine/fedora"), deadline)
    assert target == vsock_proxy.Target("vsock", 42, 22, "")
    assert str(target) == "machine/fedora (vsock/42)"


def test_nspawn_container_is_reached_on_its_exported_socket(machined, tmp_path):
    instance = machined("system", {"box": {"name": "box", "class": "container",
                                           "service": "systemd-nspawn"}})
    export = instance.runtime_dir / "systemd" / "nspawn" / "unix-export" / "box"
    export.mkdir(parents=True)
    serve_unix(export, lambda conn: conn.sendall(b"SSH-2.0-Container\r\n"), name="ssh")
    result = run_proxy("machine/box", input=b"")
    assert (result.returncode, result.stdout) == (0, b"SSH-2.0-Container\r\n"), result.stderr


def test_user_instance_is_asked_before_the_system_one(machined, muxer):
    user_mux, system_mux = muxer("firecracker"), muxer("firecracker")
    user = machined("user", {"fedora": vm(sshAddress="vsock-mux" + user_mux.path)})
    system = machined("system", {"fedora": vm(sshAddress="vsock-mux" + system_mux.path)})
    assert run_proxy("--check", "machine/fedora").returncode == 0
    assert (user_mux.connections, system_mux.connections) == (1, 0)
    assert len(user.calls) == 1 and system.calls == []


def test_system_instance_answers_when_the_user_one_does_not_know_the_name(machined, muxer):
    mux = muxer("firecracker")
    user = machined("user", {})
    machined("system", {"fedora": vm(sshAddress="vsock-mux" + mux.path)})
    assert run_proxy("--check", "machine/fedora").returncode == 0
    assert user.calls == [{"method": "io.systemd.Machine.List",
                           "parameters": {"name": "fedora"}}]


def test_no_such_machine(machined):
    machined("user", {})
    machined("system", {"debian": vm(vSockCid=5)})
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert result.stderr == (b"vsock-proxy: machine/fedora: systemd-machined knows no machine "
                             b"fedora (see 'machinectl list')\n")


def test_machined_not_running(machined):
    result = run_proxy("machine/fedora")
    user = os.path.join(os.environ["XDG_RUNTIME_DIR"], "systemd/machine/io.systemd.Machine")
    system = os.path.join(os.environ["VSOCK_PROXY_RUN_DIR"], "systemd/machine/io.systemd.Machine")
    assert result.returncode == 1
    assert result.stderr.decode() == ("vsock-proxy: machine/fedora: systemd-machined is not "
                                      "running (no answer on %s or %s)\n" % (user, system))


def test_machined_that_crashes_mid_call_is_not_called_not_running(machined):
    instance = machined("user", {}, behaviour="crash")
    result = run_proxy("machine/fedora")
    assert (result.returncode, result.stderr.decode()) == (
        1, "vsock-proxy: machine/fedora: systemd-machined at %s broke off the call: "
           "Connection reset by peer (ECONNRESET)\n" % instance.path)


def test_machine_without_a_vsock_cid(machined):
    machined("system", {"fedora": vm()})
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert result.stderr == (b"vsock-proxy: machine/fedora: the machine has no vsock CID and "
                             b"no ssh address vsock-proxy understands (class vm)\n")


def test_other_varlink_errors_are_named(machined):
    machined("system", {"fedora": "org.varlink.service.PermissionDenied"})
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert result.stderr == (b"vsock-proxy: machine/fedora: systemd-machined answered "
                             b"org.varlink.service.PermissionDenied\n")


@pytest.mark.parametrize("reply", [[], None, "yes"])
def test_a_reply_without_parameters_is_not_varlink(machined, reply):
    machined("system", {"fedora": "placeholder"}).reply_override = {"parameters": reply}
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert result.stderr.decode().endswith("sent a reply that is not Varlink JSON\n")


def test_a_reply_nested_too_deep_is_not_varlink(machined):
    depth = 100000
    machined("system", {"fedora": "placeholder"}).reply_override = (
        b'{"parameters": {"vSockCid": ' + b"[" * depth + b"]" * depth + b"}}")
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert result.stderr.decode() == (
        "vsock-proxy: machine/fedora: systemd-machined at %s/systemd/machine/"
        "io.systemd.Machine sent a reply that is not Varlink JSON\n"
        % os.environ["VSOCK_PROXY_RUN_DIR"])
    with pytest.raises(vsock_proxy.ConnectError, match="not Varlink JSON"):
        vsock_proxy.connect("machine/fedora")


def test_a_boolean_is_no_cid(machined):
    machined("system", {"fedora": vm(vSockCid=True)})
    result = run_proxy("machine/fedora")
    assert result.returncode == 1
    assert b"the machine has no vsock CID" in result.stderr


def test_a_machined_that_never_answers_is_bounded_by_the_timeout(machined, tmp_path):
    """It accepts and stays silent: one deadline covers the whole attempt."""
    socket_dir = tmp_path / "silent" / "systemd" / "machine"
    socket_dir.mkdir(parents=True)
    listener = unix_listener(socket_dir / "io.systemd.Machine")
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "silent"))
    started = time.monotonic()
    result = run_proxy("--timeout", "1", "machine/fedora", env=env, timeout=20)
    listener.close()
    assert time.monotonic() - started < 10             # a bound, not a measurement
    assert result.returncode == 1
    assert result.stderr.decode() == (
        "vsock-proxy: machine/fedora: systemd-machined at %s/io.systemd.Machine did not "
        "answer in time\n" % socket_dir)


def test_a_machined_that_drips_its_reply_is_bounded_by_the_timeout(machined):
    """One deadline for the whole exchange, not one per read."""
    instance = machined("user", {"fedora": vm(sshAddress="unix/nowhere")}, behaviour="drip")
    started = time.monotonic()
    result = run_proxy("--timeout", "1", "machine/fedora", timeout=20)
    assert time.monotonic() - started < 10             # a bound, not a measurement
    assert (result.returncode, result.stderr.decode()) == (
        1, "vsock-proxy: machine/fedora: systemd-machined at %s did not answer in "
           "time\n" % instance.path)


def test_wait_gives_up_on_a_dripping_machined_on_time(machined):
    machined("user", {"fedora": vm(sshAddress="unix/nowhere")}, behaviour="drip")
    started = time.monotonic()
    result = run_proxy("--timeout", "1", "--wait", "2", "machine/fedora", timeout=20)
    assert time.monotonic() - started < 10             # a bound, not a measurement
    assert result.returncode == 1
    assert re.fullmatch(r"vsock-proxy: machine/fedora: systemd-machined at \S+ did not "
                        r"answer in time \(gave up after [\d.]+s and \d+ attempts\)\n",
                        result.stderr.decode()), result.stderr


def test_a_machined_with_a_full_listen_backlog_is_busy_not_missing(machined):
    instance = machined("user", {}, behaviour="busy")
    result = run_proxy("--timeout", "1", "machine/fedora", timeout=20)
    assert (result.returncode, result.stderr.decode()) == (
        1, "vsock-proxy: machine/fedora: systemd-machined at %s stayed busy (its listen "
           "backlog is full)\n" % instance.path)


def test_wait_retries_a_busy_machined_until_it_answers(machined, tmp_path):
    guest = serve_unix(tmp_path, lambda conn: conn.sendall(b"SSH-2.0-Guest\r\n"))
    machined("user", {"fedora": vm(sshAddress="unix" + guest)}, behaviour="busy", busy_for=1.5)
    result = run_proxy("--timeout", "0.5", "--wait", "10", "machine/fedora", input=b"",
                       timeout=20)
    assert (result.returncode, result.stdout) == (0, b"SSH-2.0-Guest\r\n"), result.stderr
