/* nccl_dev.c: the lab's "device": where NCCL's work and the worker's compute
 * kernels run, and its timer.
 *
 * INGERO_LAB_DEVICE=cpu (the default): work runs in the calling thread when it
 * is enqueued, so an NCCL call returns once its data moved (host call time =
 * collective time).
 * INGERO_LAB_DEVICE=gpu: one device per process with one stream: a thread that
 * runs work items in the order they were enqueued (all cudaStream_t arguments
 * name this one stream). Enqueueing returns at once; labStreamSynchronize
 * blocks until every item enqueued before it has run. An item that fails
 * makes the error sticky, as a CUDA error is: later items are dropped, and
 * every later enqueue and synchronize returns it.
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

struct item {
  struct item *next;
  ncpu_work_fn fn;
  void *arg;
};

static struct {
  pthread_mutex_t mu;
  pthread_cond_t work, done_cv;
  struct item *head, *tail;
  uint64_t enqueued, done;
  int started;
  ncclResult_t error;       /* sticky */
  char msg[256];
  uint64_t raw0, gpu0;      /* the GPU timer's origin */
} dev = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t mode_once = PTHREAD_ONCE_INIT, fork_once = PTHREAD_ONCE_INIT;
static int mode = -1;       /* 0 cpu, 1 gpu, -1 a bad INGERO_LAB_DEVICE */

static void read_mode(void) {
  const char *v = getenv("INGERO_LAB_DEVICE");
  mode = (!v || !*v || !strcmp(v, "cpu")) ? 0 : !strcmp(v, "gpu") ? 1 : -1;
}

/* A forked child has the parent's queue but not its thread: it starts afresh. */
static void after_fork_child(void) {
  pthread_mutex_init(&dev.mu, NULL);
  pthread_cond_init(&dev.work, NULL);
  pthread_cond_init(&dev.done_cv, NULL);
  dev.head = dev.tail = NULL;
  dev.enqueued = dev.done = 0;
  dev.started = 0;
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

static void *device_main(void *unused) {
  (void)unused;
  pthread_mutex_lock(&dev.mu);
  for (;;) {
    while (!dev.head) pthread_cond_wait(&dev.work, &dev.mu);
    struct item *it = dev.head;
    dev.head = it->next;
    if (!dev.head) dev.tail = NULL;
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
    dev.done++;
    pthread_cond_broadcast(&dev.done_cv);
  }
  return NULL;
}

ncclResult_t ncpu_dev_enqueue(ncpu_work_fn fn, void *arg) {
  if (!ncpu_dev_async()) return fn(arg, 0);
  pthread_once(&fork_once, register_fork);
  struct item *it = malloc(sizeof *it);
  if (!it) { fn(arg, 1); return ncclSystemError; }
  *it = (struct item){NULL, fn, arg};
  pthread_mutex_lock(&dev.mu);
  ncclResult_t err = dev.error;
  if (err == ncclSuccess && !dev.started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, device_main, NULL) == 0) dev.started = 1;
    else err = ncclSystemError;
    pthread_attr_destroy(&attr);
  }
  if (err != ncclSuccess) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s", dev.started ? dev.msg : "cannot start the device thread");
    pthread_mutex_unlock(&dev.mu);
    free(it);
    fn(arg, 1);
    ncpu_set_error(NULL, "%s", msg);
    return err;
  }
  if (dev.tail) dev.tail->next = it;
  else dev.head = it;
  dev.tail = it;
  dev.enqueued++;
  pthread_cond_signal(&dev.work);
  pthread_mutex_unlock(&dev.mu);
  return ncclSuccess;
}

ncclResult_t ncpu_dev_sync(void) {
  if (!ncpu_dev_async()) return ncclSuccess;
  pthread_mutex_lock(&dev.mu);
  uint64_t ticket = dev.enqueued;
  while (dev.done < ticket) pthread_cond_wait(&dev.done_cv, &dev.mu);
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
