/* The one piece of state the kernel families share: whether this process may use AMX tiles (attention.c and
 * linears.c ask it). Everything else they share is inline, in common.h. */
#include "common.h"

#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
/* Linux hands out AMX's tile state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
 * oneDNN asks too, and asking again is harmless. BATCHRUN_AMX=0 keeps the kernels off AMX (the AVX-512 paths,
 * as on a CPU without it). First asked outside any parallel region (packing a linear, or paged_attention). */
int amx_allowed(void) {
    static int state = 0; /* 1 granted, -1 refused or turned off */
    if (state == 0) {
        const char *env = getenv("BATCHRUN_AMX");
        state = (env == NULL || strcmp(env, "0") != 0) && syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return state > 0;
}
#endif
