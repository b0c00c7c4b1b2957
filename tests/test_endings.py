"""The relay always ends, and exit 0 means every byte arrived: the
termination-and-integrity matrix (tests/endings.py) over AF_UNIX.  The same
matrix runs over real AF_VSOCK in test_vsock.py."""

import pytest

from conftest import serve_unix
from endings import matrix, run_case


@pytest.mark.parametrize("path, stdio, ending", matrix())
def test_relay_ends_as_its_table_says(tmp_path, request, path, stdio, ending):
    run_case(path, stdio, ending, lambda peer: "unix" + serve_unix(tmp_path, peer),
             seed=request.node.name)
