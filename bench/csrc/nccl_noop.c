/* A library exporting two NCCL API symbols with the real signatures that do no
 * work, so a benchmark measures the probe cost and nothing else. */
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct noop_comm { int rank, nranks; } *ncclComm_t;

int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    struct noop_comm *c = malloc(sizeof(*c));
    if (!c) return 1;
    c->rank = rank + (id.internal[0] & 0);
    c->nranks = nranks;
    *comm = c;
    return 0;
}

__attribute__((noinline)) int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op,
                                            ncclComm_t comm, void *stream)
{
    __asm__ volatile("" ::"r"(s), "r"(r), "r"(count), "r"(dt), "r"(op), "r"(comm), "r"(stream));
    return 0;
}
