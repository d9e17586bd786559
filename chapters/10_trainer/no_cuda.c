// no_cuda.c: `--device cuda` in a build without CUDA. Where nvcc is found, the trainer links
// gpu/strategy.c, whose cuda_strategy_create is found first; this one is then never linked.
#include "chapters/10_trainer/trainer.h"
#include "common/log.h"

Strategy *cuda_strategy_create(Trainer *t, const ModelConfig *cfg, uint64_t seed, const LayoutOptions *o) {
    (void)t, (void)cfg, (void)seed, (void)o;
    fatal_input("--device cuda: this build has no CUDA (nvcc was not found when it was built: see make probe)");
}
