/* nccl_prof.c: the lab's NCCL loads a profiler plugin and calls it as NCCL does.
 *
 * Loading (NCCL 2.30's src/plugin/profiler.cc and plugin_open.cc): the first
 * communicator's init dlopens NCCL_PROFILER_PLUGIN (RTLD_NOW | RTLD_LOCAL) as
 * given, then, for a bare name, as libnccl-profiler-<name>.so; unset, it tries
 * libnccl-profiler.so; "none" loads nothing. It takes the first of the symbols
 * ncclProfiler_v6, ncclProfiler_v5, ncclProfiler_v4 the library defines
 * (NCCL would go on to v3..v1, which carry no GPU timestamps and are not
 * mirrored here: such a plugin is not used). Each communicator calls init
 * with that version's signature (commHash, nNodes, nRanks, rank; the mask
 * the plugin returns is kept process-wide, as NCCL keeps it); an init that
 * fails leaves that communicator without the plugin. The library is closed
 * after the last communicator's finalize. NCCL_DEBUG=INFO prints the
 * plugin's log lines and what was loaded.
 *
 * Events are built in the descriptor of the version loaded (the structs of
 * nccl_profiler_abi.h, mirrored from NVIDIA's headers), filled as NCCL's v4,
 * v5 and v6 adapters fill them: v4 sees no API events, and a task's
 * parentObj is its group there; v5 and v6 get the CollApi/P2pApi handle as
 * parentObj and the group in coll.parentGroup / p2p.parentGroup. Proxy events
 * (ProxyOp under a task, ProxyStep under a ProxyOp, a NetPlugin socket event
 * under a step, as src/plugin/profiler.cc and src/transport/net_socket.cc make
 * them) are started when the plugin asked for them or for an event below them.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl_profiler_abi.h"
#include "nccl_prof.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int refs, load_failed, api;
static void *lib;
static ncclProfiler_v4_t *p4;
static ncclProfiler_v5_t *p5;
static ncclProfiler_v6_t *p6;
static _Atomic int mask;   /* ncclProfilerEventMask: the last init's */

static int debug_level(void) {
  const char *v = getenv("NCCL_DEBUG");
  if (!v || !*v) return NCCL_LOG_NONE;
  if (!strcasecmp(v, "VERSION")) return NCCL_LOG_VERSION;
  if (!strcasecmp(v, "WARN")) return NCCL_LOG_WARN;
  if (!strcasecmp(v, "INFO")) return NCCL_LOG_INFO;
  if (!strcasecmp(v, "TRACE")) return NCCL_LOG_TRACE;
  return NCCL_LOG_NONE;
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags, (void)file, (void)line;
  if (level == NCCL_LOG_NONE || (int)level > debug_level()) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "NCCL %s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

static void *open_plugin(const char *name) {
  char buf[300];
  if (!name || !*name) return dlopen("libnccl-profiler.so", RTLD_NOW | RTLD_LOCAL);
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  size_t n = strlen(name);
  if (!h && !strchr(name, '/') && (strncmp(name, "lib", 3) || n < 3 || strcmp(name + n - 3, ".so"))) {
    snprintf(buf, sizeof buf, "libnccl-profiler-%s.so", name);
    h = dlopen(buf, RTLD_NOW | RTLD_LOCAL);
  }
  if (!h) logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "PROFILER/Plugin: %s: %s", name, dlerror());
  return h;
}

/* Under mu: 1 when a plugin is loaded (this call holds one more reference). */
static int load(void) {
  if (load_failed) return 0;
  if (lib) { refs++; return 1; }
  const char *name = getenv("NCCL_PROFILER_PLUGIN");
  if (name && !strcasecmp(name, "none")) { load_failed = 1; return 0; }
  lib = open_plugin(name);
  if (lib && (p6 = dlsym(lib, "ncclProfiler_v6"))) api = 6;
  else if (lib && (p5 = dlsym(lib, "ncclProfiler_v5"))) api = 5;
  else if (lib && (p4 = dlsym(lib, "ncclProfiler_v4"))) api = 4;
  if (!api) {
    if (lib) {
      logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "External profiler plugin %s is unsupported", name);
      dlclose(lib);
      lib = NULL;
    }
    load_failed = 1;
    return 0;
  }
  logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "PROFILER/Plugin: Loaded %s (v%d)",
         api == 6 ? p6->name : api == 5 ? p5->name : p4->name, api);
  refs = 1;
  return 1;
}

static void unload(void) {
  if (--refs > 0) return;
  dlclose(lib);
  lib = NULL;
  p4 = NULL, p5 = NULL, p6 = NULL;
  api = 0;
}

void *ncpu_prof_init(uint64_t comm_hash, int nnodes, int nranks, int rank) {
  void *ctx = NULL;
  int m = 0, err;
  pthread_mutex_lock(&mu);
  if (!load()) {
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  if (api == 6) err = p6->init(&ctx, comm_hash, &m, NULL, nnodes, nranks, rank, logger);
  else if (api == 5) err = p5->init(&ctx, comm_hash, &m, NULL, nnodes, nranks, rank, logger);
  else err = p4->init(&ctx, &m, NULL, comm_hash, nnodes, nranks, rank, logger);
  if (err != ncclSuccess) {
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__,
           "Profiler init failed with error '%d'. Continue without profiler.", (int)err);
    unload();
    ctx = NULL;
  } else {
    atomic_store_explicit(&mask, m, memory_order_relaxed);
  }
  pthread_mutex_unlock(&mu);
  return ctx;
}

void ncpu_prof_finalize(void *ctx) {
  if (!ctx) return;
  pthread_mutex_lock(&mu);
  if (api == 6) p6->finalize(ctx);
  else if (api == 5) p5->finalize(ctx);
  else if (api == 4) p4->finalize(ctx);
  unload();
  pthread_mutex_unlock(&mu);
}

static int mask_has(int bits) { return (atomic_load_explicit(&mask, memory_order_relaxed) & bits) != 0; }

/* NCCL's tests for starting each kind of event (profiler.cc): a kind is started
 * when the plugin asked for it or for any event that hangs below it. */
int ncpu_prof_wants_api(void) {
  return api >= 5 && mask_has(ncclProfileGroupApi | ncclProfileCollApi | ncclProfileP2pApi | ncclProfileKernelLaunch |
                              ncclProfileGroup | ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp |
                              ncclProfileProxyStep | ncclProfileKernelCh | ncclProfileNetPlugin);
}

int ncpu_prof_wants_tasks(void) {
  return api && mask_has(ncclProfileGroup | ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp |
                         ncclProfileProxyStep | ncclProfileKernelCh | ncclProfileNetPlugin);
}

int ncpu_prof_wants_kernel(void) { return api && mask_has(ncclProfileKernelCh); }

/* Declares `d`, the loaded version's descriptor, zeroed; runs `fill` (and `fill5`
 * for v5 and v6, whose descriptors have more fields); starts the event. */
#define START_EVENT(ctx, handle, fill, fill5)                                                     \
  do {                                                                                            \
    if (api == 6) { ncclProfilerEventDescr_v6_t d; memset(&d, 0, sizeof d); fill; fill5;         \
                    p6->startEvent(ctx, handle, &d); }                                            \
    else if (api == 5) { ncclProfilerEventDescr_v5_t d; memset(&d, 0, sizeof d); fill; fill5;    \
                         p5->startEvent(ctx, handle, &d); }                                       \
    else if (api == 4) { ncclProfilerEventDescr_v4_t d; memset(&d, 0, sizeof d); fill;          \
                         p4->startEvent(ctx, handle, &d); }                                       \
  } while (0)

void *ncpu_prof_group_api_start(void *ctx, int group_depth) {
  void *h = NULL;
  if (!ctx || api < 5) return NULL;
  if (api == 6) { ncclProfilerEventDescr_v6_t d = {.type = ncclProfileGroupApi};
                  d.groupApi.groupDepth = group_depth; p6->startEvent(ctx, &h, &d); }
  else { ncclProfilerEventDescr_v5_t d = {.type = ncclProfileGroupApi};
         d.groupApi.groupDepth = group_depth; p5->startEvent(ctx, &h, &d); }
  return h;
}

void ncpu_prof_group_api_state(void *h, int end_api_start) {
  if (!h || api < 5) return;
  ncclProfilerEventState_t s = end_api_start ? ncclProfilerGroupEndApiStart : ncclProfilerGroupStartApiStop;
  if (api == 6) p6->recordEventState(h, s, NULL);
  else p5->recordEventState(h, s, NULL);
}

void *ncpu_prof_call_api_start(void *ctx, void *group_api, int is_coll, const char *func, size_t count,
                               const char *datatype, int root, void *stream) {
  void *h = NULL;
  if (!ctx || api < 5) return NULL;
#define API_FILL                                                              \
  d.type = is_coll ? ncclProfileCollApi : ncclProfileP2pApi;                  \
  d.parentObj = group_api;                                                    \
  if (is_coll) {                                                              \
    d.collApi.func = func; d.collApi.count = count;                           \
    d.collApi.datatype = datatype; d.collApi.root = root;                     \
    d.collApi.stream = stream;                                                \
  } else {                                                                    \
    d.p2pApi.func = func; d.p2pApi.count = count;                             \
    d.p2pApi.datatype = datatype; d.p2pApi.stream = stream;                   \
  }
  if (api == 6) { ncclProfilerEventDescr_v6_t d; memset(&d, 0, sizeof d); API_FILL; p6->startEvent(ctx, &h, &d); }
  else { ncclProfilerEventDescr_v5_t d; memset(&d, 0, sizeof d); API_FILL; p5->startEvent(ctx, &h, &d); }
#undef API_FILL
  return h;
}

void *ncpu_prof_group_start(void *ctx) {
  void *h = NULL;
  if (ctx) START_EVENT(ctx, &h, d.type = ncclProfileGroup, (void)0);
  return h;
}

void *ncpu_prof_task_start(void *ctx, const struct ncpu_prof_task *t) {
  void *h = NULL;
  if (!ctx) return NULL;
  if (t->is_coll) {
    START_EVENT(ctx, &h, {
      d.type = ncclProfileColl;
      d.rank = t->rank;
      d.coll.seqNumber = t->seq;
      d.coll.func = t->func;
      d.coll.sendBuff = t->sendbuff;
      d.coll.recvBuff = t->recvbuff;
      d.coll.count = t->count;
      d.coll.root = t->root_or_peer;
      d.coll.datatype = t->datatype;
      d.coll.nChannels = t->nchannels;
      d.coll.nWarps = 1;            /* one device thread runs every channel */
      d.coll.algo = t->algo;
      d.coll.proto = t->proto;
      d.parentObj = t->group;
    }, { d.parentObj = t->api; d.coll.parentGroup = t->group; });
  } else {
    START_EVENT(ctx, &h, {
      d.type = ncclProfileP2p;
      d.rank = t->rank;
      d.p2p.func = t->func;
      d.p2p.buff = t->recvbuff ? t->recvbuff : (void *)t->sendbuff;
      d.p2p.count = t->count;
      d.p2p.datatype = t->datatype;
      d.p2p.peer = t->root_or_peer;
      d.p2p.nChannels = t->nchannels;
      d.parentObj = t->group;
    }, { d.parentObj = t->api; d.p2p.parentGroup = t->group; });
  }
  return h;
}

void *ncpu_prof_kch_start(void *ctx, void *parent, int channel, uint64_t ptimer) {
  void *h = NULL;
  if (ctx && parent && ncpu_prof_wants_kernel())
    START_EVENT(ctx, &h, {
      d.type = ncclProfileKernelCh;
      d.parentObj = parent;
      d.kernelCh.channelId = (uint8_t)channel;
      d.kernelCh.pTimer = ptimer;
    }, (void)0);
  return h;
}

void ncpu_prof_kch_stop(void *h, uint64_t ptimer) {
  if (!h) return;
  ncclProfilerEventStateArgs_v5_t a5 = {.kernelCh = {.pTimer = ptimer}};
  ncclProfilerEventStateArgs_v4_t a4 = {.kernelCh = {.pTimer = ptimer}};
  if (api == 6) p6->recordEventState(h, ncclProfilerKernelChStop, &a5);
  else if (api == 5) p5->recordEventState(h, ncclProfilerKernelChStop, &a5);
  else if (api == 4) p4->recordEventState(h, ncclProfilerKernelChStop, &a4);
  ncpu_prof_stop(h);
}

void *ncpu_prof_proxy_op_start(void *ctx, void *task, int channel, int peer, int nsteps, int chunk, int is_send) {
  void *h = NULL;
  if (ctx && task && mask_has(ncclProfileProxyOp | ncclProfileProxyStep | ncclProfileNetPlugin))
    START_EVENT(ctx, &h, {
      d.type = ncclProfileProxyOp;
      d.parentObj = task;
      d.proxyOp.pid = getpid();
      d.proxyOp.channelId = (uint8_t)channel;
      d.proxyOp.peer = peer;
      d.proxyOp.nSteps = nsteps;
      d.proxyOp.chunkSize = chunk;
      d.proxyOp.isSend = is_send;
    }, (void)0);
  return h;
}

void *ncpu_prof_proxy_step_start(void *ctx, void *proxy_op, int step) {
  void *h = NULL;
  if (ctx && proxy_op && mask_has(ncclProfileProxyStep | ncclProfileNetPlugin))
    START_EVENT(ctx, &h, {
      d.type = ncclProfileProxyStep;
      d.parentObj = proxy_op;
      d.proxyStep.step = step;
    }, (void)0);
  return h;
}

void ncpu_prof_proxy_step_state(void *h, enum ncpu_prof_wait w, size_t trans) {
  static const ncclProfilerEventState_t STATE[] = {ncclProfilerProxyStepSendGPUWait, ncclProfilerProxyStepSendPeerWait_v4,
                                                  ncclProfilerProxyStepSendWait, ncclProfilerProxyStepRecvWait,
                                                  ncclProfilerProxyStepRecvGPUWait};
  if (!h) return;
  ncclProfilerEventStateArgs_v5_t a5 = {.proxyStep = {.transSize = trans}};
  ncclProfilerEventStateArgs_v4_t a4 = {.proxyStep = {.transSize = trans}};
  if (api == 6) p6->recordEventState(h, STATE[w], &a5);
  else if (api == 5) p5->recordEventState(h, STATE[w], &a5);
  else if (api == 4) p4->recordEventState(h, STATE[w], &a4);
}

/* NCCL's socket transport (src/transport/net_socket.cc) starts one per socket task,
 * under the step's handle, with plugin id NCCL_PROFILER_NET_TYPE_SOCK | 1. */
void ncpu_prof_net_socket(void *ctx, void *step, int fd, int is_send, size_t len) {
  void *h = NULL;
  if (!ctx || !step || !mask_has(ncclProfileNetPlugin)) return;
  ncclProfilerNetSockDescr_v1_t data = {.type = ncclProfileSocket,
                                        .sock = {.fd = fd, .op = is_send ? 0 : 1, .length = len}};
  START_EVENT(ctx, &h, {
    d.type = ncclProfileNetPlugin;
    d.parentObj = step;
    d.netPlugin.id = NCCL_PROFILER_NET_TYPE_SOCK | NCCL_PROFILER_NET_SOCKET_VER;
    d.netPlugin.data = &data;
  }, (void)0);
  ncpu_prof_stop(h);
}

void ncpu_prof_stop(void *h) {
  if (!h) return;
  if (api == 6) p6->stopEvent(h);
  else if (api == 5) p5->stopEvent(h);
  else if (api == 4) p4->stopEvent(h);
}
