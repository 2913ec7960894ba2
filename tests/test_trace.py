"""engine.observe.trace: events from the meter, exported to Chrome trace JSON and loaded back."""

from __future__ import annotations

import json

import pytest
import torch

from engine.observe.meter import CommMeter
from engine.comm import ops
from engine.observe.trace import TraceEvent, events_from_meter, from_chrome_trace, to_chrome_trace
from tests.helpers import run_ranks


def _traced_rank(rank, world_size):
    t = torch.ones(1000)
    with CommMeter() as meter:
        for _ in range(3):
            ops.all_reduce(t)
    return events_from_meter(meter, rank)


def test_meter_events_round_trip_through_chrome_trace_json(tmp_path):
    events = [e for per_rank in run_ranks(_traced_rank, 2) for e in per_rank]
    path = tmp_path / "comm.trace.json"
    to_chrome_trace(events, path)

    doc = json.loads(path.read_text())  # valid JSON in the Trace Event Format
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 6 and {e["pid"] for e in complete} == {0, 1}
    assert min(e["ts"] for e in complete) == 0  # shifted to start at zero
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}

    back = from_chrome_trace(path)
    t0 = min(e.start for e in events)
    for original, loaded in zip(sorted(events, key=lambda e: (e.rank, e.start)), back):
        assert (loaded.name, loaded.rank, loaded.lane) == ("all_reduce", original.rank, "comm")
        assert loaded.start == pytest.approx(original.start - t0, abs=1e-6)
        assert loaded.seconds == pytest.approx(original.seconds, abs=1e-6)
        assert loaded.args["bytes_sent"] == 4000  # 2(N-1)/N · 4000 B with N = 2


def test_lanes_become_threads_and_bad_events_are_rejected():
    events = [TraceEvent("F0", 0, 0.0, 1.0, lane="stage0"), TraceEvent("B0", 0, 1.0, 3.0,
                                                                      lane="stage0"),
              TraceEvent("send", 0, 0.5, 0.6, lane="comm")]
    back = from_chrome_trace(to_chrome_trace(events))
    assert [(e.name, e.lane, e.seconds) for e in back] == [
        ("F0", "stage0", 1.0), ("send", "comm", pytest.approx(0.1)), ("B0", "stage0", 2.0)]
    with pytest.raises(ValueError, match="ends \\(1.0\\) before it starts \\(2.0\\)"):
        TraceEvent("x", 0, 2.0, 1.0)


def test_the_cpu_clock_is_perf_counter_and_marks_are_ordered():
    import time

    from engine.observe.trace import Clock

    clock = Clock("cpu")
    before = time.perf_counter()
    first, second = clock.mark(), clock.mark()
    assert before <= clock.seconds(first) <= clock.seconds(second) <= time.perf_counter()


@pytest.mark.gpu
def test_the_cuda_clock_times_execution_not_launch():
    import time

    import torch

    from engine.observe.trace import Clock

    clock = Clock("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(20):
        a = a @ a / 64
    end = clock.mark()
    launched = time.perf_counter()  # the host got here long before the GPU finished
    assert clock.seconds(end) - clock.seconds(start) > 0
    assert clock.seconds(end) > launched
