"""Quantization recipes, one YAML per DeepSeek model (installed as dsq.recipes).

Each gives the method and settings `dsq quantize --recipe NAME` applies, the calibration, the
layers kept 16-bit, the memory needed, and how to serve the result with llama.cpp / Ollama,
vLLM and SGLang (with tensor / pipeline / expert parallel sizes when one GPU is not enough).
"""
