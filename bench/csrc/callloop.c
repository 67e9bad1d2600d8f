/* callloop LIB N: calls ncclCommInitRank once, then ncclAllReduce N times, and
 * prints the mean nanoseconds per call. Waits for a line on stdin first, so the
 * benchmark can attach probes to this process's library before the loop. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef int (*init_fn)(void **, int, ncclUniqueId, int);
typedef int (*ar_fn)(const void *, void *, size_t, int, int, void *, void *);

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: callloop LIB N\n"); return 2; }
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    init_fn init = (init_fn)dlsym(h, "ncclCommInitRank");
    ar_fn ar = (ar_fn)dlsym(h, "ncclAllReduce");
    long n = atol(argv[2]);
    char line[64];
    printf("ready\n"); fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    ncclUniqueId id; memset(&id, 7, sizeof id);
    void *comm = NULL;
    init(&comm, 1, id, 0);
    float buf[4];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) ar(buf, buf, 4, 7, 0, comm, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("%.1f\n", ns / n);
    return 0;
}
