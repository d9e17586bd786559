# Llama 3 distributed training, reference implementation in C (and CUDA).
#   make            build every CPU target (and GPU targets when nvcc is found)
#   make run        train the `small` model on the built-in synthetic data, write a trace
#   make test       every CPU test (no GPU needed)
#   make bench      forward+backward+step timing against PyTorch on this CPU
#   make test-gpu   GPU kernels (also under compute-sanitizer) and training steps against the reference
#                   (needs a GPU: fails without one)
#   make bench-gpu  GPU training steps against PyTorch on the same GPU, seq 2048 and 8192: tokens/s,
#                   TFLOP/s, MFU (two conventions); attention alone against SDPA
#   make deps       install what the project needs on a fresh Debian machine (root)
BUILD ?= build
CC ?= cc
PYTHON := $(BUILD)/venv/bin/python

# ---- probe the machine (by pkg-config or by compiling, never by fixed paths) -------------------
have_pkg = $(shell pkg-config --exists $(1) 2>/dev/null && echo yes)
HAVE_CHECK := $(call have_pkg,check)
HAVE_CJSON := $(call have_pkg,libcjson)
HAVE_OPENBLAS := $(call have_pkg,openblas)
# Open MPI: its compiler wrapper gives the flags; every program links it (common/comm.c).
MPICC := $(shell command -v mpicc 2>/dev/null)
MPI_CFLAGS := $(if $(MPICC),$(shell $(MPICC) --showme:compile 2>/dev/null))
MPI_LIBS := $(if $(MPICC),$(shell $(MPICC) --showme:link 2>/dev/null))
# How the tests start ranks: oversubscribed (more ranks than cores), and as root where that is us.
MPIRUN := mpirun --oversubscribe$(if $(filter 0,$(shell id -u)), --allow-run-as-root)
NVCC := $(shell command -v nvcc 2>/dev/null)
# NCCL: found when a program including nccl.h links against -lnccl (next to nvcc's CUDA, or system-wide).
CUDA_HOME_FOUND := $(if $(NVCC),$(abspath $(dir $(NVCC))/..))
HAVE_NCCL := $(shell printf '\043include <nccl.h>\nint main(void){int v; return ncclGetVersion(&v);}' | \
  $(CC) -x c - -o /dev/null $(if $(CUDA_HOME_FOUND),-I$(CUDA_HOME_FOUND)/include -L$(CUDA_HOME_FOUND)/lib -L$(CUDA_HOME_FOUND)/lib64) \
  -lnccl 2>/dev/null && echo yes)
# CUPTI (the GPU timeline's per-kernel records): found when a program using it links against -lcupti.
HAVE_CUPTI := $(if $(CUDA_HOME_FOUND),$(shell printf '\043include <cupti.h>\nint main(void){uint64_t t; return cuptiGetTimestamp(&t);}' | \
  $(CC) -x c - -o /dev/null -I$(CUDA_HOME_FOUND)/include -I$(CUDA_HOME_FOUND)/extras/CUPTI/include \
  -L$(CUDA_HOME_FOUND)/lib64 -L$(CUDA_HOME_FOUND)/extras/CUPTI/lib64 -lcupti 2>/dev/null && echo yes))
HAVE_OPENMP := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo yes)

WARN := -Wall -Wextra -Wno-unused-parameter
CFLAGS ?= -O3 -march=native
CFLAGS += -std=gnu11 $(WARN) -I. -MMD -MP
# sqrtf and friends need not set errno: without this, the check for a negative input keeps every
# loop that takes a square root (AdamW's) scalar. Results are the same bits (sqrt is exact either way).
CFLAGS += -fno-math-errno
CFLAGS += $(EXTRA_CFLAGS)  # e.g. the lab grader quiets unused-variable warnings in skeletons
LDLIBS := -lm -lpthread
CFLAGS += $(MPI_CFLAGS)
LDLIBS += $(MPI_LIBS)
# Checked here rather than in `probe` so that a single target (make build/tests/test_x) says it too.
ifeq ($(MPI_LIBS)$(filter deps clean,$(MAKECMDGOALS)),)
  $(error Open MPI is required (ranks are MPI processes) but `mpicc --showme:link` failed: run 'make deps')
endif

ifeq ($(HAVE_CJSON),yes)
  CFLAGS += $(shell pkg-config --cflags libcjson)
  LDLIBS += $(shell pkg-config --libs libcjson)
endif
# Prefer Debian's OpenMP build of OpenBLAS (next to the default pthread build): it shares libgomp's
# thread pool with the reference's own parallel loops instead of spinning against it (20-35% faster
# steps here, a tenth of the system time). The rpath makes the binary load that build at run time.
OPENBLAS_LIBDIR := $(shell pkg-config --variable=libdir openblas 2>/dev/null)
OPENBLAS_OPENMP_DIR := $(if $(HAVE_OPENMP),$(wildcard $(subst openblas-pthread,openblas-openmp,$(OPENBLAS_LIBDIR))/libopenblas.so))
ifeq ($(HAVE_OPENBLAS),yes)
  CFLAGS += -DHAVE_OPENBLAS $(shell pkg-config --cflags openblas)
  ifneq ($(OPENBLAS_OPENMP_DIR),)
    OPENBLAS_KIND := openmp
    LDLIBS += -L$(dir $(OPENBLAS_OPENMP_DIR)) -Wl,-rpath,$(dir $(OPENBLAS_OPENMP_DIR)) -lopenblas
  else
    OPENBLAS_KIND := default
    LDLIBS += $(shell pkg-config --libs openblas)
  endif
endif
ifeq ($(HAVE_OPENMP),yes)
  CFLAGS += -fopenmp
  LDLIBS += -fopenmp
endif
# One OpenMP runtime per process. A compiler whose -fopenmp links LLVM's libomp (clang) would load it
# next to the libgomp that OpenBLAS's OpenMP build needs: two thread pools, and with OMP_PROC_BIND
# set, libgomp pins the process to one CPU as it loads, before libomp counts the CPUs (every thread
# then runs on that one). libomp also implements libgomp's interface, so $(BUILD)/omp/libgomp.so.1
# names it and the programs look there first (an RPATH, unlike a RUNPATH, also serves the libraries
# they load): OpenBLAS runs on the compiler's runtime.
LIBOMP := $(if $(HAVE_OPENMP),$(shell t=$$(mktemp) && printf '\043include <omp.h>\nint main(void){return omp_get_max_threads();}' | \
  $(CC) -fopenmp -x c - -o $$t 2>/dev/null && ldd $$t | awk '$$1 ~ /^libomp[.]so/ {print $$3}'; rm -f $$t))
ifeq ($(if $(LIBOMP),yes)$(OPENBLAS_KIND),yesopenmp)
  LIBOMP_AS_GOMP := $(abspath $(BUILD))/omp
  $(shell mkdir -p $(LIBOMP_AS_GOMP) && ln -sfn $(LIBOMP) $(LIBOMP_AS_GOMP)/libgomp.so.1)
  LDLIBS += -Wl,--disable-new-dtags,-rpath,$(LIBOMP_AS_GOMP)
endif
CHECK_LIBS := $(shell pkg-config --libs check 2>/dev/null)

# ---- sources ----------------------------------------------------------------------------------
COMMON_SRC := $(wildcard common/*.c)
# Chapter modules (ddp.c, ...) are built with the reference, in fp32 and float64; a chapter's
# chapters/NN_x/main_NAME.c is a program, build/NAME; chapters/10_trainer/train.c is the trainer.
CHAPTER_PROGRAM_SRC := $(wildcard chapters/*/main_*.c)
CHAPTER_SRC := $(filter-out $(CHAPTER_PROGRAM_SRC) chapters/10_trainer/train.c,$(wildcard chapters/*/*.c))
REF_SRC := $(wildcard reference_cpu/*.c) $(CHAPTER_SRC)
COMMON_OBJ := $(COMMON_SRC:%.c=$(BUILD)/obj/%.o)
REF32_OBJ := $(REF_SRC:%.c=$(BUILD)/obj/f32/%.o)
REF64_OBJ := $(REF_SRC:%.c=$(BUILD)/obj/f64/%.o)
LIBCOMMON := $(BUILD)/libcommon.a
LIBREF32 := $(BUILD)/libref32.a
LIBREF64 := $(BUILD)/libref64.a

LINK_INPUTS = $< $(filter %.o %.a,$^)  # a program rule: its one source file and the objects and libraries, not what its .d file added (headers, included .c files)
# tests/test_*.c run in fp32, tests/test64_*.c in the float64 build of the reference.
TEST32_SRC := $(wildcard tests/test_*.c)
TEST64_SRC := $(wildcard tests/test64_*.c)
TEST_BIN := $(TEST32_SRC:tests/%.c=$(BUILD)/tests/%) $(TEST64_SRC:tests/%.c=$(BUILD)/tests/%)

CHAPTER_PROGRAMS := $(foreach f,$(CHAPTER_PROGRAM_SRC),$(BUILD)/$(patsubst main_%.c,%,$(notdir $(f))))
PROGRAMS := $(BUILD)/train $(BUILD)/train64 $(CHAPTER_PROGRAMS)

.PHONY: all run test bench deps clean probe exercises grade print-lab-build
# Drivers that end-to-end test scripts run (tests/t_hf.sh), in fp32 and float64.
TEST_DRIVERS := $(BUILD)/tests/hf_driver $(BUILD)/tests/hf_driver64
all: probe $(PROGRAMS) $(TEST_DRIVERS) $(if $(HAVE_CHECK),$(TEST_BIN))

probe:
	@echo "probe: cc=$(CC) ($(shell $(CC) -dumpfullversion 2>/dev/null || $(CC) -dumpversion))" \
	  "openmp=$(or $(HAVE_OPENMP),no)$(if $(LIBOMP_AS_GOMP),:libomp-for-openblas) openblas=$(if $(HAVE_OPENBLAS),$(OPENBLAS_KIND),no) cjson=$(or $(HAVE_CJSON),no)" \
	  "check=$(or $(HAVE_CHECK),no) mpi=$(if $(MPICC),yes,no) nvcc=$(if $(NVCC),yes,no) nccl=$(or $(HAVE_NCCL),no) cupti=$(or $(HAVE_CUPTI),no)"
ifneq ($(HAVE_CJSON),yes)
	@echo "probe: libcjson is required (safetensors headers, JSON traces): run 'make deps'" && false
endif
ifneq ($(HAVE_CHECK),yes)
	@echo "probe: Check not found: test programs are skipped (run 'make deps')"
endif

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj/f32/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@
$(BUILD)/obj/f64/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DREF_FLOAT64 -c $< -o $@

$(LIBCOMMON): $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^
$(LIBREF32): $(REF32_OBJ)
	$(AR) rcs $@ $^
$(LIBREF64): $(REF64_OBJ)
	$(AR) rcs $@ $^

$(BUILD)/train: chapters/10_trainer/train.c $(LIBREF32) $(LIBCOMMON)
	$(CC) $(CFLAGS) $(LINK_INPUTS) -o $@ $(LDLIBS)
$(BUILD)/train64: chapters/10_trainer/train.c $(LIBREF64) $(LIBCOMMON)
	$(CC) $(CFLAGS) -DREF_FLOAT64 $(LINK_INPUTS) -o $@ $(LDLIBS)

# build/NAME from chapters/*/main_NAME.c
define chapter_program
$(BUILD)/$(patsubst main_%.c,%,$(notdir $(1))): $(1) $(LIBREF32) $(LIBCOMMON)
	$$(CC) $$(CFLAGS) $$(LINK_INPUTS) -o $$@ $$(LDLIBS)
endef
$(foreach f,$(CHAPTER_PROGRAM_SRC),$(eval $(call chapter_program,$(f))))

$(BUILD)/tests/test_%: tests/test_%.c $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LINK_INPUTS) -o $@ $(CHECK_LIBS) $(LDLIBS)
$(BUILD)/tests/test64_%: tests/test64_%.c $(LIBREF64) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DREF_FLOAT64 $(LINK_INPUTS) -o $@ $(CHECK_LIBS) $(LDLIBS)

$(BUILD)/tests/hf_driver: tests/hf_driver.c $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LINK_INPUTS) -o $@ $(LDLIBS)
$(BUILD)/tests/hf_driver64: tests/hf_driver.c $(LIBREF64) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DREF_FLOAT64 $(LINK_INPUTS) -o $@ $(LDLIBS)

# ---- GPU (gpu/): built only where nvcc is found; needs no GPU to build -----------------------
# Kernels (gpu/*.cu) for Hopper (sm_90a, the H100/H200) with warnings as errors; gpu/*.c is C on top
# of them (the GPU model), gpu/main_NAME.c a program, build/NAME. GPU programs link $(LIBGPU) and the
# CUDA runtime; tests/gpu/ holds the tests that need a device. Run alone, they print SKIP and exit 0
# without one; make test-gpu (scripts/test_gpu.sh) sets GPU_TEST_REQUIRE_DEVICE=1, so that they fail. tests/test_gpu_host.c (the host-side parts) is an ordinary test.
.PHONY: gpu test-gpu bench-gpu print-nvccflags
ifneq ($(NVCC),)
NVCCFLAGS := -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -I. -MMD -MP \
  -Xcompiler -Wall,-Wextra -Werror all-warnings
GPU_PROGRAM_SRC := $(wildcard gpu/main_*.c)
# The NCCL communicator (gpu/nccl.cu) and its test only where NCCL was found; gpu/no_nccl.c (no NCCL
# backend: device buffers are staged) elsewhere.
NO_NCCL_SRC := $(if $(HAVE_NCCL),gpu/no_nccl.c,gpu/nccl.cu tests/gpu/test_gpu_nccl.c)
# The per-kernel timeline from CUPTI where it was found; gpu/no_cupti.c (off, saying why) elsewhere.
NOT_CUPTI_SRC := $(if $(HAVE_CUPTI),gpu/no_cupti.c,gpu/cupti.c)
GPU_OBJ := $(patsubst %.cu,$(BUILD)/obj/%.o,$(filter-out $(NO_NCCL_SRC),$(wildcard gpu/*.cu))) \
  $(patsubst %.c,$(BUILD)/obj/%.o,$(filter-out $(GPU_PROGRAM_SRC) $(NOT_CUPTI_SRC) $(NO_NCCL_SRC),$(wildcard gpu/*.c)))
LIBGPU := $(BUILD)/libgpu.a
GPU_CFLAGS := -I$(CUDA_HOME_FOUND)/include -I$(CUDA_HOME_FOUND)/extras/CUPTI/include -Werror
GPU_LDLIBS := -L$(CUDA_HOME_FOUND)/lib64 -Wl,-rpath,$(CUDA_HOME_FOUND)/lib64 -lcublasLt -lcudart -lstdc++ \
  $(if $(HAVE_NCCL),-lnccl) $(if $(HAVE_CUPTI),-L$(CUDA_HOME_FOUND)/extras/CUPTI/lib64 -lcupti)
GPU_TEST_BIN := $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(filter-out $(NO_NCCL_SRC),$(wildcard tests/gpu/test_*.c)))
GPU_PROGRAMS := $(GPU_TEST_BIN) $(foreach f,$(GPU_PROGRAM_SRC),$(BUILD)/$(patsubst main_%.c,%,$(notdir $(f)))) \
  $(BUILD)/train-cuda

$(BUILD)/obj/gpu/%.o: gpu/%.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
$(BUILD)/obj/gpu/%.o: gpu/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(GPU_CFLAGS) -c $< -o $@
$(LIBGPU): $(GPU_OBJ)
	$(AR) rcs $@ $^
$(BUILD)/tests/gpu/%: tests/gpu/%.c $(LIBGPU) $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(GPU_CFLAGS) $(LINK_INPUTS) -o $@ $(GPU_LDLIBS) $(LDLIBS)
# The trainer with the GPU library (--device cuda; build/train hands over to it). $(LIBGPU) comes
# before the reference's library so that gpu/strategy.c's cuda_strategy_create is the one linked.
$(BUILD)/train-cuda: chapters/10_trainer/train.c $(LIBGPU) $(LIBREF32) $(LIBCOMMON)
	$(CC) $(CFLAGS) $(GPU_CFLAGS) $(LINK_INPUTS) -o $@ $(GPU_LDLIBS) $(LDLIBS)
$(BUILD)/%: gpu/main_%.c $(LIBGPU) $(LIBREF32) $(LIBCOMMON)
	$(CC) $(CFLAGS) $(GPU_CFLAGS) $(LINK_INPUTS) -o $@ $(GPU_LDLIBS) $(LDLIBS)

# The FP8 cast oracle (chapter 9): cuda_fp8.h's host conversions against chapters/09_fp8/fp8_cast.c,
# a plain C++ program (no device code), run by tests/t_fp8_cast.sh.
FP8_ORACLE := $(BUILD)/tests/fp8_oracle
$(FP8_ORACLE): tests/fp8_oracle.cpp $(BUILD)/obj/f32/chapters/09_fp8/fp8_cast.o
	@mkdir -p $(dir $@)
	$(CXX) -O2 -std=c++17 -I. -I$(CUDA_HOME_FOUND)/include $(WARN) -Werror $(LINK_INPUTS) -o $@

all: gpu $(FP8_ORACLE)
gpu: $(LIBGPU) $(GPU_PROGRAMS)
test-gpu: gpu
	GPU_TEST_REQUIRE_DEVICE=1 BUILD=$(BUILD) MPIRUN="$(MPIRUN)" scripts/test_gpu.sh
bench-gpu: gpu
	BUILD=$(BUILD) scripts/bench_gpu.sh
print-nvccflags:
	@echo $(NVCCFLAGS)
else
gpu bench-gpu:
	@echo "SKIP: nvcc not found, so no GPU target is built (make probe)"
test-gpu:  # it checks a GPU, so without one it fails (make test runs what needs no GPU)
	@echo "test-gpu: nvcc not found, so no GPU target is built (make probe): nothing was tested" >&2; exit 1
endif

# ---- the GPU kernels on the CPU (tests/gpu/emu): needs a C++ compiler, not CUDA ---------------
# gpu/*.cu compiled as C++ against the emulator's cuda_runtime.h (threads as fibers, real barriers),
# linked with the GPU test programs: build/tests/emu/test_gpu_* run tests/gpu/'s checks here.
EMU_CXXFLAGS := -std=c++17 -O2 -I tests/gpu/emu/include -I. -DGPU_EMULATOR $(WARN) -Wno-unknown-pragmas -Werror -MMD -MP
# The emulator has its own NCCL (tests/gpu/emu/nccl.cpp: ranks are processes, data goes through
# shared memory), so gpu/nccl.cu is built and gpu/no_nccl.c is not.
EMU_OBJ := $(patsubst gpu/%.cu,$(BUILD)/obj/emu/%.o,$(filter-out gpu/matmul.cu gpu/runtime.cu,$(wildcard gpu/*.cu))) \
  $(BUILD)/obj/emu/emu.o $(BUILD)/obj/emu/emu_nccl.o \
  $(patsubst gpu/%.c,$(BUILD)/obj/emu/%.o,$(filter-out gpu/main_%.c gpu/cupti.c gpu/no_nccl.c,$(wildcard gpu/*.c)))
EMU_TEST_BIN := $(patsubst tests/gpu/%.c,$(BUILD)/tests/emu/%,$(wildcard tests/gpu/test_*.c)) \
  $(BUILD)/tests/emu/test_emulator $(BUILD)/tests/emu/train $(BUILD)/tests/emu/bench_gpu
ifneq ($(shell command -v $(CXX) 2>/dev/null),)
all: $(EMU_TEST_BIN)
endif
$(BUILD)/obj/emu/%.o: gpu/%.cu
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -x c++ -c $< -o $@
$(BUILD)/obj/emu/emu.o: tests/gpu/emu/emu.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@
$(BUILD)/obj/emu/emu_nccl.o: tests/gpu/emu/nccl.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -c $< -o $@
$(BUILD)/obj/emu/%.o: gpu/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DGPU_EMULATOR -Werror -c $< -o $@
$(BUILD)/tests/emu/test_emulator: tests/gpu/emu/test_emulator.cpp $(EMU_OBJ) $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) $(LINK_INPUTS) -o $@ $(LDLIBS)
# The trainer with --device cuda on the emulator (tests/t_gpu_trainer.sh).
$(BUILD)/tests/emu/train: chapters/10_trainer/train.c $(EMU_OBJ) $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Werror $(LINK_INPUTS) -o $@ -lstdc++ $(LDLIBS)
# The GPU benchmark on the emulator (tests/t_gpu_emulated.sh runs scripts/bench_gpu.sh with it:
# the times are the emulator's, the plumbing from its lines to a planner profile is what is tested).
$(BUILD)/tests/emu/bench_gpu: gpu/main_bench_gpu.c $(EMU_OBJ) $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Werror $(LINK_INPUTS) -o $@ -lstdc++ $(LDLIBS)
$(BUILD)/tests/emu/%: tests/gpu/%.c $(EMU_OBJ) $(LIBREF32) $(LIBCOMMON)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Werror $(LINK_INPUTS) -o $@ -lstdc++ $(LDLIBS)

# ---- the two commands of the README, and the rest ---------------------------------------------
RUN_FLAGS ?= --model small --steps 150 --batch 4 --seq-len 128 --lr 1e-3 --log-every 10 --trace $(BUILD)/small.pftrace
run: all
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-2} $(BUILD)/train $(RUN_FLAGS)

test: all
	BUILD=$(BUILD) PYTHON=$(PYTHON) MPIRUN="$(MPIRUN)" tests/run_tests.sh

bench: all
	BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/bench.sh

# Labs: skeletons generated from the chapters' LAB markers; `make grade LAB=ring` scores yours
# (FIRST=1: stop at the first failing check; GRADE_CHECK_TIMEOUT=S: each check's time limit).
# make exercises never overwrites a skeleton you edited; FORCE=1 keeps yours as FILE.edited instead
# (FILE.edited.2, ... when an earlier one is there).
exercises:
	$(PYTHON) scripts/make_exercises.py $(if $(FORCE),--force)
# LAB and FIRST are checked as make reads them, before the libraries are built (one line, exit 2):
# LAB is one of the labs letter for letter (grade.sh checks it again); FIRST=0 is off, not "set".
GRADE_LABS := $(patsubst exercises/%/FILES,%,$(wildcard exercises/*/FILES))
GRADE_LAB_OK = $(strip $(foreach l,$(GRADE_LABS),$(and $(findstring $(LAB),$(l)),$(findstring $(l),$(LAB)),$(l))))
GRADE_FIRST_OK = $(if $(filter 0 1,$(words $(FIRST))),$(if $(filter-out 0 1,$(FIRST)),,ok))
grade: $(if $(filter grade,$(MAKECMDGOALS)),$(if $(GRADE_LAB_OK),,$(error grade: unknown lab '$(LAB)' (make grade LAB=NAME; labs: $(GRADE_LABS))))$(if $(GRADE_FIRST_OK),,$(error grade: FIRST=$(FIRST): must be 1 (stop at the first failing check) or 0))) $(LIBREF32) $(LIBCOMMON)
	@BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/grade.sh "$(LAB)" $(if $(filter 1,$(FIRST)),--first-failure)
# What scripts/grade.sh needs to compile one lab file and link it against the libraries above.
print-lab-build:
	@printf "LAB_CC='%s'\nLAB_CFLAGS='%s'\nLAB_LDLIBS='%s'\nLAB_CHECK_LIBS='%s'\n" "$(CC)" "$(CFLAGS)" "$(LDLIBS)" "$(CHECK_LIBS)"

deps:
	BUILD=$(BUILD) scripts/deps.sh

clean:
	rm -rf $(BUILD)/obj $(BUILD)/tests $(BUILD)/*.a $(PROGRAMS) $(GPU_PROGRAMS)

# Header dependencies (-MMD) of every object and program; a program's .d lists the headers its
# main file includes, so its link rule takes $(LINK_INPUTS), the prerequisites without them.
-include $(shell find $(BUILD) -name '*.d' -not -path '$(BUILD)/venv/*' -not -path '$(BUILD)/bench-venv/*' 2>/dev/null)
