"""The HTTP edge raises the soft open-file limit to the hard one: many containers start
processes at 1024, a thousand idle client sockets away from refusing everyone."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

PROBE = """
import resource
from radixpool.http_edge import FD_RESERVE, edge_protocol, EdgeLimits
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
protocol = edge_protocol(EdgeLimits(max_connections=1 << 30))
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
print(soft, protocol.max_connections, FD_RESERVE)
"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096,
                    reason="the hard open-file limit here leaves nothing to raise")
def test_the_edge_raises_the_open_file_limit_and_keeps_a_reserve():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    soft, room, reserve = map(int, out.split())
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert room == soft - reserve   # connections capped below the descriptors left
