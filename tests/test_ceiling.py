"""The bandwidth ceilings and how a GPU command brackets its cases with them: CPU only, no torch
(the kernel's compile check needs nvcc; the measurements themselves run on the H200, test_gpu_baselines)."""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest

from persistentkv import ceiling
from persistentkv.errors import PKVError
from persistentkv.measure.rows import ceiling_rows, raw_frame


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed (the kernel compiles on GPU hosts)")
def test_ceiling_kernel_compiles_for_hopper_without_spills(tmp_path):
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "c.cubin"),
                           str(ceiling.kernels_dir() / ceiling.KERNEL_FILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes spill stores" in done.stderr
    ptx = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", "-o", "-", str(ceiling.kernels_dir() / ceiling.KERNEL_FILE)],
                         capture_output=True, text=True, check=True).stdout
    assert ptx.count("ld.global.nc.v4") >= 4   # 16-byte loads, four in flight
    assert "atom.global.xor" in ptx             # the reduction keeps every load


def test_ceiling_rows_from_samples_and_failures():
    samples = [ceiling.CeilingSample("read-ceiling", i, 4 * 10**9, t) for i, t in enumerate([1000.0, 1100.0, 900.0])]
    samples.append(ceiling.CeilingSample("copy-ceiling", 0, 2 * 10**9, 1000.0))
    assert ceiling.median_gbps(samples) == pytest.approx(4000.0)
    rows = ceiling_rows(samples, {}, "rid", "bench_kernels")
    frame = raw_frame(rows)
    assert (frame["protocol"] == "ceiling").all() and np.allclose(frame["read_ceiling_gbps"], 4000.0)
    copy = frame[frame["backend"] == "copy-ceiling"]
    assert copy["frac_of_ceiling"].iloc[0] == pytest.approx(0.5)
    failed = raw_frame(ceiling_rows([], {"read-ceiling": "cupy cannot be imported"}, "rid", "x"))
    assert failed["status"].tolist() == ["failed"] and math.isnan(failed["read_ceiling_gbps"].iloc[0])


def test_fit_stream_recovers_rate_and_fixed_cost():
    """time = intercept + bytes / rate, fitted over noisy samples at several sizes, gives back the
    rate and the fixed cost; one size, or times that do not grow, cannot."""
    rng = np.random.default_rng(7)
    sizes = np.repeat([1, 4, 16, 32], 10) * 2**30
    times = 3.0 + sizes / 4600e3 + rng.normal(0, 0.5, sizes.size)  # 4600 GB/s = 4600e3 bytes per us
    rate, intercept = ceiling.fit_stream(sizes, times)
    assert abs(rate - 4600) < 1 and abs(intercept - 3.0) < 1.0
    with pytest.raises(PKVError, match="two or more sizes"):
        ceiling.fit_stream([2**30] * 3, [1.0, 2.0, 3.0])
    with pytest.raises(PKVError, match="do not grow"):
        ceiling.fit_stream([2**30, 2**32], [10.0, 5.0])


def _reads(times_by_size, first=0):
    """read-ceiling samples, repeats numbered on across sizes."""
    out = []
    for nbytes, times in times_by_size:
        for t in times:
            out.append(ceiling.CeilingSample("read-ceiling", first + len(out), nbytes, t))
    return out


def test_ceiling_is_the_largest_sizes_median_and_the_fit_only_informs():
    # 12 us fixed, 4500 GB/s streaming: 4 GiB reads at ~4441 GB/s, 16 GiB at ~4485, the slope at 4500
    four, sixteen = 4 * 2**30, 16 * 2**30
    two = _reads([(four, [12.0 + four / 4500e3] * 3), (sixteen, [12.0 + sixteen / 4500e3] * 3)])
    rate, fixed = ceiling.stream_fit(two)
    assert rate == pytest.approx(4500.0) and fixed == pytest.approx(12.0)
    at16 = sixteen / (12.0 + sixteen / 4500e3) / 1e3
    assert ceiling.ceiling_gbps(two) == pytest.approx(at16) and 4480.0 < at16 < 4490.0
    # a slow spell of the small size tilts the fit above every sample; the ceiling does not move
    slow = _reads([(four, [12.0 + four / 4300e3] * 3), (sixteen, [12.0 + sixteen / 4500e3] * 3)])
    assert ceiling.stream_fit(slow)[0] > max(s.gbps for s in slow) + 10
    assert ceiling.ceiling_gbps(slow) == pytest.approx(at16)
    one = [s for s in two if s.bytes_moved == four]
    assert ceiling.stream_fit(one) is None
    assert ceiling.ceiling_gbps(one) == pytest.approx(four / (12.0 + four / 4500e3) / 1e3)
    assert math.isnan(ceiling.ceiling_gbps([]))
    # copy samples never count, however large
    assert ceiling.ceiling_gbps(one + [ceiling.CeilingSample("copy-ceiling", 0, 4 * sixteen, 1.0)]) == ceiling.ceiling_gbps(one)
    rows = raw_frame(ceiling_rows(two, {}, "rid", "bench_kernels"))
    assert np.allclose(rows["read_ceiling_gbps"], at16)
    assert np.allclose(rows.loc[rows["kv_bytes"] == sixteen, "frac_of_ceiling"], 1.0)
    assert (rows.loc[rows["kv_bytes"] == four, "frac_of_ceiling"] < 0.995).all()


class _FakeDevice:
    def __init__(self):
        self.emptied = 0

    def empty_cache(self):
        self.emptied += 1


def test_measure_ceilings_reads_two_sizes_and_keeps_the_first_when_the_second_fails(monkeypatch):
    def fake_read(device, nbytes, repeats, warmup):
        if nbytes > 2**34:
            raise RuntimeError("CUDA out of memory. Tried to allocate 32.00 GiB\nmore")
        return [ceiling.CeilingSample("read-ceiling", r, nbytes, 10.0 + nbytes / 4000e3) for r in range(repeats)]

    def fake_copy(device, nbytes, repeats, warmup):
        return [ceiling.CeilingSample("copy-ceiling", r, 2 * nbytes, 2 * nbytes / 3000e3) for r in range(repeats)]

    monkeypatch.setattr(ceiling, "measure_read", fake_read)
    monkeypatch.setattr(ceiling, "measure_copy", fake_copy)
    logged = []
    samples, failures = ceiling.measure_ceilings(_FakeDevice(), repeats=3, log=logged.append)
    reads = [s for s in samples if s.backend == "read-ceiling"]
    assert failures == {} and [s.repeat for s in reads] == list(range(6))
    assert {s.bytes_moved for s in reads} == {ceiling.READ_BYTES, ceiling.STREAM_BYTES}
    assert ceiling.ceiling_gbps(samples) == pytest.approx(ceiling.STREAM_BYTES / (10.0 + ceiling.STREAM_BYTES / 4000e3) / 1e3)
    assert any("GB/s over 16 GiB" in line and "4000 GB/s + 10.0 us fixed" in line for line in logged)

    device, logged = _FakeDevice(), []
    samples, failures = ceiling.measure_ceilings(device, repeats=3, stream_bytes=2**35, log=logged.append)
    assert failures == {} and device.emptied == 1
    assert {s.bytes_moved for s in samples if s.backend == "read-ceiling"} == {ceiling.READ_BYTES}
    assert any("over 32 GiB: not measured (RuntimeError: CUDA out of memory" in line for line in logged)
    assert ceiling.ceiling_gbps(samples) == pytest.approx(ceiling.READ_BYTES / (10.0 + ceiling.READ_BYTES / 4000e3) / 1e3)


def test_run_read_ceiling_is_the_higher_median_and_renumbering_moves_repeats_on():
    def phase(times, first=0):
        return [ceiling.CeilingSample("read-ceiling", first + i, 4 * 10**9, t) for i, t in enumerate(times)]

    low, high = phase([1000.0, 1000.0, 5000.0]), phase([900.0, 800.0, 4000.0])  # medians 4000 and ~4444 GB/s
    assert ceiling.run_read_gbps([low, high]) == pytest.approx(4 * 10**9 / 900e-6 / 1e9)
    assert ceiling.run_read_gbps([high, low]) == ceiling.run_read_gbps([low, high])
    assert ceiling.run_read_gbps([low, []]) == pytest.approx(4000.0)
    assert math.isnan(ceiling.run_read_gbps([[], []]))
    moved = ceiling.renumbered(high, 3)
    assert [s.repeat for s in moved] == [3, 4, 5] and [s.time_us for s in moved] == [900.0, 800.0, 4000.0]


def _phases(monkeypatch, runner, phases):
    """runner._ceilings returning ``phases`` (each (samples, failures)) in turn."""
    calls = iter(phases)
    monkeypatch.setattr(runner, "_ceilings", lambda device, quick: next(calls))


def test_bracketed_rows_use_the_run_ceiling_and_keep_both_measurements(monkeypatch):
    from persistentkv.measure import runner
    from persistentkv.measure.rows import raw_row

    def samples(backend, times, nbytes):
        return [ceiling.CeilingSample(backend, i, nbytes, t) for i, t in enumerate(times)]

    before = samples("read-ceiling", [1000.0, 1000.0, 1000.0], 4 * 10**9) + samples("copy-ceiling", [1000.0], 2 * 10**9)
    after = samples("read-ceiling", [950.0, 800.0, 800.0], 4 * 10**9)   # faster at the end: 5000 GB/s
    _phases(monkeypatch, runner, [(before, {}), (after, {"copy-ceiling": "out of memory"})])
    seen = []

    def body(gbps):
        seen.append(gbps)
        case = dict(run_id="r", experiment="bench_kernels", trace="t", seed=0, step=0, batch_size=1, max_len=1000,
                    total_tokens=1000, kv_bytes=10**8, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                    dtype="float16", hole_fraction=0.0, protocol="kernel", route="workqueue", read_ceiling_gbps=gbps)
        ok = raw_row(**case, backend="pkv-workqueue", time_us=25.0, per_layer_us=25.0,
                     frac_of_ceiling=10**8 / 25e-6 / 1e9 / gbps)
        bad = raw_row(**case, backend="vllm-fa3", status="failed", reason="no")
        return [ok, bad]

    rows = runner._bracketed(object(), "r", "bench_kernels", False, body)
    assert seen == [pytest.approx(4000.0)]           # the cases ran with the first measurement's ceiling
    frame = raw_frame(rows)
    assert np.allclose(frame["read_ceiling_gbps"], 5000.0)
    ok = frame[frame["backend"] == "pkv-workqueue"].iloc[0]
    assert ok["frac_of_ceiling"] == pytest.approx(4000.0 / 5000.0)   # 100 MB in 25 us = 4 TB/s
    assert math.isnan(frame[frame["backend"] == "vllm-fa3"]["frac_of_ceiling"].iloc[0])
    reads = frame[frame["backend"] == "read-ceiling"]
    assert reads["repeat"].tolist() == [0, 1, 2, 3, 4, 5] and (reads["status"] == "ok").all()
    copy = frame[frame["backend"] == "copy-ceiling"]              # measured once: not a failure
    assert copy["status"].tolist() == ["ok"]


def test_bracketed_marks_a_ceiling_failed_only_when_neither_measurement_has_it(monkeypatch):
    from persistentkv.measure import runner

    why = {"read-ceiling": "cupy cannot be imported", "copy-ceiling": "out of memory"}
    _phases(monkeypatch, runner, [([], dict(why)), ([], dict(why))])
    frame = raw_frame(runner._bracketed(object(), "r", "x", True, lambda gbps: []))
    assert sorted(frame["backend"]) == ["copy-ceiling", "read-ceiling"]
    assert (frame["status"] == "failed").all() and frame["read_ceiling_gbps"].isna().all()


def test_cupy_stream_prefers_the_stream_protocol_and_falls_back_to_external_stream():
    """CuPy 14's Stream.from_external for a stream with __cuda_stream__; ExternalStream (with the
    stream's device) for older CuPy or a stream without the protocol; never a new stream."""
    calls = []

    class ProtocolStream:
        cuda_stream, device_index = 0xBEEF, 3

        def __cuda_stream__(self):
            return (0, self.cuda_stream)

    class PlainStream:
        cuda_stream, device_index = 0xCAFE, 1

    def external(ptr, device_id=-1):
        calls.append(("external", ptr, device_id))
        return "external"

    def from_external(obj):
        calls.append(("from_external", obj.cuda_stream))
        return "from_external"

    class Cuda14:
        ExternalStream = staticmethod(external)

        class Stream:
            pass

    Cuda14.Stream.from_external = staticmethod(from_external)

    class Cuda13:
        ExternalStream = staticmethod(external)

        class Stream:
            pass

    cupy14 = type("cupy14", (), {"cuda": Cuda14})
    cupy13 = type("cupy13", (), {"cuda": Cuda13})
    assert ceiling.cupy_stream(ProtocolStream(), cupy14) == "from_external"
    assert ceiling.cupy_stream(PlainStream(), cupy14) == "external"
    assert ceiling.cupy_stream(ProtocolStream(), cupy13) == "external"
    assert calls == [("from_external", 0xBEEF), ("external", 0xCAFE, 1), ("external", 0xBEEF, 3)]
