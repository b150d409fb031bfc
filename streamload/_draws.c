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

#include "_draws_core.h"

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
    const char *bad = draw_batch(prefix.buf, (int)(prefix.len / 4), where.buf, dims.buf, n, &g, max_pixels, boxes.buf,
                                 full.buf, params.buf, taken.buf);
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
