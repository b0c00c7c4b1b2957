"""The clients people reach for, through the shipped snippet: scp, sftp,
rsync and git with the names without '/', ControlMaster, a client that runs
the snippet's command with pipes, a ProxyCommand given on the command line,
a hop through another host, and a local port forwarded with socat.  Each
drives the real program against the real `sshd -i`."""

import hashlib
import os
import shlex
import socket
import subprocess
import textwrap
import threading
import time

import pytest

from conftest import (PROXY_ARGV, SHIPPED_SNIPPET, echo, readme_commands, require, run_cmd,
                      serve_unix, sha256_until_eof, slash_free, unix_listener)


def snippet_config(sshd, extra=""):
    """An ssh_config that Includes the shipped snippet first, as the README says."""
    return sshd.ssh_config("Include %s\n%s" % (SHIPPED_SNIPPET, textwrap.dedent(extra)))


def test_scp_copies_both_ways_with_the_name_without_slash(sshd, vsock_proxy_on_path, tmp_path):
    config, host = snippet_config(sshd), slash_free("unix", sshd.socket_path)
    original = tmp_path / "original.bin"
    original.write_bytes(os.urandom(3 << 20))
    up = sshd.scp(original, "%s:%s/remote.bin" % (host, tmp_path), config=config,
                  env=vsock_proxy_on_path)
    assert (up.returncode, up.stderr) == (0, b"")
    down = sshd.scp("%s:%s/remote.bin" % (host, tmp_path), tmp_path / "back.bin",
                    config=config, env=vsock_proxy_on_path)
    assert (down.returncode, down.stderr) == (0, b"")
    assert (tmp_path / "back.bin").read_bytes() == original.read_bytes()


def test_sftp_with_a_slash_in_the_socket_name_names_the_spelling_without(
        sshd, vsock_proxy_on_path):
    config = snippet_config(sshd)
    result = sshd.sftp("unix%s:/tmp" % sshd.socket_path, "ls\n", config=config,
                       env=vsock_proxy_on_path)
    assert result.returncode != 0
    assert ("vsock-proxy: unix%s:/tmp: no such socket file: %s:/tmp (ENOENT); scp and sftp "
            "pass 'HOST:PATH' whole when HOST has a '/': write %s:/tmp\n"
            % (sshd.socket_path, sshd.socket_path, slash_free("unix", sshd.socket_path))
            ).encode() in result.stderr


def tree(root):
    """{relative path: SHA-256} of every file under root."""
    return {os.path.relpath(os.path.join(d, name), root):
            hashlib.sha256(open(os.path.join(d, name), "rb").read()).hexdigest()
            for d, _, names in os.walk(root) for name in names}


def test_rsync_copies_a_tree_both_ways(sshd, vsock_proxy_on_path, tmp_path):
    require("rsync")
    config, host = snippet_config(sshd), slash_free("unix", sshd.socket_path)
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "a.bin").write_bytes(os.urandom(1 << 20))
    (source / "sub" / "b.txt").write_text("rsync through vsock-proxy\n")
    rsh = ["-e", "ssh -F %s" % config]
    up = run_cmd(["rsync", "-a", *rsh, "%s/" % source, "%s:%s/remote/" % (host, tmp_path)],
                 env=vsock_proxy_on_path, timeout=60)
    assert (up.returncode, up.stderr) == (0, b"")
    down = run_cmd(["rsync", "-a", *rsh, "%s:%s/remote/" % (host, tmp_path), "%s/back/" % tmp_path],
                   env=vsock_proxy_on_path, timeout=60)
    assert (down.returncode, down.stderr) == (0, b"")
    assert tree(tmp_path / "back") == tree(source) != {}


def test_git_clones_and_pushes_with_the_scp_syntax(sshd, vsock_proxy_on_path, tmp_path):
    require("git")
    host = slash_free("unix", sshd.socket_path)
    env = dict(vsock_proxy_on_path, HOME=str(tmp_path), GIT_CONFIG_NOSYSTEM="1",
               GIT_SSH_COMMAND="ssh -F %s" % snippet_config(sshd))
    git = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.org",
           "-c", "init.defaultBranch=main"]

    def run_git(*args, cwd=tmp_path):
        result = run_cmd([*git, *args], cwd=cwd, env=env, timeout=60)
        assert result.returncode == 0, result.stderr
        return result
    run_git("init", "-q", "--bare", "repo.git")
    run_git("clone", "-q", "%s:%s/repo.git" % (host, tmp_path), "work")
    (tmp_path / "work" / "hello.txt").write_text("hello over vsock\n")
    run_git("add", "hello.txt", cwd=tmp_path / "work")
    run_git("commit", "-q", "-m", "first", cwd=tmp_path / "work")
    run_git("push", "-q", "origin", "HEAD:main", cwd=tmp_path / "work")
    shown = run_git("--git-dir", str(tmp_path / "repo.git"), "show", "main:hello.txt")
    assert shown.stdout == b"hello over vsock\n"


@pytest.mark.parametrize("control_path", ["%C", "%h"])
def test_controlmaster_shares_one_connection(sshd, vsock_proxy_on_path, vm_socket, control_path):
    host = slash_free("unix", vm_socket)
    directory = os.path.dirname(vm_socket)
    config = snippet_config(sshd, """\
        Host *
            ControlMaster auto
            ControlPath %s/%s
            ControlPersist 60
        """ % (directory, control_path))
    try:
        first = sshd.ssh(host, "echo first", config=config, env=vsock_proxy_on_path,
                         stdin=subprocess.DEVNULL)
        assert (first.returncode, first.stdout) == (0, b"first\n"), first.stderr
        check = sshd.ssh(host, config=config, extra_args=["-O", "check"],
                         env=vsock_proxy_on_path)
        assert check.returncode == 0 and check.stderr.startswith(b"Master running"), check.stderr
        if control_path == "%h":
            assert os.path.exists(os.path.join(directory, host))
        second = sshd.ssh(host, "echo second", config=config, env=vsock_proxy_on_path)
        assert (second.returncode, second.stdout) == (0, b"second\n"), second.stderr
    finally:
        sshd.ssh(host, config=config, extra_args=["-O", "exit"], env=vsock_proxy_on_path)


def control_path_of(sshd, host):
    result = sshd.ssh(host, config=sshd.ssh_config("Host *\n    ControlPath /cm/%C\n"),
                      extra_args=["-G"])
    return [line for line in result.stdout.split(b"\n") if line.startswith(b"controlpath ")]


@pytest.mark.parametrize("name, other_case, shared", [
    ("unix/run/Vm.sock", "unix/run/vm.sock", True),
    ("unix%run%Vm.sock", "unix%run%vm.sock", False)])
def test_names_that_differ_in_case_share_a_control_path_only_with_a_slash(
        sshd, name, other_case, shared):
    """ssh lowercases host names, except ones with a '%' in them: the README
    warns that a master for .../Vm.sock serves .../vm.sock too."""
    assert (control_path_of(sshd, name) == control_path_of(sshd, other_case)) is shared


def test_client_that_runs_the_snippet_command_with_pipes_gets_a_relay(sshd, vsock_proxy_on_path):
    """asyncssh reads the snippet but ignores ProxyUseFdpass: it runs
    'vsock-proxy --fdpass ...' with pipes.  ssh does the same without it."""
    result = sshd.ssh(slash_free("unix", sshd.socket_path), "echo relayed",
                      config=snippet_config(sshd), extra_args=["-o", "ProxyUseFdpass=no"],
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"relayed\n", b"")


def test_fdpass_with_pipes_relays_and_says_so_with_v(tmp_path):
    path = serve_unix(tmp_path, echo)
    result = run_cmd([*PROXY_ARGV, "-v", "--fdpass", "unix" + path], input=b"ping\n")
    assert (result.returncode, result.stdout) == (0, b"ping\n")
    assert result.stderr.startswith(
        b"vsock-proxy: stdout is not a unix socket (ProxyUseFdpass is not in effect): "
        b"relaying instead of passing the socket\n")


@pytest.mark.parametrize("name", ["unix/", "unix%"])
def test_proxycommand_on_the_command_line_overrides_the_snippet(sshd, vsock_proxy_on_path, name):
    """The snippet's ProxyUseFdpass yes still applies: ssh waits for a socket,
    and vsock-proxy, seeing ssh at the other end, passes it."""
    host = ("unix" + sshd.socket_path if name == "unix/"
            else slash_free("unix", sshd.socket_path))
    result = sshd.ssh(host, "echo overridden", config=snippet_config(sshd),
                      extra_args=["-o", "ProxyCommand=vsock-proxy -v %n %p"],
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"overridden\n"), result.stderr
    assert result.stderr.startswith(b"vsock-proxy: ssh waits for a socket (ProxyUseFdpass "
                                    b"yes): passing it instead of relaying\n")


def test_hop_through_another_host_works_with_proxyusefdpass_no(sshd, vsock_proxy_on_path):
    """ProxyCommand ssh HOST vsock-proxy ... on a name the snippet matches:
    the relay runs on the other host, so ssh here must not wait for a socket."""
    config = snippet_config(sshd)
    hop = slash_free("unix", sshd.socket_path).replace("%", "%%")
    remote = " ".join(map(shlex.quote, PROXY_ARGV))
    result = sshd.ssh(
        "vsock%3", "echo hopped", config=config, env=vsock_proxy_on_path,
        extra_args=["-o", "ProxyUseFdpass=no", "-o", "ProxyCommand=ssh -F %s %s %s unix%s %%p"
                    % (config, hop, remote, sshd.socket_path.replace("%", "%%"))])
    assert (result.returncode, result.stdout) == (0, b"hopped\n"), result.stderr


def test_snippet_is_quiet_about_host_keys_it_does_not_keep(sshd, vsock_proxy_on_path, muxer):
    """No "Permanently added 'vsock-mux%...' to the list of known hosts"
    into every scp and rsync: stderr stays empty."""
    mux = muxer(backend="sshd")
    result = sshd.ssh(slash_free("vsock-mux", mux.path), "echo quiet",
                      config=snippet_config(sshd, "Host *\n    LogLevel INFO\n"),
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"quiet\n", b"")


def test_snippet_still_shows_a_refused_login(sshd, vsock_proxy_on_path, muxer):
    mux = muxer(backend="sshd")
    config = snippet_config(sshd, "Host *\n    LogLevel INFO\n    User no-such-user\n")
    result = sshd.ssh(slash_free("vsock-mux", mux.path), "true", config=config,
                      env=vsock_proxy_on_path)
    assert result.returncode == 255
    assert b"Permission denied (publickey" in result.stderr


def test_glob_characters_in_a_name_reach_vsock_proxy_as_typed(sshd, vsock_proxy_on_path,
                                                               tmp_path):
    """Unquoted, the shell would expand 'unix%*' to this file in ssh's
    working directory and log in to the test sshd."""
    (tmp_path / slash_free("unix", sshd.socket_path)).write_text("")
    result = sshd.ssh("unix%*", "true", config=snippet_config(sshd), cwd=tmp_path,
                      env=vsock_proxy_on_path)
    assert result.returncode == 255
    assert result.stderr.startswith(b"vsock-proxy: unix%*: no such socket file: /* (ENOENT)\n")


@pytest.mark.parametrize("hostname, matched", [("unix/run/ab", True), ("unix/run/a'b", False)])
def test_a_name_with_a_quote_never_reaches_the_snippet_command(sshd, hostname, matched):
    """Older ssh passes a quote in a host name to the shell; this ssh refuses
    such names on the command line, so the name comes from HostName here,
    and 'Match final' matches the Host patterns against it again."""
    config = sshd.ssh_config('Include %s\nHost alias\n    HostName "%s"\nMatch final\n'
                             % (SHIPPED_SNIPPET, hostname))
    settings = sshd.ssh("alias", config=config, extra_args=["-G"]).stdout.decode()
    assert ("proxycommand vsock-proxy --fdpass '%n' %p" in settings.splitlines()) is matched


# -- a local port forwarded to the guest (tools that run no ProxyCommand) -----

def free_tcp_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def connect_when_listening(port, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=timeout)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def echo_through(sock, payload):
    """Send payload and EOF while reading the echo to EOF; its SHA-256."""
    sender = threading.Thread(target=lambda: (sock.sendall(payload),
                                              sock.shutdown(socket.SHUT_WR)))
    sender.start()
    hasher = hashlib.sha256()
    for data in iter(lambda: sock.recv(1 << 20), b""):
        hasher.update(data)
    sender.join()
    return hasher.hexdigest()


def test_socat_exec_forwards_a_local_port_to_the_guest(tmp_path, vsock_proxy_on_path):
    """The README's socat line.  socat gives EXEC: one socketpair as stdin and
    stdout: vsock-proxy relays on it, and passes the guest's EOF on."""
    require("socat")
    guest = serve_unix(tmp_path, echo)
    port = free_tcp_port()
    [line] = readme_commands("port-forward-socat")
    line = line.replace("8080", str(port)).replace("vsock/3 80", "unix" + guest)
    forward = subprocess.Popen(shlex.split(line), stderr=subprocess.PIPE, env=vsock_proxy_on_path)
    try:
        payload = os.urandom(8 << 20)
        for _ in range(2):               # one connection after the other
            with connect_when_listening(port) as sock:
                sock.settimeout(30)
                assert echo_through(sock, payload) == hashlib.sha256(payload).hexdigest()
    finally:
        forward.terminate()
        forward.wait(10)
    assert forward.stderr.read() == b""


def test_one_accepted_socket_as_stdin_and_stdout_relays_each_half_close(tmp_path):
    """inetd and systemd's Accept=yes start vsock-proxy with the accepted
    connection as both stdin and stdout.  The guest here speaks, shuts down
    its sending side and then listens: its EOF must reach the client while
    the client has yet to send (closing stdout alone would not end a socket
    that stdin still holds)."""
    received = []

    def greet_then_listen(conn):
        conn.sendall(b"send me everything\n")
        conn.shutdown(socket.SHUT_WR)
        received.append(sha256_until_eof(conn))
    guest = serve_unix(tmp_path, greet_then_listen)
    with unix_listener(tmp_path / "forward.sock") as listener, \
            socket.socket(socket.AF_UNIX) as client:
        client.connect(listener.getsockname())
        accepted, _ = listener.accept()
        with accepted:
            proxy = subprocess.Popen([*PROXY_ARGV, "unix" + guest], stdin=accepted,
                                     stdout=accepted, stderr=subprocess.PIPE)
        client.settimeout(30)
        assert client.makefile("rb").read() == b"send me everything\n"
        payload = os.urandom(8 << 20)
        client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        assert proxy.wait(30) == 0
    assert proxy.stderr.read() == b""
    assert received == [hashlib.sha256(payload).hexdigest()]
