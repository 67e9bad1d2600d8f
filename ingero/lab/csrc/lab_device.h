/* lab_device.h: the few CUDA runtime calls a training step makes, for the lab's
 * device (nccl_dev.c, in libnccl.so.2 beside the NCCL API).
 *
 * INGERO_LAB_DEVICE=gpu: one stream per process, run by a device thread; a
 * launch returns at once. INGERO_LAB_DEVICE=cpu (default): a launch runs its
 * work in the calling thread before it returns. Every stream argument names
 * the process's one stream.
 */
#ifndef LAB_DEVICE_H_
#define LAB_DEVICE_H_

#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A compute "kernel" of `ms` milliseconds (a sleep on the device). */
ncclResult_t labLaunchKernel(double ms, cudaStream_t stream);

/* cudaStreamSynchronize: waits until all work enqueued so far has run; the
 * device's first error (sticky; ncclGetLastError(NULL) says what failed). */
ncclResult_t labStreamSynchronize(cudaStream_t stream);

/* 1 when the device is GPU-like (work runs later, on the device thread). */
int labDeviceAsync(void);

#ifdef __cplusplus
}
#endif
#endif
