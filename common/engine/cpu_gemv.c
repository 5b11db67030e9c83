/* A decode step's bf16 GEMVs of a few rows (y = x W^T + b, W [out, in] row-major, as nn.Linear keeps it) in chunks of rows
 * that the engine thread shares with a helper thread on an idle core (cpu_gemv.py says when and why).
 *
 * The helper runs under SCHED_IDLE on its core, so any other work there preempts it. It spins between GEMVs (a
 * decode step calls one every ~0.1 ms) and sleeps on a futex after SPIN_US without one: idle, it takes no CPU.
 * The engine never waits on it for long: it takes chunks in order as the helper does, computes any chunk left
 * unclaimed, and revokes one the helper holds past wait_us (then computes it itself; the helper, finding its chunk
 * revoked, drops its copy). Each chunk's state carries the job's number, so a helper still on the last job can
 * claim nothing of the next. One engine thread a process calls gemv_bf16 (the engine loop). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "cpu_bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define CHUNK 32
#define MAX_CHUNKS 16384
#define SPIN_US 1000
#define MAX_M 8  /* input rows: a decode step's sequences */
enum { FREE = 0, HELPER = 1, PUBLISHING = 2, DONE = 3, REVOKED = 4, MINE = 5 };
/* a chunk's state is (job << 3) | one of these: a helper still on an old job can claim none of a new one's */
#define ST(job, s) (((int64_t)(job) << 3) | (s))

typedef struct {
    const uint16_t *w, *x, *bias;  /* x [m, in] */
    uint16_t *y;                   /* [m, out] */
    int64_t in, out, chunks, m;
} Job;

static Job job;
static _Atomic int64_t next_chunk;
static _Atomic int64_t state[MAX_CHUNKS];
static _Atomic uint32_t seq;      /* bumped per job; the helper waits on it */
static _Atomic int helper_asleep;
static _Atomic int helper_running;
/* Revoking a chunk lets the engine return while the helper may still read the job's w and x. So the helper says
 * which job it reads (helper_in, 0: none) and the engine which it has closed: either the helper sees its job closed
 * and reads nothing, or the engine sees it inside and the caller keeps w and x alive (gemv_bf16's low bit). */
static _Atomic uint32_t helper_in, closed;

static inline double now_us(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }

/* out[r - r0] = (W x)[r] for the rows [r0, r1) of one input row x */
static void rows1(const Job *j, const uint16_t *x, int64_t r0, int64_t r1, uint16_t *out) {
    int64_t in = j->in;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const uint16_t *w0 = j->w + r * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        int64_t i = 0;
        for (; i + 32 <= in; i += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + i), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + i), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + i), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + i), xv);
        }
        float s[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
        for (; i < in; i++) {
            float xi = bf16_to_f32(x[i]);
            s[0] += bf16_to_f32(w0[i]) * xi; s[1] += bf16_to_f32(w1[i]) * xi;
            s[2] += bf16_to_f32(w2[i]) * xi; s[3] += bf16_to_f32(w3[i]) * xi;
        }
        for (int k = 0; k < 4; k++) out[r - r0 + k] = f32_to_bf16(s[k] + (j->bias ? bf16_to_f32(j->bias[r + k]) : 0.f));
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = j->w + r * in;
        __m512 a0 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= in; i += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + i), (__m512bh)_mm512_loadu_si512(x + i));
        float s = _mm512_reduce_add_ps(a0);
        for (; i < in; i++) s += bf16_to_f32(w0[i]) * bf16_to_f32(x[i]);
        out[r - r0] = f32_to_bf16(s + (j->bias ? bf16_to_f32(j->bias[r]) : 0.f));
    }
}

/* rows [r0, r1) of every input row: input row k's go to out + k * stride (the weights' chunk stays in cache) */
static void rows(const Job *j, int64_t r0, int64_t r1, uint16_t *out, int64_t stride) {
    for (int64_t k = 0; k < j->m; k++) rows1(j, j->x + k * j->in, r0, r1, out + k * stride);
}

static inline int64_t chunk_end(const Job *j, int64_t c) { int64_t e = (c + 1) * CHUNK; return e < j->out ? e : j->out; }

static void *helper_main(void *arg) {
    int core = (int)(intptr_t)arg;
    cpu_set_t set; CPU_ZERO(&set); CPU_SET(core, &set);
    sched_setaffinity(0, sizeof set, &set);
    struct sched_param p = {0};
    sched_setscheduler(0, SCHED_IDLE, &p);
    uint16_t scratch[MAX_M * CHUNK];
    uint32_t seen = atomic_load(&seq);
    for (;;) {
        double idle_since = now_us();
        while (atomic_load_explicit(&seq, memory_order_acquire) == seen) {
            if (now_us() - idle_since > SPIN_US) {  /* nothing moves: sleep until a job comes */
                atomic_store(&helper_asleep, 1);
                if (atomic_load(&seq) == seen) syscall(SYS_futex, &seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_store(&helper_asleep, 0);
                idle_since = now_us();
            } else _mm_pause();
        }
        seen = atomic_load(&seq);
        atomic_store(&helper_in, seen);
        if (atomic_load(&closed) == seen) {  /* done without us: its inputs may be gone */
            atomic_store(&helper_in, 0);
            continue;
        }
        Job j = job;
        for (;;) {
            int64_t c = atomic_fetch_add(&next_chunk, 1);
            if (c >= j.chunks) break;
            int64_t expect = ST(seen, FREE);
            if (!atomic_compare_exchange_strong(&state[c], &expect, ST(seen, HELPER))) break;
            rows(&j, c * CHUNK, chunk_end(&j, c), scratch, CHUNK);
            expect = ST(seen, HELPER);
            if (!atomic_compare_exchange_strong(&state[c], &expect, ST(seen, PUBLISHING))) break;  /* revoked */
            for (int64_t k = 0; k < j.m; k++)
                memcpy(j.y + k * j.out + c * CHUNK, scratch + k * CHUNK, (chunk_end(&j, c) - c * CHUNK) * 2);
            atomic_store_explicit(&state[c], ST(seen, DONE), memory_order_release);
        }
        atomic_store(&helper_in, 0);
    }
    return NULL;
}

int gemv_start(int core) {
    if (atomic_exchange(&helper_running, 1)) return 0;
    pthread_t t;
    return pthread_create(&t, NULL, helper_main, (void *)(intptr_t)core);
}

/* y = x W^T (+ bias) for m input rows (at most MAX_M). Returns twice the chunks the helper computed, plus 1 while the
 * helper may still read w and x (the caller keeps them alive until a later call returns an even number); -1: m out
 * of range. share = 0: all on this thread. */
int64_t gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t in,
                  int64_t out, int share, int wait_us) {
    Job j = {w, x, bias, y, in, out, (out + CHUNK - 1) / CHUNK, m};
    if (m < 1 || m > MAX_M) return -1;
    if (!share || !atomic_load(&helper_running) || j.chunks > MAX_CHUNKS || j.chunks < 2) {
        for (int64_t c = 0; c < j.chunks; c++) rows(&j, c * CHUNK, chunk_end(&j, c), y + c * CHUNK, out);
        return 0;
    }
    uint32_t k = atomic_load(&seq) + 1;  /* this job's number (only this thread bumps it) */
    for (int64_t c = 0; c < j.chunks; c++) atomic_store_explicit(&state[c], ST(k, FREE), memory_order_relaxed);
    job = j;
    atomic_store(&next_chunk, 0);
    atomic_store_explicit(&seq, k, memory_order_release);
    if (atomic_load(&helper_asleep)) syscall(SYS_futex, &seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    for (;;) {  /* our share: chunks in order, as the helper takes them too */
        int64_t c = atomic_fetch_add(&next_chunk, 1);
        if (c >= j.chunks) break;
        int64_t expect = ST(k, FREE);
        if (!atomic_compare_exchange_strong(&state[c], &expect, ST(k, MINE))) continue;
        rows(&j, c * CHUNK, chunk_end(&j, c), y + c * CHUNK, out);
    }
    int64_t helped = 0;
    double start = now_us();
    for (int64_t c = 0; c < j.chunks; c++) {
        for (;;) {
            int64_t s = atomic_load_explicit(&state[c], memory_order_acquire);
            if (s == ST(k, MINE)) break;
            if (s == ST(k, DONE)) { helped++; break; }
            if (s == ST(k, FREE) || (s == ST(k, HELPER) && now_us() - start > wait_us)) {  /* lost, or preempted */
                int64_t expect = s;
                if (atomic_compare_exchange_strong(&state[c], &expect, ST(k, REVOKED))) {
                    rows(&j, c * CHUNK, chunk_end(&j, c), y + c * CHUNK, out);
                    break;
                }
                continue;
            }
            _mm_pause();
        }
    }
    atomic_store(&next_chunk, j.chunks);  /* (a helper still looping takes no more) */
    atomic_store(&closed, k);
    return helped * 2 + (atomic_load(&helper_in) != 0);
}

int gemv_available(void) { return 1; }
#else  /* no bf16 dot products on this CPU: oneDNN's GEMM serves (cpu_gemv.applies is False) */
int gemv_available(void) { return 0; }
int gemv_start(int core) { (void)core; return -1; }
int64_t gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t m, int64_t in,
                  int64_t out, int share, int wait_us) {
    (void)w; (void)x; (void)bias; (void)y; (void)m; (void)in; (void)out; (void)share; (void)wait_us;
    return -1;
}
#endif
