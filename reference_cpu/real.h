// real.h: the reference computes in `real`: float normally, double in the float64 build
// (compiled from the same sources with -DREF_FLOAT64, used for finite-difference gradient checks).
#pragma once
#include <math.h>

#include "reference_cpu/exp_f32.h"

#ifdef REF_FLOAT64
typedef double real;
#define REAL_NAME "F64"
#define COMM_REAL COMM_FLOAT64  // the communicator's datatype for real (common/comm.h)
#define rsqrt_r(x) (1.0 / sqrt(x))
#define exp_r exp
#define log_r log
#define log1p_r log1p
#define sqrt_r sqrt
#define fma_r fma
#define cos_r cos
#define sin_r sin
#else
typedef float real;
#define REAL_NAME "F32"
#define COMM_REAL COMM_FLOAT32
#define rsqrt_r(x) (1.0f / sqrtf(x))
#define exp_r exp_f32  // vectorisable, within 1 ulp (exp_f32.h)
#define log_r logf
#define log1p_r log1pf
#define sqrt_r sqrtf
#define fma_r fmaf
#define cos_r cosf
#define sin_r sinf
#endif
