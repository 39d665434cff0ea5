/* dsq's CPU kernels built for avx512: GGUF (gguf_cpu.inc; routed experts: moe_cpu.inc), int4/int8 and FP8
 * (intq_cpu.inc), RMS norm (norm_cpu.inc), decode attention (attn_cpu.inc), a whole decode layer (layer_cpu.inc) */
#define DSQ_ISA "avx512"
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include "gguf_cpu.inc"
#include "moe_cpu.inc"
#include "intq_cpu.inc"
#include "norm_cpu.inc"
#include "read_cpu.inc"
#include "attn_cpu.inc"
#include "layer_cpu.inc"
