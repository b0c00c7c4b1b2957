"""Installing: --ssh-config prints a snippet that ssh accepts and that runs
this installation by absolute paths, whatever a user's PATH holds; an
installation ssh_config cannot name is refused in one line; a Python older
than 3.9 says so in one line."""

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import vsock_proxy
from conftest import PROXY_SCRIPT, ROOT, imported_from, proxy_command_in, run_cmd

BARE_PATH = "/usr/bin:/bin"       # no vsock-proxy, no pyenv shim


def copy_of_the_file(directory, name="vsock-proxy"):
    """vsock_proxy.py copied to directory/name: as a command (vsock-proxy,
    run as a script) or as an importable module (vsock_proxy.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / name
    program.write_bytes(PROXY_SCRIPT.read_bytes())
    program.chmod(0o755)
    return program


def test_snippet_of_a_copied_command_runs_it_as_a_script_with_the_python_that_printed_it(
        sshd, tmp_path):
    """'#!/usr/bin/env python3' is each user's first python3 (a pyenv shim,
    an older one): the snippet names the one that printed it."""
    program = copy_of_the_file(tmp_path / "bin")
    printed = run_cmd([sys.executable, program, "--ssh-config"])
    assert printed.returncode == 0, printed.stderr
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(printed.stdout)
    assert proxy_command_in(snippet.read_text()) == "%s -I -S %s" % (sys.executable, program)
    result = sshd.ssh("unix" + sshd.socket_path, "echo anywhere",
                      config=sshd.ssh_config("Include %s\n" % snippet),
                      env=dict(os.environ, PATH=BARE_PATH))
    assert (result.returncode, result.stdout) == (0, b"anywhere\n"), result.stderr


def test_snippet_of_an_importable_module_imports_it_from_its_directory(sshd, tmp_path):
    module = copy_of_the_file(tmp_path / "lib", "vsock_proxy.py")
    printed = run_cmd([sys.executable, module, "--ssh-config"])
    assert printed.returncode == 0, printed.stderr
    assert proxy_command_in(printed.stdout.decode()) == imported_from(module.parent)
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(printed.stdout)
    result = sshd.ssh("unix" + sshd.socket_path, "echo imported",
                      config=sshd.ssh_config("Include %s\n" % snippet),
                      env=dict(os.environ, PATH=BARE_PATH))
    assert (result.returncode, result.stdout) == (0, b"imported\n"), result.stderr


def test_snippet_command_is_not_swayed_by_the_working_directory_or_python_variables(
        sshd, tmp_path, monkeypatch):
    """ssh runs the proxy in the user's working directory (a cloned
    repository, say) and environment: a vsock_proxy.py there, PYTHONPATH,
    PYTHONSTARTUP or PYTHONSAFEPATH must not change what runs."""
    printed = run_cmd([sys.executable, PROXY_SCRIPT, "--ssh-config"])
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(printed.stdout)
    planted = tmp_path / "planted"
    planted.mkdir()
    for name in ("vsock_proxy.py", "sitecustomize.py", "startup.py"):
        (planted / name).write_text("raise SystemExit('planted %s ran')\n" % name)
    monkeypatch.chdir(planted)
    env = dict(os.environ, PATH=BARE_PATH, PYTHONPATH=str(planted), PYTHONSAFEPATH="1",
               PYTHONSTARTUP=str(planted / "startup.py"), PYTHONHOME=str(planted))
    result = sshd.ssh("unix" + sshd.socket_path, "echo untouched",
                      config=sshd.ssh_config("Include %s\n" % snippet), env=env)
    assert (result.returncode, result.stdout) == (0, b"untouched\n"), result.stderr


def test_launcher_finds_its_module_where_python_puts_no_script_directory(tmp_path):
    """The system-wide install: a symlink in bin/ to the launcher beside
    vsock_proxy.py.  Python's own sys.path[0] is gone with PYTHONSAFEPATH
    (Python 3.11+) or -I; the launcher puts its directory there itself."""
    lib = tmp_path / "lib"
    copy_of_the_file(lib, "vsock_proxy.py")
    shutil.copy(ROOT / "vsock-proxy", lib / "vsock-proxy")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vsock-proxy").symlink_to(lib / "vsock-proxy")
    version = b"vsock-proxy %s\n" % vsock_proxy.__version__.encode()
    for argv, env in (([sys.executable, "-I"], os.environ),
                      ([sys.executable], dict(os.environ, PYTHONSAFEPATH="1"))):
        result = run_cmd(argv + [tmp_path / "bin" / "vsock-proxy", "--version"], env=env,
                         cwd=tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (0, version, b"")


def test_snippet_command_loads_the_byte_code_pip_compiled(pip_installed):
    """The point of importing rather than running the file: Python compiles
    a script at every start (8 ms), an imported module only once."""
    printed = run_cmd([pip_installed.command, "--ssh-config"])
    command = shlex.split(proxy_command_in(printed.stdout.decode()))
    site_packages = str(pip_installed.module.parent)
    assert command[1:] == shlex.split(imported_from(site_packages))[1:]
    # python -v says where each module's code object came from.
    result = run_cmd(command[:1] + ["-v"] + command[1:] + ["--version"])
    assert result.stdout == b"vsock-proxy %s\n" % vsock_proxy.__version__.encode()
    cached = os.path.join(site_packages, "__pycache__", "vsock_proxy.")
    assert re.search(rb"code object from '%s[^']*\.pyc'" % re.escape(cached.encode()),
                     result.stderr), result.stderr.decode()[-2000:]


@pytest.mark.parametrize("name", ["it's", 'say "hi"', "back\\slash", "new\nline"])
def test_ssh_config_refuses_a_path_an_ssh_config_line_cannot_carry(tmp_path, name):
    program = copy_of_the_file(tmp_path / name)
    result = run_cmd([sys.executable, program, "--ssh-config"])
    assert (result.returncode, result.stdout) == (2, b"")
    assert result.stderr == (
        "vsock-proxy: --ssh-config: %s has a quote, a backslash or a control character in "
        "its path, which an ssh_config line cannot carry; install vsock-proxy (and Python) "
        "under a plainer path\n" % str(program).replace("\n", "\\n")).encode()


@pytest.mark.parametrize("name", ["vsock-proxy", "vsock_proxy.py"])
def test_ssh_config_from_a_path_the_locale_cannot_decode_prints_its_bytes(tmp_path, name):
    directory = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    program = copy_of_the_file(tmp_path / os.fsdecode(directory), name)
    env = dict(os.environ, LC_ALL="C.UTF-8", PYTHONUTF8="0")   # stdout: strict UTF-8
    env.pop("PYTHONIOENCODING", None)
    result = run_cmd([sys.executable, program, "--ssh-config"], env=env)
    assert (result.returncode, result.stderr) == (0, b"")
    snippet = tmp_path / "vsock-proxy.conf"
    snippet.write_bytes(result.stdout)
    settings = run_cmd(["ssh", "-F", snippet, "-G", "vsock%3"]).stdout
    command = (b"'%s/vsock-proxy'" % directory if name == "vsock-proxy" else
               b"-c %s '%s'" % (shlex.quote(vsock_proxy.IMPORT_AND_RUN).encode(), directory))
    assert b"proxycommand %s -I -S %s --fdpass '%%n' %%p\n" % (
        os.fsencode(sys.executable), command) in settings
    # and the command runs, finding the file there
    argv = shlex.split(os.fsdecode(settings.split(b"proxycommand ")[1].split(b"\n")[0]))
    argv = [a for a in argv if a not in ("--fdpass", "%n", "%p")] + ["--version"]
    assert run_cmd(argv, env=env).stdout == b"vsock-proxy %s\n" % vsock_proxy.__version__.encode()


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
