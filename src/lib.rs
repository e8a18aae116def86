//! metrale: an LLM inference engine for Qwen3 dense and hybrid Qwen3.5 / Qwen3-Next models.
