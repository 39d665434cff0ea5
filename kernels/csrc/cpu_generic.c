/* the GGUF CPU kernels built for generic (see gguf_cpu.inc) */
#define DSQ_ISA "generic"
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include "gguf_cpu.inc"
#include "intq_cpu.inc"
