/* `inflight_threads LIB N`: N threads each call LIB's ncclAllReduce, which blocks
 * (reads a pipe nobody writes) until the process ends: N NCCL calls in flight.
 * Prints "ready" after a line on stdin says the probes are attached, and once every
 * thread has called; exits at the next line. For bench/inflight_cost.py. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int (*allreduce_t)(const void *, void *, size_t, int, int, void *, void *);
static allreduce_t g_ar;
static int g_entered;

static void *blocked_call(void *arg)
{
    (void)arg;
    __atomic_add_fetch(&g_entered, 1, __ATOMIC_SEQ_CST);
    g_ar(NULL, NULL, 1, 7, 0, (void *)0x1, NULL);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) return 2;
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h || !(g_ar = (allreduce_t)dlsym(h, "ncclAllReduce"))) return 2;
    int n = atoi(argv[2]);
    char line[16];
    printf("loaded\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 2;
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, blocked_call, NULL)) return 3;
    }
    while (__atomic_load_n(&g_entered, __ATOMIC_SEQ_CST) < n) usleep(1000);
    usleep(100000);   /* the last threads are inside the call by now */
    printf("ready\n");
    fflush(stdout);
    fgets(line, sizeof line, stdin);
    return 0;
}
