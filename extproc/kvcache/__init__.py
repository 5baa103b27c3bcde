"""KV-cache block hashing and indexes (vLLM-compatible block hashes live in `vllm_hash`)."""
