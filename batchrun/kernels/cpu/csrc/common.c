/* The one state the families share: whether this process may use AMX tiles. */
#include "common.h"

#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
/* Linux grants AMX's tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA; asking again is
 * harmless). BATCHRUN_AMX=0 keeps the kernels off AMX. */
int amx_allowed(void) {
    static int state = 0; /* 1 granted, -1 refused or turned off */
    if (state == 0) {
        const char *env = getenv("BATCHRUN_AMX");
        state = (env == NULL || strcmp(env, "0") != 0) && syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return state > 0;
}
#endif
