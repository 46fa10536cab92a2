"""Llama-family models (Llama, Qwen2, Qwen3) written against the paged KV cache."""
