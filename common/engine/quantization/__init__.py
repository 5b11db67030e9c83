"""FP8: linear layers whose weights are stored in float8_e4m3fn (fp8_linear.py), read from Hugging Face's and
llm-compressor's FP8 checkpoints or quantised at load time (fp8_checkpoint.py), and the FP8 KV cache
(kv_cache.py)."""
