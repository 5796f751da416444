"""Stream-ordered host functions and CUDA-graph capture of the speculative step."""
