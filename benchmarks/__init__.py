"""Speed and memory of one GRPO step (bench) and the GPU checks (gpu_check.sh). Run from the repository root:
`python -m benchmarks.bench`, `bash benchmarks/gpu_check.sh`."""
