/* lab_device.h: the few CUDA runtime calls a training step makes, for the lab's
 * device (nccl_dev.c, in libnccl.so.2 beside the NCCL API).
 *
 * INGERO_LAB_DEVICE=gpu: streams, each run by a device thread of its own (the
 * default stream NULL, and those labStreamCreate makes); a launch returns at
 * once, and different streams run side by side. INGERO_LAB_DEVICE=cpu
 * (default): a launch runs its work in the calling thread before it returns,
 * whatever its stream.
 */
#ifndef LAB_DEVICE_H_
#define LAB_DEVICE_H_

#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A compute "kernel" of `ms` milliseconds (a sleep on the device). */
ncclResult_t labLaunchKernel(double ms, cudaStream_t stream);

/* cudaStreamCreate: a stream of its own (at most 63 per process). */
ncclResult_t labStreamCreate(cudaStream_t *stream);

/* cudaEventRecord(e, on) + cudaStreamWaitEvent(waiter, e): the work enqueued on
 * `waiter` from now on starts after what `on` has been given so far has run. */
ncclResult_t labStreamWaitStream(cudaStream_t waiter, cudaStream_t on);

/* cudaStreamSynchronize: waits until the work enqueued on `stream` so far has
 * run; the device's first error (sticky; ncclGetLastError(NULL) says what failed). */
ncclResult_t labStreamSynchronize(cudaStream_t stream);

/* cudaDeviceSynchronize: the same for every stream. */
ncclResult_t labDeviceSynchronize(void);

/* 1 when the device is GPU-like (work runs later, on the device thread). */
int labDeviceAsync(void);

#ifdef __cplusplus
}
#endif
#endif
