/*
 * A continuation one native call hands another: what to run, without the GIL, right after a
 * batch's reads (streamload._gather.pread_gather's `then`), so that a batch's read and its
 * decode are one release of the GIL, not two. Passed as a PyCapsule named STREAMLOAD_THEN
 * whose pointer is a streamload_then that lives as long as the capsule.
 */
#ifndef STREAMLOAD_THEN_H
#define STREAMLOAD_THEN_H

#define STREAMLOAD_THEN "streamload.then"

typedef struct {
    void (*run)(void *ctx); /* called once, without the GIL: must not touch Python objects */
    void *ctx;
} streamload_then;

#endif
