/*
 * streamload.decode._jpegbatch: decode a batch of JPEGs into one uint8 buffer, in one call
 * that releases the GIL once.
 *
 * The geometry (each sample's crop box, DCT reduction and flip) is ImageDecoder's: computed
 * in Python and handed to decode(), or drawn in C by a prepare()d job (../_draws_core.h, the
 * same numbers bit for bit) that also reads the headers and decodes, run without the GIL by
 * the batch's read (pread_gather's continuation, ../_then.h) or by Job.finish(). Either way:
 * libjpeg-turbo decode at 1/factor, Pillow's bilinear resample of the box (the same
 * coefficients and fixed-point arithmetic as Pillow's Resample.c, re-implemented), a
 * horizontal flip, and the write into the sample's HWC RGB slot.
 *
 * Safety: libjpeg errors and warnings longjmp back here (never exit()); every write is to
 * a buffer sized from libjpeg's own output dimensions or to the caller's checked slot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>

#include <jerror.h>
#include <jpeglib.h>

#include "../_draws_core.h"
#include "../_then.h"

#define PRECISION_BITS (32 - 8 - 2)

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int strict; /* a warning (corrupt or truncated data libjpeg would paper over) refuses the image */
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    error_mgr *err = (error_mgr *)cinfo->err;
    if (level < 0 && err->strict) {
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

/* Route libjpeg's errors and warnings of `cinfo` to `err` (the caller sets its jump with setjmp). */
static void use_errors(struct jpeg_decompress_struct *cinfo, error_mgr *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->strict = 0;
    err->message[0] = 0;
}

/* Growable scratch memory of one batch call (freed at its end). */
typedef struct {
    void *ptr;
    size_t size;
} block;

static void *grow(block *b, size_t size) {
    if (size > b->size) {
        void *p = realloc(b->ptr, size);
        if (p == NULL) return NULL;
        b->ptr = p;
        b->size = size;
    }
    return b->ptr;
}

typedef struct {
    block rows;    /* scanlines from libjpeg */
    block temp;    /* the horizontal pass's output (uint8, as Pillow's intermediate image) */
    block kk_h, kk_v, bounds_h, bounds_v;
    block acc;     /* one output row's sums */
    block vrow;    /* one row after the vertical pass */
} scratch;

static void scratch_free(scratch *s) {
    free(s->rows.ptr);
    free(s->temp.ptr);
    free(s->kk_h.ptr);
    free(s->kk_v.ptr);
    free(s->bounds_h.ptr);
    free(s->bounds_v.ptr);
    free(s->acc.ptr);
    free(s->vrow.ptr);
}

static double bilinear(double x) {
    if (x < 0.0) x = -x;
    if (x < 1.0) return 1.0 - x;
    return 0.0;
}

/*
 * Pillow's precompute_coeffs (bilinear, support 1) then normalize_coeffs_8bpc: the same
 * float box, the same double arithmetic and the same rounding, so the same int32 weights.
 * Returns ksize, or 0 when out of memory or the box is unusable.
 */
static int coefficients(int in_size, float in0, float in1, int out_size, block *kk_block, block *bounds_block,
                        int32_t **kk_out, int **bounds_out) {
    double scale, filterscale, support, center, ww, ss;
    int xx, x, ksize, xmin, xmax;
    double *pre;
    int32_t *kk;
    int *bounds;

    filterscale = scale = (double)(in1 - in0) / out_size;
    if (filterscale < 1.0) filterscale = 1.0;
    support = 1.0 * filterscale;
    if (!(support < 1e6)) return 0;
    ksize = (int)ceil(support) * 2 + 1;
    if ((size_t)out_size > SIZE_MAX / sizeof(double) / (size_t)ksize) return 0;
    pre = (double *)grow(kk_block, (size_t)out_size * ksize * sizeof(double));
    bounds = (int *)grow(bounds_block, (size_t)out_size * 2 * sizeof(int));
    if (pre == NULL || bounds == NULL) return 0;
    for (xx = 0; xx < out_size; xx++) {
        double *k = &pre[(size_t)xx * ksize];
        center = in0 + (xx + 0.5) * scale;
        ww = 0.0;
        ss = 1.0 / filterscale;
        xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax < 0) xmax = 0;
        if (xmax > ksize) xmax = ksize; /* cannot happen for a box inside the image; a guard */
        for (x = 0; x < xmax; x++) {
            double w = bilinear((x + xmin - center + 0.5) * ss);
            k[x] = w;
            ww += w;
        }
        for (x = 0; x < xmax; x++) {
            if (ww != 0.0) k[x] /= ww;
        }
        for (; x < ksize; x++) k[x] = 0;
        bounds[xx * 2 + 0] = xmin;
        bounds[xx * 2 + 1] = xmax;
    }
    /* normalize_coeffs_8bpc, in place (int32 written over the doubles, front to back) */
    kk = (int32_t *)pre;
    for (x = 0; x < out_size * ksize; x++) {
        double v = pre[x];
        kk[x] = v < 0 ? (int32_t)(-0.5 + v * (1 << PRECISION_BITS)) : (int32_t)(0.5 + v * (1 << PRECISION_BITS));
    }
    *kk_out = kk;
    *bounds_out = bounds;
    return ksize;
}

static inline uint8_t clip8(int32_t in) {
    if (in >= (1 << PRECISION_BITS << 8)) return 255;
    if (in <= 0) return 0;
    return (uint8_t)(in >> PRECISION_BITS);
}

/* Status of one sample. */
enum { OK = 0, REFUSED = 1, SKIPPED = 2 };

/* One row through the horizontal pass (Pillow's _8bpc arithmetic), mirrored when flip. */
static void horizontal(const uint8_t *src, uint8_t *dst, int width, const int32_t *kk, const int *bounds, int ksize,
                       int flip) {
    int xx;
    for (xx = 0; xx < width; xx++) {
        int xmin = bounds[xx * 2], xmax = bounds[xx * 2 + 1], x;
        const int32_t *k = &kk[(size_t)xx * ksize];
        const uint8_t *p = src + (size_t)xmin * 3;
        int32_t s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0;
        int o = flip ? width - 1 - xx : xx;
        for (x = 0; x < xmax; x++) {
            s0 += p[x * 3 + 0] * k[x];
            s1 += p[x * 3 + 1] * k[x];
            s2 += p[x * 3 + 2] * k[x];
        }
        dst[o * 3 + 0] = clip8(s0);
        dst[o * 3 + 1] = clip8(s1);
        dst[o * 3 + 2] = clip8(s2);
    }
}

/* A row copied, mirrored when flip. */
static void copy_row(const uint8_t *src, uint8_t *dst, int width, int flip) {
    int xx;
    if (!flip) {
        memcpy(dst, src, (size_t)width * 3);
        return;
    }
    for (xx = 0; xx < width; xx++) {
        dst[(width - 1 - xx) * 3 + 0] = src[xx * 3 + 0];
        dst[(width - 1 - xx) * 3 + 1] = src[xx * 3 + 1];
        dst[(width - 1 - xx) * 3 + 2] = src[xx * 3 + 2];
    }
}

/*
 * Decode one JPEG into out (height x width x 3, HWC RGB). box: the source box in the
 * decoded image's coordinates (Pillow's float box). vertical_first: Pillow 13's order of
 * the two passes (the vertical first when the height shrinks by more than twice the
 * width; before 13, always the horizontal first). Returns OK or REFUSED (message set).
 */
static int decode_one(struct jpeg_decompress_struct *cinfo, error_mgr *err, scratch *s, const unsigned char *data,
                      size_t size, int factor, const float box[4], int flip, int pillow13, uint8_t *out, int height,
                      int width) {
    int ksize_h = 0, ksize_v = 0, need_h, need_v, h_first, in_w, in_h, y_first, y_last, row_h, yy, temp_w, rows;
    int32_t *kk_h = NULL, *kk_v = NULL, *acc;
    int *bounds_h = NULL, *bounds_v = NULL;
    uint8_t *temp, *vrow;
    size_t row_bytes;
    JSAMPROW rowptr[16];

    if (setjmp(err->jump)) {
        jpeg_abort_decompress(cinfo);
        return REFUSED;
    }
    if (size > ULONG_MAX) {
        snprintf(err->message, sizeof err->message, "JPEG too large");
        return REFUSED;
    }
    err->strict = 1;
    jpeg_mem_src(cinfo, (const unsigned char *)data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
    if (cinfo->jpeg_color_space != JCS_YCbCr && cinfo->jpeg_color_space != JCS_GRAYSCALE &&
        cinfo->jpeg_color_space != JCS_RGB) {
        snprintf(err->message, sizeof err->message, "colour space %d is not decoded here", (int)cinfo->jpeg_color_space);
        jpeg_abort_decompress(cinfo);
        return REFUSED;
    }
    cinfo->out_color_space = JCS_EXT_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)factor;
    cinfo->dct_method = JDCT_ISLOW;
    cinfo->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(cinfo);
    in_w = (int)cinfo->output_width;
    in_h = (int)cinfo->output_height;
    if (cinfo->output_components != 3 || in_w < 1 || in_h < 1 || cinfo->rec_outbuf_height > 16 ||
        !(box[0] >= 0 && box[1] >= 0 && box[2] <= in_w && box[3] <= in_h && box[0] < box[2] && box[1] < box[3])) {
        snprintf(err->message, sizeof err->message, "box (%g, %g, %g, %g) outside the %dx%d decode", box[0], box[1],
                 box[2], box[3], in_w, in_h);
        jpeg_abort_decompress(cinfo);
        return REFUSED;
    }
    /* Pillow's ImagingResampleInner: which passes, in which order, and which source rows */
    need_h = width != in_w || box[0] != 0 || box[2] != width;
    need_v = height != in_h || box[1] != 0 || box[3] != height;
    h_first = !(pillow13 && (in_h - height) > 0 && (in_h - height) > (in_w - width) * 2);
    ksize_v = coefficients(in_h, box[1], box[3], height, &s->kk_v, &s->bounds_v, &kk_v, &bounds_v);
    if (need_h) ksize_h = coefficients(in_w, box[0], box[2], width, &s->kk_h, &s->bounds_h, &kk_h, &bounds_h);
    if (ksize_v == 0 || (need_h && ksize_h == 0)) {
        snprintf(err->message, sizeof err->message, "out of memory");
        jpeg_abort_decompress(cinfo);
        return REFUSED;
    }
    y_first = bounds_v[0];
    y_last = bounds_v[height * 2 - 2] + bounds_v[height * 2 - 1];
    if (y_last > in_h) y_last = in_h;
    if (y_first >= in_h) y_first = in_h - 1;
    if (y_last <= y_first) y_last = y_first + 1;
    rows = y_last - y_first;
    for (yy = 0; yy < height; yy++) { /* rows relative to y_first, kept inside the rows kept */
        bounds_v[yy * 2] -= y_first;
        if (bounds_v[yy * 2] < 0) bounds_v[yy * 2] = 0;
        if (bounds_v[yy * 2] > rows) bounds_v[yy * 2] = rows;
        if (bounds_v[yy * 2] + bounds_v[yy * 2 + 1] > rows) bounds_v[yy * 2 + 1] = rows - bounds_v[yy * 2];
    }
    /* temp: the rows y_first..y_last, through the horizontal pass when it comes first */
    temp_w = (need_h && h_first) ? width : in_w;
    row_bytes = (size_t)in_w * 3;
    row_h = cinfo->rec_outbuf_height;
    temp = (uint8_t *)grow(&s->temp, (size_t)rows * temp_w * 3);
    acc = (int32_t *)grow(&s->acc, (size_t)temp_w * 3 * sizeof(int32_t));
    vrow = (uint8_t *)grow(&s->vrow, (size_t)temp_w * 3);
    if (grow(&s->rows, row_bytes * row_h) == NULL || temp == NULL || acc == NULL || vrow == NULL) {
        snprintf(err->message, sizeof err->message, "out of memory");
        jpeg_abort_decompress(cinfo);
        return REFUSED;
    }
    for (yy = 0; yy < row_h; yy++) rowptr[yy] = (JSAMPROW)((uint8_t *)s->rows.ptr + row_bytes * yy);
    /* Rows above and below the box are skipped (still entropy-decoded: a damaged stream is
     * refused whatever the crop). */
    while (cinfo->output_scanline < cinfo->output_height) {
        int first = (int)cinfo->output_scanline, got, r;
        if (first < y_first) {
            jpeg_skip_scanlines(cinfo, (JDIMENSION)(y_first - first));
            continue;
        }
        if (first >= y_last) {
            jpeg_skip_scanlines(cinfo, cinfo->output_height - cinfo->output_scanline);
            break;
        }
        got = (int)jpeg_read_scanlines(cinfo, rowptr, (JDIMENSION)row_h);
        for (r = 0; r < got; r++) {
            int y = first + r;
            uint8_t *dst;
            if (y < y_first || y >= y_last) continue;
            dst = temp + (size_t)(y - y_first) * temp_w * 3;
            if (need_h && h_first)
                horizontal((const uint8_t *)rowptr[r], dst, width, kk_h, bounds_h, ksize_h, 0);
            else
                memcpy(dst, rowptr[r], row_bytes);
        }
        if (got == 0) break; /* suspended (cannot happen with a memory source); a guard */
    }
    jpeg_finish_decompress(cinfo);
    /* The vertical pass (rows accumulated whole: the same integer sums as Pillow's), then
     * the horizontal one when it comes second, the flip, and the write into the slot. */
    for (yy = 0; yy < height; yy++) {
        uint8_t *dst = out + (size_t)yy * width * 3;
        const uint8_t *src;
        if (need_v) {
            int ymin = bounds_v[yy * 2], ymax = bounds_v[yy * 2 + 1], y, i;
            const int n3 = temp_w * 3;
            const int32_t *k = &kk_v[(size_t)yy * ksize_v];
            for (i = 0; i < n3; i++) acc[i] = 1 << (PRECISION_BITS - 1);
            for (y = 0; y < ymax; y++) {
                const uint8_t *p = temp + (size_t)(ymin + y) * temp_w * 3;
                const int32_t w = k[y];
                for (i = 0; i < n3; i++) acc[i] += p[i] * w;
            }
            for (i = 0; i < n3; i++) vrow[i] = clip8(acc[i]);
            src = vrow;
        } else {
            src = temp + (size_t)(yy < rows ? yy : rows - 1) * temp_w * 3;
        }
        if (need_h && !h_first)
            horizontal(src, dst, width, kk_h, bounds_h, ksize_h, flip);
        else
            copy_row(src, dst, width, flip);
    }
    return OK;
}

/* Acquire each item's bytes (buffer protocol); an item without contiguous bytes gets len -1. */
static Py_buffer *get_buffers(PyObject *seq, Py_ssize_t n) {
    Py_buffer *views = (Py_buffer *)PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Py_buffer));
    Py_ssize_t i;
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (PyObject_GetBuffer(item, &views[i], PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            views[i].obj = NULL;
            views[i].buf = NULL;
            views[i].len = -1;
        }
    }
    return views;
}

static void release_buffers(Py_buffer *views, Py_ssize_t n) {
    Py_ssize_t i;
    for (i = 0; i < n; i++)
        if (views[i].obj != NULL) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

/* A writable (or readable) contiguous buffer of at least `need` bytes. */
static int get_array(PyObject *obj, Py_buffer *view, size_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    if ((size_t)view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zu needed", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The buffers of a batch's n samples, their status words and messages (freed by the caller, any
   of them NULL on failure); -1 with a Python error set when one could not be had. */
static int batch_scratch(PyObject *seq, Py_ssize_t n, Py_buffer **views, int **status,
                         char (**messages)[JMSG_LENGTH_MAX]) {
    *views = get_buffers(seq, n);
    *status = (int *)PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int));
    *messages = PyMem_Calloc((size_t)(n > 0 ? n : 1), JMSG_LENGTH_MAX);
    if (*views == NULL || *status == NULL || *messages == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *messages_list(Py_ssize_t n, const int *status, char (*messages)[JMSG_LENGTH_MAX]) {
    PyObject *out = PyList_New(n);
    Py_ssize_t i;
    if (out == NULL) return NULL;
    for (i = 0; i < n; i++) {
        PyObject *item;
        if (status[i] == REFUSED) {
            item = PyUnicode_DecodeUTF8(messages[i], (Py_ssize_t)strnlen(messages[i], JMSG_LENGTH_MAX), "replace");
            if (item == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        } else {
            item = Py_NewRef(Py_None);
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* One sample of a batch's decode into its slot: SKIPPED (reduction 0: not the kernel's), OK,
 * or REFUSED with why in `message`. What decode() and a prepared job both run a sample. */
static int decode_sample(struct jpeg_decompress_struct *cinfo, error_mgr *err, scratch *s, const unsigned char *p,
                         Py_ssize_t len, const int32_t params[2], const float box[4], int pillow13, uint8_t *slot,
                         int height, int width, char *message) {
    int factor = params[0], flip = params[1];
    if (factor == 0) return SKIPPED;
    err->message[0] = 0;
    if (len < 2 || (factor != 1 && factor != 2 && factor != 4 && factor != 8)) {
        snprintf(message, JMSG_LENGTH_MAX, len < 2 ? "no bytes" : "bad reduction");
        return REFUSED;
    }
    int status = decode_one(cinfo, err, s, p, (size_t)len, factor, box, flip, pillow13, slot, height, width);
    if (status == REFUSED) memcpy(message, err->message, JMSG_LENGTH_MAX);
    return status;
}

/* Read one JPEG's header into dims[0..2] (width, height, 3 colour / 1 grey; all 0 when the
 * kernel does not decode it). Returns OK, or REFUSED with why in `message` (JMSG_LENGTH_MAX).
 * Its own jump target: a libjpeg error while reading lands here, never in the caller. */
static int read_header(struct jpeg_decompress_struct *cinfo, error_mgr *err, const unsigned char *p, size_t len,
                       int32_t *dims, char *message) {
    dims[0] = dims[1] = dims[2] = 0;
    if (len < 2 || p[0] != 0xFF || p[1] != 0xD8) {
        snprintf(message, JMSG_LENGTH_MAX, "not a JPEG");
        return REFUSED;
    }
    if (setjmp(err->jump)) {
        memcpy(message, err->message, JMSG_LENGTH_MAX);
        jpeg_abort_decompress(cinfo);
        dims[0] = dims[1] = dims[2] = 0;
        return REFUSED;
    }
    jpeg_mem_src(cinfo, p, (unsigned long)len);
    jpeg_read_header(cinfo, TRUE);
    int status = OK;
    if (cinfo->jpeg_color_space == JCS_YCbCr || cinfo->jpeg_color_space == JCS_RGB) {
        dims[2] = 3;
    } else if (cinfo->jpeg_color_space == JCS_GRAYSCALE) {
        dims[2] = 1;
    } else {
        snprintf(message, JMSG_LENGTH_MAX, "colour space %d is not decoded here", (int)cinfo->jpeg_color_space);
        status = REFUSED;
    }
    if (status == OK) {
        dims[0] = (int32_t)cinfo->image_width;
        dims[1] = (int32_t)cinfo->image_height;
    }
    jpeg_abort_decompress(cinfo);
    return status;
}

PyDoc_STRVAR(headers_doc,
             "headers(datas, dims) -> list\n\n"
             "Read each JPEG's header: dims (int32, 3 a sample) gets width, height and 3 (colour) or 1 (grey),\n"
             "or 0 when the kernel does not decode it. Returns the reason per sample (None: readable).");

static PyObject *headers(PyObject *self, PyObject *args) {
    PyObject *datas, *dims_obj, *seq, *result = NULL;
    Py_buffer dims_view, *views;
    Py_ssize_t n, i;
    int32_t *dims;
    int *status;
    char(*messages)[JMSG_LENGTH_MAX];
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    (void)self;

    if (!PyArg_ParseTuple(args, "OO", &datas, &dims_obj)) return NULL;
    seq = PySequence_Fast(datas, "datas must be a sequence of bytes-like objects");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (get_array(dims_obj, &dims_view, (size_t)n * 3 * sizeof(int32_t), 1, "dims") != 0) {
        Py_DECREF(seq);
        return NULL;
    }
    dims = (int32_t *)dims_view.buf;
    if (batch_scratch(seq, n, &views, &status, &messages) != 0) goto done;
    use_errors(&cinfo, &err);
    if (setjmp(err.jump)) {
        PyErr_Format(PyExc_MemoryError, "libjpeg: %s", err.message);
        goto done;
    }
    jpeg_create_decompress(&cinfo);
    /* Headers only: a few microseconds each, so the GIL stays held (no wait to take it back). */
    for (i = 0; i < n; i++)
        status[i] = views[i].len < 0 ? (snprintf(messages[i], JMSG_LENGTH_MAX, "not a JPEG"), REFUSED)
                                      : read_header(&cinfo, &err, (const unsigned char *)views[i].buf,
                                                    (size_t)views[i].len, &dims[i * 3], messages[i]);
    if (setjmp(err.jump) == 0) /* (read_header's jump target is gone: an error letting go lands here) */
        jpeg_destroy_decompress(&cinfo);
    result = messages_list(n, status, messages);
done:
    if (views != NULL) release_buffers(views, n);
    PyMem_Free(status);
    PyMem_Free(messages);
    PyBuffer_Release(&dims_view);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(decode_doc,
             "decode(datas, boxes, params, out, height, width, pillow13) -> list\n\n"
             "Decode a batch of JPEGs into out (uint8, n x height x width x 3, RGB), the GIL released once for\n"
             "the whole batch. boxes: float32, 4 a sample (the source box in the decoded image's coordinates,\n"
             "as Pillow's resize takes it); params: int32, 2 a sample (DCT reduction 1/2/4/8, or 0 to leave the\n"
             "sample alone; flip 0/1); pillow13: Pillow 13's order of the resize passes. Returns per sample None\n"
             "(decoded or left alone) or why it was refused.");

static PyObject *decode(PyObject *self, PyObject *args) {
    PyObject *datas, *boxes_obj, *params_obj, *out_obj, *seq, *result = NULL;
    Py_buffer boxes_view, params_view, out_view, *views;
    Py_ssize_t n, i;
    int height, width, pillow13 = 0, failed = 0;
    int *status;
    char(*messages)[JMSG_LENGTH_MAX];
    size_t slot;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOOOiip", &datas, &boxes_obj, &params_obj, &out_obj, &height, &width, &pillow13))
        return NULL;
    if (height < 1 || width < 1 || height > 65535 || width > 65535) {
        PyErr_SetString(PyExc_ValueError, "height and width must be in 1..65535");
        return NULL;
    }
    seq = PySequence_Fast(datas, "datas must be a sequence of bytes-like objects");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    slot = (size_t)height * width * 3;
    if (get_array(boxes_obj, &boxes_view, (size_t)n * 4 * sizeof(float), 0, "boxes") != 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (get_array(params_obj, &params_view, (size_t)n * 2 * sizeof(int32_t), 0, "params") != 0) {
        PyBuffer_Release(&boxes_view);
        Py_DECREF(seq);
        return NULL;
    }
    if (get_array(out_obj, &out_view, (size_t)n * slot, 1, "out") != 0) {
        PyBuffer_Release(&params_view);
        PyBuffer_Release(&boxes_view);
        Py_DECREF(seq);
        return NULL;
    }
    if (batch_scratch(seq, n, &views, &status, &messages) != 0) goto done;
    {
        const float *boxes = (const float *)boxes_view.buf;
        const int32_t *params = (const int32_t *)params_view.buf;
        uint8_t *out = (uint8_t *)out_view.buf;
        Py_BEGIN_ALLOW_THREADS
        struct jpeg_decompress_struct cinfo;
        error_mgr err;
        scratch s;
        memset(&s, 0, sizeof s);
        use_errors(&cinfo, &err);
        if (setjmp(err.jump)) {
            failed = 1;
        } else {
            jpeg_create_decompress(&cinfo);
            for (i = 0; i < n; i++)
                status[i] = decode_sample(&cinfo, &err, &s, (const unsigned char *)views[i].buf, views[i].len,
                                          &params[i * 2], &boxes[i * 4], pillow13, out + slot * (size_t)i, height,
                                          width, messages[i]);
            if (setjmp(err.jump) == 0) /* (decode_one's jump target is gone: an error letting go lands here) */
                jpeg_destroy_decompress(&cinfo);
        }
        scratch_free(&s);
        Py_END_ALLOW_THREADS
    }
    if (failed) {
        PyErr_SetString(PyExc_MemoryError, "libjpeg could not start");
        goto done;
    }
    result = messages_list(n, status, messages);
done:
    if (views != NULL) release_buffers(views, n);
    PyMem_Free(status);
    PyMem_Free(messages);
    PyBuffer_Release(&out_view);
    PyBuffer_Release(&params_view);
    PyBuffer_Release(&boxes_view);
    Py_DECREF(seq);
    return result;
}


/* -- a batch's headers, draws and decode as one job: run after its read, in the same release ---- */

typedef struct {
    PyObject_HEAD
    Py_buffer data, offsets, prefix, where, dims, boxes, full, params, taken, out;
    int acquired; /* how many of the buffers above are held, in that order */
    Py_ssize_t n;
    int height, width, pillow13, state, failed;
    geometry g;
    long long max_pixels;
    const char *bad;
    double seconds;
    int *status;
    char (*messages)[JMSG_LENGTH_MAX];
    streamload_then then;
} Job;

enum { PREPARED = 0, RAN = 1, FINISHED = 2 };

static void job_release(Job *job) {
    Py_buffer *views[] = {&job->data,   &job->offsets, &job->prefix, &job->where, &job->dims,
                          &job->boxes,  &job->full,    &job->params, &job->taken, &job->out};
    for (int i = 0; i < job->acquired; i++) PyBuffer_Release(views[i]);
    job->acquired = 0;
    PyMem_Free(job->status);
    PyMem_Free(job->messages);
    job->status = NULL;
    job->messages = NULL;
}

static void job_dealloc(Job *job) {
    job_release(job);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

/* Headers, draws, decode: no Python object touched (the buffers are held by the job). */
static void job_run(void *ctx) {
    Job *job = (Job *)ctx;
    if (job->state != PREPARED) return;
    job->state = RAN;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const uint8_t *data = (const uint8_t *)job->data.buf;
    const int64_t *offsets = (const int64_t *)job->offsets.buf;
    int32_t *dims = (int32_t *)job->dims.buf;
    const float *boxes = (const float *)job->boxes.buf;
    const int32_t *params = (const int32_t *)job->params.buf;
    uint8_t *out = (uint8_t *)job->out.buf;
    size_t slot = (size_t)job->height * job->width * 3;
    Py_ssize_t n = job->n, i;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    scratch s;
    memset(&s, 0, sizeof s);
    use_errors(&cinfo, &err);
    if (setjmp(err.jump)) {
        job->failed = 1;
        scratch_free(&s);
        return;
    }
    jpeg_create_decompress(&cinfo);
    for (i = 0; i < n; i++) /* the headers (as headers() reads them) */
        read_header(&cinfo, &err, data + offsets[i], (size_t)(offsets[i + 1] - offsets[i]), &dims[i * 3],
                    job->messages[i]);
    job->bad = draw_batch((const uint32_t *)job->prefix.buf, (int)(job->prefix.len / 4), (const int64_t *)job->where.buf,
                          dims, n, &job->g, job->max_pixels, (float *)job->boxes.buf, (double *)job->full.buf,
                          (int32_t *)job->params.buf, (uint8_t *)job->taken.buf);
    if (job->bad == NULL) {
        for (i = 0; i < n; i++) /* the decode (as decode() runs it) */
            job->status[i] =
                decode_sample(&cinfo, &err, &s, data + offsets[i], (Py_ssize_t)(offsets[i + 1] - offsets[i]),
                              &params[i * 2], &boxes[i * 4], job->pillow13, out + slot * (size_t)i, job->height,
                              job->width, job->messages[i]);
    }
    if (setjmp(err.jump) == 0) /* (the last jump target may be read_header's or decode_one's, gone by now) */
        jpeg_destroy_decompress(&cinfo);
    scratch_free(&s);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    job->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

static void then_gone(PyObject *capsule) {
    PyObject *job = (PyObject *)PyCapsule_GetContext(capsule);
    Py_XDECREF(job);
}

static PyObject *job_then(Job *job, void *closure) {
    (void)closure;
    if (job->state != PREPARED) {
        PyErr_SetString(PyExc_RuntimeError, "this job has run");
        return NULL;
    }
    /* The capsule keeps the job alive as long as it is (the call it is passed to may outlive
     * every other reference), and lets go of it when it goes. */
    PyObject *capsule = PyCapsule_New(&job->then, STREAMLOAD_THEN, then_gone);
    if (capsule == NULL) return NULL;
    if (PyCapsule_SetContext(capsule, job) != 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    Py_INCREF(job);
    return capsule;
}

PyDoc_STRVAR(job_finish_doc,
             "finish() -> (reasons, seconds)\n\n"
             "Run the job if no read ran it (the GIL released), then give each sample's refusal (None: decoded\n"
             "or not taken) and the seconds its headers, draws and decode took; the buffers are let go.");

static PyObject *job_finish(Job *job, PyObject *unused) {
    (void)unused;
    if (job->state == FINISHED) {
        PyErr_SetString(PyExc_RuntimeError, "this job has finished");
        return NULL;
    }
    if (job->state == PREPARED) {
        Py_BEGIN_ALLOW_THREADS
        job_run(job);
        Py_END_ALLOW_THREADS
    }
    job->state = FINISHED;
    PyObject *result = NULL;
    if (job->failed)
        PyErr_SetString(PyExc_MemoryError, "libjpeg could not start");
    else if (job->bad != NULL)
        PyErr_SetString(PyExc_ValueError, job->bad);
    else {
        PyObject *reasons = messages_list(job->n, job->status, job->messages);
        if (reasons != NULL) result = Py_BuildValue("(Nd)", reasons, job->seconds);
    }
    job_release(job);
    return result;
}

static PyMethodDef job_methods[] = {
    {"finish", (PyCFunction)job_finish, METH_NOARGS, job_finish_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"then", (getter)job_then, NULL, "The continuation to hand a batch's read (pread_gather's then).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "streamload.decode._jpegbatch.Job",
    .tp_basicsize = sizeof(Job),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch's headers, crop draws and decode, to run once without the GIL (prepare()).",
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

/* An exact C-contiguous buffer of `need` bytes (writable if asked), held by the job. */
static int job_get(Job *job, Py_buffer *view, PyObject *obj, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    job->acquired++;
    if (need >= 0 && view->len != need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", what, view->len, need);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(prepare_doc,
             "prepare(data, offsets, prefix, where, geometry, max_pixels, dims, boxes, full, params, taken, out,\n"
             "        height, width, pillow13) -> Job\n\n"
             "A batch's decode to run once without the GIL, after its bytes are read into data (sample i at\n"
             "data[offsets[i]:offsets[i + 1]], int64 offsets): each JPEG's header into dims (int32[n, 3]), its\n"
             "crop box and flip drawn as streamload._draws.crops draws them (prefix, where, geometry, max_pixels,\n"
             "boxes, full, params, taken: the same meaning and sizes), and its decode into out (uint8,\n"
             "n x height x width x 3) as decode() does. Hand job.then to pread_gather to run it right after\n"
             "the read, in the same release of the GIL; job.finish() runs it if no read did.");

static PyObject *prepare(PyObject *self, PyObject *args) {
    PyObject *data_o, *offsets_o, *prefix_o, *where_o, *dims_o, *boxes_o, *full_o, *params_o, *taken_o, *out_o;
    geometry g;
    long long max_pixels;
    int height, width, pillow13 = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO(pppiiddddd)LOOOOOOiip", &data_o, &offsets_o, &prefix_o, &where_o,
                          &g.random_crop, &g.flip, &g.dct_scaling, &g.out_w, &g.out_h, &g.scale_lo, &g.scale_hi,
                          &g.ratio_lo, &g.ratio_hi, &g.resize, &max_pixels, &dims_o, &boxes_o, &full_o, &params_o,
                          &taken_o, &out_o, &height, &width, &pillow13))
        return NULL;
    if (height < 1 || width < 1 || height > 65535 || width > 65535) {
        PyErr_SetString(PyExc_ValueError, "height and width must be in 1..65535");
        return NULL;
    }
    if (g.out_w != width || g.out_h != height) {
        PyErr_SetString(PyExc_ValueError, "the geometry's output size must be height x width");
        return NULL;
    }
    Job *job = PyObject_New(Job, &JobType);
    if (job == NULL) return NULL;
    job->acquired = 0;
    job->status = NULL;
    job->messages = NULL;
    job->state = PREPARED;
    job->failed = 0;
    job->bad = NULL;
    job->seconds = 0.0;
    job->g = g;
    job->max_pixels = max_pixels;
    job->height = height;
    job->width = width;
    job->pillow13 = pillow13;
    job->then.run = job_run;
    job->then.ctx = job;
    if (job_get(job, &job->data, data_o, -1, 0, "data") != 0) goto fail;
    if (job_get(job, &job->offsets, offsets_o, -1, 0, "offsets") != 0) goto fail;
    if (job->offsets.len < 8 || job->offsets.len % 8) {
        PyErr_SetString(PyExc_ValueError, "offsets: int64, one a sample and one more");
        goto fail;
    }
    Py_ssize_t n = job->offsets.len / 8 - 1;
    job->n = n;
    const int64_t *offsets = (const int64_t *)job->offsets.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (offsets[0] < 0 || offsets[i + 1] < offsets[i] || offsets[i + 1] > (int64_t)job->data.len) {
            PyErr_Format(PyExc_ValueError, "offsets: sample %zd does not lie inside data", i);
            goto fail;
        }
    }
    if (job_get(job, &job->prefix, prefix_o, -1, 0, "prefix") != 0) goto fail;
    if (job->prefix.len % 4 || job->prefix.len / 4 > 60) {
        PyErr_SetString(PyExc_ValueError, "prefix: uint32 words, at most 60, are needed");
        goto fail;
    }
    if (job_get(job, &job->where, where_o, n * 16, 0, "where") != 0) goto fail;
    if (job_get(job, &job->dims, dims_o, n * 12, 1, "dims") != 0) goto fail;
    if (job_get(job, &job->boxes, boxes_o, n * 16, 1, "boxes") != 0) goto fail;
    if (job_get(job, &job->full, full_o, n * 32, 1, "full") != 0) goto fail;
    if (job_get(job, &job->params, params_o, n * 8, 1, "params") != 0) goto fail;
    if (job_get(job, &job->taken, taken_o, n, 1, "taken") != 0) goto fail;
    if (job_get(job, &job->out, out_o, n * (Py_ssize_t)height * width * 3, 1, "out") != 0) goto fail;
    job->status = (int *)PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int));
    job->messages = PyMem_Calloc((size_t)(n > 0 ? n : 1), JMSG_LENGTH_MAX);
    if (job->status == NULL || job->messages == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    return (PyObject *)job;
fail:
    Py_DECREF(job);
    return NULL;
}

static PyMethodDef methods[] = {
    {"headers", headers, METH_VARARGS, headers_doc},
    {"decode", decode, METH_VARARGS, decode_doc},
    {"prepare", prepare, METH_VARARGS, prepare_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegbatch", "A batch of JPEGs decoded, cropped, resized and flipped in one call.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegbatch(void) {
    if (PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", LIBJPEG_TURBO_VERSION_NUMBER) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
