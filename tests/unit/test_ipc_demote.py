"""ipc.demote: a helper takes the least CPU share for its own session, never for the session it
was started in (/proc/self/autogroup is the whole session's). A shell whose session a worker
started by hand had put at nice 19 starved its test clients for seconds beside a busy server."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# a session leader at autogroup nice 0 starts the demoted helper, in its session or in one of its own,
# and prints its own session's autogroup nice once the helper is done, then the helper's
LEADER = r"""
import os, subprocess, sys
helper = ("import os, sys; from specguide.process import ipc; ipc.demote('SPECGUIDE_TEST_PARENT'); "
          "print(open('/proc/self/autogroup').read().split()[-1], os.getsid(0) == os.getpid())")
with open("/proc/self/autogroup", "w") as f:
    f.write("0")
env = {**os.environ, "SPECGUIDE_TEST_PARENT": str(os.getpid())}
out = subprocess.run([sys.executable, "-c", helper], env=env, capture_output=True, text=True,
                     start_new_session=sys.argv[1] == "own", check=True).stdout.split()
print(open("/proc/self/autogroup").read().split()[-1], *out)
"""


def _run(where: str) -> list[str]:
    # the leader's own session: whatever the helper does to it never reaches the test run's session
    return subprocess.run([sys.executable, "-c", LEADER, where], capture_output=True, text=True, check=True,
                          start_new_session=True).stdout.split()


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="the kernel has no autogroup scheduling")
def test_a_helper_in_its_own_session_takes_nice_19_for_that_session_alone():
    leader, helper, leads = _run("own")
    assert (leader, helper, leads) == ("0", "19", "True")


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="the kernel has no autogroup scheduling")
def test_a_helper_started_inside_another_session_leaves_that_session_at_its_nice():
    leader, helper, leads = _run("parent")
    assert (leader, helper, leads) == ("0", "0", "False")  # was 19 and 19: the leader's session demoted
