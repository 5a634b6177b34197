// CTA trace stamps for kernels/pkv_decode.cu, compiled only under PKV_TRACE=1
// (DecodeEngine(spec, trace=True); read by benchmarks/trace_cta.py). No module the engine serves
// with includes this file.
//
// Thread 0 of every decode CTA stamps %globaltimer (ns, one clock for the whole GPU) and clock64
// (this SM's cycles) at each phase into shared memory (no registers held across the loop), and
// appends the record to pkv_trace as it exits. Phases: 0 entry, 1 prologue issued (item and first page ids), 2 first stage
// landed, 3 loop done, 4 state written, 5 merge decided, 6 exit. A record is TRACE_FIELDS words:
// 7 ns stamps, 7 cycle stamps, then meta word 0 = SM | blockIdx.x << 16 | slot << 40 and meta word
// 1 = merged (fused tail) | item tokens << 8.
#pragma once

namespace pkv {

constexpr int TRACE_STAMPS = 7;
constexpr int TRACE_FIELDS = 16;
constexpr int TRACE_RECORDS = 1 << 16;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* trace_slots() {
  __shared__ unsigned long long s_trace[TRACE_FIELDS];
  return s_trace;
}
__device__ __forceinline__ void stamp(int phase) {
  if (threadIdx.x == 0) {
    unsigned long long* t = trace_slots();
    t[phase] = global_ns();
    t[TRACE_STAMPS + phase] = clock64();
  }
}
__device__ __forceinline__ void trace_merged(int merged) {
  if (threadIdx.x == 0) trace_slots()[2 * TRACE_STAMPS + 1] = merged;
}

}  // namespace pkv

// Records, TRACE_FIELDS words each, appended in the order CTAs finish.
extern "C" {
__device__ unsigned long long pkv_trace[pkv::TRACE_RECORDS * pkv::TRACE_FIELDS];
__device__ unsigned int pkv_trace_count;
}

namespace pkv {
// The end of a traced CTA: stamp the exit, then thread 0 appends the record.
__device__ __forceinline__ void trace_end(int slot, int tokens) {
  stamp(6);
  if (threadIdx.x == 0) {
    unsigned long long* t = trace_slots();
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    t[2 * TRACE_STAMPS] = (unsigned long long)smid | ((unsigned long long)blockIdx.x << 16) |
                          ((unsigned long long)(unsigned)slot << 40);
    t[2 * TRACE_STAMPS + 1] |= (unsigned long long)tokens << 8;
    const unsigned r = atomicAdd(&pkv_trace_count, 1u);
    if (r < TRACE_RECORDS)
      for (int f = 0; f < TRACE_FIELDS; ++f) pkv_trace[(unsigned long long)r * TRACE_FIELDS + f] = t[f];
  }
}
}  // namespace pkv

#define PKV_TRACE_BEGIN                                                       \
  if (threadIdx.x == 0)                                                       \
    for (int f = 0; f < pkv::TRACE_FIELDS; ++f) pkv::trace_slots()[f] = 0ull; \
  pkv::stamp(0)
#define PKV_TRACE_END(slot, it) pkv::trace_end(slot, it.hi - it.lo)
