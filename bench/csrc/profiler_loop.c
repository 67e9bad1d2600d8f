/* profiler_loop PLUGIN|none N: the calls NCCL (2.28+, profiler API v5) makes
 * into a profiler plugin for one collective on 2 channels, N times; prints the
 * mean nanoseconds per operation. Per operation: a GroupApi event (offered by
 * NCCL, refused by Ingero's plugin), a CollApi event with its stream, stopped
 * as the call returns, a Group event, the Coll event (its parentObj the
 * CollApi event, its parentGroup the Group event) started and stopped, the
 * Group event stopped, and per channel a KernelCh start, its KernelChStop
 * state and its stop, with GPU timestamps taken from the host clock, and per
 * channel a send ProxyOp of two ProxySteps, each through the SendGPUWait and
 * SendWait states (what the plugin's proxy summaries cost). "none":
 * no plugin loaded, NCCL skips every call (only the loop's own clock reads
 * remain). Waits for a line on stdin first, so the benchmark can attach
 * probes to this process before the loop. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl_profiler_abi.h"

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static ncclProfiler_v5_t *p;
static void *ctx;

static void *start(ncclProfilerEventDescr_v5_t *d)
{
    void *h = NULL;
    if (p)
        p->startEvent(ctx, &h, d);
    return h;
}

static void one_op(uint64_t seq)
{
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileGroupApi;
    start(&d);
    d.type = ncclProfileCollApi;
    d.collApi.stream = (void *)0x7f0000001000;
    void *api = start(&d);
    if (p && api)
        p->stopEvent(api);
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileGroup;
    void *group = start(&d);
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileColl;
    d.parentObj = api;
    d.coll.parentGroup = group;
    d.coll.seqNumber = seq;
    d.coll.func = "AllReduce";
    d.coll.count = 1024;
    d.coll.datatype = "ncclFloat32";
    d.coll.nChannels = 2;
    d.coll.algo = "RING";
    d.coll.proto = "SIMPLE";
    void *op = start(&d);
    if (p && op)
        p->stopEvent(op);
    if (p && group)
        p->stopEvent(group);
    void *k[2];
    for (int c = 0; c < 2; c++) {
        memset(&d, 0, sizeof(d));
        d.type = ncclProfileKernelCh;
        d.parentObj = op;
        d.kernelCh.channelId = c;
        d.kernelCh.pTimer = now_ns();
        k[c] = start(&d);
    }
    /* the proxy thread's network transfers: per channel a send ProxyOp of two steps,
     * each through NCCL's send states (transport/net.cc) */
    for (int c = 0; c < 2; c++) {
        memset(&d, 0, sizeof(d));
        d.type = ncclProfileProxyOp;
        d.parentObj = op;
        d.proxyOp.channelId = c;
        d.proxyOp.peer = 1;
        d.proxyOp.nSteps = 2;
        d.proxyOp.chunkSize = 2048;
        d.proxyOp.isSend = 1;
        void *px = start(&d);
        for (int s = 0; s < 2; s++) {
            memset(&d, 0, sizeof(d));
            d.type = ncclProfileProxyStep;
            d.parentObj = px;
            d.proxyStep.step = s;
            void *st = start(&d);
            ncclProfilerEventStateArgs_v5_t a = {.proxyStep = {.transSize = 2048}};
            if (p && st) {
                p->recordEventState(st, ncclProfilerProxyStepSendGPUWait, &a);
                p->recordEventState(st, ncclProfilerProxyStepSendWait, &a);
                p->stopEvent(st);
            }
        }
        if (p && px)
            p->stopEvent(px);
    }
    for (int c = 0; c < 2; c++) {
        ncclProfilerEventStateArgs_v5_t a = {.kernelCh = {.pTimer = now_ns()}};
        if (p && k[c]) {
            p->recordEventState(k[c], ncclProfilerKernelChStop, &a);
            p->stopEvent(k[c]);
        }
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: profiler_loop PLUGIN|none N\n");
        return 2;
    }
    if (strcmp(argv[1], "none") != 0) {
        void *h = dlopen(argv[1], RTLD_NOW);
        if (!h || !(p = dlsym(h, "ncclProfiler_v5"))) {
            fprintf(stderr, "%s: no ncclProfiler_v5\n", argv[1]);
            return 1;
        }
        int mask;
        if (p->init(&ctx, 0x1234, &mask, "bench", 1, 2, 0, NULL) != ncclSuccess)
            return 1;
    }
    long n = atol(argv[2]);
    char line[64];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 1;
    uint64_t a = now_ns();
    for (long i = 0; i < n; i++)
        one_op((uint64_t)i);
    uint64_t b = now_ns();
    printf("%.1f\n", (double)(b - a) / n);
    if (p)
        p->finalize(ctx);
    return 0;
}
