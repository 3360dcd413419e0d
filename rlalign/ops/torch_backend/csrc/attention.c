/* Strict attention on the CPU, row by row: the arithmetic of rlalign.ops.torch_backend.attention
 * (its module docstring has the formula), without its 16-row tiles, key gathers and index plans.
 *
 * Bits. A query row's result is made of the same IEEE operations, in the same order, as in the
 * torch formulation:
 *   - q.k and p.v are fp32 chains (MAC, common.h: FMA steps, or under MKL's COMPATIBLE branch
 *     multiply-then-add steps) over d (resp. over the 64 keys of the block) in increasing
 *     order, starting from 0: what the fixed-shape fp32 GEMM tiles of the torch formulation compute
 *     on this library (checked by `rlalign doctor` and the tests, which compare the two paths with
 *     torch.equal; these chains are not cut into CHAIN_BLOCKs, so under COMPATIBLE a head_dim past
 *     CHAIN_BLOCK fails the check and runs the formulation);
 *   - the row sum of p is the balanced pairwise tree of 64 leaves; every other step is one
 *     correctly rounded fp32 operation (compiled with -ffp-contract=off: no fused multiply-add
 *     other than the explicit fmaf of MAC);
 *   - exp is not computed here: the caller applies torch's exp between rl_attn_scores and
 *     rl_attn_update, so it is the very function the torch formulation uses.
 * Terms the torch formulation multiplies out but that cannot change a bit are skipped: a key past
 * the row's position has score -inf and p = 0 (see rl_attn_scores, rl_attn_update). A row only ever
 * reads keys and values of its own sequence up to its own position, so its bits cannot depend on
 * the other rows, sequences or the page layout.
 */
#include "common.h"

#define KB 64        /* keys per block (spec.ATTN_KV_BLOCK) */
#define MAX_D 256    /* largest head_dim handled here (the caller checks) */
#define MAX_THREADS 64
/* below this much work (query rows x keys) a call runs on one thread */
#define PARALLEL_MIN_WORK 16384.0

typedef struct {
    const void *k, *v;               /* key/value tables, rows [token * hkv + head][d] */
    int64_t kv_bf16;                 /* 1: the tables hold bfloat16, else float32 */
    const int64_t *q_start;          /* per sequence: first query row (token) of the call */
    const int64_t *n_q;              /* number of query tokens */
    const int64_t *pos0;             /* absolute position of its first query token */
    const int64_t *ctx_len;          /* keys in its context (positions 0 .. ctx_len - 1) */
    const int64_t *block_table;      /* paged: [n_seq, bt_stride] page ids; NULL: packed */
    int64_t bt_stride, page_size;
    const int64_t *key_start;        /* packed: token index of position 0 */
    int64_t n_seq, hq, hkv, d;
} layout;

/* one call's arguments, shared by the threads (each fills its own copy's ``bad``) */
typedef struct {
    const layout *L;
    int64_t j;
    float scale;
    const float *q, *m_in, *p, *alpha;
    float *p_arg, *a_arg, *m_out, *l, *acc, *out;
    int bad;
} task;

/* Pointers to the rows of keys first .. first + n - 1 of (sequence s, kv head h), all inside the
 * context; bf16 rows are widened (exactly) into buf [n][d]. */
static void block_rows(const layout *L, const void *table, int64_t s, int64_t h, int64_t first, int64_t n,
                       float *buf, const float **rows) {
    const int64_t d = L->d, ps = L->page_size;
    /* paged: walk the pages (one division per block, not per key) */
    const int64_t *pages = L->block_table ? L->block_table + s * L->bt_stride + first / ps : NULL;
    int64_t off_in_page = L->block_table ? first % ps : 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t tok;
        if (pages) {
            tok = *pages * ps + off_in_page;
            if (++off_in_page == ps) {
                off_in_page = 0;
                pages++;
            }
        } else {
            tok = L->key_start[s] + first + i;
        }
        const int64_t off = (tok * L->hkv + h) * d;
        if (L->kv_bf16) {
            const uint16_t *src = (const uint16_t *)table + off;
            float *dst = buf + i * d;
            for (int64_t x = 0; x < d; x++) dst[x] = bf16_to_f32(src[x]);
            rows[i] = dst;
        } else {
            rows[i] = (const float *)table + off;
        }
    }
}

/* The block's n key (or value) rows of (sequence s, kv head h) transposed into out[x * KB + i] = row_i[x]
 * (block_rows' rows; copies only); with zero_tail the columns n .. KB - 1 are set to 0. */
static void transposed_block(const layout *L, const void *table, int64_t s, int64_t h, int64_t first, int64_t n,
                             float *buf, const float **rows, float *out, int zero_tail) {
    const int64_t d = L->d;
    block_rows(L, table, s, h, first, n, buf, rows);
    for (int64_t i = 0; i < n; i++)
        for (int64_t x = 0; x < d; x++) out[x * KB + i] = rows[i][x];
    if (zero_tail)
        for (int64_t i = n; i < KB; i++)
            for (int64_t x = 0; x < d; x++) out[x * KB + i] = 0.0f;
}

/* The work of block j for sequence s: query tokens t0 .. nq - 1 see it (position >= 64 j), and keys
 * first .. first + nk - 1 are the ones any of them sees (all inside the context: a query's position
 * is below its context length). Returns 0 when no query of s sees the block. */
static int block_span(const layout *L, int64_t s, int64_t j, int64_t *t0, int64_t *nk) {
    const int64_t first = j * KB, nq = L->n_q[s], last = L->pos0[s] + nq - 1;
    if (nq == 0 || last < first) return 0;
    *t0 = first > L->pos0[s] ? first - L->pos0[s] : 0;
    *nk = last - first + 1 < KB ? last - first + 1 : KB;
    return 1;
}

/* q . k_i for all 64 columns of the transposed key block kt [d][64]: per key one FMA chain over x in
 * increasing order from 0 (64 independent chains, x outermost). */
static inline __attribute__((always_inline)) void score_row(const float *qr, const float *kt, int64_t d,
                                                            float *sc) {
    float v[KB];
    for (int i = 0; i < KB; i++) v[i] = 0.0f;
    for (int64_t x = 0; x < d; x++) {
        const float qx = qr[x], *kr = kt + x * KB;
        for (int i = 0; i < KB; i++) v[i] = MAC(qx, kr[i], v[i]);
    }
    memcpy(sc, v, sizeof v);
}

/* p . V over keys 0 .. seen - 1: per output element one FMA chain over the keys in increasing order
 * from 0. */
static inline __attribute__((always_inline)) void pv_row(const float *pr, const float *const *rows, int64_t seen,
                                                         int64_t d, float *pv) {
    for (int64_t x = 0; x < d; x++) pv[x] = 0.0f;
    for (int64_t i = 0; i < seen; i++) {
        const float pi = pr[i], *vr = rows[i];
        for (int64_t x = 0; x < d; x++) pv[x] = MAC(pi, vr[x], pv[x]);
    }
}

/* run CALL with D_ a compile-time constant for the common head dims (the same operations; constant
 * trip counts let the compiler keep a row's accumulators in registers) */
#define SPECIALISE_D(d, CALL)                                     \
    switch (d) {                                                  \
        case 32: { const int64_t D_ = 32; CALL; break; }          \
        case 64: { const int64_t D_ = 64; CALL; break; }          \
        case 128: { const int64_t D_ = 128; CALL; break; }        \
        default: { const int64_t D_ = (d); CALL; break; }         \
    }

/* Ask the memory system for the key (or value) rows of a sequence's block j ahead of their use: the
 * rows of one call are scattered over the cache's pages, so the loads would otherwise wait on
 * memory one by one. Speed only. */
static inline __attribute__((always_inline)) void prefetch_block(const layout *L, const void *table, int64_t s, int64_t j) {
    int64_t t0, nk;
    if (s >= L->n_seq || !block_span(L, s, j, &t0, &nk)) return;
    const int64_t first = j * KB, ps = L->page_size, elem = L->kv_bf16 ? 2 : 4;
    const int64_t span = L->hkv * L->d * elem;   /* one token's rows, every head */
    for (int64_t i = 0; i < nk; i++) {
        const int64_t p = first + i;
        const int64_t tok = L->block_table
            ? L->block_table[s * L->bt_stride + p / ps] * ps + p % ps
            : L->key_start[s] + p;
        const char *row = (const char *)table + tok * span;
        for (int64_t b = 0; b < span; b += 64) __builtin_prefetch(row + b);
    }
}

#define PREFETCH_AHEAD 4   /* sequences */

/* Block j, scores: for every query row that sees block j (position >= 64 j):
 *   raw_i = (q . k_i) * scale;  s_i = raw_i if key position <= row position else -inf
 *   m_new = max(m, max_i s_i);  p_arg[row, i] = s_i - m_new;  a_arg[row] = m - m_new
 * Keys past the row's position are not multiplied out: their score is -inf whatever the key holds
 * (and a key inside the context is seen by the context's last query, whose check covers it).
 * Returns 1 if a computed raw score is not finite (a non-finite key in a context, or an overflow). */
static void scores_range(task *T, int64_t s0, int64_t s1) {
    const layout *L = T->L;
    const float *q = T->q, *m = T->m_in, scale = T->scale;
    float *p_arg = T->p_arg, *a_arg = T->a_arg, *m_new = T->m_out;
    const int64_t d = L->d, g = L->hq / L->hkv, j = T->j, first = j * KB;
    float kt[MAX_D * KB], buf[KB * MAX_D];
    const float *rows[KB];
    int bad = 0;
    /* columns past a block's keys are multiplied out but never used: start them finite */
    memset(kt, 0, sizeof kt);
    for (int64_t s = s0; s < s1; s++) {
        int64_t t0, nk;
        if (!block_span(L, s, j, &t0, &nk)) continue;
        prefetch_block(L, L->k, s + PREFETCH_AHEAD, j);
        for (int64_t h = 0; h < L->hkv; h++) {
            transposed_block(L, L->k, s, h, first, nk, buf, rows, kt, 0);   /* kt[x][i] = k_i[x] */
            for (int64_t t = t0; t < L->n_q[s]; t++) {
                const int64_t pos = L->pos0[s] + t;
                const int64_t seen = pos - first + 1 < KB ? pos - first + 1 : KB;   /* keys <= pos */
                for (int64_t e = 0; e < g; e++) {
                    const int64_t row = (L->q_start[s] + t) * L->hq + h * g + e;
                    const float *qr = q + row * d;
                    float sc[KB];
                    SPECIALISE_D(d, score_row(qr, kt, D_, sc));
                    float mx = -INFINITY;
                    for (int64_t i = 0; i < seen; i++) {
                        sc[i] = sc[i] * scale;
                        if (!isfinite(sc[i])) bad = 1;
                        if (sc[i] > mx || isnan(sc[i])) mx = sc[i];
                    }
                    const float mo = m[row];
                    const float mn = (mo > mx || isnan(mo)) ? mo : mx;
                    float *pr = p_arg + row * KB;
                    for (int64_t i = 0; i < seen; i++) pr[i] = sc[i] - mn;
                    /* keys past the row: exp(-inf - m) = 0 in the formulation; the update uses 0 for them
                     * and never reads these entries (0 here keeps the caller's exp off its slow path) */
                    for (int64_t i = seen; i < KB; i++) pr[i] = 0.0f;
                    a_arg[row] = mo - mn;
                    m_new[row] = mn;
                }
            }
        }
    }
    T->bad = bad;
}

/* Block j, update, after the caller's p = exp(p_arg), alpha = exp(a_arg):
 *   l = l * alpha + tree_sum(p);  acc = (p . V) + acc * alpha  (block 0: (p . V) + 0 * alpha);  m = m_new
 * The p . V chain skips the keys past the row's position: their p is exactly 0, so a term would add
 * a zero, which can only change the sign of a zero sum -- and the final + 0.0 maps that away. */
static void update_range(task *T, int64_t s0, int64_t s1) {
    const layout *L = T->L;
    const float *p = T->p, *alpha = T->alpha, *m_new = T->m_in;
    float *m = T->m_out, *l = T->l, *acc = T->acc;
    const int64_t d = L->d, g = L->hq / L->hkv, j = T->j, first = j * KB;
    float buf[KB * MAX_D];
    const float *rows[KB];
    for (int64_t s = s0; s < s1; s++) {
        int64_t t0, nk;
        if (!block_span(L, s, j, &t0, &nk)) continue;
        prefetch_block(L, L->v, s + PREFETCH_AHEAD, j);
        for (int64_t h = 0; h < L->hkv; h++) {
            block_rows(L, L->v, s, h, first, nk, buf, rows);
            for (int64_t t = t0; t < L->n_q[s]; t++) {
                const int64_t pos = L->pos0[s] + t;
                const int64_t seen = pos - first + 1 < KB ? pos - first + 1 : KB;
                for (int64_t e = 0; e < g; e++) {
                    const int64_t row = (L->q_start[s] + t) * L->hq + h * g + e;
                    const float al = alpha[row];
                    float pr[KB], a[KB / 2], b[KB / 4];
                    memcpy(pr, p + row * KB, (size_t)seen * sizeof(float));
                    for (int64_t i = seen; i < KB; i++) pr[i] = 0.0f;   /* exp(-inf - m): keys past the row */
                    /* tree_sum: pairs (2i, 2i + 1), level by level */
                    for (int i = 0; i < KB / 2; i++) a[i] = pr[2 * i] + pr[2 * i + 1];
                    for (int n = KB / 2; n > 1; n /= 2) {
                        for (int i = 0; i < n / 2; i++) b[i] = a[2 * i] + a[2 * i + 1];
                        memcpy(a, b, (size_t)(n / 2) * sizeof(float));
                    }
                    const float scaled = l[row] * al;
                    l[row] = scaled + a[0];
                    float pv[MAX_D];
                    SPECIALISE_D(d, pv_row(pr, rows, seen, D_, pv));
                    float *ar = acc + row * d;
                    if (j == 0) {
                        const float zero = 0.0f * al;
                        for (int64_t x = 0; x < d; x++) ar[x] = pv[x] + zero;
                    } else {
                        for (int64_t x = 0; x < d; x++) {
                            const float kept = ar[x] * al;
                            ar[x] = pv[x] + kept;
                        }
                    }
                    m[row] = m_new[row];
                }
            }
        }
    }
}

static void finish_range(task *T, int64_t s0, int64_t s1) {
    const layout *L = T->L;
    const int64_t d = L->d;
    int bad = 0;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t rows = L->n_q[s] * L->hq, base = L->q_start[s] * L->hq;
        for (int64_t r = base; r < base + rows; r++) {
            const float lr = T->l[r];
            for (int64_t x = 0; x < d; x++) {
                const float a = T->acc[r * d + x];
                if (!isfinite(a)) bad = 1;
                T->out[r * d + x] = a / lr + 0.0f;
            }
        }
    }
    T->bad = bad;
}

/* ---- threads: the sequences are cut into contiguous ranges of about equal work (rows x keys), run by
 * the OpenMP threads -- torch's own pool: the library links libgomp.so.1, which resolves to the copy
 * torch already loaded. A row's arithmetic does not depend on which thread runs it. */

/* A sequence's work: its rows x the keys they visit (the forward's start at pos0, the backward's at 0). */
static double seq_work(const layout *L, int64_t s, int with_context) {
    return (double)L->n_q[s] * (double)((with_context ? L->pos0[s] : 0) + L->n_q[s] + KB);
}

/* Cut the sequences into contiguous ranges of about equal work, bounds[0..threads]; returns the number of threads
 * to run (1: run everything on the caller's thread). */
static int64_t split_work(const layout *L, int64_t threads, int with_context, int64_t *bounds) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    double total = 0.0;
    for (int64_t s = 0; s < L->n_seq; s++) total += seq_work(L, s, with_context);
    if (threads <= 1 || L->n_seq < 2 || total < PARALLEL_MIN_WORK) return 1;
    double acc = 0.0;
    int64_t s = 0;
    bounds[0] = 0;
    for (int64_t t = 0; t < threads; t++) {
        const double goal = total * (double)(t + 1) / (double)threads;
        while (s < L->n_seq && (t == threads - 1 || acc < goal)) {
            acc += seq_work(L, s, with_context);
            s++;
        }
        bounds[t + 1] = s;
    }
    return threads;
}

static int parallel(task *T, void (*body)(task *, int64_t, int64_t), int64_t threads) {
    int64_t bounds[MAX_THREADS + 1];
    threads = split_work(T->L, threads, 1, bounds);
    if (threads == 1) {
        T->bad = 0;
        body(T, 0, T->L->n_seq);
        return T->bad;
    }
    task local[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) {
        local[t] = *T;
        local[t].bad = 0;
    }
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t t = 0; t < threads; t++) body(&local[t], bounds[t], bounds[t + 1]);
    int bad = 0;
    for (int64_t t = 0; t < threads; t++) bad |= local[t].bad;
    return bad;
}

/* ---- entry points (ctypes) ---- */

/* Block j, scores (see scores_range). Returns 1 if a computed raw score is not finite. */
int rl_attn_scores(const layout *L, const float *q, float scale, int64_t j, const float *m,
                   float *p_arg, float *a_arg, float *m_new, int64_t threads) {
    task T = {.L = L, .q = q, .scale = scale, .j = j, .m_in = m, .p_arg = p_arg, .a_arg = a_arg, .m_out = m_new};
    return parallel(&T, scores_range, threads);
}

/* Block j, update (see update_range), after the caller's p = exp(p_arg), alpha = exp(a_arg). */
void rl_attn_update(const layout *L, int64_t j, const float *p, const float *alpha, const float *m_new,
                    float *m, float *l, float *acc, int64_t threads) {
    task T = {.L = L, .j = j, .p = p, .alpha = alpha, .m_in = m_new, .m_out = m, .l = l, .acc = acc};
    parallel(&T, update_range, threads);
}

/* out = acc / l + 0.0 (maps -0.0 to +0.0) for every query row. Returns 1 if an accumulator is not
 * finite (a non-finite value in a context). */
int rl_attn_finish(const layout *L, const float *acc, const float *l, float *out, int64_t threads) {
    task T = {.L = L, .acc = (float *)acc, .l = (float *)l, .out = out};
    return parallel(&T, finish_range, threads);
}

/* ---- the varlen backward (rlalign.ops.torch_backend.attention.backward, _backward_bucket), row by row ----
 *
 * Bits. Per key block j and (sequence, kv head), for the rows at positions >= 64 j (token-major, g heads
 * each), the same IEEE operations as the formulation's padded bmm + elementwise steps:
 *   s_i = (q . k_i) * scale;  arg_i = s_i - lse           (rl_attn_bwd_args; the caller applies torch's exp)
 *   p_i = exp(arg_i) if key position <= row position else 0
 *   ds_i = p_i * ((do . v_i) - delta)
 *   dq  = 0 + (sum_i ds_i k_i) * scale  (block 0),  dq + (sum_i ds_i k_i) * scale  (later blocks)
 *   dv_i = sum_rows p_i do;   dk_i = (sum_rows ds_i q) * scale
 * Every dot product / sum is an fp32 chain of MAC steps (common.h) in increasing order from +0 (over d, over
 * the block's keys, over the block's rows in order), never cut into CHAIN_BLOCKs: what the library's bmm
 * computes for these shapes (rows of a block 12 .. 192 on MKL's native branches, 1 .. CHAIN_BLOCK on its
 * COMPATIBLE branch; the caller routes other buckets to the formulation and checks every shape it routes here
 * against the formulation before first use). Terms the formulation multiplies out but that cannot change
 * a bit are skipped: the padding rows and padding keys of a bucket (exact zeros: each product is +-0, and
 * a chain that starts from +0 never holds -0, so adding +-0 changes nothing). */

typedef struct {
    const layout *L;
    int64_t j;
    float scale;
    const float *q, *dout, *lse, *delta, *p;
    float *arg, *dq, *dk, *dv;
} bwd_task;

/* block j, phase 1: arg[row][i] = (q . k_i) * scale - lse[row] for the visible keys, 0 for the others */
static void bwd_args_range(bwd_task *T, int64_t s0, int64_t s1) {
    const layout *L = T->L;
    const int64_t d = L->d, g = L->hq / L->hkv, j = T->j, first = j * KB;
    float kt[MAX_D * KB], buf[KB * MAX_D];
    const float *rows[KB];
    for (int64_t s = s0; s < s1; s++) {
        int64_t t0, nk;
        if (!block_span(L, s, j, &t0, &nk)) continue;
        for (int64_t h = 0; h < L->hkv; h++) {
            transposed_block(L, L->k, s, h, first, nk, buf, rows, kt, 1);
            for (int64_t t = t0; t < L->n_q[s]; t++) {
                const int64_t seen = t - first + 1 < KB ? t - first + 1 : KB;
                for (int64_t e = 0; e < g; e++) {
                    const int64_t row = (L->q_start[s] + t) * L->hq + h * g + e;
                    float sc[KB];
                    SPECIALISE_D(d, score_row(T->q + row * d, kt, D_, sc));
                    float *ar = T->arg + row * KB;
                    const float lr = T->lse[row];
                    for (int64_t i = 0; i < seen; i++) {
                        const float si = sc[i] * T->scale;
                        ar[i] = si - lr;
                    }
                    for (int64_t i = seen; i < KB; i++) ar[i] = 0.0f;
                }
            }
        }
    }
}

/* block j, phase 2 (after the caller's p = exp(arg)): ds, dq, dk, dv of the block */
static void bwd_grads_range(bwd_task *T, int64_t s0, int64_t s1) {
    const layout *L = T->L;
    const int64_t d = L->d, g = L->hq / L->hkv, j = T->j, first = j * KB;
    float vt[MAX_D * KB], kbuf[KB * MAX_D], vbuf[KB * MAX_D];
    float dka[KB * MAX_D], dva[KB * MAX_D];
    const float *krows[KB], *vrows[KB];
    for (int64_t s = s0; s < s1; s++) {
        int64_t t0, nk;
        if (!block_span(L, s, j, &t0, &nk)) continue;
        for (int64_t h = 0; h < L->hkv; h++) {
            block_rows(L, L->k, s, h, first, nk, kbuf, krows);
            transposed_block(L, L->v, s, h, first, nk, vbuf, vrows, vt, 1);
            memset(dka, 0, (size_t)(nk * d) * sizeof(float));
            memset(dva, 0, (size_t)(nk * d) * sizeof(float));
            for (int64_t t = t0; t < L->n_q[s]; t++) {
                const int64_t seen = t - first + 1 < KB ? t - first + 1 : KB;
                for (int64_t e = 0; e < g; e++) {
                    const int64_t row = (L->q_start[s] + t) * L->hq + h * g + e;
                    const float *dor = T->dout + row * d, *qr = T->q + row * d, *pr = T->p + row * KB;
                    float dov[KB], p[KB], ds[KB];
                    SPECIALISE_D(d, score_row(dor, vt, D_, dov));
                    const float dl = T->delta[row];
                    for (int64_t i = 0; i < nk; i++) {
                        p[i] = i < seen ? pr[i] : 0.0f;
                        const float diff = dov[i] - dl;
                        ds[i] = p[i] * diff;
                    }
                    /* dq: one chain over the block's keys */
                    float acc[MAX_D];
                    for (int64_t x = 0; x < d; x++) acc[x] = 0.0f;
                    for (int64_t i = 0; i < nk; i++) {
                        const float di = ds[i], *kr = krows[i];
                        for (int64_t x = 0; x < d; x++) acc[x] = MAC(di, kr[x], acc[x]);
                    }
                    float *dqr = T->dq + row * d;
                    for (int64_t x = 0; x < d; x++) {
                        const float tx = acc[x] * T->scale;
                        dqr[x] = (j == 0 ? 0.0f : dqr[x]) + tx;
                    }
                    /* dk, dv: chains over the rows, this row next */
                    for (int64_t i = 0; i < nk; i++) {
                        const float pi = p[i], di = ds[i];
                        float *dvr = dva + i * d, *dkr = dka + i * d;
                        for (int64_t x = 0; x < d; x++) dvr[x] = MAC(pi, dor[x], dvr[x]);
                        for (int64_t x = 0; x < d; x++) dkr[x] = MAC(di, qr[x], dkr[x]);
                    }
                }
            }
            for (int64_t i = 0; i < nk; i++) {
                const int64_t key = (L->key_start[s] + first + i) * L->hkv + h;
                for (int64_t x = 0; x < d; x++) {
                    T->dv[key * d + x] = dva[i * d + x];
                    T->dk[key * d + x] = dka[i * d + x] * T->scale;
                }
            }
        }
    }
}

/* the sequences in contiguous ranges of about equal work, on torch's OpenMP pool (see parallel) */
static void bwd_parallel(bwd_task *T, void (*body)(bwd_task *, int64_t, int64_t), int64_t threads) {
    int64_t bounds[MAX_THREADS + 1];
    threads = split_work(T->L, threads, 0, bounds);
    if (threads == 1) {
        body(T, 0, T->L->n_seq);
        return;
    }
    #pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t t = 0; t < threads; t++) body(T, bounds[t], bounds[t + 1]);
}

/* Block j, phase 1 (see bwd_args_range): arg [T * hq][64]. */
void rl_attn_bwd_args(const layout *L, const float *q, const float *lse, float scale, int64_t j, float *arg,
                      int64_t threads) {
    bwd_task T = {.L = L, .j = j, .scale = scale, .q = q, .lse = lse, .arg = arg};
    bwd_parallel(&T, bwd_args_range, threads);
}

/* Block j, phase 2 (see bwd_grads_range), after p = exp(arg): dq rows accumulate, dk/dv rows are written. */
void rl_attn_bwd_grads(const layout *L, const float *q, const float *dout, const float *delta, const float *p,
                       float scale, int64_t j, float *dq, float *dk, float *dv, int64_t threads) {
    bwd_task T = {.L = L, .j = j, .scale = scale, .q = q, .dout = dout, .delta = delta, .p = p,
                  .dq = dq, .dk = dk, .dv = dv};
    bwd_parallel(&T, bwd_grads_range, threads);
}
