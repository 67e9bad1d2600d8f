/* nccl_cpu_internal.h: what nccl_cpu.c (API, collectives, groups), nccl_net.c
 * (TCP bootstrap, mesh set-up, nonblocking transfer engine) and nccl_dev.c (the
 * device: stream thread and GPU timer) share.
 * Not installed; not part of the NCCL API.
 */
#ifndef NCCL_CPU_INTERNAL_H_
#define NCCL_CPU_INTERNAL_H_

#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include "nccl.h"

#define NCPU_COMM_MAGIC 0x4e43434c43505531ULL /* "NCCLCPU1" */
#define NCPU_ID_MAGIC 0x31555043u             /* "CPU1", first 4 bytes of every unique id */
#define NCPU_MAX_RANKS 1024

/* Layout of ncclUniqueId.internal (128 bytes). The root's address comes
 * first and the nonce last, so two ids may share their first bytes and still
 * name different communicators (the root groups ranks by all 128 bytes). */
struct ncpu_id {
  uint32_t magic;
  uint16_t family;   /* AF_INET / AF_INET6 */
  uint16_t port;     /* network order */
  uint8_t addr[16];  /* IPv4 in the first 4 bytes */
  uint8_t fill[96];  /* random */
  uint64_t nonce;    /* random */
};
_Static_assert(sizeof(struct ncpu_id) == NCCL_UNIQUE_ID_BYTES, "ncpu_id must be 128 bytes");

struct ncclComm {
  uint64_t magic;
  int rank;
  int nranks;
  int *sfds;             /* sfds[peer]: the connected TCP (or AF_UNIX) socket this rank sends to
                            peer on; -1 for self */
  int *rfds;             /* rfds[peer]: the one it receives from peer on. One connection per
                            direction, as NCCL's network transport has (a send and a receive
                            comm per peer): the reverse path of a transfer carries only ACKs */
  uint64_t id_hash;      /* splitmix64 fold of the unique id (0 for split/InitAll children) */
  struct sockaddr_storage self_addr; /* this rank's address (port 0), for splits */
  int timeout_ms;        /* no progress for this long -> ncclRemoteError */
  int aborted;
  uint32_t splits;        /* ncclCommSplit calls so far (same on every rank) */
  int nnodes;            /* distinct host addresses among the ranks */
  int blocking;          /* 0: a non-blocking communicator (ncclConfig_t.blocking = 0) */
  _Atomic int state;     /* ncclCommGetAsyncError: ncclInProgress while an init, split or
                            launch is under way on another thread, then its result */
  uint64_t prof_hash;    /* what a profiler plugin gets as commHash (not id_hash: NCCL's own) */
  void *prof_ctx;        /* the profiler plugin's context (NULL: none) */
  uint64_t seq[8];       /* launched collectives per function (enum kind): NCCL's seqNumber */
  char last_error[256];
};

/* One point-to-point transfer on a socket, driven by ncpu_run_ops. */
struct ncpu_op {
  int fd;
  int is_send;
  int peer;              /* for error messages */
  char *buf;
  size_t len;
  size_t done;
  void *step;            /* the profiler's ProxyStep of this transfer (NULL: none) */
  int peer_wait;         /* its step is in SendPeerWait (the peer's window is closed) */
};

/* nccl_net.c */
int ncpu_timeout_ms(void);
ncclResult_t ncpu_root_listen(struct ncpu_id *id);
ncclResult_t ncpu_bootstrap(struct ncclComm *comm, const ncclUniqueId *id);
ncclResult_t ncpu_listen_on(const struct sockaddr_storage *local, int *lfd,
                            struct sockaddr_storage *bound);
ncclResult_t ncpu_build_mesh(struct ncclComm *comm, int lfd, const struct sockaddr_storage *addrs,
                             uint64_t tag);
ncclResult_t ncpu_run_ops(struct ncclComm *comm, struct ncpu_op *ops, int nops);
/* Around ncpu_run_ops, for transfers that are one step each (p2p, broadcast, reduce): a
 * ProxyOp per op under tasks[i] (NULL: none), its step in ops[i].step; _end stops them. */
void ncpu_prof_single_begin(struct ncclComm *comm, void *const *tasks, struct ncpu_op *ops, int n, void **proxies);
void ncpu_prof_single_end(struct ncpu_op *ops, int n, void **proxies);
void ncpu_set_error(struct ncclComm *comm, const char *fmt, ...);
const char *ncpu_thread_error(void);
uint64_t ncpu_mix(uint64_t x);
uint64_t ncpu_hash_id(const ncclUniqueId *id);

/* nccl_dev.c: work runs on the device (INGERO_LAB_DEVICE=gpu: on a stream's thread,
 * in order; cpu: in the calling thread, at once). A work function gets cancelled = 1
 * after an earlier item failed: it must only free its argument. */
typedef ncclResult_t (*ncpu_work_fn)(void *arg, int cancelled);
ncclResult_t ncpu_dev_check(void);           /* a bad INGERO_LAB_DEVICE: ncclInvalidArgument */
int ncpu_dev_async(void);
ncclResult_t ncpu_dev_enqueue(void *stream, ncpu_work_fn fn, void *arg);   /* stream: cudaStream_t */
ncclResult_t ncpu_dev_sync(void);            /* waits for what every stream was given; the sticky error */
uint64_t ncpu_dev_raw(void);                 /* CLOCK_MONOTONIC_RAW, ns */
uint64_t ncpu_dev_timer(uint64_t raw);       /* the GPU timer at that raw time */

/* nccl_coll.c: collective algorithms over a comm's mesh; count in elements. */
size_t ncpu_type_size(ncclDataType_t t);
ncclResult_t ncpu_allreduce(struct ncclComm *c, const void *s, void *r, size_t count,
                            ncclDataType_t t, ncclRedOp_t op);
ncclResult_t ncpu_allgather(struct ncclComm *c, const void *s, void *r, size_t sendcount,
                            ncclDataType_t t);
ncclResult_t ncpu_reducescatter(struct ncclComm *c, const void *s, void *r, size_t recvcount,
                                ncclDataType_t t, ncclRedOp_t op);
ncclResult_t ncpu_broadcast(struct ncclComm *c, const void *s, void *r, size_t count,
                            ncclDataType_t t, int root);
ncclResult_t ncpu_reduce(struct ncclComm *c, const void *s, void *r, size_t count,
                         ncclDataType_t t, ncclRedOp_t op, int root);
/* The profiler task of the collective this thread runs next (NULL: none), and how many
 * network steps it takes per direction; _end stops its ProxyOps. */
void ncpu_coll_profile(struct ncclComm *c, void *task, int nsteps);
void ncpu_coll_profile_end(void);

#endif
