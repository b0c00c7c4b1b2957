"""Real OpenSSH through vsock-proxy over AF_UNIX: ssh, scp and sftp against a
real `sshd -i`, in relay mode and in fd-passing mode, configured the ways
users configure it (ProxyCommand by hand, and the shipped snippet)."""

import hashlib
import os
import pty
import select
import subprocess

import pytest

from conftest import ROOT, imported_from, proxy_command_in, run_proxy

SNIPPET = ROOT / "ssh_config.d" / "vsock-proxy.conf"

MODES = {
    "relay": "ProxyCommand vsock-proxy %n %p",
    "fdpass": "ProxyCommand vsock-proxy --fdpass %n %p\n    ProxyUseFdpass yes",
}


@pytest.fixture(params=sorted(MODES))
def mode(request):
    return request.param


def alias_config(sshd, mode, target):
    """A Host alias `vm` for target: scp and sftp need one for unix paths,
    whose '/' before ':' they would read as a local path."""
    return sshd.ssh_config("Host vm\n    %s\n" % MODES[mode].replace("%n", target))


def test_ssh_runs_a_command(sshd, vsock_proxy_on_path, mode):
    config = sshd.ssh_config("Host unix/*\n    %s\n" % MODES[mode])
    result = sshd.ssh("unix" + sshd.socket_path, "echo hello", config=config,
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"hello\n"), result.stderr


def test_plain_proxycommand_with_percent_h_and_port_22(sshd, vsock_proxy_on_path):
    config = sshd.ssh_config("Host unix/*\n    ProxyCommand vsock-proxy %h 22\n")
    result = sshd.ssh("unix" + sshd.socket_path, "echo plain", config=config,
                      env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"plain\n"), result.stderr


def capitalised_socket(sshd, tmp_path):
    """The test sshd's socket under a path with capital letters."""
    directory = tmp_path / "VMs"
    directory.mkdir()
    link = directory / "Guest.sock"
    link.symlink_to(sshd.socket_path)
    return str(link)


def test_shipped_snippet_reaches_a_unix_path_with_capitals(sshd, vsock_proxy_on_path, tmp_path):
    config = sshd.ssh_config("Include %s\n" % SNIPPET)
    result = sshd.ssh("unix" + capitalised_socket(sshd, tmp_path), "echo snippet",
                      config=config, env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"snippet\n"), result.stderr


def test_percent_h_lowercases_capitals_and_the_error_says_so(sshd, vsock_proxy_on_path, tmp_path):
    config = sshd.ssh_config("Host unix/*\n    ProxyCommand vsock-proxy %h %p\n")
    path = capitalised_socket(sshd, tmp_path)
    result = sshd.ssh("unix" + path, "true", config=config, env=vsock_proxy_on_path)
    assert result.returncode == 255
    assert ("vsock-proxy: unix%s: no such socket file: %s (ENOENT); there is %s, which "
            "differs in letter case: check the name (in a ProxyCommand, use %%n: ssh "
            "lowercases %%h)\n" % (path.lower(), path.lower(), path)).encode() in result.stderr


def test_ssh_config_option_prints_the_shipped_snippet_for_this_installation():
    printed = run_proxy("--ssh-config").stdout.decode()
    assert proxy_command_in(printed) == imported_from(ROOT)
    assert printed.replace(proxy_command_in(printed), "vsock-proxy") == SNIPPET.read_text()


def test_ssh_config_option_of_the_installed_command_names_its_directory(pip_installed):
    printed = subprocess.run([str(pip_installed.command), "--ssh-config"], capture_output=True,
                             check=True).stdout.decode()
    python = proxy_command_in(printed).split()[0]      # the launcher's '#!' interpreter
    assert proxy_command_in(printed) == imported_from(pip_installed.module.parent, python)


def test_bulk_upload_and_download_match_by_hash(sshd, vsock_proxy_on_path, mode, tmp_path):
    config = alias_config(sshd, mode, "unix" + sshd.socket_path)
    upload = os.urandom(24 << 20)
    result = sshd.ssh("vm", "sha256sum", config=config, input=upload, env=vsock_proxy_on_path)
    assert result.stdout.split()[0].decode() == hashlib.sha256(upload).hexdigest(), result.stderr
    source = tmp_path / "download.bin"
    source.write_bytes(os.urandom(24 << 20))
    result = sshd.ssh("vm", "cat", str(source), config=config, env=vsock_proxy_on_path)
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(result.stdout).digest() == hashlib.sha256(source.read_bytes()).digest()


def test_scp_copies_both_ways(sshd, vsock_proxy_on_path, mode, tmp_path):
    config = alias_config(sshd, mode, "unix" + sshd.socket_path)
    original = tmp_path / "original.bin"
    original.write_bytes(os.urandom(5 << 20))
    remote = tmp_path / "remote.bin"
    back = tmp_path / "back.bin"
    up = sshd.scp(str(original), "vm:%s" % remote, config=config, env=vsock_proxy_on_path)
    assert up.returncode == 0, up.stderr
    down = sshd.scp("vm:%s" % remote, str(back), config=config, env=vsock_proxy_on_path)
    assert down.returncode == 0, down.stderr
    assert back.read_bytes() == original.read_bytes()


def test_sftp_batch_put_and_get(sshd, vsock_proxy_on_path, mode, tmp_path):
    config = alias_config(sshd, mode, "unix" + sshd.socket_path)
    original = tmp_path / "put.txt"
    original.write_bytes(b"over sftp\n" * 1000)
    result = sshd.sftp("vm", "put %s %s/remote.txt\nget %s/remote.txt %s/got.txt\n"
                       % (original, tmp_path, tmp_path, tmp_path),
                       config=config, env=vsock_proxy_on_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "got.txt").read_bytes() == original.read_bytes()


def test_sftp_host_with_a_path_is_a_clear_usage_error(sshd, vsock_proxy_on_path):
    """sftp hands 'vsock/3:/tmp' whole to the proxy as the host name."""
    config = sshd.ssh_config("Include %s\n" % SNIPPET)
    result = sshd.sftp("vsock/3:/tmp", "ls\n", config=config, env=vsock_proxy_on_path)
    assert result.returncode != 0
    assert (b"vsock-proxy: vsock/3:/tmp: ':/tmp' after the CID is not part of an address; "
            b"scp and sftp read a '/' before ':' as a local path: write vsock%3:/tmp\n"
            ) in result.stderr


def test_interactive_session_answers_each_line(sshd, vsock_proxy_on_path, mode):
    """A terminal session through the relay: typed lines come back at once,
    one at a time (a relay that batched or stalled would hang here)."""
    config = sshd.ssh_config("Host unix/*\n    %s\n" % MODES[mode])
    pid, terminal = pty.fork()
    if pid == 0:                     # the child: ssh on a terminal of its own
        try:
            os.execvpe("ssh", ["ssh", "-F", str(config), "-tt", "unix" + sshd.socket_path,
                               "PS1='$ ' exec /bin/sh -i"], vsock_proxy_on_path)
        finally:
            os._exit(127)

    def read_until(marker, timeout=20):
        seen = b""
        while marker not in seen:
            ready, _, _ = select.select([terminal], [], [], timeout)
            assert ready, "no %r within %ss; the terminal showed %r" % (marker, timeout, seen)
            seen += os.read(terminal, 4096)
        return seen
    try:
        read_until(b"$ ")
        for i in range(5):
            os.write(terminal, b"echo line-$((%d * 7))\n" % i)
            read_until(b"line-%d" % (i * 7))
        os.write(terminal, b"exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(terminal)
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
