"""HF safetensors directories <-> GGUF files, through the architecture registry (dsq.models)."""
