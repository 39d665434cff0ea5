/* the GGUF CPU kernels built for avx2 (see gguf_cpu.inc) */
#define DSQ_ISA "avx2"
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include "gguf_cpu.inc"
#include "intq_cpu.inc"
