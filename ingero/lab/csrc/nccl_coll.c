/* nccl_coll.c: collective algorithms of the CPU NCCL library.
 *
 * All-reduce is a ring: a reduce-scatter phase (N-1 steps, each sending one
 * 1/N chunk to the next rank while receiving one from the previous rank and
 * reducing it) followed by an all-gather phase (N-1 steps). All-gather and
 * reduce-scatter are the two phases on their own. Broadcast is a star from
 * the root, reduce a gather to the root. Every step moves its sends and
 * receives together through ncpu_run_ops (nonblocking sockets), so rings
 * never deadlock on full socket buffers.
 *
 * Reductions: sum, prod, max, min, avg (sum, then divided by nranks; integer
 * division for integer types) on every ncclDataType_t, float16 through
 * _Float16 and bfloat16 through float.
 */
#include <stdlib.h>
#include <string.h>

#include "nccl_cpu_internal.h"
#include "nccl_prof.h"

size_t ncpu_type_size(ncclDataType_t t) {
  static const size_t sizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return (t >= 0 && t < ncclNumTypes) ? sizes[t] : 0;
}

static float bf16_to_f(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
  u += 0x7fffu + ((u >> 16) & 1);  /* round to nearest even */
  return (uint16_t)(u >> 16);
}

#define MAXF(a, b) ((a) > (b) ? (a) : (b))
#define MINF(a, b) ((a) < (b) ? (a) : (b))
#define RED_LOOP(T)                                                                       \
  do {                                                                                    \
    T *d = dst;                                                                           \
    const T *s = src;                                                                     \
    switch (op) {                                                                         \
      case ncclProd: for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] * s[i]); break;       \
      case ncclMax: for (size_t i = 0; i < n; i++) d[i] = MAXF(d[i], s[i]); break;        \
      case ncclMin: for (size_t i = 0; i < n; i++) d[i] = MINF(d[i], s[i]); break;        \
      default: for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] + s[i]); break;             \
    }                                                                                     \
  } while (0)

/* dst[i] = dst[i] (op) src[i] for n elements; avg accumulates a sum. */
static void reduce(void *dst, const void *src, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: RED_LOOP(int8_t); break;
    case ncclUint8: RED_LOOP(uint8_t); break;
    case ncclInt32: RED_LOOP(int32_t); break;
    case ncclUint32: RED_LOOP(uint32_t); break;
    case ncclInt64: RED_LOOP(int64_t); break;
    case ncclUint64: RED_LOOP(uint64_t); break;
    case ncclFloat16: RED_LOOP(_Float16); break;
    case ncclFloat32: RED_LOOP(float); break;
    case ncclFloat64: RED_LOOP(double); break;
    case ncclBfloat16: {
      uint16_t *d = dst;
      const uint16_t *s = src;
      for (size_t i = 0; i < n; i++) {
        float a = bf16_to_f(d[i]), b = bf16_to_f(s[i]);
        float r = op == ncclProd ? a * b : op == ncclMax ? MAXF(a, b) : op == ncclMin ? MINF(a, b) : a + b;
        d[i] = f_to_bf16(r);
      }
      break;
    }
    default: break;
  }
}

#define DIV_LOOP(T) do { T *d = buf; for (size_t i = 0; i < n; i++) d[i] = (T)(d[i] / (T)nr); } while (0)

static void divide(void *buf, size_t n, ncclDataType_t t, int nr) {
  switch (t) {
    case ncclInt8: DIV_LOOP(int8_t); break;
    case ncclUint8: DIV_LOOP(uint8_t); break;
    case ncclInt32: DIV_LOOP(int32_t); break;
    case ncclUint32: DIV_LOOP(uint32_t); break;
    case ncclInt64: DIV_LOOP(int64_t); break;
    case ncclUint64: DIV_LOOP(uint64_t); break;
    case ncclFloat16: DIV_LOOP(_Float16); break;
    case ncclFloat32: DIV_LOOP(float); break;
    case ncclFloat64: DIV_LOOP(double); break;
    case ncclBfloat16: {
      uint16_t *d = buf;
      for (size_t i = 0; i < n; i++) d[i] = f_to_bf16(bf16_to_f(d[i]) / (float)nr);
      break;
    }
    default: break;
  }
}

static inline int mod(int a, int n) { return ((a % n) + n) % n; }

/* Element offset of chunk i when count elements are cut into n chunks. */
static inline size_t chunk_off(size_t count, int i, int n) { return count * (size_t)i / (size_t)n; }

/* The profiler's view of the collective this thread runs (NCCL: its proxy's): a
 * ProxyOp per direction on channel 0, begun at the first ring step, and the
 * receive step whose data the caller still consumes. */
static __thread struct {
  struct ncclComm *comm;
  void *task, *send, *recv, *recv_step;
  int nsteps, nsend, nrecv;
} prof;

void ncpu_coll_profile(struct ncclComm *c, void *task, int nsteps) {
  prof.comm = c, prof.task = task, prof.nsteps = nsteps;
  prof.send = prof.recv = prof.recv_step = NULL;
  prof.nsend = prof.nrecv = 0;
}

static void recv_consumed(void) {
  ncpu_prof_stop(prof.recv_step);
  prof.recv_step = NULL;
}

void ncpu_coll_profile_end(void) {
  recv_consumed();
  ncpu_prof_stop(prof.send);
  ncpu_prof_stop(prof.recv);
  prof.task = prof.send = prof.recv = NULL;
}

/* A ring step: send to `to` while receiving from `from`. The caller consumes the
 * received data, then calls recv_consumed(). */
static ncclResult_t exchange(struct ncclComm *c, int to, void *sbuf, size_t slen, int from,
                             void *rbuf, size_t rlen) {
  struct ncpu_op ops[2] = {
      {.fd = c->sfds[to], .is_send = 1, .peer = to, .buf = sbuf, .len = slen},
      {.fd = c->rfds[from], .is_send = 0, .peer = from, .buf = rbuf, .len = rlen},
  };
  if (prof.task && prof.comm == c) {
    void *ctx = c->prof_ctx;
    if (!prof.send) prof.send = ncpu_prof_proxy_op_start(ctx, prof.task, 0, to, prof.nsteps, (int)slen, 1);
    if (!prof.recv) prof.recv = ncpu_prof_proxy_op_start(ctx, prof.task, 0, from, prof.nsteps, (int)rlen, 0);
    recv_consumed();
    ops[0].step = ncpu_prof_proxy_step_start(ctx, prof.send, prof.nsend++);
    ncpu_prof_proxy_step_state(ops[0].step, NCPU_SEND_GPU_WAIT, slen);
    ops[1].step = prof.recv_step = ncpu_prof_proxy_step_start(ctx, prof.recv, prof.nrecv++);
  }
  ncclResult_t res = ncpu_run_ops(c, ops, 2);
  ncpu_prof_stop(ops[0].step);    /* a send that did not finish (an error) */
  return res;
}

/* Broadcast and reduce: one step with each peer, each its own ProxyOp. */
static ncclResult_t run_single(struct ncclComm *c, struct ncpu_op *ops, int n) {
  void *tasks[n > 0 ? n : 1], *proxies[n > 0 ? n : 1];
  for (int i = 0; i < n; i++) tasks[i] = prof.comm == c ? prof.task : NULL;
  ncpu_prof_single_begin(c, tasks, ops, n, proxies);
  ncclResult_t res = ncpu_run_ops(c, ops, n);
  ncpu_prof_single_end(ops, n, proxies);
  return res;
}

/* In place: afterwards chunk `rank` of buf holds the reduction over all ranks. */
static ncclResult_t ring_reduce_scatter(struct ncclComm *c, char *buf, size_t count,
                                        ncclDataType_t t, ncclRedOp_t op) {
  int n = c->nranks, r = c->rank, next = mod(r + 1, n), prev = mod(r - 1, n);
  size_t es = ncpu_type_size(t), maxc = count / n + 1;
  char *tmp = malloc(maxc * es);
  if (!tmp) return ncclSystemError;
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = mod(r - s - 1, n), rc = mod(r - s - 2, n);
    size_t so = chunk_off(count, sc, n), sn = chunk_off(count, sc + 1, n) - so;
    size_t ro = chunk_off(count, rc, n), rn = chunk_off(count, rc + 1, n) - ro;
    res = exchange(c, next, buf + so * es, sn * es, prev, tmp, rn * es);
    if (res == ncclSuccess) reduce(buf + ro * es, tmp, rn, t, op);
    recv_consumed();
  }
  free(tmp);
  return res;
}

/* In place: chunk `rank` of buf is valid on entry; afterwards every chunk is. */
static ncclResult_t ring_all_gather(struct ncclComm *c, char *buf, size_t count, size_t es) {
  int n = c->nranks, r = c->rank, next = mod(r + 1, n), prev = mod(r - 1, n);
  ncclResult_t res = ncclSuccess;
  for (int s = 0; s < n - 1 && res == ncclSuccess; s++) {
    int sc = mod(r - s, n), rc = mod(r - s - 1, n);
    size_t so = chunk_off(count, sc, n), sn = chunk_off(count, sc + 1, n) - so;
    size_t ro = chunk_off(count, rc, n), rn = chunk_off(count, rc + 1, n) - ro;
    res = exchange(c, next, buf + so * es, sn * es, prev, buf + ro * es, rn * es);
    recv_consumed();
  }
  return res;
}

ncclResult_t ncpu_allreduce(struct ncclComm *c, const void *s, void *r, size_t count,
                            ncclDataType_t t, ncclRedOp_t op) {
  size_t es = ncpu_type_size(t);
  if (s != r) memmove(r, s, count * es);
  if (c->nranks == 1) return ncclSuccess;
  ncclResult_t res = ring_reduce_scatter(c, r, count, t, op);
  if (res != ncclSuccess) return res;
  if (op == ncclAvg) {
    size_t o = chunk_off(count, c->rank, c->nranks);
    divide((char *)r + o * es, chunk_off(count, c->rank + 1, c->nranks) - o, t, c->nranks);
  }
  return ring_all_gather(c, r, count, es);
}

ncclResult_t ncpu_allgather(struct ncclComm *c, const void *s, void *r, size_t sendcount,
                            ncclDataType_t t) {
  size_t es = ncpu_type_size(t);
  char *mine = (char *)r + (size_t)c->rank * sendcount * es;
  if (s != mine) memmove(mine, s, sendcount * es);
  if (c->nranks == 1) return ncclSuccess;
  return ring_all_gather(c, r, sendcount * c->nranks, es);
}

ncclResult_t ncpu_reducescatter(struct ncclComm *c, const void *s, void *r, size_t recvcount,
                                ncclDataType_t t, ncclRedOp_t op) {
  size_t es = ncpu_type_size(t), count = recvcount * c->nranks;
  char *work = malloc(count * es + 1);
  if (!work) return ncclSystemError;
  memcpy(work, s, count * es);
  ncclResult_t res = c->nranks == 1 ? ncclSuccess : ring_reduce_scatter(c, work, count, t, op);
  if (res == ncclSuccess) {
    char *mine = work + (size_t)c->rank * recvcount * es;
    if (op == ncclAvg) divide(mine, recvcount, t, c->nranks);
    memmove(r, mine, recvcount * es);
  }
  free(work);
  return res;
}

ncclResult_t ncpu_broadcast(struct ncclComm *c, const void *s, void *r, size_t count,
                            ncclDataType_t t, int root) {
  size_t bytes = count * ncpu_type_size(t);
  if (c->rank != root) {
    struct ncpu_op op = {.fd = c->rfds[root], .is_send = 0, .peer = root, .buf = r, .len = bytes};
    return run_single(c, &op, 1);
  }
  if (s != r) memmove(r, s, bytes);
  struct ncpu_op ops[c->nranks];
  int n = 0;
  for (int p = 0; p < c->nranks; p++)
    if (p != root) ops[n++] = (struct ncpu_op){.fd = c->sfds[p], .is_send = 1, .peer = p, .buf = r, .len = bytes};
  return run_single(c, ops, n);
}

ncclResult_t ncpu_reduce(struct ncclComm *c, const void *s, void *r, size_t count,
                         ncclDataType_t t, ncclRedOp_t op, int root) {
  size_t es = ncpu_type_size(t), bytes = count * es;
  if (c->rank != root) {
    struct ncpu_op o = {.fd = c->sfds[root], .is_send = 1, .peer = root, .buf = (char *)s, .len = bytes};
    return run_single(c, &o, 1);
  }
  char *tmp = malloc(bytes * (c->nranks - 1) + 1);
  if (!tmp) return ncclSystemError;
  struct ncpu_op ops[c->nranks];
  int n = 0;
  for (int p = 0; p < c->nranks; p++)
    if (p != root) {
      ops[n] = (struct ncpu_op){.fd = c->rfds[p], .is_send = 0, .peer = p, .buf = tmp + bytes * n, .len = bytes};
      n++;
    }
  ncclResult_t res = run_single(c, ops, n);
  if (res == ncclSuccess) {
    if (s != r) memmove(r, s, bytes);
    for (int k = 0; k < n; k++) reduce(r, tmp + bytes * k, count, t, op);
    if (op == ncclAvg) divide(r, count, t, c->nranks);
  }
  free(tmp);
  return res;
}
