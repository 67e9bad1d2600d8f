/* nccl_net.c: TCP plumbing of the CPU NCCL library.
 *
 *  - ncpu_root_listen: the bootstrap root, opened by ncclGetUniqueId. A
 *    detached thread accepts ranks, groups them by the full 128-byte unique id
 *    and, once a group has all its ranks, sends every rank the listen address
 *    of every other rank. It keeps serving, so several ids that carry the same
 *    root address (they differ only in their last bytes) all work.
 *  - ncpu_bootstrap / ncpu_build_mesh: one TCP connection per ordered pair of
 *    ranks, i.e. per direction (a full mesh; each rank connects to every other
 *    rank for its sends and accepts a connection from each for its receives),
 *    as NCCL's network transport connects a send comm and a receive comm per
 *    peer (transport/net.cc): data goes one way, ACKs the other.
 *  - ncpu_run_ops: moves many sends and receives at once with nonblocking
 *    sockets and poll(2), so a ring step (send to next, receive from previous)
 *    or a group of p2p calls never deadlocks on full socket buffers. No
 *    progress for the timeout (env NCCL_CPU_TIMEOUT_S, else
 *    INGERO_LAB_TIMEOUT_S, default 60 s) fails the call with ncclRemoteError.
 *
 * Everything is IPv4 or IPv6, decided by the root's address: env
 * NCCL_SOCKET_ADDR, else MASTER_ADDR, else 127.0.0.1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <linux/tcp.h>   /* TCP_NODELAY; struct tcp_info with tcpi_snd_wnd (glibc's has none) */
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "nccl_cpu_internal.h"
#include "nccl_prof.h"

struct hello {            /* rank -> root */
  uint32_t magic;
  int32_t rank;
  int32_t nranks;
  uint32_t pad;
  ncclUniqueId id;
  struct sockaddr_storage addr;
};

struct peer_hello {       /* sender -> receiver, on a new mesh connection */
  uint32_t magic;
  int32_t rank;
  uint64_t tag;
};

int ncpu_timeout_ms(void) {
  const char *v = getenv("NCCL_CPU_TIMEOUT_S");
  if (!v || !*v) v = getenv("INGERO_LAB_TIMEOUT_S");
  double s = (v && *v) ? atof(v) : 60.0;
  if (s <= 0) s = 60.0;
  return (int)(s * 1000.0);
}

static __thread char tl_error[256];

const char *ncpu_thread_error(void) { return tl_error; }

void ncpu_set_error(struct ncclComm *comm, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  snprintf(tl_error, sizeof tl_error, "%s", buf);
  if (comm) snprintf(comm->last_error, sizeof comm->last_error, "%s", buf);
  if (getenv("NCCL_DEBUG")) fprintf(stderr, "NCCL WARN %s\n", buf);
}

uint64_t ncpu_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t ncpu_hash_id(const ncclUniqueId *id) {
  uint64_t w[16], h = 0;
  memcpy(w, id->internal, sizeof w);
  for (int i = 0; i < 16; i++) h = ncpu_mix(h ^ w[i]);
  return h;
}

static socklen_t sa_len(const struct sockaddr_storage *ss) {
  return ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

static int read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t n = recv(fd, p, len, 0);
    if (n == 0) return -1;
    if (n < 0) { if (errno == EINTR) continue; return -1; }
    p += n; len -= (size_t)n;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0) { if (errno == EINTR) continue; return -1; }
    p += n; len -= (size_t)n;
  }
  return 0;
}

static void set_io_timeout(int fd, int ms) {
  struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Connect, retrying refused/unreachable for up to timeout_ms (the peer may not listen yet). */
static int connect_retry(const struct sockaddr_storage *to, int timeout_ms) {
  double deadline = now_s() + timeout_ms / 1000.0;
  for (;;) {
    int fd = socket(to->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (const struct sockaddr *)to, sa_len(to)) == 0) {
      set_io_timeout(fd, timeout_ms);
      return fd;
    }
    int e = errno;
    close(fd);
    if (now_s() > deadline || !(e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH ||
                                e == ETIMEDOUT || e == EINTR || e == EADDRNOTAVAIL)) {
      errno = e;
      return -1;
    }
    usleep(100 * 1000);
  }
}

ncclResult_t ncpu_listen_on(const struct sockaddr_storage *local, int *lfd,
                            struct sockaddr_storage *bound) {
  int fd = socket(local->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ncclSystemError;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (local->ss_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  socklen_t len = sizeof *bound;
  if (bind(fd, (const struct sockaddr *)local, sa_len(local)) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, (struct sockaddr *)bound, &len) != 0) {
    close(fd);
    return ncclSystemError;
  }
  *lfd = fd;
  return ncclSuccess;
}

/* ---- bootstrap root ---------------------------------------------------- */

struct group {
  struct group *next;
  ncclUniqueId id;
  int nranks, joined;
  int *fds;
  struct sockaddr_storage *addrs;
};

static void group_fail(struct group *g) {
  for (int r = 0; r < g->nranks; r++) if (g->fds[r] >= 0) close(g->fds[r]);
  free(g->fds); free(g->addrs); free(g);
}

static void *root_thread(void *arg) {
  int lfd = (int)(intptr_t)arg;
  struct group *groups = NULL;
  for (;;) {
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) { if (errno == EINTR || errno == ECONNABORTED) continue; usleep(10000); continue; }
    set_io_timeout(fd, ncpu_timeout_ms());
    struct hello h;
    if (read_full(fd, &h, sizeof h) != 0 || h.magic != NCPU_ID_MAGIC || h.nranks < 1 ||
        h.nranks > NCPU_MAX_RANKS || h.rank < 0 || h.rank >= h.nranks) {
      close(fd);
      continue;
    }
    struct group **pp = &groups, *g;
    for (g = groups; g; pp = &g->next, g = g->next)
      if (memcmp(&g->id, &h.id, sizeof h.id) == 0) break;
    if (!g) {
      g = calloc(1, sizeof *g);
      g->id = h.id;
      g->nranks = h.nranks;
      g->fds = malloc(sizeof(int) * h.nranks);
      g->addrs = calloc(h.nranks, sizeof *g->addrs);
      for (int r = 0; r < h.nranks; r++) g->fds[r] = -1;
      g->next = groups;
      groups = g;
      pp = &groups;
    }
    if (h.nranks != g->nranks || g->fds[h.rank] >= 0) {  /* inconsistent: fail the whole group */
      close(fd);
      *pp = g->next;
      group_fail(g);
      continue;
    }
    g->fds[h.rank] = fd;
    g->addrs[h.rank] = h.addr;
    if (++g->joined < g->nranks) continue;
    for (int r = 0; r < g->nranks; r++)
      write_full(g->fds[r], g->addrs, sizeof(*g->addrs) * g->nranks);
    *pp = g->next;
    group_fail(g);  /* closes the (answered) connections */
  }
  return NULL;
}

static int resolve(const char *host, struct sockaddr_storage *out) {
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, NULL, &hints, &res) != 0 || !res) return -1;
  memcpy(out, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return 0;
}

ncclResult_t ncpu_root_listen(struct ncpu_id *id) {
  const char *host = getenv("NCCL_SOCKET_ADDR");
  if (!host || !*host) host = getenv("MASTER_ADDR");
  if (!host || !*host || !strcmp(host, "0.0.0.0") || !strcmp(host, "::")) host = "127.0.0.1";
  struct sockaddr_storage local = {0}, bound;
  if (resolve(host, &local) != 0) {
    ncpu_set_error(NULL, "cannot resolve bootstrap address %s", host);
    return ncclInvalidArgument;
  }
  int lfd;
  if (ncpu_listen_on(&local, &lfd, &bound) != ncclSuccess) {
    ncpu_set_error(NULL, "cannot listen on %s: %s", host, strerror(errno));
    return ncclSystemError;
  }
  memset(id, 0, sizeof *id);
  id->magic = NCPU_ID_MAGIC;
  id->family = bound.ss_family;
  if (bound.ss_family == AF_INET6) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&bound;
    id->port = s6->sin6_port;
    memcpy(id->addr, &s6->sin6_addr, 16);
  } else {
    struct sockaddr_in *s4 = (struct sockaddr_in *)&bound;
    id->port = s4->sin_port;
    memcpy(id->addr, &s4->sin_addr, 4);
  }
  if (getrandom(id->fill, sizeof id->fill, 0) != sizeof id->fill ||
      getrandom(&id->nonce, sizeof id->nonce, 0) != sizeof id->nonce) {
    close(lfd);
    return ncclSystemError;
  }
  pthread_t t;
  if (pthread_create(&t, NULL, root_thread, (void *)(intptr_t)lfd) != 0) {
    close(lfd);
    return ncclSystemError;
  }
  pthread_detach(t);
  return ncclSuccess;
}

/* ---- communicator set-up ----------------------------------------------- */

/* NCCL_SOCKET_SNDBUF / NCCL_SOCKET_RCVBUF as NCCL reads them (misc/socket.cc, os/linux.cc):
 * set when > 0, the kernel's default (autotuned) otherwise; on connections to other hosts
 * only, as NCCL's sockets carry only inter-node traffic (P2P or SHM inside a node). */
static void buffer_size(int fd, int opt, const char *var) {
  const char *v = getenv(var);
  int n = v ? atoi(v) : -1;
  if (n > 0) setsockopt(fd, SOL_SOCKET, opt, &n, sizeof n);
}

static void tune(int fd, int remote) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (remote) {
    buffer_size(fd, SO_SNDBUF, "NCCL_SOCKET_SNDBUF");
    buffer_size(fd, SO_RCVBUF, "NCCL_SOCKET_RCVBUF");
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

static int same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
  if (a->ss_family != b->ss_family) return 0;
  if (a->ss_family == AF_INET6)
    return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr, 16);
  return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
}

/* Also sets comm->nnodes: the distinct host addresses in addrs (a lab node is a network namespace).
 * Every rank connects to every other rank for its sends (sfds) and accepts one connection
 * from each for its receives (rfds); a connect completes in the peer's listen backlog, so all
 * connect first, then accept. */
ncclResult_t ncpu_build_mesh(struct ncclComm *comm, int lfd, const struct sockaddr_storage *addrs,
                             uint64_t tag) {
  int me = comm->rank;
  comm->nnodes = 0;
  for (int j = 0; j < comm->nranks; j++) {
    int k = 0;
    while (k < j && !same_host(&addrs[k], &addrs[j])) k++;
    comm->nnodes += k == j;
  }
  for (int j = 0; j < comm->nranks; j++) comm->sfds[j] = comm->rfds[j] = -1;
  for (int j = 0; j < comm->nranks; j++) {
    if (j == me) continue;
    int fd = connect_retry(&addrs[j], comm->timeout_ms);
    struct peer_hello ph = {NCPU_ID_MAGIC, me, tag};
    if (fd < 0 || write_full(fd, &ph, sizeof ph) != 0) {
      ncpu_set_error(comm, "rank %d: cannot connect to rank %d: %s", me, j, strerror(errno));
      if (fd >= 0) close(fd);
      return ncclRemoteError;
    }
    comm->sfds[j] = fd;
  }
  int want = comm->nranks - 1;
  double deadline = now_s() + comm->timeout_ms / 1000.0;
  while (want > 0) {
    struct pollfd p = {lfd, POLLIN, 0};
    int left = (int)((deadline - now_s()) * 1000);
    if (left <= 0 || poll(&p, 1, left) <= 0) {
      if (errno == EINTR) continue;
      ncpu_set_error(comm, "rank %d: timed out waiting for %d ranks to connect", me, want);
      return ncclRemoteError;
    }
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_io_timeout(fd, comm->timeout_ms);
    struct peer_hello ph;
    if (read_full(fd, &ph, sizeof ph) != 0 || ph.magic != NCPU_ID_MAGIC || ph.tag != tag ||
        ph.rank == me || ph.rank < 0 || ph.rank >= comm->nranks || comm->rfds[ph.rank] >= 0) {
      close(fd);
      continue;
    }
    comm->rfds[ph.rank] = fd;
    want--;
  }
  for (int j = 0; j < comm->nranks; j++) {
    int remote = !same_host(&addrs[me], &addrs[j]);
    if (comm->sfds[j] >= 0) tune(comm->sfds[j], remote);
    if (comm->rfds[j] >= 0) tune(comm->rfds[j], remote);
  }
  return ncclSuccess;
}

ncclResult_t ncpu_bootstrap(struct ncclComm *comm, const ncclUniqueId *uid) {
  struct ncpu_id id;
  memcpy(&id, uid, sizeof id);
  if (id.magic != NCPU_ID_MAGIC || (id.family != AF_INET && id.family != AF_INET6)) {
    ncpu_set_error(comm, "ncclUniqueId was not made by ncclGetUniqueId of this library");
    return ncclInvalidArgument;
  }
  struct sockaddr_storage root = {0};
  if (id.family == AF_INET6) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&root;
    s6->sin6_family = AF_INET6; s6->sin6_port = id.port;
    memcpy(&s6->sin6_addr, id.addr, 16);
  } else {
    struct sockaddr_in *s4 = (struct sockaddr_in *)&root;
    s4->sin_family = AF_INET; s4->sin_port = id.port;
    memcpy(&s4->sin_addr, id.addr, 4);
  }
  int bfd = connect_retry(&root, comm->timeout_ms);
  if (bfd < 0) {
    ncpu_set_error(comm, "rank %d: cannot reach the bootstrap root: %s", comm->rank, strerror(errno));
    return ncclRemoteError;
  }
  struct sockaddr_storage local = {0};
  socklen_t len = sizeof local;
  getsockname(bfd, (struct sockaddr *)&local, &len);
  if (local.ss_family == AF_INET6) ((struct sockaddr_in6 *)&local)->sin6_port = 0;
  else ((struct sockaddr_in *)&local)->sin_port = 0;
  comm->self_addr = local;
  int lfd;
  struct hello h = {0};
  if (ncpu_listen_on(&local, &lfd, &h.addr) != ncclSuccess) {
    close(bfd);
    ncpu_set_error(comm, "rank %d: cannot listen: %s", comm->rank, strerror(errno));
    return ncclSystemError;
  }
  h.magic = NCPU_ID_MAGIC; h.rank = comm->rank; h.nranks = comm->nranks; h.id = *uid;
  struct sockaddr_storage *addrs = calloc(comm->nranks, sizeof *addrs);
  ncclResult_t res = ncclSuccess;
  if (write_full(bfd, &h, sizeof h) != 0 ||
      read_full(bfd, addrs, sizeof(*addrs) * comm->nranks) != 0) {
    ncpu_set_error(comm, "rank %d: bootstrap exchange with the root failed (other ranks missing "
                   "or inconsistent nranks?)", comm->rank);
    res = ncclRemoteError;
  }
  close(bfd);
  if (res == ncclSuccess) res = ncpu_build_mesh(comm, lfd, addrs, comm->id_hash);
  close(lfd);
  free(addrs);
  return res;
}

/* ---- transfer engine --------------------------------------------------- */

static int is_active(struct ncpu_op *ops, int i) {
  if (ops[i].done == ops[i].len) return 0;
  for (int k = 0; k < i; k++)  /* FIFO per socket and direction */
    if (ops[k].fd == ops[i].fd && ops[k].is_send == ops[i].is_send && ops[k].done < ops[k].len)
      return 0;
  return 1;
}

void ncpu_prof_single_begin(struct ncclComm *comm, void *const *tasks, struct ncpu_op *ops, int n, void **proxies) {
  for (int i = 0; i < n; i++) {
    proxies[i] = ncpu_prof_proxy_op_start(comm->prof_ctx, tasks[i], 0, ops[i].peer, 1, (int)ops[i].len,
                                          ops[i].is_send);
    ops[i].step = ncpu_prof_proxy_step_start(comm->prof_ctx, proxies[i], 0);
  }
}

void ncpu_prof_single_end(struct ncpu_op *ops, int n, void **proxies) {
  for (int i = 0; i < n; i++) {
    ncpu_prof_stop(ops[i].step);   /* a receive's: its data is consumed */
    ops[i].step = NULL;
    ncpu_prof_stop(proxies[i]);
  }
}

/* A transfer's profiler step: it waits for the network from here (its socket's NetPlugin
 * event names the connection); a send's step ends when the last byte left, a receive's
 * waits for the consumer (the caller stops it). */
static void step_posted(struct ncclComm *comm, struct ncpu_op *o) {
  if (!o->step) return;
  ncpu_prof_net_socket(comm->prof_ctx, o->step, o->fd, o->is_send, o->len);
  ncpu_prof_proxy_step_state(o->step, o->is_send ? NCPU_SEND_WAIT : NCPU_RECV_WAIT, o->len);
}

/* A send that cannot go on waits for the peer (NCCL: SendPeerWait, no clear-to-send
 * credit) when what it has in flight fills the peer's advertised window: the peer does
 * not read fast enough; else for the network (SendWait: its segments in flight are not
 * acknowledged, e.g. lost and resent, or the congestion window holds it back). Recorded
 * when the state changes. */
static void send_blocked(struct ncpu_op *o) {
  if (!o->step || !o->is_send || o->done == o->len) return;
  struct tcp_info ti;
  socklen_t n = sizeof ti;
  if (getsockopt(o->fd, IPPROTO_TCP, TCP_INFO, &ti, &n) != 0 || n < offsetof(struct tcp_info, tcpi_snd_wnd) + 4)
    return;   /* not TCP (a socketpair), or an old kernel: the network it stays */
  int peer = (uint64_t)ti.tcpi_unacked * ti.tcpi_snd_mss + ti.tcpi_snd_mss > ti.tcpi_snd_wnd;
  if (peer != o->peer_wait) {
    o->peer_wait = peer;
    ncpu_prof_proxy_step_state(o->step, peer ? NCPU_SEND_PEER_WAIT : NCPU_SEND_WAIT, o->len);
  }
}

static void step_moved(struct ncpu_op *o) {
  if (!o->step) return;
  if (o->is_send) {
    ncpu_prof_stop(o->step);
    o->step = NULL;
  } else {
    ncpu_prof_proxy_step_state(o->step, NCPU_RECV_GPU_WAIT, o->len);
  }
}

ncclResult_t ncpu_run_ops(struct ncclComm *comm, struct ncpu_op *ops, int nops) {
  struct pollfd pfd[nops > 0 ? nops : 1];
  int idx[nops > 0 ? nops : 1];
  for (int i = 0; i < nops; i++) {
    step_posted(comm, &ops[i]);
    if (ops[i].done == ops[i].len) step_moved(&ops[i]);
  }
  for (;;) {
    int n = 0;
    for (int i = 0; i < nops; i++) {
      if (!is_active(ops, i)) continue;
      pfd[n].fd = ops[i].fd;
      pfd[n].events = ops[i].is_send ? POLLOUT : POLLIN;
      pfd[n].revents = 0;
      idx[n++] = i;
    }
    if (n == 0) return ncclSuccess;
    int r = poll(pfd, n, comm->timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      struct ncpu_op *o = &ops[idx[0]];
      ncpu_set_error(comm, "rank %d: no progress for %d ms %s rank %d (peer dead or hung?)",
                     comm->rank, comm->timeout_ms, o->is_send ? "sending to" : "receiving from",
                     o->peer);
      return ncclRemoteError;
    }
    for (int k = 0; k < n; k++) {
      if (!pfd[k].revents) continue;
      struct ncpu_op *o = &ops[idx[k]];
      ssize_t got = o->is_send
                        ? send(o->fd, o->buf + o->done, o->len - o->done, MSG_NOSIGNAL)
                        : recv(o->fd, o->buf + o->done, o->len - o->done, 0);
      if (got > 0) {
        o->done += (size_t)got;
        if (o->done == o->len) step_moved(o);
        else send_blocked(o);   /* a short send: its buffer is full */
        continue;
      }
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        send_blocked(o);
        continue;
      }
      ncpu_set_error(comm, "rank %d: connection to rank %d %s", comm->rank, o->peer,
                     got == 0 ? "closed by the peer" : strerror(errno));
      return ncclRemoteError;
    }
  }
}
