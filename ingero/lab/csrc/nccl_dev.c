/* nccl_dev.c: the lab's "device": where NCCL's work and the worker's compute
 * kernels run, and its timer.
 *
 * INGERO_LAB_DEVICE=cpu (the default): work runs in the calling thread when it
 * is enqueued, so an NCCL call returns once its data moved (host call time =
 * collective time).
 * INGERO_LAB_DEVICE=gpu: one device per process with streams: each a thread
 * that runs its work items in the order they were enqueued. Stream 0 is the
 * default stream (the worker's kernels; every cudaStream_t argument of
 * lab_device.h names it); the lab's NCCL gives each communicator a stream of
 * its own (nccl_cpu.c), as PyTorch gives each process group one. A stream
 * can be made to wait for what another had enqueued so far (ncpu_dev_join:
 * cudaEventRecord + cudaStreamWaitEvent). Enqueueing returns at once;
 * labStreamSynchronize blocks until every item enqueued on any stream before
 * it has run (the device). An item that fails makes the error sticky, as a
 * CUDA error is: later items of every stream are dropped, and every later
 * enqueue and synchronize returns it.
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
#define MAX_STREAMS 64      /* beyond: a communicator runs on the default stream */

struct stream;

struct item {
  struct item *next;
  ncpu_work_fn fn;          /* NULL: a wait for `on` to have run `ticket` items */
  void *arg;
  struct stream *on;
  uint64_t ticket;
};

struct stream {
  pthread_cond_t work;
  struct item *head, *tail;
  uint64_t enqueued, done;
  int started;
};

static struct {
  pthread_mutex_t mu;
  pthread_cond_t done_cv;   /* some item of some stream has run */
  struct stream s[MAX_STREAMS];
  int nstreams;             /* handed out so far; stream 0 is the default one */
  ncclResult_t error;       /* sticky */
  char msg[256];
  uint64_t raw0, gpu0;      /* the GPU timer's origin */
} dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER, .nstreams = 1};

static pthread_once_t mode_once = PTHREAD_ONCE_INIT, fork_once = PTHREAD_ONCE_INIT;
static int mode = -1;       /* 0 cpu, 1 gpu, -1 a bad INGERO_LAB_DEVICE */

static void read_mode(void) {
  const char *v = getenv("INGERO_LAB_DEVICE");
  mode = (!v || !*v || !strcmp(v, "cpu")) ? 0 : !strcmp(v, "gpu") ? 1 : -1;
}

static pthread_once_t streams_once = PTHREAD_ONCE_INIT;

static void streams_init(void) {
  for (int i = 0; i < MAX_STREAMS; i++) pthread_cond_init(&dev.s[i].work, NULL);
}

/* A forked child has the parent's queues but not their threads: it starts afresh
 * (the communicators it inherits keep their stream numbers, on fresh streams). */
static void after_fork_child(void) {
  pthread_mutex_init(&dev.mu, NULL);
  pthread_cond_init(&dev.done_cv, NULL);
  for (int i = 0; i < MAX_STREAMS; i++) {
    pthread_cond_init(&dev.s[i].work, NULL);
    dev.s[i].head = dev.s[i].tail = NULL;
    dev.s[i].enqueued = dev.s[i].done = 0;
    dev.s[i].started = 0;
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
  struct stream *s = arg;
  pthread_mutex_lock(&dev.mu);
  for (;;) {
    while (!s->head) pthread_cond_wait(&s->work, &dev.mu);
    struct item *it = s->head;
    s->head = it->next;
    if (!s->head) s->tail = NULL;
    if (!it->fn) {                      /* a wait for another stream */
      while (it->on->done < it->ticket) pthread_cond_wait(&dev.done_cv, &dev.mu);
    } else {
      int cancelled = dev.error != ncclSuccess;
      pthread_mutex_unlock(&dev.mu);
      ncclResult_t res = it->fn(it->arg, cancelled);
      const char *why = ncpu_thread_error();
      pthread_mutex_lock(&dev.mu);
      if (!cancelled && res != ncclSuccess && dev.error == ncclSuccess) {
        dev.error = res;
        snprintf(dev.msg, sizeof dev.msg, "%s", why && *why ? why : "device work failed");
      }
    }
    free(it);
    s->done++;
    pthread_cond_broadcast(&dev.done_cv);
  }
  return NULL;
}

int ncpu_dev_stream_new(void) {
  pthread_mutex_lock(&dev.mu);
  int k = dev.nstreams < MAX_STREAMS ? dev.nstreams++ : 0;
  pthread_mutex_unlock(&dev.mu);
  return k;
}

/* Appends `it` to stream k (starting its thread); on failure runs nothing and frees it. */
static ncclResult_t append(int k, struct item *it) {
  struct stream *s = &dev.s[k >= 0 && k < MAX_STREAMS ? k : 0];
  pthread_mutex_lock(&dev.mu);
  ncclResult_t err = dev.error;
  if (err == ncclSuccess && !s->started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, stream_main, s) == 0) s->started = 1;
    else err = ncclSystemError;
    pthread_attr_destroy(&attr);
  }
  if (err != ncclSuccess) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s", s->started ? dev.msg : "cannot start a device stream's thread");
    pthread_mutex_unlock(&dev.mu);
    if (it->fn) it->fn(it->arg, 1);
    free(it);
    ncpu_set_error(NULL, "%s", msg);
    return err;
  }
  if (s->tail) s->tail->next = it;
  else s->head = it;
  s->tail = it;
  s->enqueued++;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&dev.mu);
  return ncclSuccess;
}

ncclResult_t ncpu_dev_enqueue_on(int stream, ncpu_work_fn fn, void *arg) {
  if (!ncpu_dev_async()) return fn(arg, 0);
  pthread_once(&fork_once, register_fork);
  pthread_once(&streams_once, streams_init);
  struct item *it = malloc(sizeof *it);
  if (!it) { fn(arg, 1); return ncclSystemError; }
  *it = (struct item){NULL, fn, arg, NULL, 0};
  return append(stream, it);
}

ncclResult_t ncpu_dev_enqueue(ncpu_work_fn fn, void *arg) { return ncpu_dev_enqueue_on(0, fn, arg); }

ncclResult_t ncpu_dev_join(int waiter, int waitee) {
  if (!ncpu_dev_async() || waiter == waitee) return ncclSuccess;
  pthread_once(&fork_once, register_fork);
  pthread_once(&streams_once, streams_init);
  struct item *it = malloc(sizeof *it);
  if (!it) return ncclSystemError;
  struct stream *on = &dev.s[waitee >= 0 && waitee < MAX_STREAMS ? waitee : 0];
  pthread_mutex_lock(&dev.mu);
  *it = (struct item){NULL, NULL, NULL, on, on->enqueued};
  pthread_mutex_unlock(&dev.mu);
  return append(waiter, it);
}

ncclResult_t ncpu_dev_sync(void) {
  if (!ncpu_dev_async()) return ncclSuccess;
  uint64_t ticket[MAX_STREAMS];
  pthread_mutex_lock(&dev.mu);
  for (int i = 0; i < MAX_STREAMS; i++) ticket[i] = dev.s[i].enqueued;
  for (int i = 0; i < MAX_STREAMS; i++)
    while (dev.s[i].done < ticket[i]) pthread_cond_wait(&dev.done_cv, &dev.mu);
  ncclResult_t err = dev.error;
  char msg[256];
  snprintf(msg, sizeof msg, "%s", dev.msg);
  pthread_mutex_unlock(&dev.mu);
  if (err != ncclSuccess) ncpu_set_error(NULL, "%s", msg);
  return err;
}

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
  (void)stream;
  ncclResult_t res = ncpu_dev_check();
  if (res != ncclSuccess) return res;
  double *arg = malloc(sizeof *arg);
  if (!arg) return ncclSystemError;
  *arg = ms;
  return ncpu_dev_enqueue(kernel_run, arg);
}

ncclResult_t labStreamSynchronize(cudaStream_t stream) {
  (void)stream;
  ncclResult_t res = ncpu_dev_check();
  return res != ncclSuccess ? res : ncpu_dev_sync();
}
