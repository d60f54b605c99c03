"""The CPU meter of the service systems: a part's seconds are what its processes used between two
reads, a busy process counts and an idle one hardly does, and a process that ends in between
neither fails the read nor makes a part's figure negative."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.cpu_split import CpuMeter, cores_used, cpu_counters

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_a_busy_process_counts_its_cpu_seconds_and_a_sleeping_one_hardly_any():
    # the busy one spins 0.5 s of CPU when told to, says so, then sleeps
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nsys.stdin.readline()\n"
            + SPIN.format(s=0.5)
            + "print('spun', flush=True)\ntime.sleep(30)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = CpuMeter({"verifier": [busy.pid], "router": [idle.pid]})
        before = meter.read()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline().strip() == "spun"
        used = cpu_counters(before, meter.read())
        assert used["cpu_s_verifier"] >= 0.45  # the 0.5 s spin, counted in ticks of 10 ms
        assert used["cpu_s_router"] < 0.1
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_a_process_that_ended_between_the_reads_is_not_an_error_nor_negative():
    short = subprocess.Popen([sys.executable, "-c", SPIN.format(s=0.2)])
    meter = CpuMeter({"drafters": [short.pid], "clients": [99999999]})  # the second never existed
    before = meter.read()
    short.wait()
    used = cpu_counters(before, meter.read())
    assert used == {"cpu_s_drafters": 0.0, "cpu_s_clients": 0.0}


def test_cores_are_cpu_seconds_over_the_wall_and_absent_without_the_counters():
    m = {"wall_s": 4.0, "counters": {"cpu_s_verifier": 6.0, "cpu_s_gateway": 0.2}}
    cores = cores_used(m)
    assert cores is not None and cores["verifier"] == 1.5 and cores["gateway"] == 0.05 and cores["redis"] == 0.0
    assert cores_used({"wall_s": 4.0, "counters": {"verifier_busy_s": 3.0}}) is None
