/* Preloaded by tests (LD_PRELOAD) to make a process see MANY_CPUS processors (16 by
 * default) on a smaller machine, as thread pools size themselves from: sysconf, get_nprocs,
 * sched_getaffinity and pthread_getaffinity_np. Only what is read changes; threads still run on
 * the real cores. Built by tests/conftest.py with `cc -shared -fPIC`. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>
#include <dlfcn.h>

static int cpus(void) {
    const char *value = getenv("MANY_CPUS");
    int n = value ? atoi(value) : 16;
    return n > 0 && n <= 1024 ? n : 16;
}

long sysconf(int name) {
    static long (*real)(int);
    if (name == _SC_NPROCESSORS_ONLN || name == _SC_NPROCESSORS_CONF)
        return cpus();
    if (!real)
        real = (long (*)(int))dlsym(RTLD_NEXT, "sysconf");
    return real(name);
}

int get_nprocs(void) { return cpus(); }
int get_nprocs_conf(void) { return cpus(); }

static void fill(size_t size, cpu_set_t *mask) {
    memset(mask, 0, size);
    for (int i = 0; i < cpus() && (size_t)i < size * 8; i++)
        CPU_SET_S(i, size, mask);
}

int sched_getaffinity(pid_t pid, size_t size, cpu_set_t *mask) {
    (void)pid;
    fill(size, mask);
    return 0;
}

int pthread_getaffinity_np(pthread_t thread, size_t size, cpu_set_t *mask) {
    (void)thread;
    fill(size, mask);
    return 0;
}
