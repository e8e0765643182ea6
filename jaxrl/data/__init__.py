"""Data: tokenizers (byte-level, Hugging Face tokenizer.json, a trained BPE), data files (jsonl,
parquet) and their rows, chat templates, the synthetic tasks, grain prompt pipelines, preference
pairs, and the CPU GSM8K assets (gsm8k_synth.py, gsm8k_tiny.py)."""
