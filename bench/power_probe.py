"""Clock, power and energy per call of forward kernels held at their steady load (NVML through ctypes).

    python bench/power_probe.py [--sustain 3] [--seconds 3] [--cases NAME,...]

At the power cap the clock follows the load, so a kernel's time there is set by its energy per call, not by its SM
cycles alone. Each case runs back to back for ``--sustain`` seconds, then for ``--seconds`` more between two CUDA
events while a thread samples the SM clock, the power and the clock-event reasons every 10 ms; the card's energy
counter is read at both ends. Per case it prints the time per call, TFLOPs/s, the mean SM clock and power, the
SM cycles per call (clock x time), the energy per call (mean power x time) and per TFLOP, the energy counter's
own figure per call, and the union of the clock-event reasons. (Over 3 s the counter disagreed with the power
samples by up to 3% for the short window calls, session 44: it moves in coarse steps; the samples are what the
power cap regulates.)

Cases (bf16 unless named fp16; `win` is a (4096, 0) window, as bench/window_speed.py times the bar):
  f128_causal64k, f128_win64k        fa2cupy, 1 x 64k, 16 heads of 128, fp16 (window_speed.py's inputs)
  f64_causal64k, f64_win64k          the same at 32 heads of 64
  f128_8k, f128_causal8k             fa2cupy, 2 x 8k, 16 heads of 128 (the README's bench rows)
  cudnn128_8k, flash128_8k           torch SDPA cuDNN / flash on the same 2 x 8k inputs
  copy1g                             a copy of 1 GiB (2 GiB of HBM traffic a call): joules per GB moved, to weigh
                                     the HBM traffic every attention call has (q, k, v read, out written)
  l2copy8m                           the same copy kernel over 8 MiB, 512 times a call: the bytes move between SMs
                                     and L2 alone (L2-resident); the copy1g figure less this one is what the DRAM
                                     itself costs a GB
  idle                               the card's power and clock with nothing queued (sampled over --seconds)
"""

import argparse
import contextlib
import ctypes
import sys
import threading
import time

sys.path.insert(0, ".")
from fa2cupy import benchmark as B  # noqa: E402

NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML calls the probe needs, on the device CuPy's current device is (by PCI bus id, so that
    CUDA_VISIBLE_DEVICES and NVML's numbering cannot disagree)."""

    def __init__(self, pci_bus_id: str):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self.handle)),
                    "nvmlDeviceGetHandleByPciBusId_v2")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned NVML error {rc}")

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(value)), "clock")
        return value.value

    def power_w(self) -> float:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(value)), "power")
        return value.value / 1e3

    def energy_j(self) -> float:
        value = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)), "energy")
        return value.value / 1e3

    def reasons(self) -> int:
        value = ctypes.c_ulonglong()
        query = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.lib.nvmlDeviceGetCurrentClocksThrottleReasons  # (the older name)
        self._check(query(self.handle, ctypes.byref(value)), "reasons")
        return value.value


REASON_NAMES = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
                0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}


def sampled(nvml: Nvml, run) -> tuple[list[tuple[int, float, int]], object]:
    """Runs ``run()`` while a thread samples (clock, power, reasons) every 10 ms; returns the samples and what
    ``run`` returned."""
    samples, stop = [], threading.Event()

    def sampler():
        while not stop.is_set():
            samples.append((nvml.sm_clock_mhz(), nvml.power_w(), nvml.reasons()))
            time.sleep(0.01)

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        result = run()
    finally:
        stop.set()
        thread.join()
    return samples, result


def make_cases():
    """name -> (Case, runner factory): built lazily, so that one case's inputs are alive at a time."""
    import fa2cupy  # noqa: PLC0415

    def fa2(window=(-1, -1)):
        def factory(inp):
            q, k, v, causal = inp.q, inp.k, inp.v, inp.case.causal
            return B.Runner(lambda: fa2cupy.flash_attn_func(q, k, v, causal=causal, window_size=window),
                            B.CupyEvents(), contextlib.nullcontext)
        return factory

    long128 = B.Case(1, 65536, 65536, 16, 16, 128, True, "fp16")
    long64 = B.Case(1, 65536, 65536, 32, 32, 64, True, "fp16")
    bench8k = B.Case(2, 8192, 8192, 16, 16, 128, False)
    bench8k_causal = B.Case(2, 8192, 8192, 16, 16, 128, True)
    return {
        "f128_causal64k": (long128, fa2(), None),
        "f128_win64k": (long128, fa2((4096, 0)), 4096),
        "f64_causal64k": (long64, fa2(), None),
        "f64_win64k": (long64, fa2((4096, 0)), 4096),
        "f128_8k": (bench8k, fa2(), None),
        "f128_causal8k": (bench8k_causal, fa2(), None),
        "cudnn128_8k": (bench8k, B.FORWARD_RUNNERS["sdpa_cudnn"], None),
        "flash128_8k": (bench8k, B.FORWARD_RUNNERS["sdpa_flash"], None),
        # (copies: no Case; the factory makes its own arrays and returns the bytes moved a call)
        "copy1g": (None, lambda: copy_runner(1 << 30, 1), None),
        "l2copy8m": (None, lambda: copy_runner(8 << 20, 512), None),
    }


COPY = r"""
extern "C" __global__ void copy_rounds(const float4* src, float4* dst, int n, int reps) {
    // volatile asm: each round's loads and stores are issued, none merged across rounds
    for (int r = 0; r < reps; ++r)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            float4 v;
            asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src + i));
            asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};"
                         :: "l"(dst + i), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
        }
}
"""


def copy_runner(nbytes: int, reps: int):
    """``reps`` copies of ``nbytes`` (random data) within one kernel, with cache-global loads and stores (so over a
    few MiB the rounds after the first stay in L2): (runner, arrays to keep alive, bytes moved a call)."""
    import cupy  # noqa: PLC0415

    kernel = cupy.RawKernel(COPY, "copy_rounds")
    src = cupy.random.random(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    n = nbytes // 16
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    runner = B.Runner(lambda: kernel((4 * sms,), (256,), (src, dst, cupy.int32(n), cupy.int32(reps))),
                      B.CupyEvents(), contextlib.nullcontext)
    return runner, (src, dst), 2 * reps * nbytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sustain", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cases", default="f128_causal64k,f128_win64k,f128_8k,cudnn128_8k,flash128_8k,"
                                           "f128_causal8k,f64_causal64k,f64_win64k")
    args = parser.parse_args()
    import cupy  # noqa: PLC0415

    nvml = Nvml(cupy.cuda.Device().pci_bus_id)
    cases = make_cases()
    print(f"{'case':16s} {'ms/call':>9s} {'TFLOPs/s':>9s} {'MHz':>6s} {'W':>6s} {'Mcycles':>8s} {'J/call':>8s} "
          f"{'J/TFLOP':>8s} {'counter':>8s}  reasons", flush=True)
    for name in args.cases.split(","):
        if name == "idle":
            cupy.cuda.runtime.deviceSynchronize()
            samples, _ = sampled(nvml, lambda: time.sleep(args.seconds))
            mhz, watts, names = summary(samples)
            print(f"{name:16s} {'':>9s} {'':>9s} {mhz:6.0f} {watts:6.0f}  {names}", flush=True)
            continue
        case, factory, window = cases[name]
        if case is None:
            runner, keep, moved = factory()
        else:
            # (fa2cupy on CuPy arrays, timed on CuPy's stream; SDPA on torch tensors, on torch's)
            framework = "torch" if name.startswith(("cudnn", "flash")) else "cupy"
            keep = B.make_forward_inputs(case, seed=0, framework=framework)
            runner = factory(keep)
        events = runner.events
        with runner.context():
            for _ in range(3):
                runner.fn()
            events.sync()
            B.sustain(runner.fn, events.sync, args.sustain)

            def timed():
                start, end = events.event(), events.event()
                e0 = nvml.energy_j()
                start.record()
                calls = B.sustain(runner.fn, events.sync, args.seconds)
                end.record()
                events.sync()
                return calls, events.elapsed_ms(start, end), nvml.energy_j() - e0

            samples, (calls, ms, joules) = sampled(nvml, timed)
        per_call = ms / calls
        mhz, watts, names = summary(samples)
        per_call_j = watts * per_call / 1e3
        if case is None:
            gb = moved / 1e9
            print(f"{name:16s} {per_call:9.3f} {gb / per_call * 1e3:6.0f}GB/s {mhz:6.0f} {watts:6.0f} "
                  f"{mhz * per_call / 1e3:8.3f} {per_call_j:8.3f} {per_call_j / gb:6.3f}/GB "
                  f"{joules / calls:8.3f}  {names}", flush=True)
        else:
            flops = (4.0 * case.batch * case.nheads * case.headdim * B.band_pairs(case.seqlen_k, window)
                     if window else B.attention_flops(case, "fwd"))
            print(f"{name:16s} {per_call:9.3f} {flops / per_call / 1e9:9.1f} {mhz:6.0f} {watts:6.0f} "
                  f"{mhz * per_call / 1e3:8.3f} {per_call_j:8.3f} {per_call_j / (flops / 1e12):8.3f} "
                  f"{joules / calls:8.3f}  {names}", flush=True)
        del keep, runner
        cupy.get_default_memory_pool().free_all_blocks()


def summary(samples) -> tuple[float, float, str]:
    """Mean SM clock (MHz), mean power (W) and the union of the clock-event reasons of NVML samples."""
    mhz = sum(s[0] for s in samples) / len(samples)
    watts = sum(s[1] for s in samples) / len(samples)
    reasons = 0
    for s in samples:
        reasons |= s[2]
    return mhz, watts, ",".join(n for bit, n in REASON_NAMES.items() if reasons & bit) or "none"


if __name__ == "__main__":
    main()
