"""The shared-memory all-reduce as one C loop (compiled with the flag helper of ``_shm_sync``).

Python orchestration costs tens of microseconds per chunk and per torch call, so chunks had to be
large (4 MiB) and every byte crossed main memory several times. Here one call runs the whole
pipeline over small chunks (default 256 KiB, which stay in the cores' caches between the rank that
writes them and the ranks that read them) with one synchronisation phase per chunk:

- before phase ``k``: a rank has copied the parts of chunk ``k`` that the others reduce into its
  buffer ``k % 3`` and written its reduced part of chunk ``k - 1`` into buffer ``(k - 1) % 3``;
- after phase ``k``: it copies the others' results of chunk ``k - 1`` into its tensor, reduces its
  own part of chunk ``k`` (its own contribution read from its tensor, the result written to its
  tensor and to its buffer in the same pass) and copies in chunk ``k + 1``.

Three buffers per rank: buffer ``(k + 1) % 3`` is written in step ``k``, and was last read (the
copy-out of chunk ``k - 2``) before every rank published phase ``k``. The three buffers lie in the
half of the rank's slot pair that the previous collective did not end in (the Python paths use
the halves alternately), so a slow rank still copying out the previous collective's last chunk
is never overwritten.

A wait that runs past its budget returns to Python (the index of the rank it waits for, with the
step saved in ``state``), which checks the deadline and the peer's process and calls again to
resume: the kernel never blocks past the budget and never decides about errors.

Reduction order is the Python path's, bit for bit: a left fold over local ranks; float32 and
float64 in their own type, bfloat16 accumulated in float32 and rounded once (round to nearest
even, as torch), integers wrapping; ``avg`` a true division by ``divide``. float16 stays on the
torch path (x86-64 without F16C converts it in software).
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["KERNELS", "KINDS", "NATIVE_DTYPES", "NATIVE_OPS", "bind"]

NATIVE_DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int16: 6,
    torch.int32: 7,
    torch.int64: 8,
}
NATIVE_OPS = {"sum": 0, "avg": 0, "product": 1, "min": 2, "max": 3}
KINDS = {"all_reduce": 0, "broadcast": 1, "all_gather": 2, "reduce_scatter": 3}

KERNELS = r"""
#include <string.h>
#include <math.h>

enum { T_F32, T_F64, T_BF16, T_F16, T_I8, T_U8, T_I16, T_I32, T_I64 };
enum { O_SUM, O_PROD, O_MIN, O_MAX };
#define BLK 1024

static inline float ld_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t st_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
#define ID(x) (x)
#define FADD(a, b) ((a) + (b))
#define FMUL(a, b) ((a) * (b))
#define IADD(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define IMUL(a, b) ((int64_t)((uint64_t)(a) * (uint64_t)(b)))
#define FMIN(a, b) (((a) != (a) || (b) != (b)) ? NAN : ((b) < (a) ? (b) : (a)))
#define FMAX(a, b) (((a) != (a) || (b) != (b)) ? NAN : ((a) < (b) ? (b) : (a)))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))
#define IMAX(a, b) ((a) < (b) ? (b) : (a))

/* out[i] = fold over j of src[j][i] (left to right), / div when div > 1; also into out2 (the
   shared buffer, which a peer reads next).
   out may be one of the sources: a block is read whole before it is written. */
#define DEFINE_FOLD(NAME, T, A, LD, ST, ADD, MUL, MIN, MAX)                                   \
static void NAME(void *out_, void *out2_, void **src_, int n, int64_t cnt, int op, double div) { \
    T *out = (T *)out_, *out2 = (T *)out2_;                                                   \
    A acc[BLK];                                                                               \
    for (int64_t b = 0; b < cnt; b += BLK) {                                                  \
        int64_t m = cnt - b < BLK ? cnt - b : BLK;                                            \
        const T *s = (const T *)src_[0] + b;                                                  \
        for (int64_t i = 0; i < m; i++) acc[i] = LD(s[i]);                                    \
        for (int j = 1; j < n; j++) {                                                         \
            s = (const T *)src_[j] + b;                                                       \
            switch (op) {                                                                     \
            case O_SUM: for (int64_t i = 0; i < m; i++) acc[i] = ADD(acc[i], (A)LD(s[i])); break; \
            case O_PROD: for (int64_t i = 0; i < m; i++) acc[i] = MUL(acc[i], (A)LD(s[i])); break; \
            case O_MIN: for (int64_t i = 0; i < m; i++) { A v = LD(s[i]); acc[i] = MIN(acc[i], v); } break; \
            default: for (int64_t i = 0; i < m; i++) { A v = LD(s[i]); acc[i] = MAX(acc[i], v); } break; \
            }                                                                                 \
        }                                                                                     \
        if (div > 1) { A d = (A)div; for (int64_t i = 0; i < m; i++) acc[i] = acc[i] / d; }   \
        T *o = out + b;                                                                       \
        for (int64_t i = 0; i < m; i++) o[i] = (T)ST(acc[i]);                                 \
        if (out2) memcpy(out2 + b, o, (size_t)m * sizeof(T));                                 \
    }                                                                                         \
}

DEFINE_FOLD(fold_f32, float, float, ID, ID, FADD, FMUL, FMIN, FMAX)
DEFINE_FOLD(fold_f64, double, double, ID, ID, FADD, FMUL, FMIN, FMAX)
DEFINE_FOLD(fold_bf16, uint16_t, float, ld_bf16, st_bf16, FADD, FMUL, FMIN, FMAX)
DEFINE_FOLD(fold_i8, int8_t, int64_t, ID, ID, IADD, IMUL, IMIN, IMAX)
DEFINE_FOLD(fold_u8, uint8_t, int64_t, ID, ID, IADD, IMUL, IMIN, IMAX)
DEFINE_FOLD(fold_i16, int16_t, int64_t, ID, ID, IADD, IMUL, IMIN, IMAX)
DEFINE_FOLD(fold_i32, int32_t, int64_t, ID, ID, IADD, IMUL, IMIN, IMAX)
DEFINE_FOLD(fold_i64, int64_t, int64_t, ID, ID, IADD, IMUL, IMIN, IMAX)

typedef void (*fold_fn)(void *, void *, void **, int, int64_t, int, double);
static fold_fn fold_of(int dtype) {
    switch (dtype) {
    case T_F32: return fold_f32; case T_F64: return fold_f64; case T_BF16: return fold_bf16;
    case T_I8: return fold_i8; case T_U8: return fold_u8; case T_I16: return fold_i16;
    case T_I32: return fold_i32; case T_I64: return fold_i64; default: return 0;
    }
}

enum { K_ALLREDUCE, K_BROADCAST, K_ALLGATHER, K_REDUCESCATTER };

typedef struct {
    char *slots; int64_t rank_stride, buf0, buf_stride;
    int64_t *flags; int fstride, n, me;
    int kind, root; char *data, *out; int64_t count, chunk; int isz, dtype, op; double div;
} ar_t;

static char *buf_of(const ar_t *a, int j, int64_t k) {
    return a->slots + j * a->rank_stride + a->buf0 + (k % 3) * a->buf_stride;
}
/* part j of a chunk of cnt elements: [lo, hi), parts start on 64-byte boundaries */
static void part(const ar_t *a, int64_t cnt, int j, int64_t *lo, int64_t *hi) {
    int64_t unit = 64 / a->isz; if (unit < 1) unit = 1;
    int64_t per = (cnt + a->n - 1) / a->n; per = (per + unit - 1) / unit * unit;
    *lo = j * per < cnt ? j * per : cnt; *hi = (j + 1) * per < cnt ? (j + 1) * per : cnt;
}
static int64_t chunk_len(const ar_t *a, int64_t k) {
    int64_t lo = k * a->chunk; return a->count - lo < a->chunk ? a->count - lo : a->chunk;
}

/* all-reduce: publish the parts of chunk k the others reduce */
static void ar_in(const ar_t *a, int64_t k) {
    int64_t cnt = chunk_len(a, k), lo, hi; char *src = a->data + k * a->chunk * a->isz;
    char *dst = buf_of(a, a->me, k);
    part(a, cnt, a->me, &lo, &hi);
    memcpy(dst, src, (size_t)(lo * a->isz));
    memcpy(dst + hi * a->isz, src + hi * a->isz, (size_t)((cnt - hi) * a->isz));
}
/* all-reduce: reduce this rank's part of chunk k into the tensor and the buffer */
static void ar_reduce(const ar_t *a, int64_t k) {
    int64_t cnt = chunk_len(a, k), lo, hi; char *mine = a->data + k * a->chunk * a->isz;
    part(a, cnt, a->me, &lo, &hi);
    if (hi <= lo) return;
    void *src[64];
    for (int j = 0; j < a->n; j++)
        src[j] = (j == a->me ? mine : buf_of(a, j, k)) + lo * a->isz;
    fold_of(a->dtype)(mine + lo * a->isz, buf_of(a, a->me, k) + lo * a->isz, src, a->n, hi - lo, a->op, a->div);
}
/* all-reduce: copy the others' results of chunk k */
static void ar_out(const ar_t *a, int64_t k) {
    int64_t cnt = chunk_len(a, k), lo, hi; char *dst = a->data + k * a->chunk * a->isz;
    for (int j = 0; j < a->n; j++) {
        if (j == a->me) continue;
        part(a, cnt, j, &lo, &hi);
        if (hi > lo) memcpy(dst + lo * a->isz, buf_of(a, j, k) + lo * a->isz, (size_t)((hi - lo) * a->isz));
    }
}

/* what a rank writes into its buffer before phase k */
static void produce(const ar_t *a, int64_t k) {
    size_t len = (size_t)(chunk_len(a, k) * a->isz), off = (size_t)(k * a->chunk * a->isz);
    switch (a->kind) {
    case K_ALLREDUCE: ar_in(a, k); break;
    case K_BROADCAST: if (a->me == a->root) memcpy(buf_of(a, a->me, k), a->data + off, len); break;
    case K_ALLGATHER: memcpy(buf_of(a, a->me, k), a->data + off, len); break;
    default: /* reduce-scatter: row j of the chunk goes to rank j (our own row stays put) */
        for (int j = 0; j < a->n; j++)
            if (j != a->me)
                memcpy(buf_of(a, a->me, k) + j * a->chunk * a->isz,
                       a->data + (j * a->count) * a->isz + off, len);
    }
}
/* what a rank does after phase k */
static void consume(const ar_t *a, int64_t k, int64_t nch) {
    size_t len = (size_t)(chunk_len(a, k < nch ? k : 0) * a->isz), off = (size_t)(k * a->chunk * a->isz);
    switch (a->kind) {
    case K_ALLREDUCE:
        if (k >= 1) ar_out(a, k - 1);
        if (k < nch) ar_reduce(a, k);
        break;
    case K_BROADCAST: if (a->me != a->root) memcpy(a->data + off, buf_of(a, a->root, k), len); break;
    case K_ALLGATHER:
        for (int j = 0; j < a->n; j++)
            memcpy(a->out + (j * a->count) * a->isz + off,
                    j == a->me ? a->data + off : buf_of(a, j, k), len);
        break;
    default: {
        void *src[64];
        for (int j = 0; j < a->n; j++)
            src[j] = j == a->me ? a->data + (a->me * a->count) * a->isz + off
                                : buf_of(a, j, k) + a->me * a->chunk * a->isz;
        fold_of(a->dtype)(a->out + off, 0, src, a->n, (int64_t)len / a->isz, a->op, a->div);
    }
    }
}
static void publish(const ar_t *a, int64_t *state) {
    state[0]++;
    torsh_store(a->flags + (int64_t)a->me * a->fstride, state[0]);
}

/* One collective of the node's n <= 64 ranks over chunks of `chunk` elements (of `count`: the
   tensor for all-reduce and broadcast, each rank's part for all-gather and reduce-scatter).
   state: [0] this rank's phase counter (in/out), [1] the step to resume at, [2] 0 on the first
   call. Returns -1 when done, -2 on bad arguments, or the index of the rank a wait ran out of
   budget on (call again with the same state to resume). small != 0 (all-reduce whose tensor
   fits one chunk): one phase, every rank folds the whole tensor. */
int torsh_collective(int kind, char *slots, int64_t rank_stride, int64_t buf0, int64_t buf_stride,
                     int64_t *flags, int fstride, int n, int me, int root, char *data, char *out,
                     int64_t count, int isz, int dtype, int op, double div, int64_t chunk,
                     int small, int64_t *state, int64_t budget_ns) {
    ar_t a = {slots, rank_stride, buf0, buf_stride, flags, fstride, n, me,
              kind, root, data, out, count, chunk, isz, dtype, op, div};
    if (n > 64 || chunk < 1 || ((kind == K_ALLREDUCE || kind == K_REDUCESCATTER) && !fold_of(dtype)))
        return -2;
    if (small) {
        if (!state[2]) {
            memcpy(buf_of(&a, me, 0), data, (size_t)(count * isz));
            publish(&a, state); state[2] = 1;
        }
        int lag = torsh_wait_all(flags, fstride, n, state[0], budget_ns);
        if (lag >= 0) return lag;
        void *src[64];
        for (int j = 0; j < n; j++) src[j] = j == me ? data : buf_of(&a, j, 0);
        fold_of(dtype)(data, 0, src, n, count, op, div);
        return -1;
    }
    int64_t nch = (count + chunk - 1) / chunk, last = nch + (kind == K_ALLREDUCE);
    if (nch == 0) return -1;
    if (!state[2]) { produce(&a, 0); publish(&a, state); state[2] = 1; state[1] = 0; }
    for (int64_t k = state[1]; k < last; k++) {
        state[1] = k;
        int lag = torsh_wait_all(flags, fstride, n, state[0], budget_ns);
        if (lag >= 0) return lag;
        consume(&a, k, nch);
        if (k + 1 < nch) produce(&a, k + 1);
        if (k + 1 < last) publish(&a, state);
    }
    return -1;
}
"""


def bind(lib: ctypes.CDLL) -> None:
    """Declare the kernel's signature on the loaded helper."""
    i64, ptr, int_ = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.torsh_collective.argtypes = [
        int_, ptr, i64, i64, i64,  # kind, slots, rank stride, buffer 0 offset, buffer stride
        ptr, int_, int_, int_, int_,  # flags, flag stride, n, me, root
        ptr, ptr, i64, int_, int_, int_, ctypes.c_double,  # data, out, count, isz, dtype, op, div
        i64, int_, ptr, i64,  # chunk, small, state, budget
    ]  # fmt: skip
    lib.torsh_collective.restype = ctypes.c_int
