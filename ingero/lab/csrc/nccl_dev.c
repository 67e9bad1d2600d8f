/* nccl_dev.c: the lab's "device": where NCCL's work and the worker's compute
 * kernels run, and its timer.
 *
 * INGERO_LAB_DEVICE=cpu (the default): work runs in the calling thread when it
 * is enqueued, so an NCCL call returns once its data moved (host call time =
 * collective time).
 * INGERO_LAB_DEVICE=gpu: one device per process with streams, as CUDA's: the
 * default stream (NULL) and those labStreamCreate makes (as PyTorch gives each
 * process group, i.e. each communicator, one), each a thread that runs its work
 * items in the order they were enqueued; different streams run side by side.
 * Enqueueing returns at once; labStreamWaitStream makes a stream's later work
 * wait for what another had been given so far (cudaEventRecord +
 * cudaStreamWaitEvent); labStreamSynchronize blocks until a stream has run what
 * was enqueued on it, labDeviceSynchronize (and the library's own waits) until
 * every stream has. An item that fails makes the error sticky for the device,
 * as a CUDA error is: later items are dropped, and every later enqueue and
 * synchronize returns it. A communicator's work must run on one stream at a
 * time (its sockets carry one operation after another), as NCCL requires of a
 * communicator's launches.
 *
 * The GPU timer (what a kernel reads from %globaltimer): CLOCK_MONOTONIC_RAW
 * run 25 ppm fast from an offset, the wall-clock time the device started. So
 * it is neither the host's CLOCK_MONOTONIC (a profiler plugin must fit offset
 * and drift to put device times on the host clock) nor any other rank's
 * timer (each process is its own GPU). Stamps are read by the device when the
 * work runs, never computed for it afterwards.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#pragma GCC visibility push(default)
#include "lab_device.h"
#pragma GCC visibility pop
#include "nccl_cpu_internal.h"

#define GPU_DRIFT_PPM 25
#define MAX_STREAMS 64

struct item {
  struct item *next;
  ncpu_work_fn fn;
  void *arg;
};

/* A stream: its queue, run in order by a thread of its own (started at its first
 * enqueue). The default stream (NULL) is streams[0]. */
struct CUstream_st {
  pthread_cond_t work;
  struct item *head, *tail;
  uint64_t enqueued, done;
  int started;
};

static struct {
  pthread_mutex_t mu;       /* every stream's queue and counters */
  pthread_cond_t done_cv;   /* some stream finished an item */
  struct CUstream_st streams[MAX_STREAMS];
  int nstreams;
  ncclResult_t error;       /* sticky, for the whole device */
  char msg[256];
  uint64_t raw0, gpu0;      /* the GPU timer's origin */
} dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER, .nstreams = 1,
         .streams[0] = {.work = PTHREAD_COND_INITIALIZER}};

static pthread_once_t mode_once = PTHREAD_ONCE_INIT, fork_once = PTHREAD_ONCE_INIT;
static int mode = -1;       /* 0 cpu, 1 gpu, -1 a bad INGERO_LAB_DEVICE */

static void read_mode(void) {
  const char *v = getenv("INGERO_LAB_DEVICE");
  mode = (!v || !*v || !strcmp(v, "cpu")) ? 0 : !strcmp(v, "gpu") ? 1 : -1;
}

static struct CUstream_st *stream_of(cudaStream_t s) { return s ? s : &dev.streams[0]; }

/* A forked child has the parent's queues but not their threads: it starts afresh
 * (the stream handles it inherited stay valid, empty). */
static void after_fork_child(void) {
  pthread_mutex_init(&dev.mu, NULL);
  pthread_cond_init(&dev.done_cv, NULL);
  for (int i = 0; i < dev.nstreams; i++) {
    struct CUstream_st *st = &dev.streams[i];
    pthread_cond_init(&st->work, NULL);
    st->head = st->tail = NULL;
    st->enqueued = st->done = 0;
    st->started = 0;
  }
  dev.error = ncclSuccess;
  dev.msg[0] = 0;
}

static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

ncclResult_t ncpu_dev_check(void) {
  pthread_once(&mode_once, read_mode);
  if (mode >= 0) return ncclSuccess;
  ncpu_set_error(NULL, "INGERO_LAB_DEVICE=%.40s: use cpu or gpu", getenv("INGERO_LAB_DEVICE"));
  return ncclInvalidArgument;
}

int ncpu_dev_async(void) {
  pthread_once(&mode_once, read_mode);
  return mode == 1;
}

int labDeviceAsync(void) { return ncpu_dev_async(); }

uint64_t ncpu_dev_raw(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static pthread_once_t timer_once = PTHREAD_ONCE_INIT;

static void timer_origin(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  dev.gpu0 = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  dev.raw0 = ncpu_dev_raw();
}

uint64_t ncpu_dev_timer(uint64_t raw) {
  pthread_once(&timer_once, timer_origin);
  int64_t d = (int64_t)(raw - dev.raw0);   /* negative for a stamp read before the origin was set */
  return dev.gpu0 + (uint64_t)(d + d / (1000000 / GPU_DRIFT_PPM));
}

static void *stream_main(void *arg) {
  struct CUstream_st *st = arg;
  pthread_mutex_lock(&dev.mu);
  for (;;) {
    while (!st->head) pthread_cond_wait(&st->work, &dev.mu);
    struct item *it = st->head;
    st->head = it->next;
    if (!st->head) st->tail = NULL;
    int cancelled = dev.error != ncclSuccess;
    pthread_mutex_unlock(&dev.mu);
    ncclResult_t res = it->fn(it->arg, cancelled);
    const char *why = ncpu_thread_error();
    free(it);
    pthread_mutex_lock(&dev.mu);
    if (!cancelled && res != ncclSuccess && dev.error == ncclSuccess) {
      dev.error = res;
      snprintf(dev.msg, sizeof dev.msg, "%s", why && *why ? why : "device work failed");
    }
    st->done++;
    pthread_cond_broadcast(&dev.done_cv);
  }
  return NULL;
}

ncclResult_t ncpu_dev_enqueue(void *stream, ncpu_work_fn fn, void *arg) {
  if (!ncpu_dev_async()) return fn(arg, 0);
  pthread_once(&fork_once, register_fork);
  struct CUstream_st *st = stream_of(stream);
  struct item *it = malloc(sizeof *it);
  if (!it) { fn(arg, 1); return ncclSystemError; }
  *it = (struct item){NULL, fn, arg};
  pthread_mutex_lock(&dev.mu);
  ncclResult_t err = dev.error;
  if (err == ncclSuccess && !st->started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, stream_main, st) == 0) st->started = 1;
    else err = ncclSystemError;
    pthread_attr_destroy(&attr);
  }
  if (err != ncclSuccess) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s", st->started ? dev.msg : "cannot start a device stream's thread");
    pthread_mutex_unlock(&dev.mu);
    free(it);
    fn(arg, 1);
    ncpu_set_error(NULL, "%s", msg);
    return err;
  }
  if (st->tail) st->tail->next = it;
  else st->head = it;
  st->tail = it;
  st->enqueued++;
  pthread_cond_signal(&st->work);
  pthread_mutex_unlock(&dev.mu);
  return ncclSuccess;
}

/* Under dev.mu: waits until stream `st` has run what was enqueued on it so far. */
static void drain(struct CUstream_st *st) {
  uint64_t ticket = st->enqueued;
  while (st->done < ticket) pthread_cond_wait(&dev.done_cv, &dev.mu);
}

/* Waits for `only` (NULL: every stream); the device's sticky error. */
static ncclResult_t sync_streams(struct CUstream_st *only) {
  if (!ncpu_dev_async()) return ncclSuccess;
  pthread_mutex_lock(&dev.mu);
  if (only) drain(only);
  else
    for (int i = 0; i < dev.nstreams; i++) drain(&dev.streams[i]);
  ncclResult_t err = dev.error;
  char msg[256];
  snprintf(msg, sizeof msg, "%s", dev.msg);
  pthread_mutex_unlock(&dev.mu);
  if (err != ncclSuccess) ncpu_set_error(NULL, "%s", msg);
  return err;
}

ncclResult_t ncpu_dev_sync(void) { return sync_streams(NULL); }

/* ---- the worker's side: kernels and synchronisation (lab_device.h) -------- */

static ncclResult_t kernel_run(void *arg, int cancelled) {
  double ms = *(double *)arg;
  free(arg);
  if (cancelled || ms <= 0) return ncclSuccess;
  struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000.0 * (long)(ms / 1000)) * 1e6)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
  return ncclSuccess;
}

ncclResult_t labLaunchKernel(double ms, cudaStream_t stream) {
  ncclResult_t res = ncpu_dev_check();
  if (res != ncclSuccess) return res;
  double *arg = malloc(sizeof *arg);
  if (!arg) return ncclSystemError;
  *arg = ms;
  return ncpu_dev_enqueue(stream, kernel_run, arg);
}

ncclResult_t labStreamCreate(cudaStream_t *stream) {
  if (!stream) return ncclInvalidArgument;
  pthread_mutex_lock(&dev.mu);
  int i = dev.nstreams < MAX_STREAMS ? dev.nstreams++ : -1;
  if (i >= 0) pthread_cond_init(&dev.streams[i].work, NULL);
  pthread_mutex_unlock(&dev.mu);
  if (i < 0) {
    ncpu_set_error(NULL, "labStreamCreate: the lab's device has at most %d streams", MAX_STREAMS);
    return ncclInvalidUsage;
  }
  *stream = &dev.streams[i];
  return ncclSuccess;
}

/* The item labStreamWaitStream enqueues: waits until a stream has run `ticket` items. */
struct wait_arg {
  struct CUstream_st *on;
  uint64_t ticket;
};

static ncclResult_t wait_run(void *arg, int cancelled) {
  struct wait_arg *w = arg;
  pthread_mutex_lock(&dev.mu);
  while (!cancelled && w->on->done < w->ticket) pthread_cond_wait(&dev.done_cv, &dev.mu);
  pthread_mutex_unlock(&dev.mu);
  free(w);
  return ncclSuccess;
}

ncclResult_t labStreamWaitStream(cudaStream_t waiter, cudaStream_t on) {
  ncclResult_t res = ncpu_dev_check();
  if (res != ncclSuccess || !ncpu_dev_async() || stream_of(waiter) == stream_of(on)) return res;
  struct wait_arg *w = malloc(sizeof *w);
  if (!w) return ncclSystemError;
  pthread_mutex_lock(&dev.mu);
  *w = (struct wait_arg){stream_of(on), stream_of(on)->enqueued};
  pthread_mutex_unlock(&dev.mu);
  return ncpu_dev_enqueue(waiter, wait_run, w);
}

ncclResult_t labStreamSynchronize(cudaStream_t stream) {
  ncclResult_t res = ncpu_dev_check();
  return res != ncclSuccess ? res : sync_streams(stream_of(stream));
}

ncclResult_t labDeviceSynchronize(void) {
  ncclResult_t res = ncpu_dev_check();
  return res != ncclSuccess ? res : sync_streams(NULL);
}
