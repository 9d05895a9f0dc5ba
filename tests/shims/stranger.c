/* A native library whose load starts a thread that no fork handler stops (a stand-in for a
 * library overmind knows nothing of): its constructor starts "om-stranger", which waits for ever. */
#define _GNU_SOURCE
#include <pthread.h>
#include <unistd.h>

static void *wait_for_ever(void *arg) {
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

__attribute__((constructor)) static void start(void) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, wait_for_ever, NULL) == 0) {
        pthread_setname_np(thread, "om-stranger");
        pthread_detach(thread);
    }
}
