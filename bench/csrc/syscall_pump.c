/* syscall_pump RATE SECONDS: getppid() RATE times a second for SECONDS,
 * paced every millisecond; waits for a line on stdin first. Prints the
 * number of calls made. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: syscall_pump RATE SECONDS\n"); return 2; }
    double rate = atof(argv[1]), secs = atof(argv[2]);
    char line[16];
    printf("ready\n"); fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    double t0 = now();
    long done = 0;
    for (;;) {
        double el = now() - t0;
        if (el >= secs) break;
        long due = (long)(el * rate);
        while (done < due) { syscall(SYS_getppid); done++; }
        struct timespec ms = {0, 200000};
        nanosleep(&ms, NULL);
    }
    printf("%ld\n", done);
    return 0;
}
