"""Installing: --ssh-config prints a snippet that ssh accepts and that runs
this installation by absolute paths, whatever a user's PATH holds; an
installation ssh_config cannot name is refused in one line; a Python older
than 3.9 says so in one line."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PROXY_SCRIPT, run_cmd

BARE_PATH = "/usr/bin:/bin"       # no vsock-proxy, no pyenv shim


def copy_of_the_file(directory, shebang=None):
    """vsock_proxy.py copied to directory/vsock-proxy, as the README's
    system-wide install does, optionally with another '#!' line."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "vsock-proxy"
    text = PROXY_SCRIPT.read_text()
    if shebang:
        text = shebang + "\n" + text.split("\n", 1)[1]
    program.write_text(text)
    program.chmod(0o755)
    return program


def proxy_command(snippet):
    return snippet.split("ProxyCommand ")[1].split(" --fdpass")[0]


def test_snippet_of_a_file_run_through_env_names_the_interpreter(sshd, tmp_path):
    """'#!/usr/bin/env python3' is each user's first python3 (a pyenv shim,
    an older one): the snippet names the one that printed it."""
    program = copy_of_the_file(tmp_path / "bin")
    printed = run_cmd([sys.executable, program, "--ssh-config"])
    assert printed.returncode == 0, printed.stderr
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(printed.stdout)
    assert proxy_command(snippet.read_text()) == "%s %s" % (sys.executable, program)
    result = sshd.ssh("unix" + sshd.socket_path, "echo anywhere",
                      config=sshd.ssh_config("Include %s\n" % snippet),
                      env=dict(os.environ, PATH=BARE_PATH))
    assert (result.returncode, result.stdout) == (0, b"anywhere\n"), result.stderr


def test_snippet_of_a_program_whose_shebang_names_this_interpreter_runs_it_as_is(tmp_path):
    """pip's wrapper names its venv's Python in its '#!' line."""
    program = copy_of_the_file(tmp_path / "bin", shebang="#!" + sys.executable)
    printed = run_cmd([program, "--ssh-config"])
    assert proxy_command(printed.stdout.decode()) == str(program)


@pytest.mark.parametrize("name", ["it's", 'say "hi"', "back\\slash", "new\nline"])
def test_ssh_config_refuses_a_path_an_ssh_config_line_cannot_carry(tmp_path, name):
    program = copy_of_the_file(tmp_path / name)
    result = run_cmd([sys.executable, program, "--ssh-config"])
    assert (result.returncode, result.stdout) == (2, b"")
    assert result.stderr == (
        "vsock-proxy: --ssh-config: %s has a quote, a backslash or a control character in "
        "its path, which an ssh_config line cannot carry; install vsock-proxy (and Python) "
        "under a plainer path\n" % str(program).replace("\n", "\\n")).encode()


def test_ssh_config_from_a_path_the_locale_cannot_decode_prints_its_bytes(tmp_path):
    directory = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    program = copy_of_the_file(tmp_path / os.fsdecode(directory))
    env = dict(os.environ, LC_ALL="C.UTF-8", PYTHONUTF8="0")   # stdout: strict UTF-8
    env.pop("PYTHONIOENCODING", None)
    result = run_cmd([sys.executable, program, "--ssh-config"], env=env)
    assert (result.returncode, result.stderr) == (0, b"")
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(result.stdout)
    settings = run_cmd(["ssh", "-F", snippet, "-G", "vsock%3"]).stdout
    assert b"proxycommand %s '%s/vsock-proxy' --fdpass '%%n' %%p\n" % (
        os.fsencode(sys.executable), directory) in settings


def pyenv_python(version):
    """pyenv's newest Python X.Y, or None."""
    root = (subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
            if shutil.which("pyenv") else os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob("%s/versions/%s.*/bin/python%s" % (root, version, version)))
    return found[-1] if found else None


@pytest.mark.parametrize("version", ["3.6", "3.7", "3.8"])
def test_python_older_than_3_9_says_so_in_one_line(version):
    python = pyenv_python(version)
    if python is None:
        pytest.skip("no Python %s under pyenv" % version)
    result = run_cmd([python, PROXY_SCRIPT, "--fdpass", "vsock/3"])
    assert (result.returncode, result.stdout) == (2, b"")
    line = result.stderr.decode()
    assert line.startswith("vsock-proxy: needs Python 3.9 or later, and %s is Python %s."
                           % (python, version)) and line.count("\n") == 1
    assert line.endswith(": run it as 'PYTHON %s' with a newer Python (--ssh-config, run "
                         "that way, prints a snippet that does)\n" % PROXY_SCRIPT)
