/* A library whose ncclAllReduce (the real signature) never returns: it reads a
 * pipe nobody writes. For bench/inflight_cost.py: calls that stay in flight. */
#include <stddef.h>
#include <unistd.h>

__attribute__((noinline)) int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op,
                                            void *comm, void *stream)
{
    int fd[2];
    char c;
    __asm__ volatile("" ::"r"(s), "r"(r), "r"(count), "r"(dt), "r"(op), "r"(comm), "r"(stream));
    if (pipe(fd) == 0)
        while (read(fd[0], &c, 1) != 0) {}
    return 0;
}
