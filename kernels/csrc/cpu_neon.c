/* dsq's CPU kernels built for neon (aarch64; the files as in cpu_avx2.c): NEON row dots at M = 1, and
 * integer dot products (SDOT) where the CPU has them, checked at run time */
#define DSQ_ISA "neon"
#define DSQ_NEON 1
#if !defined(__aarch64__) || !defined(__ARM_NEON)
#error "cpu_neon.c is for aarch64 (NEON) only"
#endif
#include <arm_neon.h>
#include "gguf_cpu.inc"
#include "moe_cpu.inc"
#include "intq_cpu.inc"
#include "norm_cpu.inc"
#include "read_cpu.inc"
#include "attn_cpu.inc"
#include "layer_cpu.inc"
