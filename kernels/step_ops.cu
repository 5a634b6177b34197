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
// append_kv into an FP8 e4m3 cache (pkv_append_kv_<float16|bfloat16>_e4m3): the same walk over
// 16-byte chunks of the fp16/bf16 source rows, each chunk's 8 elements written as 8 e4m3 codes
// (one 8-byte store) of x / scale[h], h the chunk's KV head (a chunk never straddles heads:
// D % 8 == 0), the scale read on the device from a float32 pointer, s_sh = 0 (per tensor) or 1
// (per KV head). The spec is the NumPy mirror persistentkv.fp8.quantize(x, scale): the exact
// quotient rounded to the nearest e4m3 value, ties to even, SATURATING at +-448 (an overflow,
// an inf source included, is +-448, never inf or NaN; a NaN source stays NaN, code 0x7F).
// Bit-exact with it: the quotient is first rounded to float32 toward zero with a sticky bit
// (round to odd: div.rz, and the last bit set when the remainder fma(-q, s, x) is not zero),
// which a second rounding to e4m3 (24 >= 4 + 2 bits) turns into the rounding of the exact
// quotient, with no double-rounding tie. That second rounding is cvt.rn.satfinite.e4m3x2.f32
// on sm_89+ and, on older arches (sm_80, which has no FP8 cvt), pkv_e4m3_rn_sat: the same
// rounding in integer arithmetic (bit-exact software, not a trap; host-compiled and compared
// with fp8.quantize by tests/test_step_ops.py). Scale values are not checked on the device (the
// host never reads them): a scale that is not finite and > 0 gives what the division gives.
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

// The append's walk: thread i < rows * row_chunks takes 16-byte chunk i of k (row t, chunk c), the
// next rows * row_chunks threads the same chunks of v; a grid-stride loop covers any T. ``write``
// stores one chunk: write(is_v, slot, c, value); a slot outside [0, num_slots) is skipped.
template <class Write>
__device__ __forceinline__ void append_walk(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                            const long long* __restrict__ slots, int rows, int row_chunks,
                                            long long k_stride, long long v_stride, long long num_slots,
                                            Write write) {
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
    write(is_v, slot, c, is_v ? __ldg(v + t * v_stride + c) : __ldg(k + t * k_stride + c));
  }
}

// k, v: rows of row_chunks uint4 at strides k_stride, v_stride (in uint4); k_flat, v_flat: rows
// at dst_stride. Each chunk copied as it is.
extern "C" __global__ void __launch_bounds__(PKV_APPEND_THREADS)
pkv_append_kv(const uint4* __restrict__ k, const uint4* __restrict__ v, uint4* __restrict__ k_flat,
              uint4* __restrict__ v_flat, const long long* __restrict__ slots, int rows, int row_chunks,
              long long k_stride, long long v_stride, long long dst_stride, long long num_slots) {
  append_walk(k, v, slots, rows, row_chunks, k_stride, v_stride, num_slots,
              [=](bool is_v, long long slot, long long c, const uint4& val) {
                (is_v ? v_flat : k_flat)[slot * dst_stride + c] = val;
              });
}

// ---- append_kv into an FP8 e4m3 cache (header: "append_kv into an FP8 e4m3 cache") -----------

// float32 -> e4m3 code: round to nearest, ties to even, saturating at +-448 (inf too); NaN ->
// 0x7F. Integer arithmetic only (the sm_80 path; host-callable, so tests run it on the CPU).
__host__ __device__ __forceinline__ unsigned char pkv_e4m3_rn_sat(float x) {
  union {
    float f;
    pkv_u32 u;
  } bits;
  bits.f = x;
  const pkv_u32 sign = (bits.u >> 24) & 0x80u, mag = bits.u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7f;                                  // NaN
  if (mag >= 0x43e00000u) return static_cast<unsigned char>(sign | 0x7eu);  // >= 448: saturate
  const int e = static_cast<int>(mag >> 23) - 127;                     // |x| in [2^e, 2^(e+1))
  const int floor_e = e < -6 ? -6 : e;                                 // e4m3 subnormals: 2^-9 steps
  const int shift = 20 + (floor_e - e);                                // significand bits dropped
  if (shift > 24) return static_cast<unsigned char>(sign);             // |x| < 2^-10: rounds to 0
  const pkv_u32 sig = (mag & 0x7fffffu) | 0x800000u;                   // 24-bit significand
  pkv_u32 kept = sig >> shift;
  const pkv_u32 rest = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1u))) ++kept;            // a carry moves the exponent up
  return static_cast<unsigned char>(sign | ((static_cast<pkv_u32>(floor_e + 6) << 3) + kept));
}

// x / s rounded to float32 "to odd": toward zero, the last bit set where inexact; finite |q| < 448
// only (larger ones saturate anyway, and inf / NaN must stay what they are).
__device__ __forceinline__ float pkv_div_odd(float x, float s) {
  float q, r;
  asm("div.rz.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(s));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(-q), "f"(s), "f"(x));
  if (r != 0.0f && fabsf(q) < 448.0f) q = __uint_as_float(__float_as_uint(q) | 1u);
  return q;
}

// Two float32 -> two e4m3 codes in 16 bits (lo: the first byte in memory).
__device__ __forceinline__ pkv_u32 pkv_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  pkv_u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<pkv_u32>(pkv_e4m3_rn_sat(lo)) | (static_cast<pkv_u32>(pkv_e4m3_rn_sat(hi)) << 8);
#endif
}

// k, v: rows of row_chunks uint4 (8 source elements each) at strides k_stride, v_stride (in
// uint4); k_flat, v_flat: rows of row_chunks uint2 (8 codes each) at dst_stride (in uint2);
// head_chunks = D / 8 chunks per KV head; scale of head h: k_scale[h * s_sh], v_scale[h * s_sh].
template <class Dt>
__device__ __forceinline__ void append_kv_e4m3(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                               uint2* __restrict__ k_flat, uint2* __restrict__ v_flat,
                                               const long long* __restrict__ slots,
                                               const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                               int s_sh, int head_chunks, int rows, int row_chunks, long long k_stride,
                                               long long v_stride, long long dst_stride, long long num_slots) {
  append_walk(k, v, slots, rows, row_chunks, k_stride, v_stride, num_slots,
              [=](bool is_v, long long slot, long long c, const uint4& val) {
                const int head = static_cast<int>(c / head_chunks);
                const float s = __ldg((is_v ? v_scale : k_scale) + head * s_sh);
                float f[8];
                unpack8<Dt>(val, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = pkv_div_odd(f[e], s);
                uint2 out;
                out.x = pkv_e4m3x2(f[0], f[1]) | (pkv_e4m3x2(f[2], f[3]) << 16);
                out.y = pkv_e4m3x2(f[4], f[5]) | (pkv_e4m3x2(f[6], f[7]) << 16);
                (is_v ? v_flat : k_flat)[slot * dst_stride + c] = out;
              });
}

#define PKV_APPEND_E4M3_ENTRY(NAME, DT)                                                           \
  extern "C" __global__ void __launch_bounds__(PKV_APPEND_THREADS)                                 \
  NAME(const uint4* __restrict__ k, const uint4* __restrict__ v, uint2* __restrict__ k_flat,       \
       uint2* __restrict__ v_flat, const long long* __restrict__ slots,                            \
       const float* __restrict__ k_scale, const float* __restrict__ v_scale, int s_sh,              \
       int head_chunks, int rows, int row_chunks, long long k_stride, long long v_stride,           \
       long long dst_stride, long long num_slots) {                                                 \
    append_kv_e4m3<DT>(k, v, k_flat, v_flat, slots, k_scale, v_scale, s_sh, head_chunks, rows,     \
                       row_chunks, k_stride, v_stride, dst_stride, num_slots);                     \
  }

PKV_APPEND_E4M3_ENTRY(pkv_append_kv_float16_e4m3, Fp16)
PKV_APPEND_E4M3_ENTRY(pkv_append_kv_bfloat16_e4m3, Bf16)
