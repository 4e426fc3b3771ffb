/* A 2x2 max-pool of stride 2 (floor rounding) on channels-last tensors, forward and backward, in bf16 and fp32.

   It computes what torch's max_pool2d and its backward compute, bit for bit: the first largest value of each window
   in row-major order wins (a NaN wins over any number, a later NaN over an earlier one, and comes out with its own
   bits, where torch's bf16 kernel may set others), and its position gets the gradient; the others, and an odd last
   row or column, get +0. It is faster because it keeps one byte per output
   for the winner's place in its window, not an int64 index, and writes every gradient once instead of zero-filling
   the whole input and scattering into it. The inner loops run over the channels, contiguous in memory, and the
   compiler vectorizes them. Each call splits the batch between `threads` threads.

   Built and loaded by cifarkit.core.native; called by cifarkit.models.pooling. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const void *x; void *y; uint8_t *place; const void *grad; void *grad_input;
    long n0, n1, h, w, c;
} Job;

static inline float bf16_value(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* `at`: the place (0-3) of the winner among a window's values a, b, d, e, in row-major order. */
#define WINNER(a, b, d, e, at)                                                          \
    do {                                                                                \
        float m = (a); int t;                                                           \
        (at) = 0;                                                                       \
        t = ((b) > m) | ((b) != (b)); m = t ? (b) : m; (at) = t ? 1 : (at);             \
        t = ((d) > m) | ((d) != (d)); m = t ? (d) : m; (at) = t ? 2 : (at);             \
        t = ((e) > m) | ((e) != (e)); (at) = t ? 3 : (at);                              \
    } while (0)

/* Per element type: its value as a float, and the gradient torch's backward leaves (it adds each gradient to a
   zero, which makes -0 a +0). */
static inline float value_bf16(uint16_t v) { return bf16_value(v); }
static inline float value_f32(float v) { return v; }
static inline uint16_t plus_zero_bf16(uint16_t g) { return g == 0x8000 ? 0 : g; }
static inline float plus_zero_f32(float g) { return g + 0.0f; }

/* A window's row of channels, and its gradient, for one element type: T the element, SUFFIX the helpers' suffix. */
#define ROWS(T, SUFFIX)                                                                                   \
    static void window_##SUFFIX(const T *restrict p00, const T *restrict p01, const T *restrict p10,     \
                                const T *restrict p11, T *restrict y, uint8_t *restrict place, long c) { \
        for (long k = 0; k < c; k++) {                                                                   \
            uint8_t at;                                                                                  \
            WINNER(value_##SUFFIX(p00[k]), value_##SUFFIX(p01[k]), value_##SUFFIX(p10[k]),               \
                   value_##SUFFIX(p11[k]), at);                                                          \
            y[k] = at == 0 ? p00[k] : at == 1 ? p01[k] : at == 2 ? p10[k] : p11[k];                      \
            place[k] = at;                                                                               \
        }                                                                                                \
    }                                                                                                    \
    static void scatter_##SUFFIX(const T *restrict g, const uint8_t *restrict place, T *restrict p00,    \
                                 T *restrict p01, T *restrict p10, T *restrict p11, long c) {            \
        for (long k = 0; k < c; k++) {                                                                   \
            T v = plus_zero_##SUFFIX(g[k]);                                                              \
            uint8_t at = place[k];                                                                       \
            p00[k] = at == 0 ? v : 0; p01[k] = at == 1 ? v : 0;                                          \
            p10[k] = at == 2 ? v : 0; p11[k] = at == 3 ? v : 0;                                          \
        }                                                                                                \
    }

/* One body per element type: T the element, SUFFIX the helpers' suffix. */
#define PARTS(T, SUFFIX)                                                                                  \
    ROWS(T, SUFFIX)                                                                                       \
    static void *forward_##SUFFIX(void *arg) {                                                            \
        const Job *j = arg; long h = j->h, w = j->w, c = j->c, oh = h / 2, ow = w / 2;                   \
        for (long n = j->n0; n < j->n1; n++)                                                             \
            for (long r = 0; r < oh; r++)                                                                \
                for (long q = 0; q < ow; q++) {                                                          \
                    const T *p00 = (const T *)j->x + ((n * h + 2 * r) * w + 2 * q) * c;                  \
                    long o = ((n * oh + r) * ow + q) * c;                                                \
                    window_##SUFFIX(p00, p00 + c, p00 + w * c, p00 + w * c + c, (T *)j->y + o,           \
                                    j->place + o, c);                                                    \
                }                                                                                        \
        return 0;                                                                                        \
    }                                                                                                    \
    static void *backward_##SUFFIX(void *arg) {                                                           \
        const Job *j = arg; long h = j->h, w = j->w, c = j->c, oh = h / 2, ow = w / 2;                   \
        for (long n = j->n0; n < j->n1; n++) {                                                           \
            T *image = (T *)j->grad_input + n * h * w * c;                                               \
            for (long r = 0; r < oh; r++) {                                                              \
                for (long q = 0; q < ow; q++) {                                                          \
                    T *p00 = image + (2 * r * w + 2 * q) * c;                                            \
                    long o = ((n * oh + r) * ow + q) * c;                                                \
                    scatter_##SUFFIX((const T *)j->grad + o, j->place + o, p00, p00 + c, p00 + w * c,    \
                                     p00 + w * c + c, c);                                                \
                }                                                                                        \
                if (w % 2) {                                                                             \
                    memset(image + (2 * r * w + w - 1) * c, 0, c * sizeof(T));                           \
                    memset(image + ((2 * r + 1) * w + w - 1) * c, 0, c * sizeof(T));                     \
                }                                                                                        \
            }                                                                                            \
            if (h % 2) memset(image + (h - 1) * w * c, 0, w * c * sizeof(T));                            \
        }                                                                                                \
        return 0;                                                                                        \
    }

PARTS(uint16_t, bf16)
PARTS(float, f32)

#define MAX_THREADS 256

static void run(void *(*part)(void *), Job job, long n, int threads) {
    pthread_t ids[MAX_THREADS];
    Job jobs[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > n) threads = (int)n;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    for (int i = 0; i < threads; i++) {
        jobs[i] = job;
        jobs[i].n0 = n * i / threads;
        jobs[i].n1 = n * (i + 1) / threads;
        started[i] = i > 0 && pthread_create(&ids[i], 0, part, &jobs[i]) == 0;
        if (i > 0 && !started[i]) part(&jobs[i]);  /* no thread to be had: this one does the share */
    }
    part(&jobs[0]);
    for (int i = 1; i < threads; i++)
        if (started[i]) pthread_join(ids[i], 0);
}

/* x: n x h x w x c; y and place: n x (h/2) x (w/2) x c. element_bytes: 2 (bf16) or 4 (fp32). */
void max_pool_2x2_forward(const void *x, void *y, uint8_t *place, long n, long h, long w, long c,
                          int element_bytes, int threads) {
    Job job = {x, y, place, 0, 0, 0, 0, h, w, c};
    run(element_bytes == 2 ? forward_bf16 : forward_f32, job, n, threads);
}

/* grad and place: n x (h/2) x (w/2) x c; grad_input: n x h x w x c, every element written. */
void max_pool_2x2_backward(const void *grad, const uint8_t *place, void *grad_input, long n, long h, long w, long c,
                           int element_bytes, int threads) {
    Job job = {0, 0, (uint8_t *)place, grad, grad_input, 0, 0, h, w, c};
    run(element_bytes == 2 ? backward_bf16 : backward_f32, job, n, threads);
}
