// A backtrace for a process that dies of SIGSEGV/SIGBUS where no debugger can attach (e.g.
// under compute-sanitizer, whose injection conflicts with cuda-gdb's). Build and preload:
//   gcc -shared -fPIC -O1 -o segv-backtrace.so scripts/segv-backtrace.c
//   compute-sanitizer --tool racecheck env LD_PRELOAD=$PWD/segv-backtrace.so megainfer ...
// On the fault it prints the faulting thread's frames (library + offset) and /proc/self/maps to
// stderr, then dies of the same signal. Installed before main, so Rust's runtime (which only
// installs its stack-overflow handler over the default action) leaves it in place.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static void handler(int sig, siginfo_t *si, void *ctx) {
    void *buf[64];
    int n = backtrace(buf, 64);
    char msg[128];
    int len = snprintf(msg, sizeof msg, "SEGV-HANDLER sig %d addr %p tid %d\n", sig, si->si_addr, gettid());
    write(2, msg, len);
    backtrace_symbols_fd(buf, n, 2);
    int fd = open("/proc/self/maps", O_RDONLY);
    char m[65536];
    int r;
    while ((r = read(fd, m, sizeof m)) > 0) write(2, m, r);
    signal(sig, SIG_DFL);
    raise(sig);
}
__attribute__((constructor)) static void init(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGBUS, &sa, 0);
}
