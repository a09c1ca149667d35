"""How the edge stamped a draft or report decides whether it measures the link (`edge_node.link_stamps`), and
the run-queue reading that sets a probe aside (`edge_node.run_delay`)."""

from __future__ import annotations

import os

import pytest

from edge_node.link_stamps import MAX_QUEUED_WIDTH_S, LinkStamps
from edge_node.run_delay import RunDelay


def test_a_message_read_late_counts_when_its_arrival_is_known_within_the_width():
    st = LinkStamps()
    st.note("d", "draft", 3, waited=False, width_s=None)
    st.note("d", "report", 3, waited=True, width_s=MAX_QUEUED_WIDTH_S / 2)  # taken in during a long call
    assert st.take("d", "draft", 3) == "idle" and st.take("d", "report", 3) == "queued"
    st.note("d", "draft", 4, waited=True, width_s=2 * MAX_QUEUED_WIDTH_S)  # may have waited longer
    st.note("d", "report", 4, waited=True, width_s=None)  # not known since when
    assert st.take("d", "draft", 4) == "late" and st.take("d", "report", 4) == "late"
    st.note("d", "draft", 5, waited=False, width_s=None)
    assert st.take("d", "draft", 6) == "late"  # another round's stamp says nothing of this one
    assert st.take("d", "draft", 5) == "late"  # ... and was taken (popped) by that call
    assert st.counts == {"idle": 1, "queued": 1, "late": 4}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc: nothing is set aside there")
def test_the_run_queue_wait_is_a_counter_of_this_process_threads():
    rd = RunDelay()
    first = rd.now()
    busy = sum(i * i for i in range(200_000))  # some work: the counter never goes back
    second = rd.now()
    assert busy > 0 and first is not None and 0 <= first <= second
    assert RunDelay.waited(first, second) == second - first and RunDelay.waited(None, second) == 0.0
    assert RunDelay(tasks=[]).now() == 0.0  # watching no thread: never set aside
