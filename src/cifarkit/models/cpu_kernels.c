/* Memory-bound steps of CPU training that torch's kernels do slowly, on channels-last tensors: the inner loops run
   over the channels, contiguous in memory, and the compiler vectorizes them; each call splits its rows (images, or
   pixels) between `threads` threads. Built and loaded by cifarkit.core.native; called by cifarkit.models.pooling
   and cifarkit.models.norm_act, whose docstrings say why each exists.

   1. A 2x2 max-pool of stride 2 (floor rounding), forward and backward, in bf16 and fp32. It computes what torch's
      max_pool2d and its backward compute, bit for bit: the first largest value of each window in row-major order
      wins (a NaN wins over any number, a later NaN over an earlier one, and comes out with its own bits, where
      torch's bf16 kernel may set others), and its position gets the gradient; the others, and an odd last row or
      column, get +0. It keeps one byte per output for the winner's place in its window, not an int64 index, and
      writes every gradient once instead of zero-filling the whole input and scattering into it.

   2. BatchNorm in training mode followed by GELU, in bf16, forward and backward, in two passes over the tensor each
      way instead of torch's five and eight. Each step rounds to bf16 where torch's separate kernels do (the
      normalized values, GELU's output, GELU's gradient, the input's gradient). GELU and its derivative are read
      from tables indexed by the bf16 bits of their input, which the caller fills with torch's own results, so they
      are torch's values; the batch statistics are summed in double, in another order than torch's. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 256

typedef void (*Part)(const void *job, long start, long end, int thread);

typedef struct { Part part; const void *job; long start, end; int thread; } Share;

static void *run_share(void *arg) {
    const Share *s = arg;
    s->part(s->job, s->start, s->end, s->thread);
    return 0;
}

/* part(job, start, end, thread) over rows [0, rows) split in `threads` contiguous shares; returns the threads used. */
static int parallel(Part part, const void *job, long rows, int threads) {
    pthread_t ids[MAX_THREADS];
    Share shares[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > rows) threads = (int)rows;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    for (int i = 0; i < threads; i++) {
        shares[i] = (Share){part, job, rows * i / threads, rows * (i + 1) / threads, i};
        started[i] = i > 0 && pthread_create(&ids[i], 0, run_share, &shares[i]) == 0;
        if (i > 0 && !started[i]) run_share(&shares[i]);  /* no thread to be had: this one does the share */
    }
    run_share(&shares[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(ids[i], 0);
    return threads;
}

static inline float bf16_value(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bf16 conversion (a NaN becomes the quiet NaN). */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? 0x7FC0u : rounded;
}

/* ---- 1. the 2x2 max-pool ---- */

typedef struct {
    const void *x; void *y; uint8_t *place; const void *grad; void *grad_input;
    long h, w, c;
} Pool;

/* `at`: the place (0-3) of the winner among a window's values a, b, d, e, in row-major order. */
#define WINNER(a, b, d, e, at)                                                   \
    do {                                                                         \
        float m = (a); int t;                                                    \
        (at) = 0;                                                                \
        t = ((b) > m) | ((b) != (b)); m = t ? (b) : m; (at) = t ? 1 : (at);      \
        t = ((d) > m) | ((d) != (d)); m = t ? (d) : m; (at) = t ? 2 : (at);      \
        t = ((e) > m) | ((e) != (e)); (at) = t ? 3 : (at);                       \
    } while (0)

static void window_bf16(const uint16_t *restrict p00, const uint16_t *restrict p01, const uint16_t *restrict p10,
                        const uint16_t *restrict p11, uint16_t *restrict y, uint8_t *restrict place, long c) {
    for (long k = 0; k < c; k++) {
        uint8_t at;
        WINNER(bf16_value(p00[k]), bf16_value(p01[k]), bf16_value(p10[k]), bf16_value(p11[k]), at);
        y[k] = at == 0 ? p00[k] : at == 1 ? p01[k] : at == 2 ? p10[k] : p11[k];
        place[k] = at;
    }
}

static void window_f32(const float *restrict p00, const float *restrict p01, const float *restrict p10,
                       const float *restrict p11, float *restrict y, uint8_t *restrict place, long c) {
    for (long k = 0; k < c; k++) {
        uint8_t at;
        WINNER(p00[k], p01[k], p10[k], p11[k], at);
        y[k] = at == 0 ? p00[k] : at == 1 ? p01[k] : at == 2 ? p10[k] : p11[k];
        place[k] = at;
    }
}

/* torch's backward adds each gradient to a zero: -0 becomes +0. */
static void scatter_bf16(const uint16_t *restrict g, const uint8_t *restrict place, uint16_t *restrict p00,
                         uint16_t *restrict p01, uint16_t *restrict p10, uint16_t *restrict p11, long c) {
    for (long k = 0; k < c; k++) {
        uint16_t v = g[k] == 0x8000 ? 0 : g[k];
        uint8_t at = place[k];
        p00[k] = at == 0 ? v : 0; p01[k] = at == 1 ? v : 0; p10[k] = at == 2 ? v : 0; p11[k] = at == 3 ? v : 0;
    }
}

static void scatter_f32(const float *restrict g, const uint8_t *restrict place, float *restrict p00,
                        float *restrict p01, float *restrict p10, float *restrict p11, long c) {
    for (long k = 0; k < c; k++) {
        float v = g[k] + 0.0f;
        uint8_t at = place[k];
        p00[k] = at == 0 ? v : 0.0f; p01[k] = at == 1 ? v : 0.0f;
        p10[k] = at == 2 ? v : 0.0f; p11[k] = at == 3 ? v : 0.0f;
    }
}

/* One forward and one backward per element type T; SUFFIX names the helpers. Rows are images. */
#define POOL_PARTS(T, SUFFIX)                                                                               \
    static void pool_forward_##SUFFIX(const void *job, long start, long end, int thread) {                 \
        const Pool *j = job; long h = j->h, w = j->w, c = j->c, oh = h / 2, ow = w / 2;                    \
        (void)thread;                                                                                      \
        for (long n = start; n < end; n++)                                                                 \
            for (long r = 0; r < oh; r++)                                                                  \
                for (long q = 0; q < ow; q++) {                                                            \
                    const T *p00 = (const T *)j->x + ((n * h + 2 * r) * w + 2 * q) * c;                    \
                    long o = ((n * oh + r) * ow + q) * c;                                                  \
                    window_##SUFFIX(p00, p00 + c, p00 + w * c, p00 + w * c + c, (T *)j->y + o,             \
                                    j->place + o, c);                                                      \
                }                                                                                          \
    }                                                                                                      \
    static void pool_backward_##SUFFIX(const void *job, long start, long end, int thread) {                \
        const Pool *j = job; long h = j->h, w = j->w, c = j->c, oh = h / 2, ow = w / 2;                    \
        (void)thread;                                                                                      \
        for (long n = start; n < end; n++) {                                                               \
            T *image = (T *)j->grad_input + n * h * w * c;                                                 \
            for (long r = 0; r < oh; r++) {                                                                \
                for (long q = 0; q < ow; q++) {                                                            \
                    T *p00 = image + (2 * r * w + 2 * q) * c;                                              \
                    long o = ((n * oh + r) * ow + q) * c;                                                  \
                    scatter_##SUFFIX((const T *)j->grad + o, j->place + o, p00, p00 + c, p00 + w * c,      \
                                     p00 + w * c + c, c);                                                  \
                }                                                                                          \
                if (w % 2) {                                                                               \
                    memset(image + (2 * r * w + w - 1) * c, 0, c * sizeof(T));                             \
                    memset(image + ((2 * r + 1) * w + w - 1) * c, 0, c * sizeof(T));                       \
                }                                                                                          \
            }                                                                                              \
            if (h % 2) memset(image + (h - 1) * w * c, 0, w * c * sizeof(T));                              \
        }                                                                                                  \
    }

POOL_PARTS(uint16_t, bf16)
POOL_PARTS(float, f32)

/* x: n x h x w x c; y and place: n x (h/2) x (w/2) x c. element_bytes: 2 (bf16) or 4 (fp32). */
void max_pool_2x2_forward(const void *x, void *y, uint8_t *place, long n, long h, long w, long c,
                          int element_bytes, int threads) {
    Pool job = {x, y, place, 0, 0, h, w, c};
    parallel(element_bytes == 2 ? pool_forward_bf16 : pool_forward_f32, &job, n, threads);
}

/* grad and place: n x (h/2) x (w/2) x c; grad_input: n x h x w x c, every element written. */
void max_pool_2x2_backward(const void *grad, const uint8_t *place, void *grad_input, long n, long h, long w, long c,
                           int element_bytes, int threads) {
    Pool job = {0, 0, (uint8_t *)place, grad, grad_input, h, w, c};
    parallel(element_bytes == 2 ? pool_backward_bf16 : pool_backward_f32, &job, n, threads);
}

/* ---- 2. BatchNorm (training) then GELU, bf16 ---- */

/* Rows are pixels (n * h * w of them), each of c channels. Per channel: alpha = invstd * weight and
   beta = bias - mean * alpha make the normalized value x * alpha + beta. */
typedef struct {
    const uint16_t *x; const uint16_t *grad; uint16_t *out;
    const float *alpha, *beta, *mean, *k, *grad_mean;
    const uint32_t *gelu; const float *gelu_derivative;  /* by bf16 bits: GELU's bf16 value as fp32 bits */
    double *sums;  /* threads x 2c: a thread's two sums per channel */
    float *blocks;  /* threads x 2c: the same over its current block of rows */
    long c;
} NormAct;

/* Sums in fp32 over blocks of this many rows (vector-wide and cheap), added up across blocks in double. */
#define BLOCK_ROWS 64

static void add_block(double *restrict total, const float *restrict block, long count) {
    for (long k = 0; k < count; k++) total[k] += block[k];
}

static void sum_part(const void *job, long start, long end, int thread) {
    const NormAct *j = job; long c = j->c;
    double *total = j->sums + thread * 2 * c;
    float *block = j->blocks + thread * 2 * c;
    for (long k = 0; k < 2 * c; k++) total[k] = 0.0;
    for (long first = start; first < end; first += BLOCK_ROWS) {
        float *restrict sum = block, *restrict squares = block + c;
        for (long k = 0; k < 2 * c; k++) block[k] = 0.0f;
        long last = first + BLOCK_ROWS < end ? first + BLOCK_ROWS : end;
        for (long r = first; r < last; r++) {
            const uint16_t *restrict x = j->x + r * c;
            for (long k = 0; k < c; k++) {
                float v = bf16_value(x[k]);
                sum[k] += v; squares[k] += v * v;
            }
        }
        add_block(total, block, 2 * c);
    }
}

static void forward_part(const void *job, long start, long end, int thread) {
    const NormAct *j = job; long c = j->c;
    const float *restrict alpha = j->alpha, *restrict beta = j->beta;
    const uint32_t *restrict gelu = j->gelu;
    (void)thread;
    for (long r = start; r < end; r++) {
        const uint16_t *restrict x = j->x + r * c;
        uint16_t *restrict y = j->out + r * c;
        for (long k = 0; k < c; k++) y[k] = (uint16_t)(gelu[bf16_bits(bf16_value(x[k]) * alpha[k] + beta[k])] >> 16);
    }
}

/* GELU's gradient, rounded to bf16 as torch's gelu_backward leaves it, into out; the two sums of BatchNorm's
   backward per channel: of that gradient, and of it times (x - mean). */
static void backward_sum_part(const void *job, long start, long end, int thread) {
    const NormAct *j = job; long c = j->c;
    const float *restrict alpha = j->alpha, *restrict beta = j->beta, *restrict mean = j->mean;
    const float *restrict derivative = j->gelu_derivative;
    double *total = j->sums + thread * 2 * c;
    float *block = j->blocks + thread * 2 * c;
    for (long k = 0; k < 2 * c; k++) total[k] = 0.0;
    for (long first = start; first < end; first += BLOCK_ROWS) {
        float *restrict sum = block, *restrict dot = block + c;
        for (long k = 0; k < 2 * c; k++) block[k] = 0.0f;
        long last = first + BLOCK_ROWS < end ? first + BLOCK_ROWS : end;
        for (long r = first; r < last; r++) {
            const uint16_t *restrict x = j->x + r * c, *restrict grad = j->grad + r * c;
            uint16_t *restrict out = j->out + r * c;
            for (long k = 0; k < c; k++)
                out[k] = (uint16_t)bf16_bits(bf16_value(grad[k])
                                             * derivative[bf16_bits(bf16_value(x[k]) * alpha[k] + beta[k])]);
            for (long k = 0; k < c; k++) {  /* a second loop over the row, still in cache: each vectorizes */
                float g = bf16_value(out[k]);
                sum[k] += g; dot[k] += g * (bf16_value(x[k]) - mean[k]);
            }
        }
        add_block(total, block, 2 * c);
    }
}

/* BatchNorm's input gradient from GELU's (in out, overwritten): (g - grad_mean - (x - mean) * k) * alpha. */
static void backward_apply_part(const void *job, long start, long end, int thread) {
    const NormAct *j = job; long c = j->c;
    const float *restrict alpha = j->alpha, *restrict mean = j->mean, *restrict kk = j->k;
    const float *restrict grad_mean = j->grad_mean;
    (void)thread;
    for (long r = start; r < end; r++) {
        const uint16_t *restrict x = j->x + r * c;
        uint16_t *restrict out = j->out + r * c;
        for (long k = 0; k < c; k++)
            out[k] = (uint16_t)bf16_bits((bf16_value(out[k]) - grad_mean[k] - (bf16_value(x[k]) - mean[k]) * kk[k]) * alpha[k]);
    }
}

/* Adds the threads' sums up into result (2c doubles). */
static void add_sums(const double *sums, int threads, long c, double *result) {
    for (long k = 0; k < 2 * c; k++) {
        double total = 0.0;
        for (int t = 0; t < threads; t++) total += sums[t * 2 * c + k];
        result[k] = total;
    }
}

/* sums (2c): each channel's sum of x, then its sum of squares. Returns 0, or -1 without memory. */
int norm_act_statistics(const uint16_t *x, long rows, long c, int threads, double *sums) {
    double *scratch = malloc((sizeof(double) + sizeof(float)) * 2 * c * MAX_THREADS);
    if (!scratch) return -1;
    NormAct job = {.x = x, .sums = scratch, .blocks = (float *)(scratch + 2 * c * MAX_THREADS), .c = c};
    add_sums(scratch, parallel(sum_part, &job, rows, threads), c, sums);
    free(scratch);
    return 0;
}

void norm_act_forward(const uint16_t *x, const float *alpha, const float *beta, const uint32_t *gelu, uint16_t *y,
                      long rows, long c, int threads) {
    NormAct job = {.x = x, .out = y, .alpha = alpha, .beta = beta, .gelu = gelu, .c = c};
    parallel(forward_part, &job, rows, threads);
}

/* grad_input gets GELU's gradient; sums (2c): its sum per channel, then its sum times (x - mean). */
int norm_act_backward_sums(const uint16_t *x, const uint16_t *grad, const float *alpha, const float *beta,
                           const float *mean, const float *gelu_derivative, uint16_t *grad_input, long rows, long c,
                           int threads, double *sums) {
    double *scratch = malloc((sizeof(double) + sizeof(float)) * 2 * c * MAX_THREADS);
    if (!scratch) return -1;
    NormAct job = {.x = x, .grad = grad, .out = grad_input, .alpha = alpha, .beta = beta, .mean = mean,
                   .gelu_derivative = gelu_derivative, .sums = scratch,
                   .blocks = (float *)(scratch + 2 * c * MAX_THREADS), .c = c};
    add_sums(scratch, parallel(backward_sum_part, &job, rows, threads), c, sums);
    free(scratch);
    return 0;
}

void norm_act_backward_apply(const uint16_t *x, const float *alpha, const float *mean, const float *k,
                             const float *grad_mean, uint16_t *grad_input, long rows, long c, int threads) {
    NormAct job = {.x = x, .out = grad_input, .alpha = alpha, .mean = mean, .k = k, .grad_mean = grad_mean, .c = c};
    parallel(backward_apply_part, &job, rows, threads);
}
