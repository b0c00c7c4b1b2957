"""Connection failures: one line each, naming the target and the reason,
with the hint that helps; exit status 1; never a traceback.

The AF_VSOCK messages are checked here without opening any AF_VSOCK
connection (this machine may have no loopback transport, and then every CID
goes to the real hypervisor); test_vsock.py checks them against a real kernel.
"""

import _socket
import errno
import os
import socket

import pytest

import vsock_proxy
from vsock_proxy import ConnectError, main, parse_target

VSOCK_ERRNO_MESSAGES = [
    (errno.ECONNRESET, "vsock/3: nothing is listening on vsock port 22 (ECONNRESET): "
                       "is sshd listening on vsock port 22 in the guest?", True),
    (errno.ECONNREFUSED, "nothing is listening on vsock port 22 (ECONNREFUSED)", True),
    (errno.ENODEV, "vsock/3: no VM with CID 3 (ENODEV): is the VM running, "
                   "with a vsock device and this CID?", True),
    (errno.ETIMEDOUT, "vsock/3: no answer within 5s (ETIMEDOUT): the guest may "
                      "still be booting; try --wait 60", True),
    (errno.ENETUNREACH, "no vsock transport reaches CID 3", True),
    (errno.EACCES, "vsock/3: permission denied (EACCES)", False),
    (errno.EINVAL, "vsock/3: Invalid argument (EINVAL)", False),
]


@pytest.mark.parametrize("code, message, transient", VSOCK_ERRNO_MESSAGES)
def test_vsock_errno_becomes_a_message(code, message, transient):
    error = vsock_proxy.vsock_connect_error(
        parse_target("vsock/3"), OSError(code, os.strerror(code)), 5.0)
    assert message in str(error)
    assert error.transient is transient


def test_vsock_python_timeout_reads_as_etimedout():
    error = vsock_proxy.vsock_connect_error(parse_target("vsock/3"), socket.timeout("timed out"), 2.5)
    assert "no answer within 2.5s (ETIMEDOUT)" in str(error)


def test_vsock_enodev_on_cid_1_points_to_the_loopback_module():
    error = vsock_proxy.vsock_connect_error(
        parse_target("vsock/local"), OSError(errno.ENODEV, "No such device"), 5.0)
    assert "is the vsock_loopback module loaded?" in str(error)


def test_no_af_vsock_on_this_system_points_to_the_unix_forms(monkeypatch, capsys):
    monkeypatch.delattr(_socket, "AF_VSOCK", raising=False)
    assert main(["vsock/3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vsock-proxy: vsock/3: this system has no AF_VSOCK")
    assert "unix/PATH or vsock-mux/PATH" in err and err.count("\n") == 1


def test_af_vsock_socket_refused_by_the_kernel_says_to_load_the_module(monkeypatch, capsys):
    real_socket = vsock_proxy.Socket

    def no_vsock(family=-1, *args, **kwargs):
        if family == getattr(_socket, "AF_VSOCK", object()):
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)
    monkeypatch.setattr(_socket, "AF_VSOCK", 40, raising=False)
    monkeypatch.setattr(vsock_proxy, "Socket", no_vsock)
    assert main(["vsock/3"]) == 1
    err = capsys.readouterr().err
    assert "cannot create an AF_VSOCK socket: Address family not supported by protocol " \
           "(EAFNOSUPPORT)" in err
    assert "modprobe vhost_vsock" in err


# --- AF_UNIX, against real sockets -------------------------------------------

def test_missing_socket_file(tmp_path, capsys):
    assert main(["unix%s/vm.sock" % tmp_path]) == 1
    assert capsys.readouterr().err == (
        "vsock-proxy: unix%s/vm.sock: no such socket file: %s/vm.sock (ENOENT)\n"
        % (tmp_path, tmp_path))


def test_missing_socket_file_in_other_case_names_the_one_there(tmp_path, capsys):
    """Right for a typo as much as for a ProxyCommand with %h."""
    (tmp_path / "VM.sock").touch()
    assert main(["unix%s/vm.sock" % tmp_path]) == 1
    assert capsys.readouterr().err == (
        "vsock-proxy: unix%s/vm.sock: no such socket file: %s/vm.sock (ENOENT); there is "
        "%s/VM.sock, which differs in letter case: check the name (in a ProxyCommand, use "
        "%%n: ssh lowercases %%h)\n" % (tmp_path, tmp_path, tmp_path))


def test_missing_socket_with_colon_names_the_spelling_without_slash(tmp_path, capsys):
    assert main(["unix%s/vm.sock:/tmp" % tmp_path]) == 1
    assert capsys.readouterr().err.endswith(
        "; scp and sftp pass 'HOST:PATH' whole when HOST has a '/': write unix%s%%vm.sock:/tmp\n"
        % str(tmp_path).replace("/", "%"))


def test_missing_socket_with_colon_and_percent_in_its_path_suggests_an_alias(tmp_path, capsys):
    """The spelling without '/' would read that '%' as '/'."""
    assert main(["unix%s/100%%.sock:/tmp" % tmp_path]) == 1
    assert capsys.readouterr().err.endswith(
        "; scp and sftp pass 'HOST:PATH' whole when HOST has a '/': give the socket a "
        "Host alias in ssh_config\n")


def test_stale_socket_file_is_nothing_accepting(tmp_path, capsys):
    path = str(tmp_path / "stale.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.close()                      # the file stays, nobody listens
    assert main(["unix" + path]) == 1
    assert capsys.readouterr().err == (
        "vsock-proxy: unix%s: nothing accepts connections on %s (ECONNREFUSED): the VM "
        "or the service behind the socket is not running\n" % (path, path))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_permission_denied_names_the_cure(tmp_path, capsys):
    path = str(tmp_path / "private.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    os.chmod(path, 0o600)
    os.seteuid(65534)                     # nobody
    try:
        status = main(["unix" + path])
    finally:
        os.seteuid(0)
        listener.close()
    assert status == 1
    assert capsys.readouterr().err == (
        "vsock-proxy: unix%s: permission denied on %s (EACCES): run as a user who may "
        "open it (its owner or group, or sudo)\n" % (path, path))


def test_connect_error_exception_carries_the_printed_message(tmp_path):
    with pytest.raises(ConnectError) as caught:
        vsock_proxy.connect("unix%s/none.sock" % tmp_path)
    assert str(caught.value) == "unix%s/none.sock: no such socket file: %s/none.sock (ENOENT)" % (
        tmp_path, tmp_path)
    assert caught.value.transient


def test_control_characters_from_paths_are_escaped():
    assert vsock_proxy.printable("a\x1b[31mb\n") == "a\\x1b[31mb\\n"
    assert vsock_proxy.printable(b"\x9b2J\x07ok") == "\\x9b2J\\x07ok"


@pytest.mark.parametrize("kind", ["regular file", "directory"])
def test_a_path_that_is_no_socket_says_so_and_is_not_retried(tmp_path, kind, capsys):
    path = tmp_path / "not-a-socket"
    path.mkdir() if kind == "directory" else path.write_text("")
    assert main(["--wait", "30", "unix%s" % path]) == 1
    assert capsys.readouterr().err == "vsock-proxy: unix%s: %s is not a socket\n" % (path, path)


def test_timeval_is_laid_out_as_the_c_struct():
    """Two C longs, seconds and microseconds: what struct.pack("ll") gives."""
    import struct
    for seconds, fields in ((2.5, (2, 500000)), (0, (0, 0)), (1e-9, (0, 1)),
                            (vsock_proxy.LONGEST, (1000000, 0)), (float("inf"), (0, 0))):
        assert vsock_proxy.timeval(seconds) == struct.pack("ll", *fields)


def test_tiny_timeouts_stay_timeouts():
    """0 in a struct timeval means 'wait forever': a positive time never rounds to it."""
    assert vsock_proxy.timeval(1e-9) == vsock_proxy.timeval(0.000001) != vsock_proxy.timeval(0)
    assert vsock_proxy.timeval(2.5) == vsock_proxy.timeval(2) [:8] + vsock_proxy.timeval(0.5)[8:]
