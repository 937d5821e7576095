/* galahad.adapters.posix._readhash: a checksum frame's read and XXH3-128 in one call, outside the
 * interpreter lock.
 *
 * read_hashed(fd, offset, buffer, seed, step) -> (count, digest)
 *
 * Fills the writable buffer with the file's bytes from `offset` on, `step` bytes per pread, and
 * feeds each piece to an XXH3-128 state seeded with `seed` right after it landed, while it is
 * still in the core's cache. Returns the count read (less than the buffer only where the file
 * ends) and the 16-byte canonical digest of exactly those bytes: what
 * `xxhash.xxh3_128(seed=seed)` gives after `update` with them. A read that fails raises OSError
 * with its errno (EINTR is retried); nothing is hashed past it.
 *
 * Why it exists: a load verifies every byte it reads. In Python each piece is a round trip
 * through the interpreter lock (the read, then the hash's update), so pieces small enough to be
 * hashed in cache cost more in lock traffic than they save (docs/benchmarks.md). Here the lock is
 * released once for the whole frame. The module is optional: without it the filesystem reader
 * runs the same loop in Python (`FileReader.read_stepwise`), with the same results.
 *
 * Built against CPython's limited API (3.11), so one build serves every later Python. XXH3 comes
 * from xxHash 0.8.4 (csrc/xxhash, BSD-2-Clause, as bundled by python-xxhash 4.1.0), with its x86
 * dispatcher picking SSE2, AVX2 or AVX-512 at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <unistd.h>

#include "xxhash.h"
#ifdef GALAHAD_XXH_DISPATCH
#include "xxh_x86dispatch.h"
#endif

static PyObject *read_hashed(PyObject *self, PyObject *args) {
    int fd;
    long long offset;
    unsigned long long seed;
    Py_ssize_t step;
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTuple(args, "iLw*Kn:read_hashed", &fd, &offset, &view, &seed, &step)) {
        return NULL;
    }
    if (fd < 0 || offset < 0 || step < 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "read_hashed needs fd >= 0, offset >= 0 and step >= 1");
        return NULL;
    }
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    unsigned char *dst = (unsigned char *)view.buf;
    Py_ssize_t size = view.len, done = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_128bits_reset_withSeed(state, (XXH64_hash_t)seed);
    while (done < size) {
        size_t want = (size_t)(size - done < step ? size - done : step);
        ssize_t got = pread(fd, dst + done, want, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            failed = errno;
            break;
        }
        if (got == 0) {
            break; /* the file ends */
        }
        XXH3_128bits_update(state, dst + done, (size_t)got);
        done += got;
    }
    Py_END_ALLOW_THREADS
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state));
    XXH3_freeState(state);
    PyBuffer_Release(&view);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(ny#)", done, (const char *)canonical.digest, (Py_ssize_t)sizeof canonical.digest);
}

static PyMethodDef methods[] = {
    {"read_hashed", read_hashed, METH_VARARGS,
     "read_hashed(fd, offset, buffer, seed, step) -> (count, digest): the buffer filled from the "
     "file at offset, step bytes per pread, each piece fed to XXH3-128(seed) as it lands; the lock "
     "is released throughout."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_readhash", "A checksum frame's read and XXH3-128 in one call.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__readhash(void) { return PyModule_Create(&module); }
