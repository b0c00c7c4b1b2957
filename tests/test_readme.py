"""README.md, run: every code block in it is run by a test or says why not;
the install sections work verbatim on a fresh account; the lines for each
tool, the examples by hand and the alias work against the test sshd, with
the README's example VM replaced by it."""

import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import (ROOT, SHIPPED_SNIPPET, echo, readme_block, readme_blocks,
                      readme_commands, require, run_cmd, serve_unix, slash_free)

BARE_PATH = "/usr/bin:/bin"       # no vsock-proxy, no pyenv shim


def test_every_code_block_is_run_by_a_test_or_says_why_not():
    blocks = readme_blocks()
    fences = [line for line in (ROOT / "README.md").read_text().splitlines()
              if line.startswith("```")]
    assert len(fences) == 2 * len(blocks), "a code block the markers cannot see"
    tests = "".join(path.read_text() for path in Path(__file__).parent.glob("*.py"))
    problems, ids = [], []
    for line, kind, value, _ in blocks:
        if kind is None:
            problems.append("line %d: no <!-- run: ID --> or <!-- not run: REASON --> "
                            "above the block" % line)
        elif kind == "not run" and len(value.split()) < 3:
            problems.append("line %d: say why it is not run" % line)
        elif kind == "run":
            ids.append(value)
            if not re.search(r"readme_(block|commands)\(\"%s\"\)" % re.escape(value), tests):
                problems.append("line %d: no test calls readme_block(%r)" % (line, value))
    problems += ["run: %s is on more than one block" % i for i in set(ids) if ids.count(i) > 1]
    assert problems == []


def login_options(sshd):
    """What a user's own ssh setup would give: the key, and the host key known."""
    return ["-i", sshd.user_key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "UserKnownHostsFile=%s" % sshd.known_hosts, "-o", "User=%s" % sshd.user]


# -- the install sections, verbatim -------------------------------------------

def test_install_for_one_user_works_verbatim_on_a_fresh_account(sshd, tmp_path):
    """No ~/.ssh, no ~/.local (pip then takes its time: one run only)."""
    home = tmp_path / "home"
    home.mkdir()
    installed = run_cmd(["bash", "-e", "-c", readme_block("install-user")], cwd=ROOT,
                        env=dict(os.environ, HOME=str(home)), timeout=600)
    assert installed.returncode == 0, installed.stderr.decode(errors="replace")
    assert (home / ".ssh" / "config").read_text() == "Include ~/.ssh/vsock-proxy.conf\n\n"
    assert run_cmd([home / ".local" / "bin" / "vsock-proxy", "--version"]).returncode == 0
    # ssh reads '~' from the password database, not from HOME: name the file.
    result = run_cmd(["ssh", "-F", home / ".ssh" / "vsock-proxy.conf", *login_options(sshd),
                      slash_free("unix", sshd.socket_path), "echo installed"],
                     env=dict(os.environ, PATH=BARE_PATH))
    assert (result.returncode, result.stdout) == (0, b"installed\n"), result.stderr


def can_make_a_mount_namespace():
    return (os.geteuid() == 0 and shutil.which("unshare") is not None and
            subprocess.run(["unshare", "--mount", "true"]).returncode == 0)


def test_install_for_every_user_works_verbatim(sshd, tmp_path):
    """Run as root in a mount namespace of its own, where /usr/local/bin,
    /usr/local/lib and /etc/ssh/ssh_config.d are empty and only this test sees what it writes;
    then a user with a bare PATH and no vsock-proxy on it logs in."""
    if not can_make_a_mount_namespace():
        pytest.skip("needs root and unshare --mount")
    if "Include /etc/ssh/ssh_config.d/*.conf" not in Path("/etc/ssh/ssh_config").read_text():
        pytest.skip("this /etc/ssh/ssh_config does not include ssh_config.d")
    user_ssh = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh")
    script = "\n".join([
        "mount -t tmpfs tmpfs /usr/local/bin",
        "mount -t tmpfs tmpfs /usr/local/lib",
        "mount -t tmpfs tmpfs /etc/ssh/ssh_config.d",
        # a config of the user running the tests must not take part
        "if [ -d %s ]; then mount -t tmpfs tmpfs %s; fi" % (user_ssh, user_ssh),
        readme_block("install-system"),
        # the snippet it wrote has the ProxyCommand the README shows
        "grep -qxF %s /etc/ssh/ssh_config.d/10-vsock-proxy.conf" % shlex.quote(
            "    " + readme_block("snippet-system").strip()),
        "exec env -i PATH=%s HOME=%s ssh %s %s 'echo every user'" % (
            BARE_PATH, tmp_path, " ".join(map(str, login_options(sshd))),
            slash_free("unix", sshd.socket_path))])
    result = run_cmd(["unshare", "--mount", "--propagation", "private", "bash", "-e", "-c",
                      script], cwd=ROOT, timeout=60)
    assert (result.returncode, result.stdout) == (0, b"every user\n"), result.stderr


# -- the README's lines against the test sshd ---------------------------------

def with_test_config(command, config):
    """ssh, scp, sftp and rsync at the start of a command read this config."""
    def add(match):
        tool = match.group(2)
        option = ("-e 'ssh -F %s'" if tool == "rsync" else "-F %s") % config
        return "%s%s %s " % (match.group(1), tool, option)
    return re.sub(r"(^|&& |\| )(ssh|scp|sftp|rsync) ", add, command)


def run_as_written(command, replacements, config, env, cwd, input=b""):
    for example, ours in replacements:
        command = command.replace(example, ours)
    result = run_cmd(["bash", "-c", with_test_config(command, config)], input=input,
                     env=dict(env, GIT_SSH_COMMAND="ssh -F %s" % config), cwd=cwd, timeout=60)
    assert result.returncode == 0, (command, result.stderr)
    return result


def tcp_sshd(sshd):
    """The test sshd on a loopback TCP port as well (a host behind the VM)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener.getsockname()[1], sshd.serve_on(listener)


def test_names_without_slash_work_with_each_tool(sshd, vsock_proxy_on_path, vm_socket,
                                                  tmp_path):
    require("rsync", "git")
    host = slash_free("unix", vm_socket)
    remote = tmp_path / "remote"
    remote.mkdir()
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    run_cmd(["git", "init", "-q", "--bare", tmp_path / "project.git"], check=True)
    control_dir = os.path.dirname(vm_socket)
    port, behind_the_vm = tcp_sshd(sshd)
    replacements = [
        ("unix%%run%%vm%%ssh.sock", host.replace("%", "%%")),
        ("unix%run%vm%ssh.sock", host),
        (":/tmp/", ":%s/" % remote),
        (":/srv/project.git", ":%s/project.git" % tmp_path),
        ("~/.ssh/cm-%h", "%s/cm-%%h" % control_dir),
        ("root@10.0.2.2", "-p %d %s@127.0.0.1" % (port, sshd.user))]
    config = sshd.ssh_config("Include %s\n" % SHIPPED_SNIPPET)
    commands, outputs = readme_commands("names-without-slash"), []
    try:
        for command in commands:
            typed = b"pwd\n" if command.startswith("sftp") else b"echo $((6 * 7))\n"
            outputs.append(run_as_written(command, replacements, config, vsock_proxy_on_path,
                                          tmp_path, input=typed).stdout)
        assert os.path.exists(os.path.join(control_dir, "cm-" + host))   # the master's
    finally:
        behind_the_vm.stop()
        run_cmd(["ssh", "-F", config, "-o", "ControlPath=%s/cm-%%h" % control_dir,
                 "-O", "exit", host])
    # Each ssh line ran the shell that read "echo $((6 * 7))"; the copies arrived.
    assert [b"42\n" in out for out in outputs] == [c.startswith("ssh ") for c in commands]
    assert (remote / "notes.txt").read_text() == "notes\n"
    assert (tmp_path / "os-release").read_bytes() == Path("/etc/os-release").read_bytes()
    assert (remote / "src" / "main.c").exists()
    assert (tmp_path / "project" / ".git").is_dir()


def test_examples_by_hand_work_with_the_snippet_installed(sshd, vsock_proxy_on_path,
                                                          vm_socket, tmp_path):
    """-o ProxyCommand over the snippet's ProxyUseFdpass yes, among them."""
    echo_socket = serve_unix(tmp_path, echo)
    replacements = [("unix/tmp/echo.sock", "unix" + echo_socket), ("vsock/3", "unix" + vm_socket)]
    config = sshd.ssh_config("Include %s\n" % SHIPPED_SNIPPET)
    for command in readme_commands("by-hand"):
        result = run_as_written(command, replacements, config, vsock_proxy_on_path, tmp_path,
                                input=b"echo $((6 * 7))\n")
        assert result.stdout == (b"hello\n" if "echo hello" in command else b"42\n")


def test_a_host_alias_serves_ssh_and_scp(sshd, vsock_proxy_on_path, vm_socket, tmp_path):
    alias = readme_block("host-alias").replace("unix/run/vm/ssh.sock", "unix" + vm_socket)
    config = sshd.ssh_config(alias)
    result = sshd.ssh("myvm", "echo alias", config=config, env=vsock_proxy_on_path)
    assert (result.returncode, result.stdout) == (0, b"alias\n"), result.stderr
    (tmp_path / "f").write_text("by alias\n")
    copied = sshd.scp(tmp_path / "f", "myvm:%s/g" % tmp_path, config=config,
                      env=vsock_proxy_on_path)
    assert copied.returncode == 0 and (tmp_path / "g").read_text() == "by alias\n"
