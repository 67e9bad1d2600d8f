/* nccl_cpu.c: the exported NCCL API of the CPU NCCL library (libnccl.so.2).
 *
 * Communicator life cycle, argument checks, and groups. Only the ncclXxx
 * functions are exported (the library is built with -fvisibility=hidden).
 *
 * Groups are per thread, as in NCCL. Between ncclGroupStart and ncclGroupEnd
 * every call is queued; ncclGroupEnd runs the queue, one thread per distinct
 * communicator (so ncclCommInitAll's communicators can be driven from one
 * thread). Per communicator, its sends and receives move together first (no
 * deadlock whatever their order), then its queued collectives in call order.
 * Outside a group every call blocks until its data has moved.
 */
#define _GNU_SOURCE
#include <pthread.h>
#pragma GCC visibility push(default)
#include "nccl.h"
#pragma GCC visibility pop
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "nccl_cpu_internal.h"

enum kind { K_ALLREDUCE, K_ALLGATHER, K_REDUCESCATTER, K_BCAST, K_REDUCE, K_SEND, K_RECV };

struct call {
  enum kind kind;
  struct ncclComm *comm;
  const void *sbuf;
  void *rbuf;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int peer;  /* root or p2p peer */
};

static __thread int group_depth;
static __thread struct call *queue;
static __thread int queued, queue_cap;

static int valid(const struct ncclComm *c) { return c && c->magic == NCPU_COMM_MAGIC && !c->aborted; }

static struct ncclComm *comm_new(int rank, int nranks) {
  struct ncclComm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->magic = NCPU_COMM_MAGIC;
  c->rank = rank;
  c->nranks = nranks;
  c->timeout_ms = ncpu_timeout_ms();
  c->fds = malloc(sizeof(int) * nranks);
  if (!c->fds) { free(c); return NULL; }
  for (int i = 0; i < nranks; i++) c->fds[i] = -1;
  return c;
}

static void comm_free(struct ncclComm *c) {
  if (!c) return;
  for (int i = 0; i < c->nranks; i++) if (c->fds[i] >= 0) close(c->fds[i]);
  c->magic = 0;
  free(c->fds);
  free(c);
}

ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  if (!uniqueId) return ncclInvalidArgument;
  return ncpu_root_listen((struct ncpu_id *)uniqueId->internal);
}

static ncclResult_t init_rank(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank) {
  if (!out || nranks < 1 || nranks > NCPU_MAX_RANKS || rank < 0 || rank >= nranks) {
    ncpu_set_error(NULL, "ncclCommInitRank: invalid nranks %d or rank %d", nranks, rank);
    return ncclInvalidArgument;
  }
  *out = NULL;
  struct ncclComm *c = comm_new(rank, nranks);
  if (!c) return ncclSystemError;
  c->id_hash = ncpu_hash_id(id);
  ncclResult_t res = ncpu_bootstrap(c, id);
  if (res != ncclSuccess) { comm_free(c); return res; }
  *out = c;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, &commId, rank);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  (void)config;  /* blocking, CTA and network settings mean nothing on a CPU */
  return init_rank(comm, nranks, &commId, rank);
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  (void)devlist;
  if (!comms || ndev < 1 || ndev > NCPU_MAX_RANKS) return ncclInvalidArgument;
  uint64_t h = 0;
  if (getrandom(&h, sizeof h, 0) != sizeof h) return ncclSystemError;
  for (int i = 0; i < ndev; i++) {
    comms[i] = comm_new(i, ndev);
    if (!comms[i]) { for (int k = 0; k < i; k++) comm_free(comms[k]); return ncclSystemError; }
    comms[i]->id_hash = h;
  }
  for (int i = 0; i < ndev; i++)
    for (int j = i + 1; j < ndev; j++) {
      int sv[2];
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) {
        for (int k = 0; k < ndev; k++) { comm_free(comms[k]); comms[k] = NULL; }
        return ncclSystemError;
      }
      comms[i]->fds[j] = sv[0];
      comms[j]->fds[i] = sv[1];
    }
  return ncclSuccess;
}

struct split_info {
  int32_t color, key;
  struct sockaddr_storage addr;
};

static int by_key(const void *a, const void *b, void *arg) {
  const struct split_info *info = arg;
  int x = *(const int *)a, y = *(const int *)b;
  if (info[x].key != info[y].key) return info[x].key < info[y].key ? -1 : 1;
  return x - y;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  (void)config;
  if (!valid(comm) || !newcomm || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) return ncclInvalidArgument;
  *newcomm = NULL;
  int n = comm->nranks, lfd = -1;
  struct split_info *info = calloc(n, sizeof *info);
  int *members = malloc(sizeof(int) * n);
  struct sockaddr_storage *addrs = calloc(n, sizeof *addrs);
  if (!info || !members || !addrs) { free(info); free(members); free(addrs); return ncclSystemError; }
  ncclResult_t res = ncclSuccess;
  struct split_info *mine = &info[comm->rank];
  {
    mine->color = color;
    mine->key = key;
    struct sockaddr_storage local = comm->self_addr;
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) {  /* InitAll: loopback */
      memset(&local, 0, sizeof local);
      struct sockaddr_in *s4 = (struct sockaddr_in *)&local;
      s4->sin_family = AF_INET;
      s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    if (color != NCCL_SPLIT_NOCOLOR) res = ncpu_listen_on(&local, &lfd, &mine->addr);
    if (res != ncclSuccess) ncpu_set_error(comm, "ncclCommSplit: cannot listen: %s", strerror(errno));
  }
  /* Every rank takes part in the exchange, even one that failed, so no peer hangs. */
  ncclResult_t xres = ncpu_allgather(comm, mine, info, sizeof *info, ncclUint8);
  if (res == ncclSuccess) res = xres;
  uint32_t split_no = comm->splits++;
  if (res == ncclSuccess && color != NCCL_SPLIT_NOCOLOR) {
    int m = 0;
    for (int r = 0; r < n; r++) if (info[r].color == color) members[m++] = r;
    qsort_r(members, m, sizeof(int), by_key, info);
    int me = 0;
    for (int k = 0; k < m; k++) {
      addrs[k] = info[members[k]].addr;
      if (members[k] == comm->rank) me = k;
    }
    struct ncclComm *c = comm_new(me, m);
    if (!c) res = ncclSystemError;
    else {
      c->id_hash = ncpu_mix(comm->id_hash ^ ncpu_mix(((uint64_t)split_no << 32) | (uint32_t)color));
      c->self_addr = comm->self_addr;
      res = ncpu_build_mesh(c, lfd, addrs, c->id_hash);
      if (res != ncclSuccess) { snprintf(comm->last_error, sizeof comm->last_error, "%s", c->last_error); comm_free(c); }
      else *newcomm = c;
    }
  }
  if (lfd >= 0) close(lfd);
  free(info); free(members); free(addrs);
  return res;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return valid(comm) ? ncclSuccess : ncclInvalidArgument; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (comm->magic != NCPU_COMM_MAGIC) return ncclInvalidArgument;
  comm_free(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!valid(comm) || !asyncError) return ncclInvalidArgument;
  *asyncError = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  if (!valid(comm) || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!valid(comm) || !device) return ncclInvalidArgument;
  *device = 0;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!valid(comm) || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  if (comm && comm->magic == NCPU_COMM_MAGIC && comm->last_error[0]) return comm->last_error;
  return ncpu_thread_error();
}

/* ---- calls and groups --------------------------------------------------- */

static ncclResult_t run_collective(const struct call *k) {
  struct ncclComm *c = k->comm;
  switch (k->kind) {
    case K_ALLREDUCE: return ncpu_allreduce(c, k->sbuf, k->rbuf, k->count, k->type, k->op);
    case K_ALLGATHER: return ncpu_allgather(c, k->sbuf, k->rbuf, k->count, k->type);
    case K_REDUCESCATTER: return ncpu_reducescatter(c, k->sbuf, k->rbuf, k->count, k->type, k->op);
    case K_BCAST: return ncpu_broadcast(c, k->sbuf, k->rbuf, k->count, k->type, k->peer);
    case K_REDUCE: return ncpu_reduce(c, k->sbuf, k->rbuf, k->count, k->type, k->op, k->peer);
    default: return ncclInternalError;
  }
}

/* Runs the queued calls of one communicator: p2p together, then collectives in order. */
static ncclResult_t run_comm_calls(struct call *calls, int n, struct ncclComm *c) {
  struct ncpu_op *ops = malloc(sizeof *ops * (n ? n : 1));
  if (!ops) return ncclSystemError;
  int nops = 0;
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < n; i++) {
    struct call *k = &calls[i];
    if (k->comm != c || (k->kind != K_SEND && k->kind != K_RECV)) continue;
    size_t bytes = k->count * ncpu_type_size(k->type);
    if (k->peer == c->rank) {  /* to self: pair with the first unmatched recv/send to self */
      if (k->kind == K_RECV) continue;
      for (int j = 0; j < n; j++)
        if (calls[j].comm == c && calls[j].kind == K_RECV && calls[j].peer == c->rank && calls[j].count != (size_t)-1) {
          memmove(calls[j].rbuf, k->sbuf, bytes);
          calls[j].count = (size_t)-1;  /* matched */
          break;
        }
      continue;
    }
    ops[nops++] = (struct ncpu_op){c->fds[k->peer], k->kind == K_SEND, k->peer,
                                   k->kind == K_SEND ? (char *)k->sbuf : (char *)k->rbuf, bytes, 0};
  }
  res = ncpu_run_ops(c, ops, nops);
  free(ops);
  for (int i = 0; i < n && res == ncclSuccess; i++)
    if (calls[i].comm == c && calls[i].kind != K_SEND && calls[i].kind != K_RECV)
      res = run_collective(&calls[i]);
  return res;
}

struct comm_job {
  struct call *calls;
  int n;
  struct ncclComm *comm;
  ncclResult_t res;
  pthread_t thread;
};

static void *comm_job_main(void *arg) {
  struct comm_job *j = arg;
  j->res = run_comm_calls(j->calls, j->n, j->comm);
  return NULL;
}

static ncclResult_t submit(struct call k) {
  if (!valid(k.comm)) return ncclInvalidArgument;
  if (ncpu_type_size(k.type) == 0 || (unsigned)k.op >= ncclNumOps) {
    ncpu_set_error(k.comm, "invalid datatype %d or reduction op %d", (int)k.type, (int)k.op);
    return ncclInvalidArgument;
  }
  if ((k.kind == K_SEND || k.kind == K_RECV || k.kind == K_BCAST || k.kind == K_REDUCE) &&
      (k.peer < 0 || k.peer >= k.comm->nranks)) {
    ncpu_set_error(k.comm, "peer/root %d out of range [0, %d)", k.peer, k.comm->nranks);
    return ncclInvalidArgument;
  }
  if (group_depth == 0) {
    if (k.kind == K_SEND || k.kind == K_RECV) return run_comm_calls(&k, 1, k.comm);
    return run_collective(&k);
  }
  if (queued == queue_cap) {
    int cap = queue_cap ? queue_cap * 2 : 64;
    struct call *q = realloc(queue, sizeof *q * cap);
    if (!q) return ncclSystemError;
    queue = q;
    queue_cap = cap;
  }
  queue[queued++] = k;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  int n = queued;
  queued = 0;
  if (n == 0) return ncclSuccess;
  struct comm_job *jobs = calloc(n, sizeof *jobs);
  if (!jobs) return ncclSystemError;
  int nj = 0;
  for (int i = 0; i < n; i++) {
    int seen = 0;
    for (int j = 0; j < nj; j++) seen |= jobs[j].comm == queue[i].comm;
    if (!seen) jobs[nj++] = (struct comm_job){queue, n, queue[i].comm, ncclSuccess, 0};
  }
  ncclResult_t res = ncclSuccess;
  if (nj == 1) {
    res = run_comm_calls(queue, n, jobs[0].comm);
  } else {
    for (int j = 0; j < nj; j++) pthread_create(&jobs[j].thread, NULL, comm_job_main, &jobs[j]);
    for (int j = 0; j < nj; j++) {
      pthread_join(jobs[j].thread, NULL);
      if (res == ncclSuccess) res = jobs[j].res;
    }
  }
  free(jobs);
  return res;
}

#define CALL(...) submit((struct call){__VA_ARGS__})

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_ALLREDUCE, comm, sendbuff, recvbuff, count, datatype, op, 0);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_ALLGATHER, comm, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  (void)stream;
  return CALL(K_REDUCESCATTER, comm, sendbuff, recvbuff, recvcount, datatype, op, 0);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_BCAST, comm, sendbuff, recvbuff, count, datatype, ncclSum, root);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_REDUCE, comm, sendbuff, recvbuff, count, datatype, op, root);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_SEND, comm, sendbuff, NULL, count, datatype, ncclSum, peer);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  (void)stream;
  return CALL(K_RECV, comm, NULL, recvbuff, count, datatype, ncclSum, peer);
}

/* ---- newer entry points (NCCL 2.22 .. 2.28; see nccl.h) ------------------- */

ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId *commIds, ncclConfig_t *config) {
  (void)config;
  if (nId < 1 || !commIds) {
    ncpu_set_error(NULL, "ncclCommInitRankScalable: need at least one unique id (nId %d)", nId);
    return ncclInvalidArgument;
  }
  /* Real NCCL spreads the bootstrap over nId roots; on a CPU every rank goes
   * through the first id's root, which all ranks share. */
  return init_rank(newcomm, nranks, &commIds[0], myrank);
}

/* Closes the group like ncclGroupEnd but launches nothing: the queued calls are
 * dropped and estimatedTime is their bytes at 1 GB/s, in microseconds (a CPU has
 * no tuning model; only the shape of the answer is NCCL's). */
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo) {
  if (!simInfo) return ncclInvalidArgument;
  if (group_depth == 0) return ncclInvalidUsage;
  double bytes = 0;
  for (int i = 0; i < queued; i++) bytes += (double)queue[i].count * ncpu_type_size(queue[i].type);
  simInfo->estimatedTime = (float)(bytes / 1e3);
  if (--group_depth == 0) queued = 0;
  return ncclSuccess;
}

/* AlltoAll, Gather and Scatter as grouped sends and receives on the comm's
 * mesh (self blocks are paired in memory by run_comm_calls). */
static ncclResult_t group_close(ncclResult_t res) {
  ncclResult_t end = ncclGroupEnd();
  return res != ncclSuccess ? res : end;
}

ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  size_t es = ncpu_type_size(datatype);
  if (!valid(comm) || !es) return ncclInvalidArgument;
  ncclResult_t res = ncclGroupStart();
  for (int p = 0; p < comm->nranks && res == ncclSuccess; p++) {
    res = ncclSend((const char *)sendbuff + (size_t)p * count * es, count, datatype, p, comm, stream);
    if (res == ncclSuccess)
      res = ncclRecv((char *)recvbuff + (size_t)p * count * es, count, datatype, p, comm, stream);
  }
  return group_close(res);
}

ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count,
                        ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  size_t es = ncpu_type_size(datatype);
  if (!valid(comm) || !es || root < 0 || root >= comm->nranks) return ncclInvalidArgument;
  ncclResult_t res = ncclGroupStart();
  if (res == ncclSuccess) res = ncclSend(sendbuff, count, datatype, root, comm, stream);
  if (comm->rank == root)
    for (int p = 0; p < comm->nranks && res == ncclSuccess; p++)
      res = ncclRecv((char *)recvbuff + (size_t)p * count * es, count, datatype, p, comm, stream);
  return group_close(res);
}

ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  size_t es = ncpu_type_size(datatype);
  if (!valid(comm) || !es || root < 0 || root >= comm->nranks) return ncclInvalidArgument;
  ncclResult_t res = ncclGroupStart();
  if (comm->rank == root)
    for (int p = 0; p < comm->nranks && res == ncclSuccess; p++)
      res = ncclSend((const char *)sendbuff + (size_t)p * count * es, count, datatype, p, comm, stream);
  if (res == ncclSuccess) res = ncclRecv(recvbuff, count, datatype, root, comm, stream);
  return group_close(res);
}

/* Only the survivors call it (the excluded ranks may be gone). They swap their
 * new listening addresses over the parent's mesh, then build a fresh mesh
 * numbered in parent order. */
ncclResult_t ncclCommShrink(ncclComm_t comm, int *excludeRanksList, int excludeRanksCount,
                            ncclComm_t *newcomm, ncclConfig_t *config, int shrinkFlags) {
  (void)config; (void)shrinkFlags;
  if (!valid(comm) || !newcomm || excludeRanksCount < 0 || (excludeRanksCount && !excludeRanksList))
    return ncclInvalidArgument;
  *newcomm = NULL;
  int n = comm->nranks, lfd = -1, m = 0, me = -1;
  char *gone = calloc(n, 1);
  struct sockaddr_storage *addrs = calloc(n, sizeof *addrs), *kept = calloc(n, sizeof *kept);
  if (!gone || !addrs || !kept) { free(gone); free(addrs); free(kept); return ncclSystemError; }
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < excludeRanksCount; i++) {
    int r = excludeRanksList[i];
    if (r < 0 || r >= n || r == comm->rank) res = ncclInvalidArgument;
    else gone[r] = 1;
  }
  struct sockaddr_storage local = comm->self_addr;
  if (local.ss_family != AF_INET && local.ss_family != AF_INET6) {  /* InitAll: loopback */
    memset(&local, 0, sizeof local);
    struct sockaddr_in *s4 = (struct sockaddr_in *)&local;
    s4->sin_family = AF_INET;
    s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  if (res == ncclSuccess) res = ncpu_listen_on(&local, &lfd, &addrs[comm->rank]);
  if (res == ncclSuccess) {
    res = ncclGroupStart();
    for (int p = 0; p < n && res == ncclSuccess; p++) {
      if (gone[p] || p == comm->rank) continue;
      res = ncclSend(&addrs[comm->rank], sizeof *addrs, ncclUint8, p, comm, NULL);
      if (res == ncclSuccess) res = ncclRecv(&addrs[p], sizeof *addrs, ncclUint8, p, comm, NULL);
    }
    res = group_close(res);
  }
  uint32_t shrink_no = comm->splits++;   /* children of a comm counted together */
  if (res == ncclSuccess) {
    for (int p = 0; p < n; p++) {
      if (gone[p]) continue;
      if (p == comm->rank) me = m;
      kept[m++] = addrs[p];
    }
    struct ncclComm *c = comm_new(me, m);
    if (!c) res = ncclSystemError;
    else {
      c->id_hash = ncpu_mix(comm->id_hash ^ ncpu_mix(0x5348524b00000000ULL | shrink_no));
      c->self_addr = comm->self_addr;
      res = ncpu_build_mesh(c, lfd, kept, c->id_hash);
      if (res != ncclSuccess) { snprintf(comm->last_error, sizeof comm->last_error, "%s", c->last_error); comm_free(c); }
      else *newcomm = c;
    }
  }
  if (lfd >= 0) close(lfd);
  free(gone); free(addrs); free(kept);
  return res;
}
