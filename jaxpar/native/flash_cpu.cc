// Causal grouped-query attention for XLA:CPU as two XLA FFI handlers (forward, backward),
// threaded over XLA's intra-op thread pool when the caller asks (attribute `threaded`). fp32
// throughout.
//
// Why a native kernel: XLA:CPU runs a batched matmul's batch serially and does not run loops
// side by side, so the blockwise kernel's tiles (jaxpar/model/flash.py) use one core whatever
// the machine has. Here each task owns one
// (batch row, kv head) pair — the G query heads that read it and their dK/dV — so tasks share
// no output and need no atomics.
//
// Layout (as the model holds them, no transposes): q, o, dO [B, S, H, D]; k, v, dK, dV
// [B, S, K, D]; lse [B, H, S]; query head h = kv·G + g. The math is FlashAttention-2's (Dao
// 2023): the forward keeps the log-sum-exp, the backward recomputes P = exp(S − lse) tile by
// tile with delta = rowsum(dO ∘ O). Causal tiles above the diagonal are skipped.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Buf = ffi::Buffer<ffi::F32>;
using Out = ffi::ResultBuffer<ffi::F32>;

namespace {

constexpr int64_t kBlock = 64;  // positions per query and key tile

struct Dims {
  int64_t b, s, h, kv, d, g, nb;  // nb: tiles per sequence
};

// 16-float vectors (GCC/Clang vector extensions: one AVX-512 register here, pairs of AVX2 or
// NEON registers elsewhere). aligned(4): loads and stores need not be aligned.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16*>(p) = x; }
inline v16 splat(float x) { return v16{} + x; }
// Keeps x in a register: without it GCC folds a load that four products reuse into each of
// their FMAs (four loads instead of one; the products ran 20-25% slower on AVX-512). Where a
// v16 is not one register (AVX2, NEON) the compiler's choice stands.
inline v16 in_register(v16 x) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(x));
#endif
  return x;
}

// exp(x) for x ≤ 0 (and a little above) to a few ulp: x = n·ln 2 + r, a degree-6 polynomial
// for e^r, 2^n through the exponent bits.
inline v16 exp_v(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 big = splat(12582912.0f);  // 1.5·2^23: adding and subtracting rounds to nearest
  const v16 n = (x * 1.44269504088896341f + big) - big;
  const v16 r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Casts between vector types of one size reinterpret the bits (GCC/Clang vector extensions).
  return (v16)((i16)p + (__builtin_convertvector(n, i16) << 23));
}

// Runs fn(t) for t in [0, n): threaded, on the caller and up to pool.num_threads() helpers,
// returning when all have run (helpers that start after the work is gone find nothing to do);
// else on the caller alone (when and why: jaxpar/model/native.py, _threaded).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, bool threaded, int64_t n, Fn fn) {
  if (!threaded) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, fn]() {
    int64_t t;
    while ((t = st->next.fetch_add(1)) < n) {
      fn(t);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// The tile products, row-major, in 16-float vectors with the accumulators held in
// registers, 4 rows at a time (every row count here is a multiple of 4: D, kBlock or R).
// R = G·kBlock rows of a query tile, kBlock = 64 keys, D a template constant.
//
// Tiles are held transposed (Sᵀ: keys × query rows, row r = g·kBlock + p at position p of the
// tile). On a diagonal tile key c sees positions p ≥ c only, so Pᵀ and dSᵀ are zero below
// that staircase; the products skip whole zero vectors and key ranges there (Diag = true),
// which removes about half of a diagonal tile's work.

// out[r][c] = Σ_d a[r][d] · bt[d][c] for c < width (a multiple of kBlock; bt: D rows of
// stride ldb; out: rows of stride ldo). Diag: rows are a diagonal tile's keys; the vectors of
// positions wholly below a key group are stored as zeros, not computed.
template <int D, int V0>
inline void abt_rows(const float* a, const float* bt, int64_t ldb, int64_t r, int64_t w0,
                     float* out, int64_t ldo) {
  constexpr int kV = kBlock / 16;
  v16 acc[4][kV] = {};
  for (int d = 0; d < D; ++d) {
    v16 b[kV];
    for (int v = V0; v < kV; ++v) b[v] = in_register(load(bt + d * ldb + w0 + 16 * v));
    for (int i = 0; i < 4; ++i) {
      const v16 x = splat(a[(r + i) * D + d]);
      for (int v = V0; v < kV; ++v) acc[i][v] += x * b[v];
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int v = 0; v < kV; ++v) store(out + (r + i) * ldo + w0 + 16 * v, acc[i][v]);
}

template <int D, bool Diag>
void mul_abt(const float* a, const float* bt, int64_t ldb, int64_t rows, int64_t width,
             float* out, int64_t ldo) {
  static_assert(kBlock == 64, "the diagonal cases below assume 4 vectors per tile row");
  for (int64_t w0 = 0; w0 < width; w0 += kBlock)
    for (int64_t r = 0; r < rows; r += 4) {
      switch (Diag ? r / 16 : 0) {  // keys r..r+3 see positions ≥ r: vectors from r / 16
        case 0: abt_rows<D, 0>(a, bt, ldb, r, w0, out, ldo); break;
        case 1: abt_rows<D, 1>(a, bt, ldb, r, w0, out, ldo); break;
        case 2: abt_rows<D, 2>(a, bt, ldb, r, w0, out, ldo); break;
        default: abt_rows<D, 3>(a, bt, ldb, r, w0, out, ldo); break;
      }
    }
}

// acc[i][v] += Σ_{k0 ≤ k < k1} p[(r + i)·ldp + k] · b[k·ldb + w0 + 16v] for v ≥ V0.
template <int kV, int V0>
inline void acc_keys(v16 (&acc)[4][kV], const float* p, int64_t ldp, const float* b,
                     int64_t ldb, int64_t r, int64_t w0, int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    v16 bk[kV];
    for (int v = V0; v < kV; ++v) bk[v] = in_register(load(b + k * ldb + w0 + 16 * v));
    for (int i = 0; i < 4; ++i) {
      const v16 x = splat(p[(r + i) * ldp + k]);
      for (int v = V0; v < kV; ++v) acc[i][v] += x * bk[v];
    }
  }
}

// The two diagonal shapes of out[r][c] += Σ_k p[r][k] · b[k][c]:
//   KeysInner: k runs over a tile's keys and c over query rows (Vᵀ·Pᵀ, Kᵀ·dSᵀ): row k of
//     Pᵀ is zero at positions below k, so keys [16t, 16t + 16) skip vectors v < t;
//   RowsAreKeys: r runs over a tile's keys and k over query rows (Pᵀ·dO, dSᵀ·Q): keys r..r+3
//     read positions ≥ r only of each of the G blocks of kBlock rows.
enum class Diag { kNone, kKeysInner, kRowsAreKeys };

// out[r][c] += Σ_k p[r][k] · b[k][c] for r < rows, c < width, k < inner (strides ldp, ldb,
// ldo), in passes of 4 rows × W columns (W: 16, 32 or 64 dividing width; 4·W/16 accumulators).
template <int W, Diag M = Diag::kNone>
void mul_acc(const float* p, int64_t ldp, int64_t inner, const float* b, int64_t ldb,
             int64_t rows, int64_t width, float* out, int64_t ldo) {
  constexpr int kV = W / 16;
  static_assert(M != Diag::kKeysInner || W == kBlock, "KeysInner: one tile row per pass");
  for (int64_t w0 = 0; w0 < width; w0 += W)
    for (int64_t r = 0; r < rows; r += 4) {
      v16 acc[4][kV];
      for (int i = 0; i < 4; ++i)
        for (int v = 0; v < kV; ++v) acc[i][v] = load(out + (r + i) * ldo + w0 + 16 * v);
      if constexpr (M == Diag::kKeysInner) {  // inner = kBlock keys
        acc_keys<kV, 0>(acc, p, ldp, b, ldb, r, w0, 0, 16);
        acc_keys<kV, 1>(acc, p, ldp, b, ldb, r, w0, 16, 32);
        acc_keys<kV, 2>(acc, p, ldp, b, ldb, r, w0, 32, 48);
        acc_keys<kV, 3>(acc, p, ldp, b, ldb, r, w0, 48, 64);
      } else if constexpr (M == Diag::kRowsAreKeys) {  // inner = G·kBlock query rows
        for (int64_t g0 = 0; g0 < inner; g0 += kBlock)
          acc_keys<kV, 0>(acc, p, ldp, b, ldb, r, w0, g0 + r, g0 + kBlock);
      } else {
        acc_keys<kV, 0>(acc, p, ldp, b, ldb, r, w0, 0, inner);
      }
      for (int i = 0; i < 4; ++i)
        for (int v = 0; v < kV; ++v) store(out + (r + i) * ldo + w0 + 16 * v, acc[i][v]);
    }
}

// out [rows][D] += p [rows][inner] (row stride ldp) · b [inner][D].
template <int D, Diag M = Diag::kNone>
void mul_pb(const float* p, int64_t ldp, int64_t inner, const float* b, int64_t rows,
            float* out) {
  mul_acc<(D < 64 ? D : 64), M>(p, ldp, inner, b, D, rows, D, out, D);
}

// x [rows][cols] -> xt [cols][rows]
void transpose(const float* x, int64_t rows, int64_t cols, float* xt) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
}

// The (b, kv) pair's keys and values, zero-padded to Sp = nb·kBlock positions: k [Sp][D] and
// one of kt (keys transposed, [D][Sp]: the backward's Kᵀ·dSᵀ) or vt (values transposed: the
// forward's Vᵀ·Pᵀ), and v [Sp][D] for the backward's V·dOᵀ.
struct KV {
  std::vector<float> k, xt, v;  // xt: kt or vt
};

void pack_kv(const float* k, const float* v, const Dims& m, int64_t b, int64_t kh,
             bool forward, KV& out) {
  const int64_t sp = m.nb * kBlock;
  out.k.assign(sp * m.d, 0.f);
  out.xt.assign(m.d * sp, 0.f);
  if (!forward) out.v.assign(sp * m.d, 0.f);
  const float* t = forward ? v : k;  // the one transposed
  for (int64_t s = 0; s < m.s; ++s) {
    const int64_t at = ((b * m.s + s) * m.kv + kh) * m.d;
    std::copy(k + at, k + at + m.d, out.k.data() + s * m.d);
    if (!forward) std::copy(v + at, v + at + m.d, out.v.data() + s * m.d);
    for (int64_t d = 0; d < m.d; ++d) out.xt[d * sp + s] = t[at + d];
  }
}

// Rows of query tile i: row r = g·kBlock + p holds head kv·G + g at position i·kBlock + p
// (rows past the sequence are zeros).
void pack_rows(const float* x, const Dims& m, int64_t b, int64_t kh, int64_t i, float scale,
               float* out) {
  for (int64_t g = 0; g < m.g; ++g)
    for (int64_t p = 0; p < kBlock; ++p) {
      const int64_t s = i * kBlock + p;
      float* row = out + (g * kBlock + p) * m.d;
      if (s >= m.s) {
        std::fill(row, row + m.d, 0.f);
        continue;
      }
      const float* src = x + ((b * m.s + s) * m.h + kh * m.g + g) * m.d;
      for (int64_t d = 0; d < m.d; ++d) row[d] = src[d] * scale;
    }
}

// The forward computes each tile transposed too, Sᵀ [kBlock][R] = K_j·Qᵀ_i, so that the online
// softmax's row max, rescale and row sum run 16 query rows to a vector (no horizontal
// reductions), and accumulates Oᵀ_i [D][R] += Vᵀ_j·Pᵀ.
template <int D>
void forward_task(const float* qp, const float* kp, const float* vp, float* op, float* lp,
                  const Dims& m, int64_t b, int64_t kh) {
  const int64_t sp = m.nb * kBlock, nrows = m.g * kBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  KV kv;
  pack_kv(kp, vp, m, b, kh, /*forward=*/true, kv);
  std::vector<float> rows(nrows * D), qt(D * nrows), st(kBlock * nrows), ot(D * nrows);
  std::vector<float> top(nrows), den(nrows), qpos(nrows);
  for (int64_t i = 0; i < m.nb; ++i) {
    pack_rows(qp, m, b, kh, i, scale, rows.data());
    transpose(rows.data(), nrows, D, qt.data());
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t s = i * kBlock + r % kBlock;
      qpos[r] = s < m.s ? static_cast<float>(s) : -1.f;  // a padded row sees nothing
    }
    std::fill(ot.begin(), ot.end(), 0.f);
    std::fill(top.begin(), top.end(), -INFINITY);
    std::fill(den.begin(), den.end(), 0.f);
    // One key tile; diag (std::true_type on the diagonal) picks the staircase products.
    auto tile = [&](int64_t j, auto diag) {
      constexpr bool kDiag = decltype(diag)::value;
      constexpr Diag kKeys = kDiag ? Diag::kKeysInner : Diag::kNone;
      mul_abt<D, kDiag>(kv.k.data() + j * kBlock * D, qt.data(), nrows, kBlock, nrows,
                        st.data(), nrows);  // Sᵀ = K_j · Qᵀ
      for (int64_t r = 0; r < nrows; r += 16) {  // nrows = G·kBlock: whole vectors
        const v16 pos = load(qpos.data() + r), old = load(top.data() + r);
        v16 mx = old;
        for (int64_t c = 0; c < kBlock; ++c) {
          const v16 x = load(st.data() + c * nrows + r);
          mx = (splat(static_cast<float>(j * kBlock + c)) <= pos) & (x > mx) ? x : mx;
        }
        // A row that has seen nothing yet keeps max −inf: shift by 0 there (all its terms 0).
        const v16 shift = mx == splat(-INFINITY) ? splat(0.f) : mx;
        const v16 alpha = exp_v(old - shift);  // exp(−inf) → 0 through the clamp
        v16 sum = {};
        for (int64_t c = 0; c < kBlock; ++c) {
          float* x = st.data() + c * nrows + r;
          const v16 e = splat(static_cast<float>(j * kBlock + c)) <= pos
                            ? exp_v(load(x) - shift)
                            : splat(0.f);
          store(x, e);
          sum += e;
        }
        store(den.data() + r, load(den.data() + r) * alpha + sum);
        store(top.data() + r, mx);
        for (int d = 0; d < D; ++d) {
          float* o = ot.data() + d * nrows + r;
          store(o, load(o) * alpha);
        }
      }
      mul_acc<kBlock, kKeys>(kv.xt.data() + j * kBlock, sp, kBlock, st.data(), nrows, D, nrows,
                             ot.data(), nrows);  // Oᵀ += Vᵀ_j · Pᵀ
    };
    for (int64_t j = 0; j < i; ++j) tile(j, std::false_type{});
    tile(i, std::true_type{});
    transpose(ot.data(), D, nrows, rows.data());
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t s = i * kBlock + r % kBlock, h = kh * m.g + r / kBlock;
      if (s >= m.s) continue;
      const float inv = 1.0f / den[r];
      float* dst = op + ((b * m.s + s) * m.h + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = rows[r * D + d] * inv;
      lp[(b * m.h + h) * m.s + s] = top[r] + std::log(den[r]);
    }
  }
}

// The backward computes each tile transposed, Sᵀ [kBlock][R] (keys × query rows), so that
// dV_j += Pᵀ·dO_i and dK_j += dSᵀ·Q_i read Pᵀ and dSᵀ row by row, and accumulates dQᵀ_i
// [D][R] += Kᵀ_j · dSᵀ: no tile is transposed, only each query tile's q, dO and dQ once.
template <int D>
void backward_task(const float* qp, const float* kp, const float* vp, const float* opp,
                   const float* lp, const float* dop, float* dqp, float* dkp, float* dvp,
                   const Dims& m, int64_t b, int64_t kh) {
  const int64_t sp = m.nb * kBlock, nrows = m.g * kBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  KV kv;
  pack_kv(kp, vp, m, b, kh, /*forward=*/false, kv);
  std::vector<float> rows(nrows * D), dor(nrows * D), orow(nrows * D);
  std::vector<float> qt(D * nrows), dot(D * nrows), dqt(D * nrows), dq(nrows * D);
  std::vector<float> pt(kBlock * nrows), ds(kBlock * nrows);
  std::vector<float> lrow(nrows), delta(nrows);
  std::vector<float> qpos(nrows);  // positions (exact in float), −1: padding
  std::vector<float> dka(sp * D, 0.f), dva(sp * D, 0.f);
  for (int64_t i = 0; i < m.nb; ++i) {
    pack_rows(qp, m, b, kh, i, scale, rows.data());
    pack_rows(dop, m, b, kh, i, 1.0f, dor.data());
    pack_rows(opp, m, b, kh, i, 1.0f, orow.data());
    transpose(rows.data(), nrows, D, qt.data());
    transpose(dor.data(), nrows, D, dot.data());
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t s = i * kBlock + r % kBlock, h = kh * m.g + r / kBlock;
      qpos[r] = s < m.s ? static_cast<float>(s) : -1.f;  // a padded row sees nothing
      lrow[r] = s < m.s ? lp[(b * m.h + h) * m.s + s] : 0.f;
      float acc = 0.f;
      for (int d = 0; d < D; ++d) acc += dor[r * D + d] * orow[r * D + d];
      delta[r] = acc;
    }
    std::fill(dqt.begin(), dqt.end(), 0.f);
    auto tile = [&](int64_t j, auto diag) {  // as in the forward
      constexpr bool kDiag = decltype(diag)::value;
      mul_abt<D, kDiag>(kv.k.data() + j * kBlock * D, qt.data(), nrows, kBlock, nrows,
                        pt.data(), nrows);  // Sᵀ
      mul_abt<D, kDiag>(kv.v.data() + j * kBlock * D, dot.data(), nrows, kBlock, nrows,
                        ds.data(), nrows);  // dPᵀ = V_j · dOᵀ
      for (int64_t c = 0; c < kBlock; ++c) {
        const v16 kpos = splat(static_cast<float>(j * kBlock + c));
        float* p = pt.data() + c * nrows;
        float* dsc = ds.data() + c * nrows;
        for (int64_t r = 0; r < nrows; r += 16) {  // nrows = G·kBlock: whole vectors
          const v16 e = kpos <= load(qpos.data() + r) ? exp_v(load(p + r) - load(lrow.data() + r))
                                                      : splat(0.f);  // P, masked
          store(p + r, e);
          store(dsc + r, e * (load(dsc + r) - load(delta.data() + r)));
        }
      }
      constexpr Diag kRows = kDiag ? Diag::kRowsAreKeys : Diag::kNone;
      constexpr Diag kKeys = kDiag ? Diag::kKeysInner : Diag::kNone;
      mul_pb<D, kRows>(pt.data(), nrows, nrows, dor.data(), kBlock, dva.data() + j * kBlock * D);
      mul_pb<D, kRows>(ds.data(), nrows, nrows, rows.data(), kBlock, dka.data() + j * kBlock * D);
      mul_acc<kBlock, kKeys>(kv.xt.data() + j * kBlock, sp, kBlock, ds.data(), nrows, D, nrows,
                             dqt.data(), nrows);  // dQᵀ += Kᵀ_j · dSᵀ
    };
    for (int64_t j = 0; j < i; ++j) tile(j, std::false_type{});
    tile(i, std::true_type{});
    transpose(dqt.data(), D, nrows, dq.data());
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t s = i * kBlock + r % kBlock, h = kh * m.g + r / kBlock;
      if (s >= m.s) continue;
      float* dst = dqp + ((b * m.s + s) * m.h + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = dq[r * D + d] * scale;
    }
  }
  for (int64_t s = 0; s < m.s; ++s) {
    const int64_t at = ((b * m.s + s) * m.kv + kh) * D;
    for (int d = 0; d < D; ++d) {
      dkp[at + d] = dka[s * D + d];
      dvp[at + d] = dva[s * D + d];
    }
  }
}

Dims dims_of(Buf& q, Buf& k) {
  auto qd = q.dimensions(), kd = k.dimensions();
  return Dims{qd[0], qd[1], qd[2], kd[2], qd[3], qd[2] / kd[2], (qd[1] + kBlock - 1) / kBlock};
}

ffi::Error check(Buf& q, Buf& k) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] ||
      kd[2] == 0 || qd[2] % kd[2] != 0)
    return ffi::Error::InvalidArgument("flash_cpu: q [B,S,H,D], k and v [B,S,K,D], H % K == 0");
  if (qd[3] != 16 && qd[3] != 32 && qd[3] != 64 && qd[3] != 128)
    return ffi::Error::InvalidArgument("flash_cpu: head dim must be 16, 32, 64 or 128");
  return ffi::Error::Success();
}

#define JAXPAR_BY_HEAD_DIM(d, call) \
  switch (d) {                      \
    case 16: call(16); break;       \
    case 32: call(32); break;       \
    case 64: call(64); break;       \
    default: call(128); break;      \
  }

ffi::Error Forward(ffi::ThreadPool pool, Buf q, Buf k, Buf v, bool threaded, Out o,
                   Out lse) {
  if (auto e = check(q, k); e.failure()) return e;
  const Dims m = dims_of(q, k);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *lp = lse->typed_data();
  parallel_for(pool, threaded, m.b * m.kv, [&](int64_t t) {
#define CALL(D) forward_task<D>(qp, kp, vp, op, lp, m, t / m.kv, t % m.kv)
    JAXPAR_BY_HEAD_DIM(m.d, CALL)
#undef CALL
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout,
                    bool threaded, Out dq, Out dk, Out dv) {
  if (auto e = check(q, k); e.failure()) return e;
  const Dims m = dims_of(q, k);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *opp = o.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  parallel_for(pool, threaded, m.b * m.kv, [&](int64_t t) {
#define CALL(D) \
  backward_task<D>(qp, kp, vp, opp, lp, dop, dqp, dkp, dvp, m, t / m.kv, t % m.kv)
    JAXPAR_BY_HEAD_DIM(m.d, CALL)
#undef CALL
  });
  return ffi::Error::Success();
}

}  // namespace

// Bindings: q, k, v -> o, lse; q, k, v, o, lse, dO -> dq, dk, dv.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparFlashCpuForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>().Arg<Buf>().Arg<Buf>()
                                  .Attr<bool>("threaded")
                                  .Ret<Buf>().Ret<Buf>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparFlashCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>()
                                  .Attr<bool>("threaded")
                                  .Ret<Buf>().Ret<Buf>().Ret<Buf>());
