"""Test harnesses: multi-process runs over UCX with fault injection, CUDA children."""
