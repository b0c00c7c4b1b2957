"""The TARGET and PORT grammar, and the command line around it.

Every valid form parses to the address systemd-ssh-proxy would use; every
bad input is a usage error (exit 2) with one line that names what is wrong.
"""

import os
from pathlib import Path

import pytest

import vsock_proxy
from conftest import PROXY_ARGV, run_cmd, run_proxy
from vsock_proxy import Target, UsageError, main, parse_target

VALID = [
    ("vsock/3", 22, Target("vsock", 3, 22, "")),
    ("vsock%3", 22, Target("vsock", 3, 22, "")),
    ("vsock/0", 22, Target("vsock", 0, 22, "")),
    ("vsock/4294967294", 22, Target("vsock", 4294967294, 22, "")),
    ("vsock/hypervisor", 22, Target("vsock", 0, 22, "")),
    ("vsock/local", 22, Target("vsock", 1, 22, "")),
    ("vsock%host", 22, Target("vsock", 2, 22, "")),
    ("vsock/3", "2222", Target("vsock", 3, 2222, "")),
    ("vsock/3", "0", Target("vsock", 3, 0, "")),
    ("vsock/3", "4294967294", Target("vsock", 3, 4294967294, "")),
    ("unix/run/vm.sock", 22, Target("unix", "/run/vm.sock", None, "")),
    ("unix//run/vm.sock", 22, Target("unix", "/run/vm.sock", None, "")),
    ("unix/./vm.sock", 22, Target("unix", "./vm.sock", None, "")),
    ("unix%run/vm.sock", 22, Target("unix", "/run/vm.sock", None, "")),
    # Without any '/', every '%' after unix% and vsock-mux% stands for '/';
    # with one, the name means what it means to systemd-ssh-proxy.
    ("unix%run%vm%ssh.sock", 22, Target("unix", "/run/vm/ssh.sock", None, "")),
    ("unix%%run%vm.sock", 22, Target("unix", "/run/vm.sock", None, "")),
    ("unix%.%vm.sock", 22, Target("unix", "./vm.sock", None, "")),
    ("unix%run/a%b.sock", 22, Target("unix", "/run/a%b.sock", None, "")),
    ("unix/run%vm.sock", 22, Target("unix", "/run%vm.sock", None, "")),
    ("unix/run/VM/Ssh.sock", 22, Target("unix", "/run/VM/Ssh.sock", None, "")),
    ("unix/run/vm.sock", "9", Target("unix", "/run/vm.sock", None, "")),
    ("vsock-mux/run/fc.vsock", 22, Target("vsock-mux", "/run/fc.vsock", 22, "")),
    ("vsock-mux%run/fc.vsock", "1024", Target("vsock-mux", "/run/fc.vsock", 1024, "")),
    ("vsock-mux/./fc.vsock", 22, Target("vsock-mux", "./fc.vsock", 22, "")),
    ("vsock-mux%run%fc%v.sock", 22, Target("vsock-mux", "/run/fc/v.sock", 22, "")),
    ("machine/fedora", 22, Target("machine", "fedora", 22, "")),
    ("machine%fedora", 22, Target("machine", "fedora", 22, "")),
    (".host", 22, Target("unix", "/run/ssh-unix-local/socket", None, "")),
    ("machine/.host", 22, Target("unix", "/run/ssh-unix-local/socket", None, "")),
]


@pytest.mark.parametrize("text, port, expected", VALID)
def test_valid_target_parses_to_its_address(text, port, expected):
    assert parse_target(text, port) == expected


def test_socket_path_may_hold_bytes_the_locale_cannot_decode():
    """Such argv bytes arrive surrogate-escaped and must reach connect() as they were."""
    target = parse_target("unix/tmp/s\udcff.sock")
    assert os.fsencode(target.address) == b"/tmp/s\xff.sock"


def test_target_keeps_the_text_as_typed_for_messages():
    assert str(parse_target("vsock%local")) == "vsock%local"


# (argv, words the single error line must contain)
USAGE_ERRORS = [
    ([], "no TARGET given"),
    ([""], "empty TARGET"),
    (["vsock/3", "22", "extra"], "unexpected argument 'extra'"),
    (["tcp/3"], "unknown TARGET 'tcp/3'"),
    (["vsock"], "unknown TARGET 'vsock'"),
    (["3"], "unknown TARGET '3'"),
    (["VSOCK/3"], "unknown TARGET"),
    (["vsock/"], "no CID after the prefix"),
    (["vsock/abc"], "vsock/abc: CID 'abc' is not a decimal number"),
    (["vsock/-1"], "CID '-1' is not a decimal number"),
    (["vsock/+3"], "CID '+3' is not a decimal number"),
    (["vsock/0x3"], "CID '0x3' is not a decimal number"),
    (["vsock/\u0663"], "is not a decimal number"),   # Arabic-Indic three
    (["vsock/4294967295"], "CID 4294967295 means 'any'"),
    (["vsock/4294967296"], "CID 4294967296 is out of range (0 to 4294967294)"),
    (["vsock/3:/tmp"], "write vsock%3:/tmp"),
    (["vsock%3:"], "after the CID is not part of an address"),
    (["vsock/3 4"], "white space"),
    (["vsock/3\t"], "white space"),
    (["unix/run/x\x1b[2J"], "control characters"),
    (["unix/"], "no socket path after the prefix"),
    (["unix%"], "no socket path after the prefix"),
    (["vsock-mux/"], "no socket path after the prefix, e.g. vsock-mux/run/vm.sock"),
    (["unix/" + "d" * 120], "longer than the 107 bytes AF_UNIX allows"),
    (["machine/"], "expected machine/NAME"),
    (["machine/a/b"], "expected machine/NAME"),
    (["vsock/3", "ssh"], "PORT 'ssh' is not a decimal number"),
    (["vsock/3", "-1"], "PORT '-1' is not a decimal number"),
    (["vsock/" + "1" * 5000], "CID 111111111111... is out of range (0 to 4294967294)"),
    (["vsock/3", "9" * 100000], "PORT 999999999999... is out of range"),
    (["vsock/3", "4294967295"], "PORT 4294967295 means 'any'"),
    (["vsock/3", "99999999999"], "PORT 99999999999 is out of range"),
    (["vsock/3", ""], "PORT '' is not a decimal number"),
    (["--bogus", "vsock/3"], "unknown option '--bogus'"),
    (["--timeout"], "--timeout needs a number of seconds"),
    (["--timeout", "soon", "vsock/3"], "--timeout takes a number of seconds above 0, not 'soon'"),
    (["--timeout", "0", "vsock/3"], "--timeout takes a number of seconds above 0"),
    (["--timeout=-1", "vsock/3"], "--timeout takes a number of seconds above 0"),
    (["--timeout", "nan", "vsock/3"], "--timeout takes a number of seconds"),
    (["--wait", "-5", "vsock/3"], "--wait takes a number of seconds, not '-5'"),
    (["--fdpass", "--check", "unix/x"], "--fdpass and --check do not go together"),
]


@pytest.mark.parametrize("argv, message", USAGE_ERRORS)
def test_bad_input_is_a_usage_error_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("vsock-proxy: ") and err.count("\n") == 1
    assert message in err


def test_an_escape_sequence_in_an_argument_is_escaped_once(capsys):
    assert main(["vsock/3", "22", "\x1b[31mred"]) == 2
    assert capsys.readouterr().err == (
        "vsock-proxy: unexpected argument '\\x1b[31mred' after TARGET and PORT\n")


# argv bytes the locale cannot decode arrive as U+DC80..U+DCFF; messages show
# the byte itself (\xff), as they show control characters (\x1b).
UNDECODABLE_ARGV = [
    (["--\udcff", "vsock/3"], "unknown option '--\\xff' (see --help)"),
    (["tcp/\udcff"], "unknown TARGET 'tcp/\\xff'; expected vsock/CID, unix/PATH, "
                     "vsock-mux/PATH, machine/NAME or .host"),
    (["unix/a\udcff\x1b"], "TARGET 'unix/a\\xff\\x1b' contains white space or control "
                           "characters"),
    (["vsock/\udcff"], "vsock/\\xff: CID '\\xff' is not a decimal number"),
    (["vsock/3:\udcff"], "vsock/3:\\xff: ':\\xff' after the CID is not part of an address; "
                         "scp and sftp read a '/' before ':' as a local path: "
                         "write vsock%3:\\xff"),
    (["--timeout", "\udcff", "vsock/3"], "--timeout takes a number of seconds above 0, "
                                        "not '\\xff'"),
    (["vsock/3", "22", "\udcff"], "unexpected argument '\\xff' after TARGET and PORT"),
]


@pytest.mark.parametrize("argv, message", UNDECODABLE_ARGV)
def test_undecodable_argv_bytes_show_as_the_bytes_they_are(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == "vsock-proxy: %s\n" % message


# The API's port: an int under the command line's rules, never sent unchecked.
BAD_API_PORTS = [
    (-1, "PORT takes a number from 0 to 4294967294, not -1"),
    (4294967295, "PORT 4294967295 means 'any' to vsock and is no destination"),
    (2**40, "PORT 109951162777... is out of range (0 to 4294967294)"),
    pytest.param(10**5000, "PORT takes a number from 0 to 4294967294, not an int of "
                           "16610 bits", id="10**5000"),    # too long for str()
    (True, "PORT takes a number from 0 to 4294967294, not True"),
    (22.7, "PORT takes a number from 0 to 4294967294, not 22.7"),
    (22.0, "PORT takes a number from 0 to 4294967294, not 22.0"),
    (None, "PORT takes a number from 0 to 4294967294, not None"),
]


@pytest.mark.parametrize("port, message", BAD_API_PORTS)
def test_parse_target_refuses_an_int_port_the_command_line_would_refuse(port, message):
    with pytest.raises(UsageError) as caught:
        parse_target("vsock-mux/run/fc.vsock", port)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("text", [3, None, Path("/run/vm.sock")])
def test_parse_target_refuses_a_target_that_is_no_string(text):
    with pytest.raises(UsageError, match="^TARGET takes a str such as 'vsock/3', not "):
        parse_target(text)


def test_parse_target_decodes_a_bytes_target_as_argv_is_decoded():
    target = parse_target(b"unix/tmp/s\xff.sock")
    assert os.fsencode(target.address) == b"/tmp/s\xff.sock"
    assert str(target) == "unix/tmp/s\\xff.sock"


def test_parse_target_raises_usage_error_for_the_api():
    with pytest.raises(UsageError, match="unknown TARGET"):
        parse_target("tcp/3")


def test_options_may_come_after_the_target():
    options = vsock_proxy.parse_command_line(["unix/x", "--timeout=2.5", "-v", "--wait", "7"])
    assert (options.timeout, options.verbose, options.wait) == (2.5, True, 7.0)
    assert options.target == Target("unix", "/x", None, "")


def test_double_dash_ends_the_options():
    options = vsock_proxy.parse_command_line(["--", "vsock/3", "22"])
    assert options.target == Target("vsock", 3, 22, "")


def test_help_teaches_every_target_form_with_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for form in ("vsock/CID", "unix/PATH", "vsock-mux/PATH", "machine/NAME", ".host",
                 "--fdpass", "--timeout", "--wait", "--check", "--ssh-config",
                 "PORT is ignored", "examples:", "scp notes.txt vsock%3:/tmp/"):
        assert form in out


def test_version_prints_the_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == "vsock-proxy %s\n" % vsock_proxy.__version__


def test_ssh_config_escapes_percent_in_the_installation_path(monkeypatch, capsys):
    """ssh expands %-tokens in ProxyCommand: a literal % must be written %%."""
    monkeypatch.setattr(vsock_proxy, "__file__", "/opt/100%/lib/vsock_proxy.py")
    monkeypatch.setattr("sys.executable", "/opt/100%/bin/python3")
    assert main(["--ssh-config"]) == 0
    assert ("ProxyCommand /opt/100%%/bin/python3 -I -S -c '{}' /opt/100%%/lib --fdpass '%n' %p"
            .format(vsock_proxy.IMPORT_AND_RUN) in capsys.readouterr().out)


# --- our own output: all of it arrives, or exit 1 --------------------------------

PRINTING_OPTIONS = ["--help", "--version", "--ssh-config"]


@pytest.mark.parametrize("option", PRINTING_OPTIONS)
def test_output_into_a_full_disk_is_one_line_and_exit_1(option):
    with open("/dev/full", "wb") as full:
        result = run_proxy(option, stdout=full)
    assert (result.returncode, result.stderr) == (
        1, b"vsock-proxy: cannot write to stdout: No space left on device (ENOSPC)\n")


@pytest.mark.parametrize("option", PRINTING_OPTIONS)
def test_output_into_a_closed_pipe_is_quiet_but_no_success(option):
    """Like '| head -1' after head has gone: the reader wanted no more."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = run_proxy(option, stdout=write_end)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (1, b"")


def test_output_to_a_closed_stdout_is_one_line_and_exit_1():
    result = run_cmd(["sh", "-c", 'exec "$@" >&-', "sh", *PROXY_ARGV, "--version"])
    assert (result.returncode, result.stderr) == (
        1, b"vsock-proxy: cannot write to stdout: Bad file descriptor (EBADF)\n")
