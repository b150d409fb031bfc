/*
 * streamload._gather: a batch's positioned reads, of one file or many, in one call that releases the GIL once.
 *
 * A thread that lets go of the GIL for a system call must take it back afterwards; beside a
 * thread running Python that can wait up to the switch interval. A shuffled batch's samples
 * lie all over a shard, so reading them one os.pread (or os.preadv) at a time makes one such
 * release per sample: here the whole batch's reads are one, over all the batch's shards
 * (each entry may name its own file descriptor), read in (file, offset) order.
 *
 * Safety: every destination is checked inside its buffer before anything is read; a read
 * that fails or comes back short is reported per entry (the caller names the shard).
 * With sums, each entry's bytes are hashed (XXH3_64bits) in the same call, so the caller
 * checks a batch's digests without a call (and a GIL release) per member.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_then.h"

/* The system's xxHash (libxxhash.so.0), looked up when the module loads: XXH3_64bits is
 * what the tar sidecar's member digests are (python-xxhash's xxh3_64 with seed 0). Absent:
 * NULL, and the caller checks the digests itself. */
typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3 = NULL;

/* A contiguous buffer of at least `need` bytes. */
static int get_array(PyObject *obj, Py_buffer *view, size_t need, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) != 0) return -1;
    if ((size_t)view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zu needed", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The read order: by file descriptor, then offset (a file's reads front to back). */
typedef struct {
    int fd;
    int finished;
    int64_t offset;
    Py_ssize_t entry;
} slot;

static int by_place(const void *a, const void *b) {
    const slot *x = (const slot *)a, *y = (const slot *)b;
    if (x->fd != y->fd) return x->fd < y->fd ? -1 : 1;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->entry < y->entry ? -1 : (x->entry > y->entry);
}

/* Most bytes a call copies from the page cache holding the GIL (about a millisecond or two). */
#define CACHED_LIMIT ((int64_t)16 << 20)

/* Whether RWF_NOWAIT reads work here (cleared at the first EOPNOTSUPP/EINVAL). */
static int nowait_works = 1;

/* Read the entries of `order` not finished yet, in order: got[i] holds the bytes read so far.
 * An entry finishes when read whole, at the end of the file (short) or at a failed read
 * (got[i] = -errno). With `cached`, only what the page cache holds is read (RWF_NOWAIT): an
 * entry that would wait for the disk stays unfinished. Returns how many are unfinished. */
static int read_entries(slot *order, Py_ssize_t n, const int64_t *offsets, const int64_t *lengths, const int64_t *at,
                        const int32_t *which, const Py_buffer *outs, int64_t *got, uint64_t *sums, int cached) {
    int unfinished = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (order[k].finished) continue;
        Py_ssize_t i = order[k].entry;
        int64_t done = got[i], want = lengths[i];
        char *dst = (char *)outs[which[i]].buf + at[i];
        int waits = 0;
        while (done < want) {
            ssize_t r;
#ifdef RWF_NOWAIT
            if (cached) {
                struct iovec iov = {dst + done, (size_t)(want - done)};
                r = nowait_works ? preadv2(order[k].fd, &iov, 1, (off_t)(offsets[i] + done), RWF_NOWAIT) : -1;
                if (!nowait_works) errno = EAGAIN;
                if (r < 0 && (errno == EOPNOTSUPP || errno == EINVAL)) nowait_works = 0; /* not here: read waiting */
                if (r < 0 && (errno == EAGAIN || errno == EOPNOTSUPP || errno == EINVAL)) {
                    waits = 1;
                    break;
                }
            } else
#endif
            {
                if (cached) { /* no RWF_NOWAIT here: every read waits with the GIL released */
                    waits = 1;
                    break;
                }
                r = pread(order[k].fd, dst + done, (size_t)(want - done), (off_t)(offsets[i] + done));
            }
            if (r < 0) {
                if (errno == EINTR) continue;
                done = -(int64_t)errno;
                break;
            }
            if (r == 0) break; /* the end of the file: short */
            done += r;
        }
        got[i] = done;
        if (waits) {
            unfinished++;
            continue;
        }
        order[k].finished = 1;
        if (sums != NULL && done == want) sums[i] = xxh3(dst, (size_t)want);
    }
    return unfinished;
}

PyDoc_STRVAR(pread_gather_doc,
             "pread_gather(fd, offsets, lengths, outs, which, at, got, sums=None, cached_first=True) -> None\n\n"
             "Read entry i (lengths[i] bytes at file offset offsets[i] of fd) into outs[which[i]] at byte at[i],\n"
             "every entry in one call that releases the GIL once. fd: one descriptor for every entry, or int32\n"
             "one an entry (a batch over many files); the entries are read in (fd, offset) order, whatever\n"
             "their order here. offsets, lengths, at and got: int64, which:\n"
             "int32, one an entry (got's length is the number of entries); every destination is checked\n"
             "inside its buffer first (ValueError). got[i] gets the bytes read (fewer than lengths[i] only at\n"
             "the end of the file) or -errno when a read failed. sums (uint64, one an entry, or None): each\n"
             "entry's XXH3_64bits digest, of the entry's full read (left alone when short); needs has_xxh3().\n"
             "cached_first: what the page cache holds is read first holding the GIL (RWF_NOWAIT, up to 16 MiB a\n"
             "call), the rest with it released (one release, none for a cached batch). then: a continuation\n"
             "(a PyCapsule named 'streamload.then') run right after the reads, in the same release of the GIL\n"
             "(every read is then made with the GIL released; the continuation runs once, even for no entries).");

static PyObject *pread_gather(PyObject *self, PyObject *args) {
    PyObject *fd_obj, *outs_obj, *offsets_obj, *lengths_obj, *which_obj, *at_obj, *got_obj, *sums_obj = Py_None, *seq;
    PyObject *then_obj = Py_None;
    streamload_then *then = NULL;
    PyObject *result = NULL;
    Py_buffer fds_view, offsets_view, lengths_view, which_view, at_view, got_view, sums_view, *outs = NULL;
    uint64_t *sums = NULL;
    const int32_t *fds = NULL;
    slot *order = NULL;
    Py_ssize_t n, m, i, have = 0;
    int fd = -1, failed = 0;
    (void)self;

    int cached_first = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOO|OpO", &fd_obj, &offsets_obj, &lengths_obj, &outs_obj, &which_obj, &at_obj,
                          &got_obj, &sums_obj, &cached_first, &then_obj))
        return NULL;
    if (then_obj != Py_None) {
        then = (streamload_then *)PyCapsule_GetPointer(then_obj, STREAMLOAD_THEN);
        if (then == NULL) return NULL; /* not a continuation: TypeError/ValueError from the capsule API */
        cached_first = 0;             /* one release for the reads and what follows them */
    }
    if (sums_obj != Py_None && xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sums need the system's xxHash (libxxhash.so.0), which is not there");
        return NULL;
    }
    if (PyObject_GetBuffer(got_obj, &got_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    n = got_view.len / (Py_ssize_t)sizeof(int64_t);
    if (sums_obj != Py_None) {
        if (PyObject_GetBuffer(sums_obj, &sums_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
            PyBuffer_Release(&got_view);
            return NULL;
        }
        if (sums_view.len < n * (Py_ssize_t)sizeof(uint64_t)) {
            PyErr_SetString(PyExc_ValueError, "sums holds fewer entries than got");
            PyBuffer_Release(&sums_view);
            PyBuffer_Release(&got_view);
            return NULL;
        }
        sums = (uint64_t *)sums_view.buf;
    }
    if (PyLong_Check(fd_obj)) {
        long value = PyLong_AsLong(fd_obj);
        if (value == -1 && PyErr_Occurred()) goto release_got;
        if (value < 0 || value > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "fd is not a file descriptor");
            goto release_got;
        }
        fd = (int)value;
    } else {
        if (get_array(fd_obj, &fds_view, (size_t)n * sizeof(int32_t), "fd") != 0) goto release_got;
        fds = (const int32_t *)fds_view.buf;
    }
    if (get_array(offsets_obj, &offsets_view, (size_t)n * sizeof(int64_t), "offsets") != 0) goto release_fds;
    if (get_array(lengths_obj, &lengths_view, (size_t)n * sizeof(int64_t), "lengths") != 0) goto release_offsets;
    if (get_array(which_obj, &which_view, (size_t)n * sizeof(int32_t), "which") != 0) goto release_lengths;
    if (get_array(at_obj, &at_view, (size_t)n * sizeof(int64_t), "at") != 0) goto release_which;
    seq = PySequence_Fast(outs_obj, "outs must be a sequence of writable buffers");
    if (seq == NULL) goto release_at;
    m = PySequence_Fast_GET_SIZE(seq);
    outs = (Py_buffer *)PyMem_Calloc((size_t)(m > 0 ? m : 1), sizeof(Py_buffer));
    if (outs == NULL) {
        PyErr_NoMemory();
        goto release_seq;
    }
    for (have = 0; have < m; have++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, have), &outs[have], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) !=
            0)
            goto release_outs;
    }
    {
        const int64_t *offsets = (const int64_t *)offsets_view.buf, *lengths = (const int64_t *)lengths_view.buf;
        const int64_t *at = (const int64_t *)at_view.buf;
        const int32_t *which = (const int32_t *)which_view.buf;
        int64_t *got = (int64_t *)got_view.buf;
        for (i = 0; i < n; i++) { /* every destination inside its buffer, before anything is read */
            if (offsets[i] < 0 || lengths[i] < 0 || at[i] < 0 || which[i] < 0 || which[i] >= m ||
                lengths[i] > (int64_t)outs[which[i]].len || at[i] > (int64_t)outs[which[i]].len - lengths[i]) {
                PyErr_Format(PyExc_ValueError, "entry %zd: %lld bytes at %lld of buffer %d do not fit there", i,
                             (long long)lengths[i], (long long)at[i], (int)which[i]);
                goto release_outs;
            }
        }
        order = (slot *)PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(slot));
        if (order == NULL) {
            PyErr_NoMemory();
            goto release_outs;
        }
        for (i = 0; i < n; i++) {
            order[i].fd = fds != NULL ? fds[i] : fd;
            order[i].offset = offsets[i];
            order[i].entry = i;
            order[i].finished = 0;
            if (order[i].fd < 0) failed = 1;
        }
        if (failed) {
            PyErr_SetString(PyExc_ValueError, "a file descriptor is negative");
            goto release_outs;
        }
        qsort(order, (size_t)n, sizeof(slot), by_place);
        for (i = 0; i < n; i++) got[i] = 0;
        /* What the page cache holds is read first, holding the GIL (RWF_NOWAIT: a read that
         * would wait for the disk returns EAGAIN at once): a cached batch's reads are a copy of
         * a few milliseconds at most, cheaper than taking the GIL back beside a thread running
         * Python (up to the switch interval). The rest, if any, is read with the GIL released. */
        int64_t total = 0;
        for (i = 0; i < n; i++) total += lengths[i];
        /* (over the limit, or asked not to: every read with the GIL released) */
        int left = cached_first && total <= CACHED_LIMIT
                       ? read_entries(order, n, offsets, lengths, at, which, outs, got, sums, 1)
                       : (int)(n > 0);
        if (left || then != NULL) {
            Py_BEGIN_ALLOW_THREADS
            if (left) read_entries(order, n, offsets, lengths, at, which, outs, got, sums, 0);
            if (then != NULL) then->run(then->ctx);
            Py_END_ALLOW_THREADS
        }
    }
    result = Py_NewRef(Py_None);
release_outs:
    PyMem_Free(order);
    for (i = 0; i < have; i++) PyBuffer_Release(&outs[i]);
    PyMem_Free(outs);
release_seq:
    Py_DECREF(seq);
release_at:
    PyBuffer_Release(&at_view);
release_which:
    PyBuffer_Release(&which_view);
release_lengths:
    PyBuffer_Release(&lengths_view);
release_offsets:
    PyBuffer_Release(&offsets_view);
release_fds:
    if (fds != NULL) PyBuffer_Release(&fds_view);
release_got:
    if (sums != NULL) PyBuffer_Release(&sums_view);
    PyBuffer_Release(&got_view);
    return result;
}

/* One file of open_files(): its path, and what came of it. */
typedef struct {
    const char *path;
    int read;      /* read it whole and close it (else: keep it open, return the descriptor) */
    int64_t limit; /* read: most bytes read (a larger file is not read: its size tells) */
    int err;       /* errno of the step that failed, 0 */
    int fd;
    int link;
    unsigned mode;
    int64_t size;
    char *data;
    int64_t got;
} opening;

/* lstat (a link: stat, followed), a regular file only: open non-blocking (a FIFO put there
 * cannot block the open), fstat the descriptor (what was opened is what is checked), then
 * blocking reads; read whole and close, or keep open. Anything not a regular file is
 * never opened (err 0, fd -1: its mode tells the caller). */
static void open_one(opening *o) {
    struct stat st;
    o->fd = -1;
    if (lstat(o->path, &st) != 0) {
        o->err = errno;
        return;
    }
    if (S_ISLNK(st.st_mode)) {
        o->link = 1;
        if (stat(o->path, &st) != 0) {
            o->err = errno;
            return;
        }
    }
    o->mode = (unsigned)st.st_mode;
    o->size = (int64_t)st.st_size;
    if (!S_ISREG(st.st_mode)) return;
    int fd = open(o->path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        o->err = errno;
        return;
    }
    int flags;
    if (fstat(fd, &st) != 0 || (flags = fcntl(fd, F_GETFL)) < 0) {
        o->err = errno;
        close(fd);
        return;
    }
    o->mode = (unsigned)st.st_mode;
    o->size = (int64_t)st.st_size;
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return;
    }
    if (fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        o->err = errno;
        close(fd);
        return;
    }
    if (!o->read) {
        o->fd = fd;
        return;
    }
    if (o->size <= o->limit) {
        o->data = (char *)malloc((size_t)(o->size > 0 ? o->size : 1));
        if (o->data == NULL) o->err = ENOMEM;
        while (o->data != NULL && o->got < o->size) {
            ssize_t r = pread(fd, o->data + o->got, (size_t)(o->size - o->got), (off_t)o->got);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) o->err = errno;
            if (r <= 0) break; /* failed, or the end of the file: short (the caller's checks see it) */
            o->got += r;
        }
    }
    close(fd);
}

PyDoc_STRVAR(open_files_doc,
             "open_files(paths, reads, limits) -> list[tuple[int, int, int, int, bool, bytes | None]]\n\n"
             "Open local files in one call that releases the GIL once (a shard and its sidecar: otherwise a\n"
             "dozen system calls, each a release). paths: a list of bytes (file system paths); reads: one bool\n"
             "each, read the file whole and close it (else keep it open); limits: one int each, the most bytes\n"
             "read (a larger file is not read). Each file is lstat'ed (a symbolic link then stat'ed: the caller\n"
             "checks where it leads), opened only if a regular file (non-blocking, so a FIFO cannot block),\n"
             "fstat'ed and checked again. Returns (errno, fd, st_mode, st_size, is_link, data) a file: errno 0\n"
             "or the failed step's; fd the open descriptor (-1 when read, refused or failed: the caller owns\n"
             "it); data the bytes read (None unless read; shorter than st_size only when the file shrank).");

static PyObject *open_files(PyObject *self, PyObject *args) {
    PyObject *paths_obj, *reads_obj, *limits_obj, *paths = NULL, *reads = NULL, *limits = NULL, *result = NULL;
    opening *files = NULL;
    Py_ssize_t n = 0, i;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO", &paths_obj, &reads_obj, &limits_obj)) return NULL;
    paths = PySequence_Fast(paths_obj, "paths must be a sequence of bytes");
    reads = paths == NULL ? NULL : PySequence_Fast(reads_obj, "reads must be a sequence of bools");
    limits = reads == NULL ? NULL : PySequence_Fast(limits_obj, "limits must be a sequence of ints");
    if (limits == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(paths);
    if (PySequence_Fast_GET_SIZE(reads) != n || PySequence_Fast_GET_SIZE(limits) != n) {
        PyErr_SetString(PyExc_ValueError, "paths, reads and limits must have the same length");
        goto done;
    }
    files = (opening *)PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(opening));
    if (files == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *path = PySequence_Fast_GET_ITEM(paths, i);
        if (!PyBytes_Check(path) || (Py_ssize_t)strlen(PyBytes_AS_STRING(path)) != PyBytes_GET_SIZE(path)) {
            PyErr_Format(PyExc_ValueError, "path %zd must be bytes without NUL", i);
            goto done;
        }
        files[i].path = PyBytes_AS_STRING(path); /* the list holds it for the call */
        int read = PyObject_IsTrue(PySequence_Fast_GET_ITEM(reads, i));
        long long limit = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(limits, i));
        if (read < 0 || (limit == -1 && PyErr_Occurred())) goto done;
        files[i].read = read;
        files[i].limit = limit;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) open_one(&files[i]);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (i = 0; result != NULL && i < n; i++) {
        opening *o = &files[i];
        PyObject *data = Py_None;
        if (o->data != NULL && o->err == 0) {
            data = PyBytes_FromStringAndSize(o->data, (Py_ssize_t)o->got);
            if (data == NULL) Py_CLEAR(result);
        } else {
            Py_INCREF(data);
        }
        if (result == NULL) break;
        PyObject *row = Py_BuildValue("(iiILNN)", o->err, o->fd, o->mode, (long long)o->size,
                                      PyBool_FromLong(o->link), data);
        if (row == NULL) {
            Py_CLEAR(result);
            break;
        }
        if (o->fd >= 0) o->fd = -1; /* the caller's now */
        PyList_SET_ITEM(result, i, row);
    }
done:
    if (files != NULL) {
        for (i = 0; i < n; i++) {
            free(files[i].data);
            if (files[i].fd >= 0) close(files[i].fd); /* not handed over (an error building the result) */
        }
        PyMem_Free(files);
    }
    Py_XDECREF(paths);
    Py_XDECREF(reads);
    Py_XDECREF(limits);
    return result;
}

static PyObject *has_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(xxh3 != NULL);
}

static PyMethodDef methods[] = {
    {"pread_gather", pread_gather, METH_VARARGS, pread_gather_doc},
    {"open_files", open_files, METH_VARARGS, open_files_doc},
    {"has_xxh3", has_xxh3, METH_NOARGS, "has_xxh3() -> bool: whether pread_gather can hash (the system's xxHash)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather", "A batch's positioned reads, and a shard's opening, each in one call that releases the GIL once.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gather(void) {
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL) xxh3 = (xxh3_fn)dlsym(lib, "XXH3_64bits");
    return PyModule_Create(&module);
}
