// Causal grouped-query attention for XLA:CPU as two XLA FFI handlers (forward, backward),
// threaded over XLA's intra-op thread pool. fp32 throughout.
//
// Why a native kernel: XLA:CPU runs a batched matmul's batch serially and does not run loops
// side by side, so the blockwise kernel's tiles (jaxpar/model/flash.py) use one core whatever
// the machine has (BENCHMARKS.md, "A second machine"). Here each task owns one
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

// Runs fn(t) for t in [0, n) on the caller and up to pool.num_threads() helpers; returns when
// all have run. Helpers that start after the work is gone find nothing to do (shared state).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
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
// registers. R = G·kBlock rows of a query tile, kBlock = 64 keys, D a template constant.

// out[r][c] = Σ_d a[r][d] · bt[d][c] for c < width (a multiple of kBlock; bt: D rows of
// stride ldb; out: rows of stride ldo); rows a multiple of 4 (every caller's: R or kBlock).
template <int D>
void mul_abt(const float* a, const float* bt, int64_t ldb, int64_t rows, int64_t width,
             float* out, int64_t ldo) {
  constexpr int kV = kBlock / 16;
  for (int64_t w0 = 0; w0 < width; w0 += kBlock) {
    for (int64_t r = 0; r < rows; r += 4) {
      v16 acc[4][kV] = {};
      for (int d = 0; d < D; ++d) {
        v16 b[kV];
        for (int v = 0; v < kV; ++v) b[v] = load(bt + d * ldb + w0 + 16 * v);
        for (int i = 0; i < 4; ++i) {
          const v16 x = splat(a[(r + i) * D + d]);
          for (int v = 0; v < kV; ++v) acc[i][v] += x * b[v];
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int v = 0; v < kV; ++v) store(out + (r + i) * ldo + w0 + 16 * v, acc[i][v]);
    }
  }
}

// out[r][c] += Σ_k p[r][k] · b[k][c] for r < rows, c < width, k < inner (strides ldp, ldb,
// ldo), in passes of 4 rows × W columns (W: 16, 32 or 64 dividing width; 4·W/16 accumulators).
// P·V and dS·K (width D), Pᵀ·dO and dSᵀ·Q (width D), Kᵀ·dSᵀ (width R).
template <int W>
void mul_acc(const float* p, int64_t ldp, int64_t inner, const float* b, int64_t ldb,
             int64_t rows, int64_t width, float* out, int64_t ldo) {
  constexpr int kV = W / 16;
  for (int64_t w0 = 0; w0 < width; w0 += W)
    for (int64_t r = 0; r < rows; r += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, rows - r));
      v16 acc[4][kV];
      for (int i = 0; i < nr; ++i)
        for (int v = 0; v < kV; ++v) acc[i][v] = load(out + (r + i) * ldo + w0 + 16 * v);
      for (int64_t k = 0; k < inner; ++k) {
        v16 bk[kV];
        for (int v = 0; v < kV; ++v) bk[v] = load(b + k * ldb + w0 + 16 * v);
        for (int i = 0; i < nr; ++i) {
          const v16 x = splat(p[(r + i) * ldp + k]);
          for (int v = 0; v < kV; ++v) acc[i][v] += x * bk[v];
        }
      }
      for (int i = 0; i < nr; ++i)
        for (int v = 0; v < kV; ++v) store(out + (r + i) * ldo + w0 + 16 * v, acc[i][v]);
    }
}

// out [rows][D] += p [rows][inner] (row stride ldp) · b [inner][D].
template <int D>
void mul_pb(const float* p, int64_t ldp, int64_t inner, const float* b, int64_t rows,
            float* out) {
  mul_acc<(D < 64 ? D : 64)>(p, ldp, inner, b, D, rows, D, out, D);
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
    for (int64_t j = 0; j <= i; ++j) {
      mul_abt<D>(kv.k.data() + j * kBlock * D, qt.data(), nrows, kBlock, nrows, st.data(),
                 nrows);  // Sᵀ
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
        for (int d = 0; d < D; ++d) store(ot.data() + d * nrows + r, load(ot.data() + d * nrows + r) * alpha);
      }
      mul_acc<kBlock>(kv.xt.data() + j * kBlock, sp, kBlock, st.data(), nrows, D, nrows,
                      ot.data(), nrows);  // Oᵀ += Vᵀ_j · Pᵀ
    }
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
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = kv.k.data() + j * kBlock * D;
      mul_abt<D>(kj, qt.data(), nrows, kBlock, nrows, pt.data(), nrows);  // Sᵀ
      mul_abt<D>(kv.v.data() + j * kBlock * D, dot.data(), nrows, kBlock, nrows, ds.data(),
                 nrows);  // dPᵀ = V_j · dOᵀ
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
      mul_pb<D>(pt.data(), nrows, nrows, dor.data(), kBlock, dva.data() + j * kBlock * D);
      mul_pb<D>(ds.data(), nrows, nrows, rows.data(), kBlock, dka.data() + j * kBlock * D);
      mul_acc<kBlock>(kv.xt.data() + j * kBlock, sp, kBlock, ds.data(), nrows, D, nrows,
                      dqt.data(), nrows);  // dQᵀ += Kᵀ_j · dSᵀ
    }
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

ffi::Error Forward(ffi::ThreadPool pool, Buf q, Buf k, Buf v, Out o, Out lse) {
  if (auto e = check(q, k); e.failure()) return e;
  const Dims m = dims_of(q, k);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *lp = lse->typed_data();
  parallel_for(pool, m.b * m.kv, [&](int64_t t) {
#define CALL(D) forward_task<D>(qp, kp, vp, op, lp, m, t / m.kv, t % m.kv)
    JAXPAR_BY_HEAD_DIM(m.d, CALL)
#undef CALL
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, Buf q, Buf k, Buf v, Buf o, Buf lse, Buf dout,
                    Out dq, Out dk, Out dv) {
  if (auto e = check(q, k); e.failure()) return e;
  const Dims m = dims_of(q, k);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *opp = o.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  parallel_for(pool, m.b * m.kv, [&](int64_t t) {
#define CALL(D) \
  backward_task<D>(qp, kp, vp, opp, lp, dop, dqp, dkp, dvp, m, t / m.kv, t % m.kv)
    JAXPAR_BY_HEAD_DIM(m.d, CALL)
#undef CALL
  });
  return ffi::Error::Success();
}

}  // namespace

// Bindings: q, k, v -> o, lse; q, k, v, o, lse, dO -> dq, dk, dv.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxparFlashCpuForward, Forward,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparFlashCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>()
                                  .Ret<Buf>().Ret<Buf>().Ret<Buf>());
