/* nccl_prof.h: how the lab's NCCL calls a profiler plugin (nccl_prof.c).
 *
 * Plain C types only: nccl_prof.c includes NVIDIA's profiler ABI as mirrored in
 * ingero/csrc/nccl_profiler_abi.h, whose ncclResult_t and enum names
 * clash with nccl.h's, so the two never meet in one translation unit.
 * Not installed; not part of the NCCL API.
 */
#ifndef NCCL_PROF_H_
#define NCCL_PROF_H_

#include <stddef.h>
#include <stdint.h>

/* A communicator's plugin context (NULL: no plugin, or its init failed). The
 * plugin library is loaded by the first init and closed after the last finalize. */
void *ncpu_prof_init(uint64_t comm_hash, int nnodes, int nranks, int rank);
void ncpu_prof_finalize(void *ctx);

/* The event types the plugin asked for at its last init (NCCL keeps one mask). */
int ncpu_prof_wants_api(void);     /* GroupApi/CollApi/P2pApi events are started */
int ncpu_prof_wants_tasks(void);   /* Group, Coll, P2p events are started */
int ncpu_prof_wants_kernel(void);  /* KernelCh events are started */

/* Host, at the API call (NCCL 2.28+: profiler API v5 and v6 only; v4 never sees them). */
void *ncpu_prof_group_api_start(void *ctx, int group_depth);
void ncpu_prof_group_api_state(void *h, int end_api_start);  /* 0: GroupStartApiStop, 1: GroupEndApiStart */
void *ncpu_prof_call_api_start(void *ctx, void *group_api, int is_coll, const char *func, size_t count,
                               const char *datatype, int root, void *stream);

/* Host, at launch: the plan's group event, then one task event per operation. */
struct ncpu_prof_task {
  int is_coll;
  int rank;
  uint64_t seq;               /* collectives: per communicator and function */
  const char *func, *datatype, *algo, *proto;
  const void *sendbuff;
  void *recvbuff;
  size_t count;
  int root_or_peer;
  uint8_t nchannels;
  void *api;                  /* CollApi/P2pApi handle (v5+: parentObj) */
  void *group;                /* the plan's group handle (v4: parentObj; v5+: parentGroup) */
};
void *ncpu_prof_group_start(void *ctx);
void *ncpu_prof_task_start(void *ctx, const struct ncpu_prof_task *t);

/* Device (NCCL: its proxy thread), after the kernel wrote its stamps: a kernel
 * channel of the task `parent` started at GPU time `ptimer`; its stop. */
void *ncpu_prof_kch_start(void *ctx, void *parent, int channel, uint64_t ptimer);
void ncpu_prof_kch_stop(void *h, uint64_t ptimer);

/* Proxy (NCCL: its proxy progress thread; here the device thread that moves the
 * data over the sockets): a ProxyOp per operation, channel, peer and direction,
 * under the task `task`; a ProxyStep per transfer under it, its wait states
 * recorded as the socket waits, with a NetPlugin socket event naming its fd. */
enum ncpu_prof_wait { NCPU_SEND_GPU_WAIT, NCPU_SEND_PEER_WAIT, NCPU_SEND_WAIT, NCPU_RECV_WAIT, NCPU_RECV_GPU_WAIT };
void *ncpu_prof_proxy_op_start(void *ctx, void *task, int channel, int peer, int nsteps, int chunk, int is_send);
void *ncpu_prof_proxy_step_start(void *ctx, void *proxy_op, int step);
void ncpu_prof_proxy_step_state(void *step, enum ncpu_prof_wait w, size_t trans);
void ncpu_prof_net_socket(void *ctx, void *step, int fd, int is_send, size_t len);

void ncpu_prof_stop(void *h);      /* stopEvent of any handle; NULL is ignored */

#endif
