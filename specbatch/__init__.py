"""specbatch: offline batch text generation with speculative decoding."""
