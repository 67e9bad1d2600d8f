/* nccl_cpu.c: the exported NCCL API of the CPU NCCL library (libnccl.so.2).
 *
 * Communicator life cycle, argument checks, groups, and launching work on the
 * device (nccl_dev.c). Only the ncclXxx functions (and lab_device.h's) are
 * exported (the library is built with -fvisibility=hidden).
 *
 * Groups are per thread, as in NCCL. Between ncclGroupStart and ncclGroupEnd
 * every call is queued; ncclGroupEnd launches the queue (an ungrouped call is a
 * group of one). A launch is one work item on the device: it runs one thread
 * per distinct communicator (so ncclCommInitAll's communicators can be driven
 * from one thread); per communicator, its sends and receives move together
 * first (no deadlock whatever their order), then its collectives in call
 * order. On the CPU device the item runs before the call returns; on the
 * GPU-like device (INGERO_LAB_DEVICE=gpu) the call returns once it is
 * enqueued on its stream (a group's: its first call's), and
 * labStreamSynchronize waits for it.
 *
 * Non-blocking communicators (ncclConfig_t.blocking = 0, as in NCCL): init and
 * split run on a thread of their own and return ncclInProgress; so does a
 * launch involving one (the enqueue, not the work, runs on that thread).
 * ncclCommGetAsyncError reports ncclInProgress until it finished, then its
 * result; using the communicator before is ncclInvalidArgument. An init writes
 * the new handle before it returns; a split writes the child's only when it
 * is done (the parent's state says when). Shrink is always blocking here;
 * Grow swaps the grow id among the existing ranks blocking, then connects the
 * grown communicator as an init does (non-blocking if it is).
 *
 * A profiler plugin (NCCL_PROFILER_PLUGIN, nccl_prof.c) gets, per
 * communicator, init and finalize; per call, NCCL 2.28+'s API events; per
 * launch, a group event and one Coll/P2p event per operation, started before
 * and stopped after the enqueue, with NCCL's seqNumber (per communicator and
 * function) and function/datatype names; and from the device, its kernel
 * channels' start and stop with GPU timer stamps read while it ran:
 * collectives have 2 channels, point-to-point calls 1. A launch's calls on one
 * communicator are one kernel (one Group event; NCCL: one plan): their channels
 * carry the kernel's start and stop stamps, one device interval for all of them.
 * The transfers get NCCL's proxy events (nccl_coll.c, nccl_net.c): a ProxyOp per
 * direction of a ring collective and per peer of the other transfers, a ProxyStep
 * per transfer whose network wait is the wait on its socket.
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
#include "nccl_prof.h"

enum kind { K_ALLREDUCE, K_ALLGATHER, K_REDUCESCATTER, K_BCAST, K_REDUCE, K_SEND, K_RECV };

/* NCCL's names (ncclFuncToString, ncclDatatypeToString) as its profiler events carry them. */
static const char *const FUNC_NAME[] = {"AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce",
                                        "Send", "Recv"};
static const char *const TYPE_NAME[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64",
                                        "ncclUint64", "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
#define COLL_CHANNELS 2
#define P2P_CHANNELS 1
#define PROF_SALT 0x70726f66696c6572ULL   /* "profiler": prof_hash is not id_hash */
#define SPLIT_SALT 0x53504c4954000000ULL  /* "SPLIT" */

struct call {
  enum kind kind;
  struct ncclComm *comm;
  const void *sbuf;
  void *rbuf;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int peer;          /* root or p2p peer */
  void *stream;
  void *api;         /* the profiler's CollApi/P2pApi handle */
  void *task;        /* the profiler's Coll/P2p handle */
};

static __thread int group_depth;
static __thread struct call *queue;
static __thread int queued, queue_cap;
static __thread void *group_api;     /* the profiler's GroupApi handle of this thread's open group */
static __thread int group_api_open;
static __thread int internal;        /* > 0: the library's own exchanges: synchronous, no events */

static int valid(const struct ncclComm *c) { return c && c->magic == NCPU_COMM_MAGIC && !c->aborted; }

/* ncclCommEnsureReady: ncclInProgress is a misuse; an asynchronous error stays. */
static ncclResult_t ready(struct ncclComm *c) {
  int s = atomic_load_explicit(&c->state, memory_order_acquire);
  if (s == ncclInProgress) {
    ncpu_set_error(c, "rank %d: attempt to use communicator before the previous operation returned ncclSuccess",
                   c->rank);
    return ncclInvalidArgument;
  }
  return (ncclResult_t)s;
}

static void wait_settled(struct ncclComm *c) {
  while (atomic_load_explicit(&c->state, memory_order_acquire) == ncclInProgress) usleep(200);
}

/* Runs fn(arg) on a detached thread: a non-blocking communicator's job. */
static ncclResult_t spawn(void *(*fn)(void *), void *arg) {
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &attr, fn, arg);
  pthread_attr_destroy(&attr);
  return rc == 0 ? ncclSuccess : ncclSystemError;
}

/* 1 blocking, 0 non-blocking; -1 a config not made by NCCL_CONFIG_INITIALIZER (error set). */
static int config_blocking(const ncclConfig_t *cfg, int dflt) {
  if (!cfg) return dflt;
  if (cfg->magic != 0xcafebeef || cfg->size < offsetof(ncclConfig_t, blocking) + sizeof(int)) {
    ncpu_set_error(NULL, "ncclConfig_t was not initialized with NCCL_CONFIG_INITIALIZER");
    return -1;
  }
  if (cfg->blocking == NCCL_CONFIG_UNDEF_INT) return 1;
  if (cfg->blocking != 0 && cfg->blocking != 1) {
    ncpu_set_error(NULL, "ncclConfig_t.blocking is %d: use 0 or 1", cfg->blocking);
    return -1;
  }
  return cfg->blocking;
}

static struct ncclComm *comm_new(int rank, int nranks) {
  struct ncclComm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->magic = NCPU_COMM_MAGIC;
  c->rank = rank;
  c->nranks = nranks;
  c->timeout_ms = ncpu_timeout_ms();
  c->nnodes = 1;
  c->blocking = 1;
  atomic_init(&c->state, ncclSuccess);
  c->sfds = malloc(sizeof(int) * nranks);
  c->rfds = malloc(sizeof(int) * nranks);
  if (!c->sfds || !c->rfds) { free(c->sfds); free(c->rfds); free(c); return NULL; }
  for (int i = 0; i < nranks; i++) c->sfds[i] = c->rfds[i] = -1;
  return c;
}

static void comm_free(struct ncclComm *c) {
  if (!c) return;
  ncpu_prof_finalize(c->prof_ctx);
  for (int i = 0; i < c->nranks; i++) {
    if (c->sfds[i] >= 0) close(c->sfds[i]);
    if (c->rfds[i] >= 0) close(c->rfds[i]);
  }
  c->magic = 0;
  free(c->sfds);
  free(c->rfds);
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

/* NCCL's commHash stands for the profiler's: the same on every rank of a
 * communicator, but not the agent's fold of the id (id_hash). */
static uint64_t prof_hash_of(const ncclUniqueId *id) {
  uint64_t w[16], h = PROF_SALT;
  memcpy(w, id->internal, sizeof w);
  for (int i = 15; i >= 0; i--) h = ncpu_mix(h ^ w[i]);
  return h;
}

/* Once a communicator is connected: the profiler plugin's init (NCCL: initTransportsRank). */
static void comm_profile(struct ncclComm *c) {
  c->prof_ctx = ncpu_prof_init(c->prof_hash, c->nnodes, c->nranks, c->rank);
}

struct init_job {
  struct ncclComm *comm;
  ncclUniqueId id;
};

static void *init_job_main(void *arg) {
  struct init_job *j = arg;
  ncclResult_t res = ncpu_bootstrap(j->comm, &j->id);
  if (res == ncclSuccess) comm_profile(j->comm);
  atomic_store_explicit(&j->comm->state, res, memory_order_release);
  free(j);
  return NULL;
}

static ncclResult_t init_rank(ncclComm_t *out, int nranks, const ncclUniqueId *id, int rank,
                              const ncclConfig_t *config) {
  if (!out || nranks < 1 || nranks > NCPU_MAX_RANKS || rank < 0 || rank >= nranks) {
    ncpu_set_error(NULL, "ncclCommInitRank: invalid nranks %d or rank %d", nranks, rank);
    return ncclInvalidArgument;
  }
  *out = NULL;
  int blocking = config_blocking(config, 1);
  ncclResult_t res = ncpu_dev_check();
  if (blocking < 0) return ncclInvalidArgument;
  if (res != ncclSuccess) return res;
  struct ncclComm *c = comm_new(rank, nranks);
  if (!c) return ncclSystemError;
  c->id_hash = ncpu_hash_id(id);
  c->prof_hash = prof_hash_of(id);
  c->blocking = blocking;
  if (!blocking) {  /* NCCL writes the handle first, then connects on another thread */
    struct init_job *j = malloc(sizeof *j);
    if (!j) { comm_free(c); return ncclSystemError; }
    *j = (struct init_job){c, *id};
    atomic_store_explicit(&c->state, ncclInProgress, memory_order_relaxed);
    *out = c;
    if (spawn(init_job_main, j) != ncclSuccess) {
      free(j);
      atomic_store(&c->state, ncclSystemError);
      return ncclSystemError;
    }
    return ncclInProgress;
  }
  res = ncpu_bootstrap(c, id);
  if (res != ncclSuccess) { comm_free(c); return res; }
  comm_profile(c);
  *out = c;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, &commId, rank, NULL);
}

/* Of the config, `blocking` means something on a CPU; CTA and network settings do not. */
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  return init_rank(comm, nranks, &commId, rank, config);
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
  (void)devlist;
  if (!comms || ndev < 1 || ndev > NCPU_MAX_RANKS) return ncclInvalidArgument;
  if (ncpu_dev_check() != ncclSuccess) return ncclInvalidArgument;
  uint64_t h = 0;
  if (getrandom(&h, sizeof h, 0) != sizeof h) return ncclSystemError;
  for (int i = 0; i < ndev; i++) {
    comms[i] = comm_new(i, ndev);
    if (!comms[i]) { for (int k = 0; k < i; k++) comm_free(comms[k]); return ncclSystemError; }
    comms[i]->id_hash = h;
    comms[i]->prof_hash = ncpu_mix(h ^ PROF_SALT);
  }
  for (int i = 0; i < ndev; i++)
    for (int j = 0; j < ndev; j++) {      /* one socket pair per direction: i sends to j */
      int sv[2];
      if (i == j) continue;
      if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) {
        for (int k = 0; k < ndev; k++) { comm_free(comms[k]); comms[k] = NULL; }
        return ncclSystemError;
      }
      comms[i]->sfds[j] = sv[0];
      comms[j]->rfds[i] = sv[1];
    }
  for (int i = 0; i < ndev; i++) comm_profile(comms[i]);
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

/* A new listening socket on this rank's address (loopback for InitAll's communicators). */
static ncclResult_t listen_local(struct ncclComm *comm, int *lfd, struct sockaddr_storage *bound) {
  struct sockaddr_storage local = comm->self_addr;
  if (local.ss_family != AF_INET && local.ss_family != AF_INET6) {
    memset(&local, 0, sizeof local);
    struct sockaddr_in *s4 = (struct sockaddr_in *)&local;
    s4->sin_family = AF_INET;
    s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  return ncpu_listen_on(&local, lfd, bound);
}

/* A child communicator over the listening socket lfd and the members' addresses; on
 * success it is connected and profiled. */
static struct ncclComm *make_child(struct ncclComm *parent, int me, int m, int lfd,
                                   const struct sockaddr_storage *addrs, uint64_t salt, ncclResult_t *res) {
  struct ncclComm *c = comm_new(me, m);
  if (!c) { *res = ncclSystemError; return NULL; }
  c->id_hash = ncpu_mix(parent->id_hash ^ ncpu_mix(salt));
  c->prof_hash = ncpu_mix(parent->prof_hash ^ ncpu_mix(salt ^ SPLIT_SALT));
  c->self_addr = parent->self_addr;
  c->blocking = parent->blocking;
  *res = ncpu_build_mesh(c, lfd, addrs, c->id_hash);
  if (*res != ncclSuccess) {
    snprintf(parent->last_error, sizeof parent->last_error, "%s", c->last_error);
    comm_free(c);
    return NULL;
  }
  comm_profile(c);
  return c;
}

struct split_job {
  struct ncclComm *comm;
  int color, key, blocking;
  uint32_t split_no;
  ncclComm_t *newcomm;
};

static ncclResult_t split_run(struct split_job *j) {
  struct ncclComm *comm = j->comm;
  int n = comm->nranks, lfd = -1, color = j->color;
  /* the exchange uses the parent's sockets: nothing enqueued on the device may still */
  ncclResult_t res = ncpu_dev_sync();
  struct split_info *info = calloc(n, sizeof *info);
  int *members = malloc(sizeof(int) * n);
  struct sockaddr_storage *addrs = calloc(n, sizeof *addrs);
  if (!info || !members || !addrs) { free(info); free(members); free(addrs); return ncclSystemError; }
  struct split_info *mine = &info[comm->rank];
  mine->color = color;
  mine->key = j->key;
  if (res == ncclSuccess && color != NCCL_SPLIT_NOCOLOR) {
    res = listen_local(comm, &lfd, &mine->addr);
    if (res != ncclSuccess) ncpu_set_error(comm, "ncclCommSplit: cannot listen: %s", strerror(errno));
  }
  /* Every rank takes part in the exchange, even one that failed, so no peer hangs. */
  ncclResult_t xres = ncpu_allgather(comm, mine, info, sizeof *info, ncclUint8);
  if (res == ncclSuccess) res = xres;
  if (res == ncclSuccess && color != NCCL_SPLIT_NOCOLOR) {
    int m = 0;
    for (int r = 0; r < n; r++) if (info[r].color == color) members[m++] = r;
    qsort_r(members, m, sizeof(int), by_key, info);
    int me = 0;
    for (int k = 0; k < m; k++) {
      addrs[k] = info[members[k]].addr;
      if (members[k] == comm->rank) me = k;
    }
    struct ncclComm *c = make_child(comm, me, m, lfd, addrs, ((uint64_t)j->split_no << 32) | (uint32_t)color, &res);
    if (c) {
      c->blocking = j->blocking;
      __atomic_store_n(j->newcomm, c, __ATOMIC_RELEASE);   /* only now, as NCCL does */
    }
  }
  if (lfd >= 0) close(lfd);
  free(info); free(members); free(addrs);
  return res;
}

static void *split_job_main(void *arg) {
  struct split_job *j = arg;
  ncclResult_t res = split_run(j);
  atomic_store_explicit(&j->comm->state, res, memory_order_release);
  free(j);
  return NULL;
}

/* A non-blocking parent: returns ncclInProgress; the parent's state tells when *newcomm is written. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  if (!valid(comm) || !newcomm || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) return ncclInvalidArgument;
  ncclResult_t res = ready(comm);
  if (res != ncclSuccess) return res;
  int blocking = config_blocking(config, comm->blocking);
  if (blocking < 0) return ncclInvalidArgument;
  *newcomm = NULL;
  struct split_job *j = malloc(sizeof *j);
  if (!j) return ncclSystemError;
  *j = (struct split_job){comm, color, key, blocking, comm->splits++, newcomm};
  if (comm->blocking) {
    res = split_run(j);
    free(j);
    return res;
  }
  atomic_store_explicit(&comm->state, ncclInProgress, memory_order_release);
  if (spawn(split_job_main, j) != ncclSuccess) {
    free(j);
    atomic_store(&comm->state, ncclSuccess);
    return ncclSystemError;
  }
  return ncclInProgress;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!valid(comm)) return ncclInvalidArgument;
  wait_settled(comm);
  return ncpu_dev_sync();
}

/* Waits for the communicator's own job and for the device (which may still use it). */
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (comm->magic != NCPU_COMM_MAGIC) return ncclInvalidArgument;
  wait_settled(comm);
  ncpu_dev_sync();
  comm_free(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!valid(comm) || !asyncError) return ncclInvalidArgument;
  *asyncError = (ncclResult_t)atomic_load_explicit(&comm->state, memory_order_acquire);
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

static ncclResult_t run_collective_now(const struct call *k) {
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

static int is_p2p(const struct call *k) { return k->kind == K_SEND || k->kind == K_RECV; }

/* A collective, with the profiler's proxy events of its ring steps: 2 (N-1) per
 * direction for all-reduce (reduce-scatter, then all-gather), N-1 for either half. */
static ncclResult_t run_collective(const struct call *k) {
  int n = k->comm->nranks;
  int nsteps = k->kind == K_ALLREDUCE ? 2 * (n - 1) : k->kind == K_ALLGATHER || k->kind == K_REDUCESCATTER ? n - 1 : 1;
  ncpu_coll_profile(k->comm, k->task, nsteps);
  ncclResult_t res = run_collective_now(k);
  ncpu_coll_profile_end();
  return res;
}

static int nchannels(const struct call *k) { return is_p2p(k) ? P2P_CHANNELS : COLL_CHANNELS; }

/* Runs the calls of one communicator as one kernel: p2p together, then collectives
 * in order. As NCCL's kernel does for the tasks of one plan, every operation's
 * channels carry the kernel's start stamp (read when it starts) and its stop stamp
 * (read when all of its work is done): one device interval for the launch. A kernel
 * that failed reports no stop (its operations stay unfinished). */
static ncclResult_t run_comm_calls(struct call *calls, int n, struct ncclComm *c) {
  struct ncpu_op *ops = malloc(sizeof *ops * (n ? n : 1));
  void **kch = calloc((size_t)(n ? n : 1), sizeof(void *) * COLL_CHANNELS);
  void **tasks = calloc((size_t)(n ? n : 1), 2 * sizeof(void *));   /* then the ProxyOps */
  if (!ops || !kch || !tasks) { free(ops); free(kch); free(tasks); return ncclSystemError; }
  int nops = 0;
  ncclResult_t res = ncclSuccess;
  uint64_t g = ncpu_dev_timer(ncpu_dev_raw());
  for (int i = 0; i < n; i++)
    for (int ch = 0; ch < nchannels(&calls[i]) && calls[i].comm == c && calls[i].task; ch++)
      kch[i * COLL_CHANNELS + ch] = ncpu_prof_kch_start(c->prof_ctx, calls[i].task, ch, g);
  for (int i = 0; i < n; i++) {
    struct call *k = &calls[i];
    if (k->comm != c || !is_p2p(k)) continue;
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
    int send = k->kind == K_SEND;
    tasks[nops] = k->task;
    ops[nops++] = (struct ncpu_op){.fd = send ? c->sfds[k->peer] : c->rfds[k->peer], .is_send = send, .peer = k->peer,
                                   .buf = send ? (char *)k->sbuf : (char *)k->rbuf, .len = bytes};
  }
  if (nops) {
    ncpu_prof_single_begin(c, tasks, ops, nops, tasks + n);
    res = ncpu_run_ops(c, ops, nops);
    ncpu_prof_single_end(ops, nops, tasks + n);
  }
  for (int i = 0; i < n && res == ncclSuccess; i++)
    if (calls[i].comm == c && !is_p2p(&calls[i])) res = run_collective(&calls[i]);
  g = ncpu_dev_timer(ncpu_dev_raw());
  for (int i = 0; i < n * COLL_CHANNELS && res == ncclSuccess; i++)
    if (kch[i]) ncpu_prof_kch_stop(kch[i], g);
  free(ops); free(kch); free(tasks);
  if (res != ncclSuccess) {  /* an asynchronous error of the communicator, as in NCCL */
    int s = atomic_load(&c->state);
    if (s == ncclSuccess || s == ncclInProgress) atomic_store(&c->state, res);
  }
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

/* Distinct communicators of the calls, in order of first appearance; returns how many. */
static int distinct_comms(const struct call *calls, int n, struct ncclComm **out) {
  int m = 0;
  for (int i = 0; i < n; i++) {
    int seen = 0;
    for (int j = 0; j < m; j++) seen |= out[j] == calls[i].comm;
    if (!seen) out[m++] = calls[i].comm;
  }
  return m;
}

/* Runs the calls, one thread per distinct communicator when there are several. */
static ncclResult_t run_calls(struct call *calls, int n) {
  struct ncclComm **comms = malloc(sizeof *comms * (n ? n : 1));
  if (!comms) return ncclSystemError;
  int nj = distinct_comms(calls, n, comms);
  ncclResult_t res = ncclSuccess;
  if (nj == 1) {
    res = run_comm_calls(calls, n, comms[0]);
  } else if (nj > 1) {
    struct comm_job *jobs = calloc(nj, sizeof *jobs);
    if (!jobs) { free(comms); return ncclSystemError; }
    for (int j = 0; j < nj; j++) {
      jobs[j] = (struct comm_job){calls, n, comms[j], ncclSuccess, 0};
      pthread_create(&jobs[j].thread, NULL, comm_job_main, &jobs[j]);
    }
    for (int j = 0; j < nj; j++) {
      pthread_join(jobs[j].thread, NULL);
      if (res == ncclSuccess) res = jobs[j].res;
    }
    free(jobs);
  }
  free(comms);
  return res;
}

/* A launch: what the device runs, and owns once enqueued. */
struct batch {
  int n;
  struct call calls[];
};

static ncclResult_t batch_run(void *arg, int cancelled) {
  struct batch *b = arg;
  ncclResult_t res = cancelled ? ncclSuccess : run_calls(b->calls, b->n);
  free(b);
  return res;
}

/* NCCL's host side of a launch: seqNumber, the group and task events, the
 * enqueue, the task and group events stopped. Frees b (the device does, later). */
static ncclResult_t launch_now(struct batch *b) {
  int n = b->n;
  void **handles = calloc(2 * (size_t)n, sizeof(void *));   /* tasks, then groups */
  struct ncclComm **comms = malloc(sizeof *comms * (size_t)n);
  if (!handles || !comms) { free(handles); free(comms); free(b); return ncclSystemError; }
  int nc = distinct_comms(b->calls, n, comms), tasks = ncpu_prof_wants_tasks();
  for (int j = 0; j < nc && tasks; j++) handles[n + j] = ncpu_prof_group_start(comms[j]->prof_ctx);
  for (int i = 0; i < n; i++) {
    struct call *k = &b->calls[i];
    struct ncclComm *c = k->comm;
    int coll = !is_p2p(k);
    uint64_t seq = coll ? c->seq[k->kind]++ : 0;
    if (!tasks || !c->prof_ctx) continue;
    int g = 0;
    while (comms[g] != c) g++;
    /* NCCL describes AllGather and Broadcast tasks in bytes (ncclInt8) */
    int bytewise = k->kind == K_ALLGATHER || k->kind == K_BCAST;
    struct ncpu_prof_task t = {
        .is_coll = coll, .rank = c->rank, .seq = seq, .func = FUNC_NAME[k->kind],
        .datatype = bytewise ? TYPE_NAME[ncclInt8] : TYPE_NAME[k->type], .algo = coll ? "RING" : NULL,
        .proto = coll ? "SIMPLE" : NULL, .sendbuff = k->sbuf, .recvbuff = k->rbuf,
        .count = bytewise ? k->count * ncpu_type_size(k->type) : k->count, .root_or_peer = k->peer,
        .nchannels = coll ? COLL_CHANNELS : P2P_CHANNELS, .api = k->api, .group = handles[n + g]};
    k->task = handles[i] = ncpu_prof_task_start(c->prof_ctx, &t);
  }
  ncclResult_t res = ncpu_dev_enqueue(b->calls[0].stream, batch_run, b);   /* the first call's stream */
  for (int i = 0; i < 2 * n; i++) ncpu_prof_stop(handles[i]);
  free(handles);
  free(comms);
  return res;
}

static void *launch_job_main(void *arg) {
  struct batch *b = arg;
  int n = b->n;
  struct ncclComm **comms = malloc(sizeof *comms * (size_t)n);
  int nc = comms ? distinct_comms(b->calls, n, comms) : 0;
  ncclResult_t res = launch_now(b);
  for (int j = 0; j < nc; j++) {   /* unless the device already failed it */
    int want = ncclInProgress;
    atomic_compare_exchange_strong(&comms[j]->state, &want, res);
  }
  free(comms);
  return NULL;
}

/* Launches calls[0..n): at once, or for a group with a non-blocking communicator
 * on a thread of its own (ncclInProgress; the communicators' state says when). */
static ncclResult_t launch(const struct call *calls, int n) {
  if (internal) {
    struct call *copy = malloc(sizeof *copy * (size_t)n);
    if (!copy) return ncclSystemError;
    memcpy(copy, calls, sizeof *copy * (size_t)n);
    ncclResult_t res = run_calls(copy, n);
    free(copy);
    return res;
  }
  struct batch *b = malloc(sizeof *b + sizeof(struct call) * (size_t)n);
  if (!b) return ncclSystemError;
  b->n = n;
  memcpy(b->calls, calls, sizeof(struct call) * (size_t)n);
  int nonblocking = 0;
  for (int i = 0; i < n; i++) nonblocking |= !calls[i].comm->blocking;
  if (!nonblocking) return launch_now(b);
  for (int i = 0; i < n; i++) atomic_store_explicit(&calls[i].comm->state, ncclInProgress, memory_order_release);
  if (spawn(launch_job_main, b) != ncclSuccess) {
    for (int i = 0; i < n; i++) atomic_store(&calls[i].comm->state, ncclSuccess);
    free(b);
    return ncclSystemError;
  }
  return ncclInProgress;
}

/* NCCL 2.28+: at each call, a GroupApi event for the thread's open group (one
 * per group) and a CollApi/P2pApi event for the call. */
static void api_events(struct call *k) {
  void *ctx = k->comm->prof_ctx;
  if (!ctx || !ncpu_prof_wants_api()) return;
  if (!group_api_open) {
    group_api = ncpu_prof_group_api_start(ctx, group_depth ? group_depth : 1);
    group_api_open = 1;
    ncpu_prof_group_api_state(group_api, 0);
  }
  k->api = ncpu_prof_call_api_start(ctx, group_api, !is_p2p(k), FUNC_NAME[k->kind], k->count,
                                    TYPE_NAME[k->type], k->peer, k->stream);
  ncpu_prof_stop(k->api);
}

static void group_api_end(void) { if (group_api_open) ncpu_prof_group_api_state(group_api, 1); }

static void group_api_close(void) {
  if (group_api_open) ncpu_prof_stop(group_api);
  group_api = NULL;
  group_api_open = 0;
}

static ncclResult_t submit(struct call k) {
  if (!valid(k.comm)) return ncclInvalidArgument;
  ncclResult_t res = ready(k.comm);
  if (res != ncclSuccess) return res;
  if (ncpu_type_size(k.type) == 0 || (unsigned)k.op >= ncclNumOps) {
    ncpu_set_error(k.comm, "invalid datatype %d or reduction op %d", (int)k.type, (int)k.op);
    return ncclInvalidArgument;
  }
  if ((is_p2p(&k) || k.kind == K_BCAST || k.kind == K_REDUCE) && (k.peer < 0 || k.peer >= k.comm->nranks)) {
    ncpu_set_error(k.comm, "peer/root %d out of range [0, %d)", k.peer, k.comm->nranks);
    return ncclInvalidArgument;
  }
  if (!internal) api_events(&k);
  if (group_depth == 0) {  /* a group of one */
    group_api_end();
    res = launch(&k, 1);
    group_api_close();
    return res;
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
  group_api_end();
  ncclResult_t res = n ? launch(queue, n) : ncclSuccess;
  group_api_close();
  return res;
}

#define CALL(...) submit((struct call){__VA_ARGS__, NULL, NULL})

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_ALLREDUCE, comm, sendbuff, recvbuff, count, datatype, op, 0, stream);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_ALLGATHER, comm, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return CALL(K_REDUCESCATTER, comm, sendbuff, recvbuff, recvcount, datatype, op, 0, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_BCAST, comm, sendbuff, recvbuff, count, datatype, ncclSum, root, stream);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_REDUCE, comm, sendbuff, recvbuff, count, datatype, op, root, stream);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_SEND, comm, sendbuff, NULL, count, datatype, ncclSum, peer, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return CALL(K_RECV, comm, NULL, recvbuff, count, datatype, ncclSum, peer, stream);
}

/* ---- newer entry points (NCCL 2.22 .. 2.29; see nccl.h) ------------------- */

ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId *commIds, ncclConfig_t *config) {
  if (nId < 1 || !commIds) {
    ncpu_set_error(NULL, "ncclCommInitRankScalable: need at least one unique id (nId %d)", nId);
    return ncclInvalidArgument;
  }
  /* Real NCCL spreads the bootstrap over nId roots; on a CPU every rank goes
   * through the first id's root, which all ranks share. */
  return init_rank(newcomm, nranks, &commIds[0], myrank, config);
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
  if (--group_depth == 0) {
    queued = 0;
    group_api_end();
    group_api_close();
  }
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
  ncclResult_t res = ready(comm);
  if (res != ncclSuccess) return res;
  *newcomm = NULL;
  int n = comm->nranks, lfd = -1, m = 0, me = -1;
  char *gone = calloc(n, 1);
  struct sockaddr_storage *addrs = calloc(n, sizeof *addrs), *kept = calloc(n, sizeof *kept);
  if (!gone || !addrs || !kept) { free(gone); free(addrs); free(kept); return ncclSystemError; }
  for (int i = 0; i < excludeRanksCount; i++) {
    int r = excludeRanksList[i];
    if (r < 0 || r >= n || r == comm->rank) res = ncclInvalidArgument;
    else gone[r] = 1;
  }
  if (res == ncclSuccess) res = ncpu_dev_sync();   /* the device may still use the parent's sockets */
  if (res == ncclSuccess) res = listen_local(comm, &lfd, &addrs[comm->rank]);
  if (res == ncclSuccess) {
    internal++;   /* the library's own exchange: synchronous, not profiled */
    res = ncclGroupStart();
    for (int p = 0; p < n && res == ncclSuccess; p++) {
      if (gone[p] || p == comm->rank) continue;
      res = ncclSend(&addrs[comm->rank], sizeof *addrs, ncclUint8, p, comm, NULL);
      if (res == ncclSuccess) res = ncclRecv(&addrs[p], sizeof *addrs, ncclUint8, p, comm, NULL);
    }
    res = group_close(res);
    internal--;
  }
  uint32_t shrink_no = comm->splits++;   /* children of a comm counted together */
  if (res == ncclSuccess) {
    for (int p = 0; p < n; p++) {
      if (gone[p]) continue;
      if (p == comm->rank) me = m;
      kept[m++] = addrs[p];
    }
    *newcomm = make_child(comm, me, m, lfd, kept, 0x5348524b00000000ULL | shrink_no, &res);
  }
  if (lfd >= 0) close(lfd);
  free(gone); free(addrs); free(kept);
  return res;
}

/* [2.29] The coordinator's grow id: a fresh bootstrap root, as ncclGetUniqueId
 * makes (real NCCL derives it from the parent and passes it to the parent's
 * boundary ranks itself; here ncclCommGrow hands it to every existing rank). */
ncclResult_t ncclCommGetUniqueId(ncclComm_t comm, ncclUniqueId *uniqueId) {
  if (!valid(comm) || !uniqueId) return ncclInvalidArgument;
  ncclResult_t res = ready(comm);
  if (res != ncclSuccess) return res;
  return ncpu_root_listen((struct ncpu_id *)uniqueId->internal);
}

struct grow_info {
  int32_t has_id;
  int32_t pad;
  ncclUniqueId id;
};

/* [2.29] New ranks (comm NULL) init with the grow id and their rank. Existing
 * ranks (rank -1; only the coordinator passes the id) swap what they have over
 * the parent's mesh, then init with the coordinator's id and their parent rank:
 * every member of the grown communicator bootstraps through the same id. The
 * new communicator takes config, else the parent's blocking (existing ranks)
 * or the default (new ranks), as NCCL does. */
ncclResult_t ncclCommGrow(ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank,
                          ncclComm_t *newcomm, ncclConfig_t *config) {
  if (!newcomm || nRanks < 1 || nRanks > NCPU_MAX_RANKS) return ncclInvalidArgument;
  *newcomm = NULL;
  if (!comm) {
    if (!uniqueId || rank < 0 || rank >= nRanks) {
      ncpu_set_error(NULL, "ncclCommGrow: a new rank passes the grow id and a rank in [0, %d), got %d",
                     nRanks, rank);
      return ncclInvalidArgument;
    }
    return init_rank(newcomm, nRanks, uniqueId, rank, config);
  }
  if (!valid(comm)) return ncclInvalidArgument;
  if (rank != -1 || nRanks <= comm->nranks) {
    ncpu_set_error(comm, "ncclCommGrow: an existing rank passes rank -1 (got %d) and more than %d ranks (got %d)",
                   rank, comm->nranks, nRanks);
    return ncclInvalidArgument;
  }
  ncclResult_t res = ready(comm);
  if (res != ncclSuccess) return res;
  int blocking = config_blocking(config, comm->blocking);
  if (blocking < 0) return ncclInvalidArgument;
  int n = comm->nranks, from = -1;
  struct grow_info mine = {0};
  struct grow_info *info = calloc(n, sizeof *info);
  if (!info) return ncclSystemError;
  if (uniqueId) {
    mine.has_id = 1;
    mine.id = *uniqueId;
  }
  res = ncpu_dev_sync();   /* the exchange uses the parent's sockets: nothing queued may still */
  /* Every existing rank takes part in the exchange, even one that failed, so no peer hangs. */
  ncclResult_t xres = ncpu_allgather(comm, &mine, info, sizeof mine, ncclUint8);
  if (res == ncclSuccess) res = xres;
  for (int r = 0; r < n && res == ncclSuccess; r++) {
    if (!info[r].has_id) continue;
    if (from >= 0 && memcmp(&info[r].id, &info[from].id, sizeof info[r].id) != 0) {
      ncpu_set_error(comm, "ncclCommGrow: ranks %d and %d passed different grow ids", from, r);
      res = ncclInvalidUsage;
    }
    if (from < 0) from = r;
  }
  if (res == ncclSuccess && from < 0) {
    ncpu_set_error(comm, "ncclCommGrow: no existing rank passed the grow id (the coordinator passes what "
                   "ncclCommGetUniqueId gave it)");
    res = ncclInvalidUsage;
  }
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (res == ncclSuccess) id = info[from].id;
  free(info);
  if (res != ncclSuccess) return res;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = blocking;
  return init_rank(newcomm, nRanks, &id, comm->rank, &cfg);
}
