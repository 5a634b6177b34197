// The decode step's one-row ops: y = x W^T (gemv), silu(x Wg^T) * (x Wu^T) (gemv_silu_mul), and
// the K/V append (append_kv). No decisions here: src/persistentkv/model/step_ops.py picks the
// launch shape (gemv_shape) and checks every shape, dtype, stride and alignment before a launch.
//
// gemv: y[T, N] = x[T, K] @ W[N, K]^T, W row-major (F.linear's layout), fp16 or bf16, fp32 sums.
// The code is a template over T, instantiated at T = 1 only (a B = 1 step): at T = 4 the B = 4
// step ran slower than with cuBLAS (benchmarks/NOTES.md, "Tried and rejected"). At T = 1 this is
// a stream of W's bytes (x is K*2 bytes, at most 28 KiB): the kernel is bound by how many bytes
// it keeps in flight, so everything is shaped around W's loads.
//
// * Work unit: a warp owns a PAIR of rows (gemv: rows 2p and 2p+1; gemv_silu_mul: gate row p and
//   up row I+p, so silu(g) * u is formed in registers and W's gate|up halves never round-trip).
//   Two rows per warp share each x chunk's load and conversion to fp32 (x is read and converted
//   once per two rows of W).
// * Lanes stride over K in 16-byte chunks (8 elements): chunk c = lane + 32 (s + split i), so each
//   load instruction of a warp reads 512 contiguous bytes of one row (fully coalesced), and the
//   `split` warps of a pair (s = 0 .. split-1) interleave over K.
// * Each lane issues UNROLL (-DPKV_GEMV_UNROLL, set by step_ops.py) chunk steps x 2 rows = 8 uint4
//   loads before it uses any: 32 lanes x 8 x 16 B = 4 KiB in flight per warp. Little's law on an
//   H200: 4.5 TB/s x ~1.5 us = 6.8 MB in flight over 132 SMs = 52 KiB per SM, i.e. >= 13 such
//   warps per SM; step_ops.py splits K until there are 32 warps of work per SM (measured against 16), and
//   __launch_bounds__(PKV_GEMV_THREADS = 256, PKV_GEMV_MIN_BLOCKS = 2) keeps <= 128 registers,
//   so two 8-warp blocks (16 warps) stay resident (ptxas: 72 registers at T = 1).
// * W goes through ld.global.nc.L1::no_allocate: it is read once, and must not evict x from L1.
//   x is read with __ldg from L1/L2 rather than staged in shared memory: every warp of an SM
//   reads the same chunks of x, so after the first warp they hit L1 (one load of 16 B per chunk
//   step against two of W), while staging would cost K*2 bytes of shared memory per block
//   (28 KiB at K = 14336) and a block-wide barrier before the first W load.
// * Split of K (split = 2, 4, 8 warps per pair) when there are too few pairs to fill the GPU
//   (N = 1280: 640 pairs x 8 = 5120 warps, 39 per SM): each warp reduces its sum with shuffles,
//   the split warps meet in shared memory (one __syncthreads), and the pair's first warp adds
//   the partials in a fixed order (deterministic: a graph replay equals the eager run). No split
//   across blocks, so no second kernel and no atomics.
// * Every accumulation is fp32 (W and x converted exactly), one rounding to the output dtype.
//
// append_kv: k and v rows [T][Hkv*D] copied to k_flat[slots[t]] and v_flat[slots[t]] as uint4,
// one 16-byte chunk per thread, both tensors in one launch (replaces two index_copy_). A slot
// outside [0, num_slots) is skipped (the host never reads the slots, so it cannot check them).
// Each block first lets the next kernel on the stream start (griddepcontrol.launch_dependents,
// sm_90+), where that kernel was launched with programmatic dependent launch, as FlashInfer's
// and TensorRT-LLM's decode kernels are: their CTAs are resident and waiting when the append
// completes (the flashinfer-tc step 0.991-0.997x, benchmarks/NOTES.md). A kernel launched plainly
// still starts after the append has completed.
//
// Plain C types and inline PTX only (cvt for fp16/bf16), so NVRTC (CuPy RawModule) compiles it
// without standard headers; the entry points are extern "C", one per (op, dtype).

#if !defined(PKV_GEMV_UNROLL) || !defined(PKV_GEMV_THREADS) || !defined(PKV_GEMV_MIN_BLOCKS) || \
    !defined(PKV_APPEND_THREADS)
#error "the PKV_GEMV_* and PKV_APPEND_THREADS defines come from persistentkv.model.step_ops.compile_options"
#endif

typedef unsigned short pkv_u16;
typedef unsigned int pkv_u32;
typedef unsigned long long pkv_u64;

#define PKV_MAX_WARPS 32  // 1024 threads: the most a block can hold, so any launch fits part[][]
#define PKV_MAX_T 4  // the partials' rows (part[][2 * PKV_MAX_T]) keep their T <= 4 size: the T = 1
                     // entry points' SASS is then byte-identical to the build whose step times
                     // benchmarks/NOTES.md records ("Tried and rejected", the step gemv at T = 2-4)

struct Fp16 {};
struct Bf16 {};

// Two packed 16-bit values -> two floats (exact).
__device__ __forceinline__ void unpack(Fp16, pkv_u32 w, float& lo, float& hi) {
  const pkv_u16 l = static_cast<pkv_u16>(w & 0xffffu), h = static_cast<pkv_u16>(w >> 16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(l));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(h));
}

__device__ __forceinline__ void unpack(Bf16, pkv_u32 w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ pkv_u16 round_to(Fp16, float x) {
  pkv_u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ pkv_u16 round_to(Bf16, float x) {
  pkv_u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

template <class Dt>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  unpack(Dt(), v.x, f[0], f[1]);
  unpack(Dt(), v.y, f[2], f[3]);
  unpack(Dt(), v.z, f[4], f[5]);
  unpack(Dt(), v.w, f[6], f[7]);
}

// W: read once, streamed past L1 so x keeps its lines there. Not volatile: the compiler may
// hoist and batch these loads (W is never written during the kernel).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One unrolled step of a lane: U chunks (c, c + stride, ...) of both rows, all 2U loads issued
// before any is used. GUARD: the tail step, where chunks past the row's end are skipped.
template <class Dt, int T, int U, bool GUARD>
__device__ __forceinline__ void pair_step(const uint4* __restrict__ x, const uint4* __restrict__ w0,
                                          const uint4* __restrict__ w1, int c, int stride, int chunks,
                                          float* acc0, float* acc1) {
  uint4 a[U], b[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int cu = c + u * stride;
    if (!GUARD || cu < chunks) {
      a[u] = load_stream(w0 + cu);
      b[u] = load_stream(w1 + cu);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int cu = c + u * stride;
    if (!GUARD || cu < chunks) {
      float fa[8], fb[8];
      unpack8<Dt>(a[u], fa);
      unpack8<Dt>(b[u], fb);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        float fx[8];
        unpack8<Dt>(__ldg(x + static_cast<pkv_u64>(t) * static_cast<pkv_u64>(chunks) + cu), fx);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc0[t] = fmaf(fa[e], fx[e], acc0[t]);
          acc1[t] = fmaf(fb[e], fx[e], acc1[t]);
        }
      }
    }
  }
}

// One pair of rows per warp (module header). n: output columns (gemv: N; silu: I, W has 2I rows);
// chunks: K / 8; split: warps per pair (blockDim.x / 32 is a multiple of it).
template <class Dt, int T, bool SILU>
__device__ __forceinline__ void gemv_pairs(const uint4* __restrict__ x, const uint4* __restrict__ w,
                                           pkv_u16* __restrict__ y, int n, int chunks, int split) {
  constexpr int U = PKV_GEMV_UNROLL;
  static_assert(T >= 1 && T <= PKV_MAX_T, "1 <= T <= PKV_MAX_T rows of x");
  __shared__ float part[PKV_MAX_WARPS][2 * PKV_MAX_T];
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31u);
  const int pairs_per_block = static_cast<int>(blockDim.x >> 5) / split;
  const int s = warp % split;
  const int p = static_cast<int>(blockIdx.x) * pairs_per_block + warp / split;
  const int pairs = SILU ? n : (n + 1) >> 1;
  const bool active = p < pairs;  // only the last block may hold idle warps; they still meet the barrier
  const int row0 = SILU ? p : 2 * p;
  const bool has_row1 = SILU || row0 + 1 < n;
  const int row1 = SILU ? n + p : (has_row1 ? row0 + 1 : row0);

  float acc0[T], acc1[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = 0.0f;

  if (active) {
    const uint4* w0 = w + static_cast<pkv_u64>(row0) * static_cast<pkv_u64>(chunks);
    const uint4* w1 = w + static_cast<pkv_u64>(row1) * static_cast<pkv_u64>(chunks);
    const int stride = 32 * split;
    int c = lane + 32 * s;
    for (; c + (U - 1) * stride < chunks; c += U * stride) {
      pair_step<Dt, T, U, false>(x, w0, w1, c, stride, chunks, acc0, acc1);
    }
    if (c < chunks) pair_step<Dt, T, U, true>(x, w0, w1, c, stride, chunks, acc0, acc1);
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    acc0[t] = warp_sum(acc0[t]);
    acc1[t] = warp_sum(acc1[t]);
  }
  if (split > 1) {  // uniform over the block: every thread reaches the barrier
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < T; ++t) {
        part[warp][t] = acc0[t];
        part[warp][T + t] = acc1[t];
      }
    }
    __syncthreads();
    if (s == 0 && lane == 0) {
#pragma unroll
      for (int t = 0; t < T; ++t) {
        acc0[t] = part[warp][t];
        acc1[t] = part[warp][T + t];
      }
      for (int j = 1; j < split; ++j) {
#pragma unroll
        for (int t = 0; t < T; ++t) {
          acc0[t] += part[warp + j][t];
          acc1[t] += part[warp + j][T + t];
        }
      }
    }
  }
  if (!active || s != 0 || lane != 0) return;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    pkv_u16* yt = y + static_cast<pkv_u64>(t) * static_cast<pkv_u64>(n);
    if (SILU) {
      const float g = acc0[t];
      yt[p] = round_to(Dt(), g / (1.0f + expf(-g)) * acc1[t]);  // silu(g) * u, one rounding
    } else {
      yt[row0] = round_to(Dt(), acc0[t]);
      if (has_row1) yt[row1] = round_to(Dt(), acc1[t]);
    }
  }
}

#define PKV_GEMV_ENTRY(NAME, DT, T, SILU)                                                          \
  extern "C" __global__ void __launch_bounds__(PKV_GEMV_THREADS, PKV_GEMV_MIN_BLOCKS)              \
  NAME(const uint4* __restrict__ x, const uint4* __restrict__ w, pkv_u16* __restrict__ y, int n,   \
       int chunks, int split) {                                                                    \
    gemv_pairs<DT, T, SILU>(x, w, y, n, chunks, split);                                            \
  }

PKV_GEMV_ENTRY(pkv_gemv_float16_t1, Fp16, 1, false)
PKV_GEMV_ENTRY(pkv_gemv_bfloat16_t1, Bf16, 1, false)
PKV_GEMV_ENTRY(pkv_gemv_silu_mul_float16_t1, Fp16, 1, true)
PKV_GEMV_ENTRY(pkv_gemv_silu_mul_bfloat16_t1, Bf16, 1, true)

// k, v: rows of row_chunks uint4 at strides k_stride, v_stride (in uint4); k_flat, v_flat: rows
// at dst_stride. Thread i < rows * row_chunks copies chunk i of k, the next rows * row_chunks
// threads the same chunks of v; a grid-stride loop covers any T.
extern "C" __global__ void __launch_bounds__(PKV_APPEND_THREADS)
pkv_append_kv(const uint4* __restrict__ k, const uint4* __restrict__ v, uint4* __restrict__ k_flat,
              uint4* __restrict__ v_flat, const long long* __restrict__ slots, int rows, int row_chunks,
              long long k_stride, long long v_stride, long long dst_stride, long long num_slots) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const long long per_tensor = static_cast<long long>(rows) * row_chunks;
  const long long total = 2 * per_tensor;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const bool is_v = i >= per_tensor;
    const long long j = is_v ? i - per_tensor : i;
    const long long t = j / row_chunks, c = j - t * row_chunks;
    const long long slot = __ldg(slots + t);
    if (slot < 0 || slot >= num_slots) continue;
    const uint4 val = is_v ? __ldg(v + t * v_stride + c) : __ldg(k + t * k_stride + c);
    (is_v ? v_flat : k_flat)[slot * dst_stride + c] = val;
  }
}
