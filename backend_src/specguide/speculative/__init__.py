"""One-model speculative decoding: drafters and batched acceptance."""
