/* Preloaded by tests (LD_PRELOAD) to stop a process (SIGSTOP) the moment it has removed the path
 * named by STOP_AFTER_UNLINK: a fixed point between a server's socket file going and its exit,
 * which a test would otherwise have to catch by polling faster than the server exits. Built by
 * tests/conftest.py with `cc -shared -fPIC`. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void stop_if_watched(const char *path, int result) {
    const char *watched = getenv("STOP_AFTER_UNLINK");
    if (result == 0 && watched && path && strcmp(path, watched) == 0)
        raise(SIGSTOP);
}

int unlink(const char *path) {
    static int (*real)(const char *);
    if (!real)
        real = (int (*)(const char *))dlsym(RTLD_NEXT, "unlink");
    int result = real(path);
    stop_if_watched(path, result);
    return result;
}

int unlinkat(int dirfd, const char *path, int flags) {
    static int (*real)(int, const char *, int);
    if (!real)
        real = (int (*)(int, const char *, int))dlsym(RTLD_NEXT, "unlinkat");
    int result = real(dirfd, path, flags);
    stop_if_watched(path, result);
    return result;
}
