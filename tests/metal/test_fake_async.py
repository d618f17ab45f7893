# L3, asynchronous command buffers and device limits on the fake Metal runtime (tests/metal/host/async_cases.cpp):
# commit returns before the work runs, handlers run on another thread, waits really wait, queues run in enqueue
# order, and a CPU access to a buffer that in-flight work uses stops the process with a message naming the
# buffer and the command buffer. Also: configured device limits, static threadgroup memory, the math mode.
from __future__ import annotations

import re

import pytest

from test_fake_runtime import host, program, run  # noqa: F401 - the session fixture and helpers

ALL_OK = ["status", "handler-thread", "enqueue-order", "two-in-flight", "read-input", "limits", "static-tg",
          "fast-math"]


def cases(host, names, env=None, check=True):  # noqa: F811 - host is the fixture
    # Nothing starts before it is waited on (every case waits), so "Committed" and the in-flight window are
    # observable however loaded the machine is.
    env = {"FAKEMETAL_LEAKS_FATAL": "1", "FAKEMETAL_GPU_DELAY_MS": "600000", **(env or {})}
    r = run(program(host, "async_cases", "typed"), names, env, check=check)
    return r, dict(re.findall(r"^([a-z-]+): (.*)$", r.stdout, re.M))


def test_command_buffers_run_asynchronously(host):  # noqa: F811
    r, out = cases(host, ALL_OK)
    assert out["status"] == "012s4 out=8", out  # NotEnqueued, Enqueued, Committed (not yet run), Scheduled, Completed
    assert out["handler-thread"] == "other thread", out
    assert out["enqueue-order"] == "ba", out  # enqueue order, not commit order
    assert out["two-in-flight"] == "ok 60", out  # reading the older command buffer's output is allowed
    assert out["read-input"] == "ok 3 6", out  # reading an input of in-flight work is allowed
    assert "fakemetal" not in r.stderr.replace("fakemetal: warning: newBufferWithLength", ""), r.stderr


def test_reading_output_of_in_flight_work_is_caught(host):  # noqa: F811
    r, out = cases(host, ["read-in-flight"], check=False)
    assert r.returncode != 0 and "read-in-flight" not in out, (r.returncode, r.stdout)
    assert ("fakemetal: CPU access to buffer 'out' (byte 0) while command buffer 'step' is in flight (it may write "
            "the buffer") in r.stderr, r.stderr


def test_writing_input_of_in_flight_work_is_caught(host):  # noqa: F811
    r, out = cases(host, ["write-in-flight"], check=False)
    assert r.returncode != 0, r.stdout
    assert "CPU access to buffer 'a' (byte 4) while command buffer 'step' is in flight (it reads the buffer" in r.stderr


def test_sync_mode_runs_inside_commit(host):  # noqa: F811
    # The debugging switch: work runs inside commit, so nothing is ever in flight (and the bugs go unseen).
    r, out = cases(host, ["status", "read-in-flight", "write-in-flight"], {"FAKEMETAL_SYNC": "1"})
    assert out["status"] == "014s4 out=8", out  # Committed is never observable
    assert out["read-in-flight"] == "read 2" and out["write-in-flight"] == "wrote, out=4", out


def test_default_limits_static_threadgroup_memory_and_math_mode(host):  # noqa: F811
    _, out = cases(host, ["limits", "static-tg", "fast-math"])
    assert out["limits"].startswith(f"maxBuffer={1 << 36} workingSet={8 << 30} maxThreads=1024 pipeline=1024 big=nil status=5 "), out
    assert "2048 threads per threadgroup (the pipeline's maxTotalThreadsPerThreadgroup allows 1 to 1024)" in out["limits"]
    assert out["static-tg"].startswith("static=4096 4 5 "), out  # 16 extra bytes fit; 32 KiB more do not
    assert ("36864 bytes of threadgroup memory (4096 static + 32768 set with setThreadgroupMemoryLength) exceed the "
            "device's 32768-byte limit") in out["static-tg"], out
    assert out["fast-math"].startswith("fakemetal: the library would be compiled with fast math"), out


def test_small_device_limits(host):  # noqa: F811
    env = {"LILY_METALSIM_MAX_THREADS_PER_THREADGROUP": "256", "LILY_METALSIM_MAX_BUFFER_LENGTH": str(4 << 30),
           "LILY_METALSIM_MAX_THREADGROUP_MEMORY": "8192", "LILY_METALSIM_WORKING_SET_SIZE": str(6 << 30)}
    r, out = cases(host, ["limits", "static-tg", "two-in-flight"], env)
    assert out["limits"].startswith(f"maxBuffer={4 << 30} workingSet={6 << 30} maxThreads=256 pipeline=256 big=nil status=5 "), out
    assert "512 threads per threadgroup (the pipeline's maxTotalThreadsPerThreadgroup allows 1 to 256)" in out["limits"]
    assert f"newBufferWithLength: {(4 << 30) + 1} bytes is not a valid buffer length" in r.stderr
    assert "12288 bytes of threadgroup memory (4096 static + 8192 set" in out["static-tg"], out
    assert out["two-in-flight"] == "ok 60", out
