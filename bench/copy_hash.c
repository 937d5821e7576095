/* The floor under `load_vs_raw` with no Python at all: bench/copy_hash.py's read in C. A
 * measurement behind docs/performance.md (Storage, twenty-first session), not a test.
 *
 *   pip download --no-deps --no-binary :all: xxhash==4.1.0 -d /tmp/xxsd && tar xzf /tmp/xxsd/xxhash-4.1.0.tar.gz -C /tmp/xxsd
 *   gcc -O2 -march=native -pthread -I/tmp/xxsd/xxhash-4.1.0/deps/xxhash bench/copy_hash.c -o /tmp/copy_hash
 *   mkdir -p /tmp/copy-hash && /tmp/copy_hash /tmp/copy-hash    # writes f0..f8 there if absent
 *
 * Nine files (31.5 MB of random bytes each, the ratio line's part size and batch) read warm by 1 and 2 threads into page-faulted buffers: whole (one pread), and in
 * slices of 64 KiB to 512 KiB, each slice hashed with XXH3-128 right after its pread.
 */
#define XXH_INLINE_ALL
#include "xxhash.h"
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define SIZE (31500000 / 4096 * 4096)
#define FILES 9
static unsigned char *bufs[FILES];
static const char *dir;
static long step;
static int hash, nthreads;
static void *work(void *a) {
    for (long i = (long)a; i < FILES; i += nthreads) {
        char p[4096];
        snprintf(p, sizeof p, "%s/f%ld", dir, i);
        int fd = open(p, O_RDONLY);
        if (fd < 0) { perror(p); exit(1); }
        XXH3_state_t st;
        XXH3_128bits_reset(&st);
        for (long off = 0; off < SIZE; off += step) {
            long n = SIZE - off < step ? SIZE - off : step;
            long got = pread(fd, bufs[i] + off, n, off);
            if (hash) XXH3_128bits_update(&st, bufs[i] + off, got);
        }
        close(fd);
    }
    return 0;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    dir = argc > 1 ? argv[1] : "/tmp/copy-hash";
    unsigned char *data = malloc(SIZE);
    for (long j = 0; j < SIZE; j++) data[j] = (unsigned char)rand();
    for (int i = 0; i < FILES; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/f%d", dir, i);
        if (access(p, R_OK) == 0) continue;
        int fd = open(p, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd < 0 || write(fd, data, SIZE) != SIZE) { perror(p); return 1; }
        close(fd);
    }
    free(data);
    for (int i = 0; i < FILES; i++) {
        bufs[i] = mmap(0, SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        for (long j = 0; j < SIZE; j += 4096) bufs[i][j] = 1;
    }
    long steps[] = {SIZE, 64 << 10, 128 << 10, 256 << 10, 512 << 10};
    for (nthreads = 1; nthreads <= 2; nthreads++)
        for (int s = 0; s < 5; s++)
            for (hash = 0; hash <= 1; hash++) {
                if (s == 0 && hash) continue;
                step = steps[s];
                double best = 1e9;
                for (int r = 0; r < 9; r++) {
                    double t = now();
                    pthread_t th[2];
                    for (long k = 0; k < nthreads; k++) pthread_create(&th[k], 0, work, (void *)k);
                    for (int k = 0; k < nthreads; k++) pthread_join(th[k], 0);
                    t = now() - t;
                    if (t < best) best = t;
                }
                printf("threads=%d slice=%ldK hash=%d %.2f GB/s\n", nthreads, step >> 10, hash, (double)FILES * SIZE / best / 1e9);
                fflush(stdout);
            }
    return 0;
}
