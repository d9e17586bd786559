// no_cuda.c: `--device cuda` in the trainer built without the GPU library (build/train). The CUDA
// libraries are large and slow to load, so build/train leaves them out and, when asked for the GPU,
// hands the whole command over to build/train-cuda (the same program linked with gpu/strategy.c),
// found next to it; where nvcc was not found there is none, and the request is refused.
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "chapters/10_trainer/trainer.h"
#include "common/log.h"

void trainer_cuda_start(char **argv) {
    char self[PATH_MAX], target[PATH_MAX + 16];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
        char *slash = strrchr(self, '/');
        if (slash) *slash = 0;
        snprintf(target, sizeof target, "%s/train-cuda", self);
        if (access(target, X_OK) == 0) {
            execv(target, argv);
            fatal("--device cuda: could not start %s", target);
        }
    }
    fatal_input("--device cuda: this build has no CUDA (nvcc was not found when it was built, so there is no "
                "train-cuda next to train: see make probe)");
}

Strategy *cuda_strategy_create(Trainer *t, const ModelConfig *cfg, const ParamSource *init, const LayoutOptions *o) {
    (void)t, (void)cfg, (void)init, (void)o;
    fatal_input("--device cuda: this program was built without CUDA");
}
