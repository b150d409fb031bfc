/*
 * streamload._draws: a batch's random crop boxes and flips in one call, the same draws as numpy.
 *
 * streamload.randomness.place_generator(epoch, position, seed) is
 *     numpy.random.Generator(numpy.random.Philox(numpy.random.SeedSequence(words)))
 * and ImageDecoder draws a sample's random-resized crop and flip from it (uniform, uniform,
 * integers, integers, random). Made in Python that costs ~20 us a sample, held under the GIL:
 * beside a training loop running Python, a batch of 64 keeps the loop from its GIL for over a
 * millisecond. Here the same numbers are made in C for a whole batch: numpy's SeedSequence
 * (its hash mixing, pool of 4 words), Philox-4x64-10 with numpy's buffering, its
 * next_double, its Lemire bounded integers, and the crop arithmetic of ImageDecoder.box,
 * _reduction and the kernel's box scale. The caller checks once per process that these
 * agree with numpy before using them (streamload.decode.native); the tests compare them on
 * thousands of keys and image sizes.
 *
 * Built with -ffp-contract=off: no fused multiply-add, so every double operation rounds as
 * Python's does; exp, log2 and sqrt are the C library's, which Python's math module calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

/* -- the module -------------------------------------------------------------------------- */

/* A C-contiguous buffer of `need` bytes whose items are `size` bytes of one of the type codes `codes`. */
static int get(PyObject *obj, Py_buffer *view, Py_ssize_t need, Py_ssize_t size, const char *codes, int writable,
               const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->len != need || view->itemsize != size || f[0] == 0 || f[1] != 0 || !strchr(codes, f[0])) {
        PyErr_Format(PyExc_ValueError, "%s: a C-contiguous buffer of %zd bytes, items of %zd bytes ('%s'), is needed",
                     what, need, size, codes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The item count of a buffer of `per` bytes an item (its length must be a multiple). */
static Py_ssize_t count(PyObject *obj, Py_ssize_t per, const char *what) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) != 0) return -1;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (len % per) {
        PyErr_Format(PyExc_ValueError, "%s: a multiple of %zd bytes is needed", what, per);
        return -1;
    }
    return len / per;
}

PyDoc_STRVAR(crops_doc,
             "crops(prefix, where, dims, geometry, max_pixels, boxes, full, params, taken)\n\n"
             "Every sample's crop box and flip, drawn as ImageDecoder draws them from\n"
             "place_generator(epoch, position, seed).\n\n"
             "prefix: uint32 SeedSequence words before the sample's (the domain and the seed's words);\n"
             "where: int64[n, 2] (epoch, position); dims: int32[n, 3] (width, height, kind) from the\n"
             "kernel's headers (kind 0: not for the kernel, nothing drawn); geometry: (random_crop, flip,\n"
             "dct_scaling, out_w, out_h, scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, resize);\n"
             "max_pixels: the largest width * height taken (negative: no limit). Out: boxes float32[n, 4]\n"
             "(the box on the reduced decode), full float64[n, 4] (the box on the full image), params\n"
             "int32[n, 2] (reduction, flip), taken uint8[n].");

static PyObject *crops(PyObject *self, PyObject *args) {
    PyObject *prefix_o, *where_o, *dims_o, *boxes_o, *full_o, *params_o, *taken_o;
    geometry g;
    long long max_pixels;
    if (!PyArg_ParseTuple(args, "OOO(pppiiddddd)LOOOO", &prefix_o, &where_o, &dims_o, &g.random_crop, &g.flip,
                          &g.dct_scaling, &g.out_w, &g.out_h, &g.scale_lo, &g.scale_hi, &g.ratio_lo, &g.ratio_hi,
                          &g.resize, &max_pixels, &boxes_o, &full_o, &params_o, &taken_o))
        return NULL;
    if (g.out_w < 1 || g.out_h < 1) {
        PyErr_SetString(PyExc_ValueError, "the output size must be positive");
        return NULL;
    }
    Py_buffer prefix, where, dims, boxes, full, params, taken;
    if (PyObject_GetBuffer(prefix_o, &prefix, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return NULL;
    if (prefix.itemsize != 4 || prefix.len / 4 > 60) {
        PyErr_SetString(PyExc_ValueError, "prefix: uint32 words, at most 60, are needed");
        PyBuffer_Release(&prefix);
        return NULL;
    }
    Py_ssize_t n = count(dims_o, 12, "dims");
    int ok = n >= 0 && get(dims_o, &dims, n * 12, 4, "il", 0, "dims") == 0;
    if (ok && get(where_o, &where, n * 16, 8, "lq", 0, "where") != 0) {
        PyBuffer_Release(&dims);
        ok = 0;
    }
    if (ok && get(boxes_o, &boxes, n * 16, 4, "f", 1, "boxes") != 0) {
        PyBuffer_Release(&dims), PyBuffer_Release(&where);
        ok = 0;
    }
    if (ok && get(full_o, &full, n * 32, 8, "d", 1, "full") != 0) {
        PyBuffer_Release(&dims), PyBuffer_Release(&where), PyBuffer_Release(&boxes);
        ok = 0;
    }
    if (ok && get(params_o, &params, n * 8, 4, "il", 1, "params") != 0) {
        PyBuffer_Release(&dims), PyBuffer_Release(&where), PyBuffer_Release(&boxes), PyBuffer_Release(&full);
        ok = 0;
    }
    if (ok && get(taken_o, &taken, n, 1, "B?", 1, "taken") != 0) {
        PyBuffer_Release(&dims), PyBuffer_Release(&where), PyBuffer_Release(&boxes), PyBuffer_Release(&full);
        PyBuffer_Release(&params);
        ok = 0;
    }
    if (!ok) {
        PyBuffer_Release(&prefix);
        return NULL;
    }
    const int32_t *d = dims.buf;
    const int64_t *w = where.buf;
    float *b = boxes.buf;
    double *fb = full.buf;
    int32_t *pr = params.buf;
    uint8_t *tk = taken.buf;
    int np = (int)(prefix.len / 4);
    uint32_t entropy[64 + 4];
    memcpy(entropy, prefix.buf, (size_t)np * 4);
    const char *bad = NULL;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t width = d[3 * i], height = d[3 * i + 1], kind = d[3 * i + 2];
        tk[i] = 0;
        if (kind == 0) continue;
        if (width < 1 || height < 1) {
            bad = "a taken image's width and height must be positive";
            break;
        }
        if (max_pixels >= 0 && width * height > max_pixels) continue;
        if (w[2 * i] < 0 || w[2 * i + 1] < 0) {
            bad = "epochs and positions must be non-negative";
            break;
        }
        philox p;
        int drawn = g.random_crop || g.flip;
        if (drawn) {
            int k = np;
            k += int_words((uint64_t)w[2 * i], entropy + k);
            k += int_words((uint64_t)w[2 * i + 1], entropy + k);
            uint64_t key[2];
            seed_key(entropy, k, key);
            philox_init(&p, key);
        }
        double box[4];
        if (g.random_crop)
            random_box(&p, &g, width, height, box);
        else
            center_box(&g, width, height, box);
        int factor = reduction(&g, box);
        int scale = box_scale(width, factor);
        for (int j = 0; j < 4; j++) {
            fb[4 * i + j] = box[j];
            b[4 * i + j] = (float)(box[j] / scale);
        }
        int flip = g.flip && next_double(&p) < 0.5;
        pr[2 * i] = factor;
        pr[2 * i + 1] = flip;
        tk[i] = 1;
    }
    PyBuffer_Release(&prefix), PyBuffer_Release(&dims), PyBuffer_Release(&where), PyBuffer_Release(&boxes);
    PyBuffer_Release(&full), PyBuffer_Release(&params), PyBuffer_Release(&taken);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(keys_doc,
             "keys(prefix, where, out)\n\n"
             "The Philox key (uint64[2]) of SeedSequence(prefix words + epoch + position) for each\n"
             "(epoch, position) of where (int64[n, 2]), into out (uint64[n, 2]).");

static PyObject *keys(PyObject *self, PyObject *args) {
    PyObject *prefix_o, *where_o, *out_o;
    if (!PyArg_ParseTuple(args, "OOO", &prefix_o, &where_o, &out_o)) return NULL;
    Py_buffer prefix, where, out;
    if (PyObject_GetBuffer(prefix_o, &prefix, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return NULL;
    if (prefix.itemsize != 4 || prefix.len / 4 > 60) {
        PyErr_SetString(PyExc_ValueError, "prefix: uint32 words, at most 60, are needed");
        PyBuffer_Release(&prefix);
        return NULL;
    }
    Py_ssize_t n = count(where_o, 16, "where");
    if (n < 0 || get(where_o, &where, n * 16, 8, "lq", 0, "where") != 0) {
        PyBuffer_Release(&prefix);
        return NULL;
    }
    if (get(out_o, &out, n * 16, 8, "LQ", 1, "out") != 0) {
        PyBuffer_Release(&prefix), PyBuffer_Release(&where);
        return NULL;
    }
    int np = (int)(prefix.len / 4);
    uint32_t entropy[64 + 4];
    memcpy(entropy, prefix.buf, (size_t)np * 4);
    const int64_t *w = where.buf;
    uint64_t *o = out.buf;
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (w[2 * i] < 0 || w[2 * i + 1] < 0) {
            bad = 1;
            break;
        }
        int k = np;
        k += int_words((uint64_t)w[2 * i], entropy + k);
        k += int_words((uint64_t)w[2 * i + 1], entropy + k);
        seed_key(entropy, k, o + 2 * i);
    }
    PyBuffer_Release(&prefix), PyBuffer_Release(&where), PyBuffer_Release(&out);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "epochs and positions must be non-negative");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"crops", crops, METH_VARARGS, crops_doc},
    {"keys", keys, METH_VARARGS, keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_draws", "A batch's crop boxes and flips, drawn as numpy draws them, in one call.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__draws(void) { return PyModule_Create(&module); }
