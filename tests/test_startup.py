"""What the command loads when it starts: ssh waits for it at every login.

Speed itself is measured in bench/; these tests pin down the choices that
make it fast: the command does without the socket module (8-10 ms), without
re (which pip's console-script wrapper imports), without os (1.5-2 ms without
site: it builds the collections ABCs) and without struct (0.3 ms), and it is started
through a launcher that imports vsock_proxy, so that Python loads the
module's cached byte code instead of compiling the whole file.
"""

import os
import socket
import sys

import pytest

from conftest import ROOT, echo, run_cmd, serve_unix

# Runs main() in a fresh interpreter (-I -S: nothing from the environment or
# site-packages) and reports on stderr which of the slow modules it loaded.
REPORT_MODULES = """
import sys
sys.path.insert(0, sys.argv[1])
import vsock_proxy
status = vsock_proxy.main(sys.argv[2:])
loaded = [name for name in ("socket", "re", "os", "struct") if name in sys.modules]
sys.stderr.write("exit %d, loaded %s\\n" % (status, " ".join(loaded) or "none of them"))
"""


@pytest.mark.parametrize("mode", ["relay", "--check", "--fdpass"])
def test_the_command_loads_none_of_the_slow_modules(tmp_path, mode):
    path = serve_unix(tmp_path, echo)
    ssh_end, stdout = socket.socketpair()
    with ssh_end, stdout:
        options = [] if mode == "relay" else [mode]
        result = run_cmd([sys.executable, "-I", "-S", "-c", REPORT_MODULES, ROOT,
                          *options, "unix" + path],
                         stdout=stdout if mode == "--fdpass" else None)
    assert result.stderr == b"exit 0, loaded none of them\n"


def test_the_python_api_still_returns_a_socket_socket(tmp_path):
    import vsock_proxy
    path = serve_unix(tmp_path, echo)
    with vsock_proxy.connect("unix" + path) as sock:
        assert type(sock) is socket.socket
        assert sock.family == socket.AF_UNIX and sock.gettimeout() is None
        sock.sendall(b"ping\n")
        assert sock.recv(100) == b"ping\n"


def test_the_launcher_finds_the_module_beside_its_real_path(tmp_path):
    """The no-pip install: the launcher and vsock_proxy.py in one directory,
    the command a symlink to the launcher (Python resolves it)."""
    os.symlink(ROOT / "vsock-proxy", tmp_path / "vsock-proxy")
    result = run_cmd([sys.executable, "-S", tmp_path / "vsock-proxy", "--version"])
    assert (result.returncode, result.stdout) == (0, b"vsock-proxy 0.1.0\n")
