/*
 * The numbers of streamload.randomness.place_generator and ImageDecoder's crop geometry, in C
 * (numpy's SeedSequence, Philox-4x64-10, uniform/integers/random; see _draws.c). A header of
 * static functions: included by the _draws module and by the JPEG batch kernel, which draws a
 * batch's boxes inside its one GIL-free call. Compile with -ffp-contract=off.
 */
#ifndef STREAMLOAD_DRAWS_CORE_H
#define STREAMLOAD_DRAWS_CORE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* -- numpy's SeedSequence (numpy/random/bit_generator.pyx) ---------------------------- */

#define POOL 4
#define INIT_A 0x43b0d7e5u
#define MULT_A 0x931e8875u
#define INIT_B 0x8b51f9ddu
#define MULT_B 0x58f38dedu
#define MIX_MULT_L 0xca01f9ddu
#define MIX_MULT_R 0x4973f715u
#define XSHIFT 16

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= MULT_A;
    value *= *hash_const;
    value ^= value >> XSHIFT;
    return value;
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t result = MIX_MULT_L * x - MIX_MULT_R * y;
    result ^= result >> XSHIFT;
    return result;
}

/* The Philox key a SeedSequence of `entropy` gives: generate_state(2, uint64). */
static void seed_key(const uint32_t *entropy, int n, uint64_t key[2]) {
    uint32_t pool[POOL];
    uint32_t hash_const = INIT_A;
    for (int i = 0; i < POOL; i++) pool[i] = hashmix(i < n ? entropy[i] : 0, &hash_const);
    for (int src = 0; src < POOL; src++)
        for (int dst = 0; dst < POOL; dst++)
            if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
    for (int src = POOL; src < n; src++)
        for (int dst = 0; dst < POOL; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src], &hash_const));
    uint32_t words[4];
    uint32_t hc = INIT_B;
    for (int i = 0; i < 4; i++) {
        uint32_t v = pool[i % POOL];
        v ^= hc;
        hc *= MULT_B;
        v *= hc;
        v ^= v >> XSHIFT;
        words[i] = v;
    }
    key[0] = (uint64_t)words[0] | ((uint64_t)words[1] << 32);
    key[1] = (uint64_t)words[2] | ((uint64_t)words[3] << 32);
}

/* A non-negative integer as numpy's _int_to_uint32_array: 0 is one word 0, else its 32-bit
 * words from the lowest while any are left. Returns the words written. */
static int int_words(uint64_t value, uint32_t *out) {
    if (value == 0) {
        out[0] = 0;
        return 1;
    }
    int n = 0;
    while (value) {
        out[n++] = (uint32_t)value;
        value >>= 32;
    }
    return n;
}

/* -- Philox-4x64-10, as numpy's philox.h buffers it ------------------------------------ */

typedef struct {
    uint64_t ctr[4], key[2], buffer[4];
    int buffer_pos, has_uint32;
    uint32_t uinteger;
} philox;

static void mulhilo(uint64_t a, uint64_t b, uint64_t *hi, uint64_t *lo) {
    unsigned __int128 p = (unsigned __int128)a * b;
    *hi = (uint64_t)(p >> 64);
    *lo = (uint64_t)p;
}

static void philox_block(const uint64_t in[4], const uint64_t key_in[2], uint64_t out[4]) {
    uint64_t c[4] = {in[0], in[1], in[2], in[3]};
    uint64_t k0 = key_in[0], k1 = key_in[1];
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += 0x9E3779B97F4A7C15ull;
            k1 += 0xBB67AE8584CAA73Bull;
        }
        uint64_t hi0, lo0, hi1, lo1;
        mulhilo(0xD2E7470EE14C6C93ull, c[0], &hi0, &lo0);
        mulhilo(0xCA5A826395121157ull, c[2], &hi1, &lo1);
        uint64_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
    memcpy(out, c, sizeof c);
}

static void philox_init(philox *p, const uint64_t key[2]) {
    memset(p, 0, sizeof *p);
    p->key[0] = key[0];
    p->key[1] = key[1];
    p->buffer_pos = 4;
}

static uint64_t next64(philox *p) {
    if (p->buffer_pos < 4) return p->buffer[p->buffer_pos++];
    if (++p->ctr[0] == 0 && ++p->ctr[1] == 0 && ++p->ctr[2] == 0) ++p->ctr[3];
    philox_block(p->ctr, p->key, p->buffer);
    p->buffer_pos = 1;
    return p->buffer[0];
}

static uint32_t next32(philox *p) {
    if (p->has_uint32) {
        p->has_uint32 = 0;
        return p->uinteger;
    }
    uint64_t next = next64(p);
    p->has_uint32 = 1;
    p->uinteger = (uint32_t)(next >> 32);
    return (uint32_t)next;
}

static double next_double(philox *p) { return (double)(next64(p) >> 11) * (1.0 / 9007199254740992.0); }

/* Generator.uniform(low, high) */
static double uniform(philox *p, double low, double high) { return low + (high - low) * next_double(p); }

/* Generator.integers(0, span) for 1 <= span <= 2**32 (int64 result): Lemire's method on 32-bit draws. */
static int64_t integers(philox *p, uint64_t span) {
    uint64_t rng = span - 1;
    if (rng == 0) return 0;
    if (rng == 0xFFFFFFFFull) return next32(p);
    uint32_t excl = (uint32_t)rng + 1;
    uint64_t m = (uint64_t)next32(p) * excl;
    uint32_t leftover = (uint32_t)m;
    if (leftover < excl) {
        uint32_t threshold = (UINT32_MAX - (uint32_t)rng) % excl;
        while (leftover < threshold) {
            m = (uint64_t)next32(p) * excl;
            leftover = (uint32_t)m;
        }
    }
    return (int64_t)(m >> 32);
}

/* Python's round(x) of a double: halves to even (nearbyint in the default rounding mode). */
static double round_even(double x) { return nearbyint(x); }

/* -- ImageDecoder's geometry ------------------------------------------------------------ */

typedef struct {
    int random_crop, flip, dct_scaling, out_w, out_h;
    double scale_lo, scale_hi, ratio_lo, ratio_hi, resize;
} geometry;

/* ImageDecoder._random_box */
static void random_box(philox *p, const geometry *g, int64_t width, int64_t height, double box[4]) {
    double area = (double)(width * height);
    for (int attempt = 0; attempt < 10; attempt++) {
        double target = area * uniform(p, g->scale_lo, g->scale_hi);
        double aspect = exp(uniform(p, g->ratio_lo, g->ratio_hi));
        double w = round_even(sqrt(target * aspect));
        double h = round_even(sqrt(target / aspect));
        if (0 < w && w <= (double)width && 0 < h && h <= (double)height) {
            int64_t left = integers(p, (uint64_t)(width - (int64_t)w + 1));
            int64_t top = integers(p, (uint64_t)(height - (int64_t)h + 1));
            box[0] = (double)left;
            box[1] = (double)top;
            box[2] = (double)left + w;
            box[3] = (double)top + h;
            return;
        }
    }
    double in_ratio = (double)width / (double)height;
    double lo = exp(g->ratio_lo), hi = exp(g->ratio_hi);
    int64_t w = width, h = height;
    if (in_ratio < lo)
        h = (int64_t)round_even((double)width / lo);
    else if (in_ratio > hi)
        w = (int64_t)round_even((double)height * hi);
    int64_t left = (width - w) / 2, top = (height - h) / 2; /* non-negative: Python's // alike */
    box[0] = (double)left;
    box[1] = (double)top;
    box[2] = (double)(left + w);
    box[3] = (double)(top + h);
}

static int64_t floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
    return q;
}

/* ImageDecoder.box for crop="center" */
static void center_box(const geometry *g, int64_t width, int64_t height, double box[4]) {
    int64_t shorter = width < height ? width : height;
    double rw = round_even((double)width * g->resize / (double)shorter);
    double rh = round_even((double)height * g->resize / (double)shorter);
    if (rw < g->out_w) rw = g->out_w;
    if (rh < g->out_h) rh = g->out_h;
    double sx = rw / (double)width, sy = rh / (double)height;
    int64_t left = floordiv((int64_t)rw - g->out_w, 2), top = floordiv((int64_t)rh - g->out_h, 2);
    box[0] = (double)left / sx;
    box[1] = (double)top / sy;
    box[2] = (double)(left + g->out_w) / sx;
    box[3] = (double)(top + g->out_h) / sy;
}

/* ImageDecoder._reduction */
static int reduction(const geometry *g, const double box[4]) {
    if (!g->dct_scaling) return 1;
    double rx = (box[2] - box[0]) / g->out_w, ry = (box[3] - box[1]) / g->out_h;
    double room = rx < ry ? rx : ry;
    int factor = 1;
    while (factor < 8 && room >= 2 * factor) factor *= 2;
    return factor;
}

/* streamload.decode.native._box_scale */
static int box_scale(int64_t width, int factor) {
    int64_t decoded = -floordiv(-width, factor);
    double r = round_even(log2((double)width / (double)decoded));
    return r > 0 ? 1 << (int)r : 1;
}

/* Every sample's crop box and flip for the kernel (see crops() in _draws.c): taken[i] = 0 for a
 * sample of kind 0 or over max_pixels (negative: no limit), else its boxes, full box and
 * (reduction, flip). Returns NULL, or what is wrong with the input. No Python, no GIL needed. */
static const char *draw_batch(const uint32_t *prefix, int nprefix, const int64_t *where, const int32_t *dims,
                              int64_t n, const geometry *g, long long max_pixels, float *boxes, double *full,
                              int32_t *params, uint8_t *taken) {
    uint32_t entropy[64 + 4];
    if (nprefix < 0 || nprefix > 60) return "prefix: uint32 words, at most 60, are needed";
    if (g->out_w < 1 || g->out_h < 1) return "the output size must be positive";
    memcpy(entropy, prefix, (size_t)nprefix * 4);
    for (int64_t i = 0; i < n; i++) {
        int64_t width = dims[3 * i], height = dims[3 * i + 1], kind = dims[3 * i + 2];
        taken[i] = 0;
        if (kind == 0) continue;
        if (width < 1 || height < 1) return "a taken image's width and height must be positive";
        if (max_pixels >= 0 && width * height > max_pixels) continue;
        if (where[2 * i] < 0 || where[2 * i + 1] < 0) return "epochs and positions must be non-negative";
        philox p;
        if (g->random_crop || g->flip) {
            int k = nprefix;
            k += int_words((uint64_t)where[2 * i], entropy + k);
            k += int_words((uint64_t)where[2 * i + 1], entropy + k);
            uint64_t key[2];
            seed_key(entropy, k, key);
            philox_init(&p, key);
        }
        double box[4];
        if (g->random_crop)
            random_box(&p, g, width, height, box);
        else
            center_box(g, width, height, box);
        int factor = reduction(g, box);
        int scale = box_scale(width, factor);
        for (int j = 0; j < 4; j++) {
            full[4 * i + j] = box[j];
            boxes[4 * i + j] = (float)(box[j] / scale);
        }
        params[2 * i] = factor;
        params[2 * i + 1] = g->flip && next_double(&p) < 0.5;
        taken[i] = 1;
    }
    return NULL;
}

#endif
