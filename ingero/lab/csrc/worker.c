/* worker.c: ingero-lab-worker, a data-parallel "training" rank on the NCCL API
 * (or, with INGERO_LAB_LAYOUT, a tensor x pipeline x data parallel one: run_layout).
 *
 * Reads the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID).
 * Rank 0 calls ncclGetUniqueId and hands the id to every other rank through a
 * tiny TCP store on MASTER_ADDR:MASTER_PORT. Communicators:
 *   A  ncclCommInitRank(world) with id X
 *   B  ncclCommInitRankConfig(world) with X whose last 8 bytes are flipped
 *   C  ncclCommSplit(A, color = GROUP_RANK, key = LOCAL_RANK)   (per node)
 * Each step: host-side busy work (INGERO_LAB_CPU_MS, default 3 ms), a compute
 * kernel (INGERO_LAB_COMPUTE_MS, default 40 ms, a sleep on the device), an
 * optional checkpoint (INGERO_LAB_IO_MB written to INGERO_LAB_IO_DIR and
 * fsync'd), then AllReduce (A, float32, INGERO_LAB_ELEMS elements), AllGather
 * (B), ReduceScatter and Broadcast (C), and a ring Send/Recv in a group (A);
 * then the step synchronises with the device (labStreamSynchronize, like
 * loss.item()) and checks every result.
 *
 * The device (lab_device.h, INGERO_LAB_DEVICE): on the CPU device (default)
 * kernels and NCCL calls run when they are called; on the GPU-like one
 * (gpu) they are enqueued on device streams (compute on the default stream,
 * each communicator's calls on a stream of its own, as PyTorch's process
 * groups: issue, joined) and the host runs ahead until the step's
 * synchronisation; there a checkpoint is written after it (the model state has
 * to come off the device first). INGERO_LAB_NONBLOCKING=1:
 * every communicator is non-blocking (ncclConfig_t.blocking = 0, PyTorch's
 * TORCH_NCCL_USE_COMM_NONBLOCKING): A and B are created with
 * ncclCommInitRankConfig, splits pass the config, and after each call that
 * returns ncclInProgress the host polls ncclCommGetAsyncError until it
 * settles, as PyTorch does.
 *
 * INGERO_LAB_ELASTIC=1 (`ingero lab run --elastic`): after the steps, the
 * survivors shrink A without one rank, run on it, then grow back to the world
 * with a grow id the excluded rank gets through the store (run_elastic).
 *
 * A fault that starts later (`ingero lab --fault-after`): from wall-clock time
 * INGERO_LAB_FAULT_FROM_NS on, the step uses INGERO_LAB_FAULT_COMPUTE_MS and
 * INGERO_LAB_FAULT_IO_MB (when set) instead.
 *
 * Rank 0 decides when to stop (INGERO_LAB_STEPS steps or INGERO_LAB_SECONDS
 * seconds, or earlier at its first step after INGERO_LAB_STOP_FILE exists) and
 * says so in the last element of every AllReduce (the layout job: through the
 * store, stop_begin_step), so all ranks run the same number of steps. Every result is checked; wrong data exits 4.
 * A dead peer fails the NCCL call after INGERO_LAB_TIMEOUT_S (default 60 s),
 * exit 3. Prints a line every INGERO_LAB_PRINT_EVERY steps and a final JSON
 * line: {"rank":…, "steps":…, "mean_step_ms":…, …}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "lab_device.h"
#include "nccl.h"

static int g_rank = -1;
static const char *g_stop_file;   /* INGERO_LAB_STOP_FILE: rank 0 stops once it exists */
static int g_nonblocking;   /* INGERO_LAB_NONBLOCKING: non-blocking communicators */
static int g_async;         /* the device is GPU-like: work runs after the call returned */

static void die(int code, const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "ingero-lab-worker: rank %d: ", g_rank);
  fprintf(stderr, fmt, a, b);
  fputc('\n', stderr);
  exit(code);
}

static void nccl_check(ncclResult_t r, const char *what, ncclComm_t comm) {
  if (r == ncclSuccess) return;
  char msg[512];
  snprintf(msg, sizeof msg, "%s (%s)", ncclGetErrorString(r), ncclGetLastError(comm));
  die(3, "%s failed: %s", what, msg);
}

/* An NCCL call's result: ncclInProgress (a non-blocking communicator) is polled
 * with ncclCommGetAsyncError until it settles; anything but success exits. */
static void settle(ncclResult_t r, const char *what, ncclComm_t comm) {
  while (r == ncclInProgress && comm) {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  nccl_check(r, what, comm);
}

/* The step's synchronisation point: the host waits for the device to drain. */
static void step_sync(void) {
  ncclResult_t r = labDeviceSynchronize();
  if (r != ncclSuccess) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s (%s)", ncclGetErrorString(r), ncclGetLastError(NULL));
    die(3, "%s failed: %s", "the device", msg);
  }
}

static void compute(double ms) { nccl_check(labLaunchKernel(ms, NULL), "labLaunchKernel", NULL); }

/* Streams, as PyTorch's ProcessGroupNCCL has them: compute runs on the default stream
 * (NULL), each communicator's calls on a stream of its own. A call is issued on its
 * communicator's stream after that stream waits for the compute enqueued so far
 * (issue); a synchronous call's result is used by later compute, which waits for the
 * communicator's stream (joined: work.wait()); an asynchronous one (async_op=True) is
 * joined later, so it runs beside what comes between. */
static struct { ncclComm_t comm; cudaStream_t stream; } g_streams[16];
static int g_nstreams;

static cudaStream_t stream_of(ncclComm_t comm) {
  for (int i = 0; i < g_nstreams; i++)
    if (g_streams[i].comm == comm) return g_streams[i].stream;
  if (g_nstreams == 16) die(3, "more than 16 communicators%s%s", "", "");
  cudaStream_t s;
  nccl_check(labStreamCreate(&s), "labStreamCreate", NULL);
  g_streams[g_nstreams].comm = comm;
  g_streams[g_nstreams++].stream = s;
  return s;
}

static cudaStream_t issue(ncclComm_t comm) {
  cudaStream_t s = stream_of(comm);
  nccl_check(labStreamWaitStream(s, NULL), "labStreamWaitStream", NULL);
  return s;
}

static void joined(ncclComm_t comm) { nccl_check(labStreamWaitStream(NULL, stream_of(comm)), "labStreamWaitStream", NULL); }

static long env_long(const char *name, long def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end) die(2, "%s must be an integer, got %s", name, v);
  return x;
}

static double env_double(const char *name, double def) {
  const char *v = getenv(name);
  return (v && *v) ? atof(v) : def;
}

static const char *env_req(const char *name) {
  const char *v = getenv(name);
  if (!v || !*v) die(2, "%s is not set (run under torchrun or `ingero lab`)%s", name, "");
  return v;
}

static long long wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Rank 0's stop decision at the end of a step. */
static int stop_now(long step, long steps_max, double t0, double seconds) {
  return (steps_max > 0 && step + 1 >= steps_max) || (seconds > 0 && now_s() - t0 >= seconds) ||
         (g_stop_file && access(g_stop_file, F_OK) == 0);
}

/* ---- the tiny store: rank 0 serves the unique id to WORLD_SIZE-1 ranks --- */

static int store_socket(const char *host, const char *port, int listening, int timeout_s) {
  struct addrinfo hints = {0}, *res;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = listening ? AI_PASSIVE : 0;
  if (getaddrinfo(host, port, &hints, &res) != 0) die(2, "cannot resolve MASTER_ADDR %s:%s", host, port);
  double deadline = now_s() + timeout_s;
  for (;;) {
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct timeval tv = {timeout_s, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (listening) {
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (bind(fd, res->ai_addr, res->ai_addrlen) == 0 && listen(fd, 256) == 0) { freeaddrinfo(res); return fd; }
    } else if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    int e = errno;
    close(fd);
    if (now_s() > deadline) die(3, "store at %s: %s", host, strerror(e));
    usleep(100 * 1000);
  }
}

/* clients > 0: hand *id to that many ranks asking for `what`; 0: ask for it. */
static void store_id(ncclUniqueId *id, const char *what, int clients, const char *run_id, int timeout_s) {
  const char *host = env_req("MASTER_ADDR"), *port = env_req("MASTER_PORT");
  char req[256], got[256];
  int n = snprintf(req, sizeof req, "GET %s %s\n", what, run_id);
  if (clients > 0) {
    int lfd = store_socket(host, port, 1, timeout_s);
    for (int served = 0; served < clients;) {
      int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
      if (fd < 0) die(3, "store: no rank connected within the timeout (%s)%s", strerror(errno), "");
      struct timeval tv = {timeout_s, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      ssize_t k = recv(fd, got, (size_t)n, MSG_WAITALL);
      if (k == n && memcmp(got, req, (size_t)n) == 0 && send(fd, id, sizeof *id, MSG_NOSIGNAL) == sizeof *id)
        served++;
      close(fd);
    }
    close(lfd);
  } else {
    int fd = store_socket(host, port, 0, timeout_s);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n || recv(fd, id, sizeof *id, MSG_WAITALL) != sizeof *id)
      die(3, "store at %s: could not read the NCCL id (%s)", host, strerror(errno));
    close(fd);
  }
}

static void exchange_id(ncclUniqueId *id, int world, const char *run_id, int timeout_s) {
  if (g_rank == 0) {
    nccl_check(ncclGetUniqueId(id), "ncclGetUniqueId", NULL);
    if (world > 1) store_id(id, "nccl_id", world - 1, run_id, timeout_s);
  } else {
    store_id(id, "nccl_id", 0, run_id, timeout_s);
  }
}

/* ---- one training step ---------------------------------------------------- */

static void busy_ms(double ms) {
  double end = now_s() + ms / 1000.0;
  volatile double x = 1.0;
  while (now_s() < end)
    for (int i = 0; i < 2000; i++) x = x * 1.0000001 + 1e-9;
}

static void checkpoint(const char *dir, int rank, long mb, char *junk, size_t junk_len) {
  char path[4096];
  snprintf(path, sizeof path, "%s/ingero-lab-rank%d.ckpt", dir, rank);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) die(2, "cannot write checkpoint %s: %s", path, strerror(errno));
  for (long i = 0; i < mb; i++)
    if (write(fd, junk, junk_len) != (ssize_t)junk_len) die(2, "checkpoint %s: %s", path, strerror(errno));
  if (fsync(fd) != 0) die(2, "fsync %s: %s", path, strerror(errno));
  close(fd);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The kernel's runqueue wait of this process so far, ns: the sum over its threads of
 * /proc/self/task/<tid>/schedstat's second field (run_delay: time runnable but waiting for a
 * CPU; CONFIG_SCHED_INFO). -1 when the kernel does not keep it. The lab reports it so a
 * test can tell a rank the machine starved from one the tracer only says was starved. */
static long long runq_ns(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  long long total = 0;
  int seen = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%s/schedstat", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;                 /* the thread has exited */
    unsigned long long cpu, wait;
    if (fscanf(f, "%llu %llu", &cpu, &wait) == 2) {
      total += (long long)wait;
      seen = 1;
    }
    fclose(f);
  }
  closedir(d);
  return seen ? total : -1;
}

/* Step times of one rank: kept (the first million) for the final p50 and max; the
 * process's runqueue wait when the steps began. */
struct steps {
  double *times, sum;
  long n, every;
  long long runq0;
};

static void steps_init(struct steps *s, long every) {
  s->times = malloc(sizeof(double) * 1000000);
  s->sum = 0;
  s->runq0 = runq_ns();
  s->n = 0;
  s->every = every;
}

/* One more step of `dt` ms; prints a progress line every `every` steps. */
static void step_done(struct steps *s, double dt) {
  if (s->n < 1000000) s->times[s->n] = dt;
  s->sum += dt;
  s->n++;
  if (s->every > 0 && s->n % s->every == 0) {
    printf("rank %d step %ld step_ms %.1f\n", g_rank, s->n, dt);
    fflush(stdout);
  }
}

/* The final JSON line's step fields: "steps", "mean_step_ms", "p50_step_ms", "max_step_ms",
 * and "runq_ms": the process's runqueue wait during the steps (absent when unknown; a
 * thread that exited meanwhile takes its share with it). */
static void print_steps(struct steps *s) {
  long kept = s->n < 1000000 ? s->n : 1000000;
  qsort(s->times, kept, sizeof(double), cmp_double);
  printf("\"steps\": %ld, \"mean_step_ms\": %.3f, \"p50_step_ms\": %.3f, \"max_step_ms\": %.3f", s->n,
         s->n ? s->sum / s->n : 0.0, kept ? s->times[kept / 2] : 0.0, kept ? s->times[kept - 1] : 0.0);
  long long now = runq_ns();
  if (s->runq0 >= 0 && now >= s->runq0) printf(", \"runq_ms\": %.3f", (now - s->runq0) / 1e6);
}

/* [probes] ncclAlltoAll, ncclGather (root 0), ncclScatter (root world-1) on `comm`,
 * where this rank is `me` of `world`, each checked; 0 when every result is right. */
static int newer_collectives(ncclComm_t comm, int me, int world, long step) {
  enum { N = 64 };
  int bad = 0;
  float *s = calloc((size_t)N * world, sizeof(float)), *r = calloc((size_t)N * world, sizeof(float));
  for (int p = 0; p < world; p++)
    for (int i = 0; i < N; i++) s[p * N + i] = (float)(me * 1000 + p) + (float)(step % 3);
  settle(ncclAlltoAll(s, r, N, ncclFloat32, comm, NULL), "ncclAlltoAll", comm);
  step_sync();
  for (int p = 0; p < world; p++) bad |= r[p * N] != (float)(p * 1000 + me) + (float)(step % 3);
  settle(ncclGather(s, r, N, ncclFloat32, 0, comm, NULL), "ncclGather", comm);
  step_sync();
  if (me == 0)
    for (int p = 0; p < world; p++) bad |= r[p * N + N - 1] != (float)(p * 1000) + (float)(step % 3);
  settle(ncclScatter(s, r, N, ncclFloat32, world - 1, comm, NULL), "ncclScatter", comm);
  step_sync();
  bad |= r[0] != (float)((world - 1) * 1000 + me) + (float)(step % 3);
  if (bad) fprintf(stderr, "ingero-lab-worker: rank %d step %ld: wrong alltoall/gather/scatter result\n", g_rank, step);
  free(s); free(r);
  return bad;
}

/* ---- elastic: shrink, then grow back (INGERO_LAB_ELASTIC=1) ---------------
 *
 * After the training steps, as an elastic job that loses a rank and gets it
 * back (NCCL 2.27 ncclCommShrink, 2.29 ncclCommGrow): the survivors shrink the
 * world A without rank X (1, or the last rank of two) and run
 * INGERO_LAB_ELASTIC_STEPS steps on the shrunk communicator while X waits.
 * Then world rank 0, the coordinator, takes a grow id from
 * ncclCommGetUniqueId(shrunk) and serves it to X through the store, as the
 * world's id was served; the survivors call ncclCommGrow(shrunk, world, -1)
 * (the coordinator with the id, the others with NULL) and X
 * ncclCommGrow(NULL, world, &id, world - 1); everyone runs as many steps on
 * the grown communicator. An elastic step: an all-reduce, an all-gather and a
 * broadcast, each checked, a group holding an all-reduce that
 * ncclGroupSimulateEnd closes (nothing runs: its buffer must be untouched and
 * the estimate positive), then ncclAlltoAll, ncclGather and ncclScatter
 * (newer_collectives), so a traced elastic job calls every newer entry point. */

static int elastic_step(ncclComm_t comm, long step, const char *which) {
  enum { N = 4096 };
  int n = 0, me = -1, bad = 0;
  ncclCommCount(comm, &n);
  ncclCommUserRank(comm, &me);
  float *ar = malloc(sizeof(float) * N), *ag_in = malloc(sizeof(float) * N), *bc = malloc(sizeof(float) * N);
  float *ag = malloc(sizeof(float) * N * (size_t)n), *sim_buf = malloc(sizeof(float) * N);
  float base = (float)(step % 3);
  for (int i = 0; i < N; i++) {
    ar[i] = (float)(me + 1) + base;
    ag_in[i] = (float)(me * 10) + base;
    bc[i] = me == 0 ? (float)(step + 7) : -1.0f;
    sim_buf[i] = 5.0f;
  }
  settle(ncclAllReduce(ar, ar, N, ncclFloat32, ncclSum, comm, NULL), "ncclAllReduce(elastic)", comm);
  settle(ncclAllGather(ag_in, ag, N, ncclFloat32, comm, NULL), "ncclAllGather(elastic)", comm);
  settle(ncclBroadcast(bc, bc, N, ncclFloat32, 0, comm, NULL), "ncclBroadcast(elastic)", comm);
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  nccl_check(ncclGroupStart(), "ncclGroupStart", comm);
  nccl_check(ncclAllReduce(sim_buf, sim_buf, N, ncclFloat32, ncclSum, comm, NULL), "ncclAllReduce(simulated)", comm);
  nccl_check(ncclGroupSimulateEnd(&sim), "ncclGroupSimulateEnd", comm);
  step_sync();
  float want = (float)n * (float)(n + 1) / 2 + base * (float)n;
  bad |= ar[0] != want || ar[N - 1] != want;
  for (int p = 0; p < n; p++) bad |= ag[(size_t)p * N] != (float)(p * 10) + base || ag[(size_t)p * N + N - 1] != (float)(p * 10) + base;
  bad |= bc[0] != (float)(step + 7) || bc[N - 1] != (float)(step + 7);
  bad |= sim_buf[0] != 5.0f || sim_buf[N - 1] != 5.0f || !(sim.estimatedTime > 0.0f);
  if (bad)
    fprintf(stderr, "ingero-lab-worker: rank %d elastic step %ld: wrong result on the %s communicator (%d ranks)\n",
            g_rank, step, which, n);
  free(ar); free(ag_in); free(bc); free(ag); free(sim_buf);
  return bad | newer_collectives(comm, me, n, step);
}

/* 0 when every elastic step was right; 4 on wrong data (NCCL failures exit 3). */
static int run_elastic(ncclComm_t A, int world, const char *run_id, int timeout_s, long esteps) {
  int X = world > 2 ? 1 : world - 1, n = 0, me = -1;
  ncclComm_t S = NULL, G = NULL;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  ncclUniqueId gid;
  memset(&gid, 0, sizeof gid);
  double t0 = now_s();
  if (g_rank != X) {
    int excluded[1] = {X};
    settle(ncclCommShrink(A, excluded, 1, &S, NULL, NCCL_SHRINK_DEFAULT), "ncclCommShrink", A);
    ncclCommCount(S, &n);
    ncclCommUserRank(S, &me);
    if (n != world - 1 || me != g_rank - (g_rank > X)) {
      fprintf(stderr, "ingero-lab-worker: rank %d: shrunk communicator is rank %d of %d\n", g_rank, me, n);
      return 4;
    }
    for (long s = 0; s < esteps; s++)
      if (elastic_step(S, s, "shrunk")) return 4;
    if (g_rank == 0) {   /* the coordinator */
      nccl_check(ncclCommGetUniqueId(S, &gid), "ncclCommGetUniqueId", S);
      store_id(&gid, "nccl_grow_id", 1, run_id, timeout_s);
    }
    ncclResult_t r = ncclCommGrow(S, world, g_rank == 0 ? &gid : NULL, -1, &G, NULL);
    settle(r, "ncclCommGrow", G);   /* G is written by the call (also when non-blocking) */
  } else {               /* left out: waits for the grow id, then joins as the last rank */
    store_id(&gid, "nccl_grow_id", 0, run_id, timeout_s);
    if (g_nonblocking) cfg.blocking = 0;
    ncclResult_t r = ncclCommGrow(NULL, world, &gid, world - 1, &G, g_nonblocking ? &cfg : NULL);
    settle(r, "ncclCommGrow", G);
  }
  ncclCommCount(G, &n);
  ncclCommUserRank(G, &me);
  if (n != world || me != (g_rank == X ? world - 1 : g_rank - (g_rank > X))) {
    fprintf(stderr, "ingero-lab-worker: rank %d: grown communicator is rank %d of %d\n", g_rank, me, n);
    return 4;
  }
  for (long s = 0; s < esteps; s++)
    if (elastic_step(G, esteps + s, "grown")) return 4;
  if (S) ncclCommDestroy(S);
  ncclCommDestroy(G);
  printf("rank %d: elastic: %s rank %d, grown back to %d ranks (rank %d); %ld + %ld steps checked in %.0f ms\n",
         g_rank, g_rank == X ? "waited, as the excluded" : "shrunk without", X, world, me, esteps, esteps,
         (now_s() - t0) * 1e3);
  fflush(stdout);
  return 0;
}

/* ---- the stop decision of a layout job, through the store ------------------
 *
 * No collective spans every rank inside a step of the layout job, so rank 0's
 * stop decision travels outside NCCL, as an elastic agent's would: rank 0
 * serves its state on MASTER_ADDR:MASTER_PORT (the store that handed out the
 * unique id) and every other rank keeps one connection to it, on a thread of
 * its own. At the start of each step a rank asks once ("GET stop <run id>")
 * and goes on without waiting for the answer: (the last step rank 0 finished,
 * the job's last step or -1). Rank 0 decides at the end of step s (its
 * seconds are up, or the stop file exists) that the job's last step is
 * s + STOP_MARGIN (INGERO_LAB_STEPS caps it: every rank knows that one), so a
 * rank that last heard "rank 0 finished step s', nothing decided" may run any
 * step up to s' + STOP_MARGIN without hearing more; only a rank that far ahead
 * of its reader waits. All ranks run the same steps. */

#define STOP_MARGIN 5

struct stopper {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  long want;        /* the step this rank is about to run (a reader asks when it grows) */
  long seen;        /* the last step rank 0 finished, as last heard (rank 0: its own) */
  long last;        /* the job's last step; -1 while rank 0 has not decided */
  long cap;         /* INGERO_LAB_STEPS - 1, or -1 */
  int failed, quit, clients, timeout_s;
  const char *run_id;
  pthread_t thread;
};

static int stop_request(char *req, size_t len, const char *run_id) {
  return snprintf(req, len, "GET stop %s\n", run_id);
}

/* Rank 0: answers every reader until each has heard the last step and hung up. */
static void *stop_serve(void *arg) {
  struct stopper *s = arg;
  char req[256], got[256];
  int n = stop_request(req, sizeof req, s->run_id), nf = 1, done = 0;
  struct pollfd *pf = calloc((size_t)s->clients + 1, sizeof *pf);
  char *told = calloc((size_t)s->clients + 1, 1);
  pf[0] = (struct pollfd){store_socket(env_req("MASTER_ADDR"), env_req("MASTER_PORT"), 1, s->timeout_s), POLLIN, 0};
  while (done < s->clients) {
    int r = poll(pf, (nfds_t)nf, s->timeout_s * 1000);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;   /* nobody asked for the whole timeout: a reader is gone */
    for (int i = nf - 1; i >= 1; i--) {
      if (!pf[i].revents) continue;
      ssize_t k = recv(pf[i].fd, got, (size_t)n, MSG_WAITALL);
      long long ans[2];
      if (k == n && memcmp(got, req, (size_t)n) == 0) {
        pthread_mutex_lock(&s->mu);
        ans[0] = s->seen;
        ans[1] = s->last;
        pthread_mutex_unlock(&s->mu);
        if (send(pf[i].fd, ans, sizeof ans, MSG_NOSIGNAL) == sizeof ans) {
          told[i] |= ans[1] >= 0;
          continue;
        }
      }
      done += told[i];   /* hung up (after the answer it needed), or a bad request */
      close(pf[i].fd);
      pf[i] = pf[nf - 1];
      told[i] = told[nf - 1];
      nf--;
    }
    if (pf[0].revents & POLLIN) {
      int fd = accept4(pf[0].fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0 && nf > s->clients) {   /* more connections than readers: not one of ours */
        close(fd);
      } else if (fd >= 0) {
        struct timeval tv = {s->timeout_s, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        told[nf] = 0;
        pf[nf++] = (struct pollfd){fd, POLLIN, 0};
      }
    }
  }
  for (int i = 0; i < nf; i++) close(pf[i].fd);
  free(pf);
  free(told);
  return NULL;
}

/* Any other rank: asks once per step the main thread starts, until it heard the last step. */
static void *stop_read(void *arg) {
  struct stopper *s = arg;
  char req[256];
  int n = stop_request(req, sizeof req, s->run_id);
  int fd = store_socket(env_req("MASTER_ADDR"), env_req("MASTER_PORT"), 0, s->timeout_s);
  long asked = -2;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    while (s->want <= asked && !s->quit) pthread_cond_wait(&s->cv, &s->mu);
    int again = s->want <= asked;   /* quitting without the answer: ask until it comes */
    asked = s->want;
    pthread_mutex_unlock(&s->mu);
    if (again) usleep(10 * 1000);
    long long ans[2];
    int ok = send(fd, req, (size_t)n, MSG_NOSIGNAL) == n && recv(fd, ans, sizeof ans, MSG_WAITALL) == sizeof ans;
    pthread_mutex_lock(&s->mu);
    if (ok) {
      s->seen = (long)ans[0];
      if (ans[1] >= 0) s->last = (long)ans[1];
    } else {
      s->failed = 1;
    }
    int finished = !ok || s->last >= 0;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (finished) break;
  }
  close(fd);
  return NULL;
}

static void stop_init(struct stopper *s, int world, const char *run_id, int timeout_s, long steps_max) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->want = -1;
  s->seen = -1;
  s->last = -1;
  s->cap = steps_max > 0 ? steps_max - 1 : -1;
  s->clients = world - 1;
  s->run_id = run_id;
  s->timeout_s = timeout_s;
  if (world > 1 && pthread_create(&s->thread, NULL, g_rank == 0 ? stop_serve : stop_read, s) != 0)
    die(3, "cannot start the stop thread: %s%s", strerror(errno), "");
}

/* Before step k: tell the reader; wait only if k is beyond what rank 0 allowed so far. */
static void stop_begin_step(struct stopper *s, long k) {
  if (g_rank == 0 || s->clients == 0) return;
  pthread_mutex_lock(&s->mu);
  s->want = k;
  pthread_cond_broadcast(&s->cv);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += s->timeout_s;
  while (s->last < 0 && k > s->seen + STOP_MARGIN && !s->failed)
    if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT) break;
  int stuck = s->last < 0 && k > s->seen + STOP_MARGIN;
  pthread_mutex_unlock(&s->mu);
  if (stuck) die(3, "no word from rank 0 through the store at %s (rank 0 gone?)%s", env_req("MASTER_ADDR"), "");
}

/* After step k (rank 0: `decide` is its stop decision); 1 when k was the job's last step. */
static int stop_end_step(struct stopper *s, long k, int decide) {
  pthread_mutex_lock(&s->mu);
  if (g_rank == 0) {
    s->seen = k;
    if (s->last < 0 && (decide || (s->cap >= 0 && k + STOP_MARGIN >= s->cap)))
      s->last = s->cap >= 0 && s->cap < k + STOP_MARGIN ? s->cap : k + STOP_MARGIN;
  }
  int end = (s->last >= 0 && k >= s->last) || (s->cap >= 0 && k >= s->cap);
  pthread_mutex_unlock(&s->mu);
  return end;
}

static void stop_finish(struct stopper *s) {
  if (s->clients == 0) return;
  pthread_mutex_lock(&s->mu);
  s->quit = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
}

/* ---- a tensor x pipeline x data parallel job (INGERO_LAB_LAYOUT="T,P,D") ----
 *
 * Ranks in Megatron's order: rank = d*P*T + p*T + t (tensor fastest). The world
 * communicator first (ncclCommInitRank, as PyTorch's default group), then
 * ncclCommSplit of it, as PyTorch's new_group does with split: the tensor group
 * (color d*P+p, key t), the data-parallel group of the stage (color p*T+t, key
 * d), one pipeline group per (d, t) (color d*T+t, key p), used only for
 * send/recv between stages, and with P > 1 the embedding group of the first and
 * last stage per (d, t) (the other stages pass NCCL_SPLIT_NOCOLOR).
 *
 * Each step runs INGERO_LAB_MICROBATCHES microbatches through the pipeline in
 * the order INGERO_LAB_SCHEDULE says (a forward: compute, tensor all-reduce; a
 * backward: twice the compute, tensor all-reduce):
 *   1f1b (default)  Megatron's schedule without interleaving: min(P-p-1, M)
 *                   warm-up forwards, then one forward and one backward per
 *                   microbatch, then the cool-down backwards. Every exchange is
 *                   a group, as batch_isend_irecv makes it (ncclGroupStart,
 *                   sends and receives, ncclGroupEnd): in the steady state a
 *                   send to one neighbour and a receive from it in one group
 *                   (send_forward_recv_backward, send_backward_recv_forward).
 *   gpipe           every forward, then every backward; each send and receive
 *                   on its own (no group).
 *   interleaved     Megatron's interleaved schedule: INGERO_LAB_VIRTUAL_STAGES
 *                   model chunks per rank (chunk v of stage p is virtual stage
 *                   v*P+p, so stage P-1 feeds stage 0 around the ring); the
 *                   exchanges of one iteration (forward and backward, both
 *                   neighbours) in one group. Needs M a multiple of P.
 * Then, as Megatron's distributed optimizer and finalize_model_grads do: the
 * data-parallel reduce-scatter of the gradients and the embedding all-reduce
 * (stages 0 and P-1), issued asynchronously (on the GPU-like device they run
 * side by side on their communicators' streams) and both waited for, then the
 * data-parallel all-gather of the parameters. No
 * collective spans every rank in a step: the stop decision goes through the
 * store (stop_begin_step / stop_end_step). Compute per step is
 * INGERO_LAB_COMPUTE_MS split 1:2 over forward and backward (a sleep, the
 * GPU-like wait), times a per-step factor in [1, 1 + INGERO_LAB_IMBALANCE]
 * drawn from (rank, step). Every received buffer is checked after the step's
 * synchronisation; wrong data exits 4.
 *
 * INGERO_LAB_SHARDING=fsdp (no pipeline: P = 1), as PyTorch FSDP runs a tp x dp job: no
 * schedule and no distributed optimizer; each step runs INGERO_LAB_LAYERS layers (run_fsdp),
 * each layer's parameters all-gathered over the data-parallel group before its forward and
 * again before its backward, its gradients reduce-scattered after the backward, each as two
 * collectives in one ncclGroupStart/End (coalesced: on the GPU-like device one launch, one
 * device interval). INGERO_LAB_REPLICAS=R > 1 (HSDP): the data-parallel ranks d split into
 * R shard groups of D/R (color by d / (D/R), key d % (D/R)) that gather and reduce-scatter,
 * and replicate groups (same d % (D/R)) that all-reduce each layer's reduced shards. */

enum schedule { SCHED_1F1B, SCHED_GPIPE, SCHED_INTERLEAVED };
static const char *const SCHEDULE_NAME[] = {"1f1b", "gpipe", "interleaved"};

static double imbalance_factor(double f, int rank, long step) {
  if (f <= 0) return 1.0;
  unsigned long long x = (unsigned long long)rank * 0x9E3779B97F4A7C15ULL ^ (unsigned long long)(step + 1) * 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 31; x *= 0x94D049BB133111EBULL; x ^= x >> 29;
  return 1.0 + f * (double)(x >> 11) / 9007199254740992.0;
}

static int check_block(const float *b, size_t n, float want, const char *what, long step) {
  if (b[0] == want && b[n - 1] == want) return 0;
  fprintf(stderr, "ingero-lab-worker: rank %d step %ld: wrong %s: %g, want %g\n", g_rank, step, what, b[0], want);
  return 1;
}

/* One step's pipeline state. A slot is one (pass, virtual microbatch): pass 0
 * forward activations, pass 1 backward gradients; vm = chunk * M + microbatch. */
struct pipe {
  int T, P, D, V, t, p, d, grouped;
  long M, step;
  double fwd_ms, bwd_ms;
  ncclComm_t TP, PP;
  size_t act_n, tp_n;
  float *actr, *acts, *tpb, *want;   /* want[slot]: what the receive must hold; NAN: none */
};

static size_t slot_of(const struct pipe *j, long vm, int pass) { return (size_t)(pass * j->M * j->V + vm); }

/* The value a block carries: the step, the slot and the sending stage (exact in a float). */
static float block_tag(long step, size_t slot, int from) {
  return (float)(((step % 128) * 256 + (long)slot) * 16 + from % 16);
}

/* One exchange of the schedule: up to four sends/receives on the pipeline group. */
struct xch {
  int n;
  struct { int send, peer; size_t slot; } op[4];
};

static void xadd(struct xch *x, int send, int peer, size_t slot) {
  if (peer < 0) return;
  x->op[x->n].send = send;
  x->op[x->n].peer = peer;
  x->op[x->n++].slot = slot;
}

/* Runs an exchange: one group (batch_isend_irecv), or each call on its own (gpipe). */
static void exchange(struct pipe *j, const struct xch *x) {
  if (x->n == 0) return;
  cudaStream_t st = issue(j->PP);
  if (j->grouped) nccl_check(ncclGroupStart(), "ncclGroupStart", j->PP);
  for (int i = 0; i < x->n; i++) {
    size_t s = x->op[i].slot;
    ncclResult_t r;
    if (x->op[i].send) {
      float *b = j->acts + s * j->act_n, v = block_tag(j->step, s, j->p);
      for (size_t e = 0; e < j->act_n; e++) b[e] = v;
      r = ncclSend(b, j->act_n, ncclFloat32, x->op[i].peer, j->PP, st);
    } else {
      j->want[s] = block_tag(j->step, s, x->op[i].peer);
      r = ncclRecv(j->actr + s * j->act_n, j->act_n, ncclFloat32, x->op[i].peer, j->PP, st);
    }
    if (j->grouped) nccl_check(r, x->op[i].send ? "ncclSend" : "ncclRecv", j->PP);
    else settle(r, x->op[i].send ? "ncclSend" : "ncclRecv", j->PP);
  }
  if (j->grouped) settle(ncclGroupEnd(), "ncclGroupEnd", j->PP);
  joined(j->PP);
}

/* A forward (pass 0) or backward (pass 1) of one virtual microbatch: compute, tensor all-reduce. */
static void pass_compute(struct pipe *j, long vm, int pass) {
  compute(pass == 0 ? j->fwd_ms : j->bwd_ms);
  if (j->T < 2) return;
  float *tb = j->tpb + slot_of(j, vm, pass) * j->tp_n;
  for (size_t i = 0; i < j->tp_n; i++) tb[i] = (float)(j->t + 1);
  settle(ncclAllReduce(tb, tb, j->tp_n, ncclFloat32, ncclSum, j->TP, issue(j->TP)), "ncclAllReduce(tensor)", j->TP);
  joined(j->TP);
}

static void run_gpipe(struct pipe *j) {
  int prev = j->p > 0 ? j->p - 1 : -1, next = j->p < j->P - 1 ? j->p + 1 : -1;
  for (int pass = 0; pass < 2; pass++)
    for (long m = 0; m < j->M; m++) {
      struct xch in = {0}, out = {0};
      xadd(&in, 0, pass == 0 ? prev : next, slot_of(j, m, pass));
      xadd(&out, 1, pass == 0 ? next : prev, slot_of(j, m, pass));
      exchange(j, &in);
      pass_compute(j, m, pass);
      exchange(j, &out);
    }
}

/* Megatron's forward_backward_pipelining_without_interleaving. */
static void run_1f1b(struct pipe *j) {
  int prev = j->p > 0 ? j->p - 1 : -1, next = j->p < j->P - 1 ? j->p + 1 : -1;
  long M = j->M, W = j->P - j->p - 1 < M ? j->P - j->p - 1 : M, R = M - W;
  for (long i = 0; i < W; i++) {                  /* warm-up: recv_forward, forward, send_forward */
    struct xch in = {0}, out = {0};
    xadd(&in, 0, prev, slot_of(j, i, 0));
    exchange(j, &in);
    pass_compute(j, i, 0);
    xadd(&out, 1, next, slot_of(j, i, 0));
    exchange(j, &out);
  }
  if (R > 0) {
    struct xch in = {0};
    xadd(&in, 0, prev, slot_of(j, W, 0));
    exchange(j, &in);
  }
  for (long i = 0; i < R; i++) {                  /* steady state: one forward, one backward */
    struct xch fb = {0}, bf = {0};
    pass_compute(j, W + i, 0);
    xadd(&fb, 1, next, slot_of(j, W + i, 0));      /* send_forward_recv_backward */
    xadd(&fb, 0, next, slot_of(j, i, 1));
    exchange(j, &fb);
    pass_compute(j, i, 1);
    xadd(&bf, 1, prev, slot_of(j, i, 1));          /* send_backward(_recv_forward) */
    if (i < R - 1) xadd(&bf, 0, prev, slot_of(j, W + i + 1, 0));
    exchange(j, &bf);
  }
  for (long i = R; i < M; i++) {                  /* cool-down: recv_backward, backward, send_backward */
    struct xch in = {0}, out = {0};
    xadd(&in, 0, next, slot_of(j, i, 1));
    exchange(j, &in);
    pass_compute(j, i, 1);
    xadd(&out, 1, prev, slot_of(j, i, 1));
    exchange(j, &out);
  }
}

/* Megatron's forward_backward_pipelining_with_interleaving (batched, no overlap):
 * iteration k runs model chunk chunk_of(k) on microbatch mb_of(k); chunk v of
 * stage p is virtual stage v*P+p, so the pipeline is a ring (stage P-1's chunk
 * v feeds stage 0's chunk v+1). The n-th block a rank receives for a chunk is
 * that chunk's microbatch n (each chunk's inputs and gradients are queues).
 * In a group: send_next, recv_prev, send_prev, recv_next, so with P = 2 (both
 * neighbours one rank) the activations go before the gradients each way. */
static long chunk_of(const struct pipe *j, long k, int forward) {
  long n = (long)j->P * j->V, c = ((k % n) + n) % n / j->P;
  return forward ? c : j->V - 1 - c;
}

static long mb_of(const struct pipe *j, long k) { return k / ((long)j->P * j->V) * j->P + k % j->P; }

static void send_fwd(struct pipe *j, struct xch *x, long c, long m) {
  if (j->p == j->P - 1 && c == j->V - 1) return;   /* the last virtual stage: the loss */
  xadd(x, 1, (j->p + 1) % j->P, slot_of(j, (j->p == j->P - 1 ? c + 1 : c) * j->M + m, 0));
}

static void send_bwd(struct pipe *j, struct xch *x, long c, long m) {
  if (j->p == 0 && c == 0) return;                  /* the first virtual stage */
  xadd(x, 1, (j->p + j->P - 1) % j->P, slot_of(j, (j->p == 0 ? c - 1 : c) * j->M + m, 1));
}

static void recv_fwd(struct pipe *j, struct xch *x, long c, long *nin) {
  xadd(x, 0, (j->p + j->P - 1) % j->P, slot_of(j, c * j->M + nin[c]++, 0));
}

static void recv_bwd(struct pipe *j, struct xch *x, long c, long *ngr) {
  xadd(x, 0, (j->p + 1) % j->P, slot_of(j, c * j->M + ngr[c]++, 1));
}

static void run_interleaved(struct pipe *j) {
  long P = j->P, V = j->V, total = j->M * V, nin[128] = {0}, ngr[128] = {0};
  int first = j->p == 0, last = j->p == P - 1, all_warmup = j->M == P;
  long Wu = all_warmup ? total : (P - j->p - 1) * 2 + (V - 1) * P;
  if (Wu > total) Wu = total;
  long Rm = total - Wu;
  struct xch x = {0};
  if (!first) recv_fwd(j, &x, 0, nin);
  exchange(j, &x);
  for (long k = 0; k < Wu; k++) {                 /* warm-up forwards */
    long c = chunk_of(j, k, 1), m = mb_of(j, k), nc = chunk_of(j, k + 1, 1);
    pass_compute(j, c * j->M + m, 0);
    memset(&x, 0, sizeof x);
    send_fwd(j, &x, c, m);
    if (!(first && nc == 0) && k != total - 1) recv_fwd(j, &x, nc, nin);
    if (k == Wu - 1 && !all_warmup && !last) recv_bwd(j, &x, V - 1, ngr);
    exchange(j, &x);
  }
  for (long k = 0; k < Rm; k++) {                 /* steady state: a forward and a backward */
    long fk = k + Wu, fc = chunk_of(j, fk, 1), fm = mb_of(j, fk), bc = chunk_of(j, k, 0), bm = mb_of(j, k);
    pass_compute(j, fc * j->M + fm, 0);
    pass_compute(j, bc * j->M + bm, 1);
    int recv_prev = 1, recv_next = 1;
    long nfc, nbc;
    if (first) {   /* the first stage is P-1 iterations ahead of the last */
      nfc = chunk_of(j, fk - (P - 1), 1);
      recv_prev = nfc != V - 1;
      nfc++;
    } else {
      nfc = chunk_of(j, fk + 1, 1);
    }
    if (last) {
      nbc = chunk_of(j, k - (P - 1), 0);
      recv_next = nbc != 0;
      nbc--;
    } else {
      nbc = chunk_of(j, k + 1, 0);
    }
    if (k == Rm - 1) recv_prev = 0;
    memset(&x, 0, sizeof x);
    send_fwd(j, &x, fc, fm);
    if (recv_prev) recv_fwd(j, &x, nfc, nin);
    send_bwd(j, &x, bc, bm);
    if (recv_next) recv_bwd(j, &x, nbc, ngr);
    exchange(j, &x);
  }
  if (all_warmup && !last) {
    memset(&x, 0, sizeof x);
    recv_bwd(j, &x, V - 1, ngr);
    exchange(j, &x);
  }
  for (long k = Rm; k < total; k++) {             /* cool-down backwards */
    long c = chunk_of(j, k, 0), m = mb_of(j, k), nbc = chunk_of(j, k + 1, 0);
    pass_compute(j, c * j->M + m, 1);
    memset(&x, 0, sizeof x);
    send_bwd(j, &x, c, m);
    if (!(last && nbc == V - 1) && k != total - 1) recv_bwd(j, &x, nbc, ngr);
    exchange(j, &x);
  }
}

/* FSDP (INGERO_LAB_SHARDING=fsdp): the parameters and gradients of each of L layers are
 * sharded over the shard group (S ranks); HSDP (R > 1 replicas): the data-parallel ranks
 * split into R shard groups, and a replicate group joins the ranks that hold the same shard. */
struct fsdp {
  int L, S, R, sh;
  size_t n;                 /* floats per shard of one tensor; each layer has two tensors */
  ncclComm_t SH, REP;
  float *shard, *full;      /* per (layer, pass, tensor): this rank's shard, the gathered tensor */
  float *gin, *gout;        /* per (layer, tensor): the full gradient, this rank's reduced shard */
};

/* What shard `sh` of tensor `i` holds in a pass of a step (exact in a float). */
static float fsdp_value(long step, int pass, int i, int sh) {
  return (float)(sh + 1 + 100 * (i + 2 * pass) + 1000 * (step % 7));
}

/* A layer's parameters all-gathered over the shard group: two tensors, coalesced
 * (torch.distributed's coalescing: one ncclGroupStart/End, one launch). */
static void fsdp_gather(struct pipe *j, struct fsdp *f, int l, int pass) {
  cudaStream_t st = issue(f->SH);
  nccl_check(ncclGroupStart(), "ncclGroupStart", f->SH);
  for (int i = 0; i < 2; i++) {
    size_t b = ((size_t)l * 2 + (size_t)pass) * 2 + (size_t)i;
    float *in = f->shard + b * f->n, v = fsdp_value(j->step, pass, i, f->sh);
    for (size_t e = 0; e < f->n; e++) in[e] = v;
    nccl_check(ncclAllGather(in, f->full + b * f->n * (size_t)f->S, f->n, ncclFloat32, f->SH, st),
               "ncclAllGather(fsdp)", f->SH);
  }
  settle(ncclGroupEnd(), "ncclGroupEnd", f->SH);
  joined(f->SH);
}

/* A layer's gradients reduce-scattered over the shard group (two, coalesced); HSDP: the
 * reduced shards all-reduced over the replicate group. */
static void fsdp_reduce(struct pipe *j, struct fsdp *f, int l) {
  size_t full = f->n * (size_t)f->S;
  cudaStream_t st = issue(f->SH);
  nccl_check(ncclGroupStart(), "ncclGroupStart", f->SH);
  for (int i = 0; i < 2; i++) {
    float *in = f->gin + ((size_t)l * 2 + (size_t)i) * full;
    for (size_t e = 0; e < full; e++) in[e] = (float)(f->sh + 1 + j->step % 3);
    nccl_check(ncclReduceScatter(in, f->gout + ((size_t)l * 2 + (size_t)i) * f->n, f->n, ncclFloat32, ncclSum,
                                 f->SH, st), "ncclReduceScatter(fsdp)", f->SH);
  }
  settle(ncclGroupEnd(), "ncclGroupEnd", f->SH);
  joined(f->SH);
  if (f->REP) {
    float *g = f->gout + (size_t)l * 2 * f->n;
    settle(ncclAllReduce(g, g, 2 * f->n, ncclFloat32, ncclSum, f->REP, issue(f->REP)), "ncclAllReduce(replicate)",
           f->REP);
    joined(f->REP);
  }
}

/* One FSDP step: the forward layer by layer (gather, compute, tensor all-reduce), then the
 * backward in reverse (gather again: the parameters were resharded after the forward;
 * compute; tensor all-reduce; reduce the gradients). No prefetch: a gather runs before its
 * layer's compute (the compute waits for it), not beside the previous layer's. */
static void run_fsdp(struct pipe *j, struct fsdp *f) {
  for (int l = 0; l < f->L; l++) {
    fsdp_gather(j, f, l, 0);
    pass_compute(j, l, 0);
  }
  for (int l = f->L - 1; l >= 0; l--) {
    fsdp_gather(j, f, l, 1);
    pass_compute(j, l, 1);
    fsdp_reduce(j, f, l);
  }
}

/* 0 when every gathered block and reduced shard of the step is right. */
static int fsdp_check(const struct fsdp *f, long step) {
  for (int l = 0; l < f->L; l++)
    for (int pass = 0; pass < 2; pass++)
      for (int i = 0; i < 2; i++) {
        const float *full = f->full + (((size_t)l * 2 + (size_t)pass) * 2 + (size_t)i) * f->n * (size_t)f->S;
        for (int s = 0; s < f->S; s++)
          if (check_block(full + (size_t)s * f->n, f->n, fsdp_value(step, pass, i, s), "fsdp all-gather", step))
            return 1;
      }
  float want = (float)f->R * ((float)(f->S * (f->S + 1) / 2) + (float)(f->S * (step % 3)));
  for (int b = 0; b < 2 * f->L; b++)
    if (check_block(f->gout + (size_t)b * f->n, f->n, want, "fsdp reduce-scatter", step)) return 1;
  return 0;
}

static int run_layout(const char *spec, int world, int node, int local_rank, const char *run_id,
                      int timeout_s, long steps_max, double seconds, double cpu_ms, double compute_ms,
                      long io_mb, const char *io_dir, long long fault_from_ns, double fault_compute_ms,
                      long fault_io_mb, long every) {
  int T = 0, P = 0, D = 0;
  if (sscanf(spec, "%d,%d,%d", &T, &P, &D) != 3 || T < 1 || P < 1 || D < 1 || T * P * D != world)
    die(2, "INGERO_LAB_LAYOUT must be T,P,D with T*P*D = WORLD_SIZE, got %s%s", spec, "");
  long M = env_long("INGERO_LAB_MICROBATCHES", 4);
  double imb = env_double("INGERO_LAB_IMBALANCE", 0.0);
  const char *sched_name = getenv("INGERO_LAB_SCHEDULE");
  if (!sched_name || !*sched_name) sched_name = "1f1b";
  int sched = -1;
  for (int i = 0; i < 3; i++)
    if (strcmp(sched_name, SCHEDULE_NAME[i]) == 0) sched = i;
  if (sched < 0) die(2, "INGERO_LAB_SCHEDULE must be 1f1b, gpipe or interleaved, got %s%s", sched_name, "");
  const char *sharding = getenv("INGERO_LAB_SHARDING");
  int fsdp = sharding && strcmp(sharding, "fsdp") == 0;
  if (sharding && *sharding && !fsdp && strcmp(sharding, "optimizer") != 0)
    die(2, "INGERO_LAB_SHARDING must be optimizer or fsdp, got %s%s", sharding, "");
  int R = (int)env_long("INGERO_LAB_REPLICAS", 1), L = (int)env_long("INGERO_LAB_LAYERS", 4);
  if (fsdp && (P != 1 || D < 2 || R < 1 || D % R != 0 || L < 1 || L > 64))
    die(2, "INGERO_LAB_SHARDING=fsdp needs no pipeline (P = 1), D >= 2, INGERO_LAB_REPLICAS dividing D and "
           "1 <= INGERO_LAB_LAYERS <= 64%s%s", "", "");
  if (!fsdp) R = 1;
  if (fsdp) M = L;   /* a slot per layer: a layer's forward and backward each have one */
  int V = sched == SCHED_INTERLEAVED ? (int)env_long("INGERO_LAB_VIRTUAL_STAGES", 2) : 1;
  if (M < 1 || M * V > 128)
    die(2, "INGERO_LAB_MICROBATCHES must be >= 1 and, times the virtual stages, <= 128%s%s", "", "");
  if (!fsdp && sched == SCHED_INTERLEAVED && (V < 1 || P < 2 || M % P != 0))
    die(2, "the interleaved schedule needs a pipeline (P > 1), INGERO_LAB_VIRTUAL_STAGES >= 1 and "
           "INGERO_LAB_MICROBATCHES a multiple of P%s%s", "", "");
  int t = g_rank % T, p = (g_rank / T) % P, d = g_rank / (T * P);
  ncclUniqueId id;
  exchange_id(&id, world, run_id, timeout_s);
  ncclComm_t W = NULL, TP = NULL, DP = NULL, PP = NULL, EMB = NULL, REP = NULL;
  int S = D / R, sh = d % S, rep = d / S;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER, *split_cfg = NULL;
  double t_init = now_s();
  ncclResult_t r;
  if (g_nonblocking) {
    cfg.blocking = 0;
    split_cfg = &cfg;
    r = ncclCommInitRankConfig(&W, world, id, g_rank, &cfg);
    settle(r, "ncclCommInitRankConfig", W);
  } else {
    nccl_check(ncclCommInitRank(&W, world, id, g_rank), "ncclCommInitRank", NULL);
  }
  r = ncclCommSplit(W, d * P + p, t, &TP, split_cfg);
  settle(r, "ncclCommSplit(tensor)", W);
  r = ncclCommSplit(W, (p * T + t) * R + rep, sh, &DP, split_cfg);   /* HSDP: the shard group */
  settle(r, "ncclCommSplit(data)", W);
  if (R > 1) {
    r = ncclCommSplit(W, (p * T + t) * S + sh, rep, &REP, split_cfg);
    settle(r, "ncclCommSplit(replicate)", W);
  }
  r = ncclCommSplit(W, d * T + t, p, &PP, split_cfg);
  settle(r, "ncclCommSplit(pipeline)", W);
  if (P > 1) {
    r = ncclCommSplit(W, p == 0 || p == P - 1 ? d * T + t : NCCL_SPLIT_NOCOLOR, p, &EMB, split_cfg);
    settle(r, "ncclCommSplit(embedding)", W);
  }
  int rp;
  ncclCommUserRank(PP, &rp);
  if (rp != p) die(3, "pipeline group numbers this rank %s, not its stage%s", rp == p ? "" : "wrongly", "");
  if (fsdp) sched_name = R > 1 ? "hsdp" : "fsdp";
  printf("rank %d/%d (node %d, local %d): layout tp=%d pp=%d dp=%d, stage %d, tp %d, dp %d, schedule %s", g_rank,
         world, node, local_rank, T, P, D, p, t, d, sched_name);
  if (fsdp) printf(" (%d layers, shard %d of %d, replica %d of %d)", L, sh, S, rep, R);
  printf("; communicators ready in %.0f ms\n", (now_s() - t_init) * 1e3);
  fflush(stdout);
  struct stopper stp;
  stop_init(&stp, world, run_id, timeout_s, steps_max);
  /* one buffer per slot: on the GPU-like device the host fills the next send
   * while earlier work is still queued, and checks only after the sync */
  size_t slots = 2 * (size_t)M * (size_t)V, emb_n = 4096, dp_n = 65536 - 65536 % (size_t)D;
  struct pipe j = {.T = T, .P = P, .D = D, .V = V, .t = t, .p = p, .d = d, .grouped = sched != SCHED_GPIPE,
                   .M = M, .TP = TP, .PP = PP, .act_n = 16384, .tp_n = 8192};
  j.actr = malloc(slots * j.act_n * 4);
  j.acts = malloc(slots * j.act_n * 4);
  j.tpb = malloc(slots * j.tp_n * 4);
  j.want = malloc(slots * 4);
  struct fsdp f = {.L = L, .S = S, .R = R, .sh = sh, .n = 4096, .SH = DP, .REP = REP};
  if (fsdp) {
    f.shard = malloc((size_t)L * 4 * f.n * 4);
    f.full = malloc((size_t)L * 4 * f.n * (size_t)S * 4);
    f.gin = malloc((size_t)L * 2 * f.n * (size_t)S * 4);
    f.gout = malloc((size_t)L * 2 * f.n * 4);
  }
  float *dps = malloc(dp_n * 4), *dpr = malloc(dp_n / D * 4), *dpg = malloc(dp_n * 4), *emb = malloc(emb_n * 4);
  size_t junk_len = 1 << 20;
  char *junk = malloc(junk_len);
  memset(junk, 0xab, junk_len);
  struct steps st;
  steps_init(&st, every);
  double t0 = now_s();
  for (long step = 0;; step++) {
    stop_begin_step(&stp, step);
    double ts = now_s();
    int faulty = fault_from_ns > 0 && wall_ns() >= fault_from_ns;
    double c = (faulty ? fault_compute_ms : compute_ms) * imbalance_factor(imb, g_rank, step);
    busy_ms(cpu_ms);
    long mb = faulty ? fault_io_mb : io_mb;
    if (mb > 0 && !g_async) checkpoint(io_dir, g_rank, mb, junk, junk_len);
    j.step = step;
    j.fwd_ms = c / (3.0 * (double)(M * V));
    j.bwd_ms = 2.0 * j.fwd_ms;
    for (size_t s = 0; s < slots; s++) j.want[s] = NAN;
    if (fsdp) run_fsdp(&j, &f);
    else if (sched == SCHED_GPIPE) run_gpipe(&j);
    else if (sched == SCHED_1F1B) run_1f1b(&j);
    else run_interleaved(&j);
    if (D > 1 && !fsdp) {   /* the distributed optimizer: gradients reduce-scattered over the stage's replicas */
      for (size_t i = 0; i < dp_n; i++) dps[i] = (float)(d + 1);
      settle(ncclReduceScatter(dps, dpr, dp_n / D, ncclFloat32, ncclSum, DP, issue(DP)), "ncclReduceScatter", DP);
    }
    if (EMB) {     /* the tied embedding's gradients, first and last stage */
      for (size_t i = 0; i < emb_n; i++) emb[i] = (float)(p == 0 ? 1 : 2);
      settle(ncclAllReduce(emb, emb, emb_n, ncclFloat32, ncclSum, EMB, issue(EMB)), "ncclAllReduce(embedding)", EMB);
    }
    if (D > 1 && !fsdp) joined(DP);   /* both ran side by side; the optimizer step needs them */
    if (EMB) joined(EMB);
    if (D > 1 && !fsdp)     /* and the updated parameters all-gathered */
      settle(ncclAllGather(dpr, dpg, dp_n / D, ncclFloat32, DP, issue(DP)), "ncclAllGather", DP);
    step_sync();
    if (mb > 0 && g_async) checkpoint(io_dir, g_rank, mb, junk, junk_len);
    for (size_t s = 0; s < slots; s++) {
      if (!isnan(j.want[s]) && check_block(j.actr + s * j.act_n, j.act_n, j.want[s], "pipeline block", step))
        return 4;
      if (T > 1 && check_block(j.tpb + s * j.tp_n, j.tp_n, (float)(T * (T + 1) / 2), "tensor all-reduce", step))
        return 4;
    }
    if (fsdp && fsdp_check(&f, step)) return 4;
    if (D > 1 && !fsdp && (check_block(dpr, dp_n / D, (float)(D * (D + 1) / 2), "data-parallel reduce-scatter", step) ||
                  check_block(dpg, dp_n, (float)(D * (D + 1) / 2), "data-parallel all-gather", step)))
      return 4;
    if (EMB && check_block(emb, emb_n, 3.0f, "embedding all-reduce", step)) return 4;
    step_done(&st, (now_s() - ts) * 1e3);
    if (stop_end_step(&stp, step, g_rank == 0 && stop_now(step, 0, t0, seconds))) break;
  }
  stop_finish(&stp);
  if (EMB) ncclCommDestroy(EMB);
  if (REP) ncclCommDestroy(REP);
  ncclCommDestroy(PP);
  ncclCommDestroy(DP);
  ncclCommDestroy(TP);
  ncclCommDestroy(W);
  printf("{\"rank\": %d, \"node\": %d, \"local_rank\": %d, \"world_size\": %d, \"layout\": \"%d,%d,%d\", "
         "\"stage\": %d, \"schedule\": \"%s\", ", g_rank, node, local_rank, world, T, P, D, p, sched_name);
  print_steps(&st);
  printf(", \"device\": \"%s\", \"elapsed_s\": %.3f, \"verified\": true}\n", g_async ? "gpu" : "cpu", now_s() - t0);
  return 0;
}

int main(void) {
  g_rank = (int)env_long("RANK", -1);
  int world = (int)env_long("WORLD_SIZE", -1), local_rank = (int)env_long("LOCAL_RANK", 0);
  int local_world = (int)env_long("LOCAL_WORLD_SIZE", 1), node = (int)env_long("GROUP_RANK", 0);
  const char *run_id = getenv("TORCHELASTIC_RUN_ID") ? getenv("TORCHELASTIC_RUN_ID") : "none";
  if (g_rank < 0 || world < 1 || g_rank >= world) die(2, "RANK and WORLD_SIZE must be set, 0 <= RANK < WORLD_SIZE%s%s", "", "");
  long steps_max = env_long("INGERO_LAB_STEPS", 0);
  double seconds = env_double("INGERO_LAB_SECONDS", steps_max > 0 ? 0 : 20);
  g_stop_file = getenv("INGERO_LAB_STOP_FILE") && *getenv("INGERO_LAB_STOP_FILE") ? getenv("INGERO_LAB_STOP_FILE") : NULL;
  double cpu_ms = env_double("INGERO_LAB_CPU_MS", 3), compute_ms = env_double("INGERO_LAB_COMPUTE_MS", 40);
  long elems = env_long("INGERO_LAB_ELEMS", 262144), io_mb = env_long("INGERO_LAB_IO_MB", 0);
  long every = env_long("INGERO_LAB_PRINT_EVERY", 10);
  int timeout_s = (int)env_long("INGERO_LAB_TIMEOUT_S", 60);
  const char *io_dir = getenv("INGERO_LAB_IO_DIR") ? getenv("INGERO_LAB_IO_DIR") : "/tmp";
  long long fault_from_ns = env_long("INGERO_LAB_FAULT_FROM_NS", 0);
  double fault_compute_ms = env_double("INGERO_LAB_FAULT_COMPUTE_MS", compute_ms);
  long fault_io_mb = env_long("INGERO_LAB_FAULT_IO_MB", io_mb);
  const char *layout = getenv("INGERO_LAB_LAYOUT");
  g_nonblocking = env_long("INGERO_LAB_NONBLOCKING", 0) != 0;
  int elastic = env_long("INGERO_LAB_ELASTIC", 0) != 0;
  long elastic_steps = env_long("INGERO_LAB_ELASTIC_STEPS", 3);
  if (elastic && (world < 2 || (layout && *layout) || elastic_steps < 1))
    die(2, "INGERO_LAB_ELASTIC needs WORLD_SIZE >= 2, no INGERO_LAB_LAYOUT and INGERO_LAB_ELASTIC_STEPS >= 1%s%s", "", "");
  if (labStreamSynchronize(NULL) != ncclSuccess) die(2, "%s%s", ncclGetLastError(NULL), "");
  g_async = labDeviceAsync();
  if (layout && *layout)
    return run_layout(layout, world, node, local_rank, run_id, timeout_s, steps_max, seconds, cpu_ms, compute_ms,
                      io_mb, io_dir, fault_from_ns, fault_compute_ms, fault_io_mb, every);
  if (elems < world * 4) die(2, "INGERO_LAB_ELEMS must be at least 4 x WORLD_SIZE%s%s", "", "");
  elems -= elems % world;  /* reduce-scatter needs a multiple of the group size */

  ncclUniqueId idA, idB;
  exchange_id(&idA, world, run_id, timeout_s);
  idB = idA;
  for (int i = 120; i < 128; i++) idB.internal[i] ^= (char)0x5a;

  ncclComm_t A = NULL, B = NULL, C = NULL;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  if (g_nonblocking) cfg.blocking = 0;
  double t_init = now_s();
  /* [probes] Like PyTorch: above TORCH_NCCL_RANKS_PER_ROOT (default 128) ranks the world
   * comes from ncclCommInitRankScalable with one id per ceil(world / per_root) roots, the
   * same list on every rank (extra ids derived from X; the CPU library bootstraps through
   * ids[0]). INGERO_LAB_NEWER_COLLECTIVES=1: AlltoAll, Gather, Scatter once per step.
   * Non-blocking: A and B are both under way before either is waited for. */
  long per_root = env_long("TORCH_NCCL_RANKS_PER_ROOT", 128);
  int newer_colls = env_long("INGERO_LAB_NEWER_COLLECTIVES", 0) != 0;
  ncclResult_t rA, rB, r;
  const char *how_a = "ncclCommInitRank";
  if (per_root > 0 && world > per_root) {
    int nroots = (int)((world + per_root - 1) / per_root);
    ncclUniqueId *ids = calloc((size_t)nroots, sizeof *ids);
    for (int k = 0; k < nroots; k++) { ids[k] = idA; ids[k].internal[100] ^= (char)k; }
    how_a = "ncclCommInitRankScalable";
    rA = ncclCommInitRankScalable(&A, world, g_rank, nroots, ids, &cfg);
    free(ids);
  } else if (g_nonblocking) {
    how_a = "ncclCommInitRankConfig";
    rA = ncclCommInitRankConfig(&A, world, idA, g_rank, &cfg);
  } else {
    rA = ncclCommInitRank(&A, world, idA, g_rank);
  }
  if (rA != ncclInProgress) settle(rA, how_a, A);
  rB = ncclCommInitRankConfig(&B, world, idB, g_rank, &cfg);
  settle(rA, how_a, A);
  settle(rB, "ncclCommInitRankConfig", B);
  r = ncclCommSplit(A, node, local_rank, &C, g_nonblocking ? &cfg : NULL);
  settle(r, "ncclCommSplit", A);
  int nC, rC, version;
  ncclCommCount(C, &nC);
  ncclCommUserRank(C, &rC);
  ncclGetVersion(&version);
  printf("rank %d/%d (node %d, local %d/%d): communicators ready in %.0f ms, node group %d/%d, NCCL %d\n",
         g_rank, world, node, local_rank, local_world, (now_s() - t_init) * 1e3, rC, nC, version);
  fflush(stdout);

  size_t ag_n = (size_t)elems / world, rs_n = (size_t)elems / nC, p2p_n = 16384, bc_n = 4096;
  float *send = malloc(elems * 4), *recv = malloc(elems * 4), *ag_in = malloc(ag_n * 4);
  float *ag_out = malloc(elems * 4), *rs_out = malloc(rs_n * 4), *bc = malloc(bc_n * 4);
  float *p2p_out = malloc(p2p_n * 4), *p2p_in = malloc(p2p_n * 4);
  size_t junk_len = 1 << 20;
  char *junk = malloc(junk_len);
  memset(junk, 0xab, junk_len);
  struct steps st;
  steps_init(&st, every);
  long step = 0;
  double t0 = now_s();
  int next = (g_rank + 1) % world, prev = (g_rank + world - 1) % world;
  for (;;) {
    double ts = now_s();
    int faulty = fault_from_ns > 0 && wall_ns() >= fault_from_ns;
    busy_ms(cpu_ms);
    compute(faulty ? fault_compute_ms : compute_ms);
    long mb = faulty ? fault_io_mb : io_mb;
    if (mb > 0 && !g_async) checkpoint(io_dir, g_rank, mb, junk, junk_len);
    int stop = stop_now(step, steps_max, t0, seconds);
    float base = (float)(step % 5);
    for (long i = 0; i < elems - 1; i++) send[i] = (float)(g_rank + 1) * (float)(i % 7 + 1) + base;
    send[elems - 1] = g_rank == 0 ? (float)stop : 0.0f;
    settle(ncclAllReduce(send, recv, elems, ncclFloat32, ncclSum, A, issue(A)), "ncclAllReduce", A);
    joined(A);
    for (size_t i = 0; i < ag_n; i++) ag_in[i] = (float)g_rank;
    settle(ncclAllGather(ag_in, ag_out, ag_n, ncclFloat32, B, issue(B)), "ncclAllGather", B);
    joined(B);
    settle(ncclReduceScatter(send, rs_out, rs_n, ncclFloat32, ncclMax, C, issue(C)), "ncclReduceScatter", C);
    for (size_t i = 0; i < bc_n; i++) bc[i] = rC == 0 ? (float)step : -1.0f;
    settle(ncclBroadcast(bc, bc, bc_n, ncclFloat32, 0, C, issue(C)), "ncclBroadcast", C);
    joined(C);
    for (size_t i = 0; i < p2p_n; i++) p2p_out[i] = (float)g_rank;
    cudaStream_t sa = issue(A);
    nccl_check(ncclGroupStart(), "ncclGroupStart", A);
    nccl_check(ncclSend(p2p_out, p2p_n, ncclFloat32, next, A, sa), "ncclSend", A);
    nccl_check(ncclRecv(p2p_in, p2p_n, ncclFloat32, prev, A, sa), "ncclRecv", A);
    settle(ncclGroupEnd(), "ncclGroupEnd", A);
    joined(A);
    if (newer_colls && newer_collectives(A, g_rank, world, step) != 0) return 4;  /* [probes] */
    step_sync();
    if (mb > 0 && g_async) checkpoint(io_dir, g_rank, mb, junk, junk_len);
    float rsum = (float)world * (world + 1) / 2;
    for (long i = 0; i < elems - 1; i++)
      if (recv[i] != rsum * (float)(i % 7 + 1) + base * world) {
        fprintf(stderr, "ingero-lab-worker: rank %d step %ld: wrong all-reduce result at %ld: %g\n",
                g_rank, step, i, recv[i]);
        return 4;
      }
    stop = recv[elems - 1] != 0.0f;
    for (int r = 0; r < world; r++)
      if (ag_out[(size_t)r * ag_n] != (float)r || ag_out[(size_t)r * ag_n + ag_n - 1] != (float)r) {
        fprintf(stderr, "ingero-lab-worker: rank %d: wrong all-gather block %d\n", g_rank, r);
        return 4;
      }
    if (bc[bc_n - 1] != (float)step) {
      fprintf(stderr, "ingero-lab-worker: rank %d: wrong broadcast\n", g_rank);
      return 4;
    }
    if (p2p_in[0] != (float)prev || p2p_in[p2p_n - 1] != (float)prev) {
      fprintf(stderr, "ingero-lab-worker: rank %d: wrong data received from rank %d\n", g_rank, prev);
      return 4;
    }
    step_done(&st, (now_s() - ts) * 1e3);
    step++;
    if (stop) break;
  }
  if (elastic && run_elastic(A, world, run_id, timeout_s, elastic_steps) != 0) return 4;
  ncclCommDestroy(C);
  ncclCommDestroy(B);
  ncclCommDestroy(A);
  printf("{\"rank\": %d, \"node\": %d, \"local_rank\": %d, \"world_size\": %d, ", g_rank, node, local_rank, world);
  print_steps(&st);
  printf(", \"device\": \"%s\", \"elapsed_s\": %.3f, \"verified\": true}\n", g_async ? "gpu" : "cpu", now_s() - t0);
  return 0;
}
