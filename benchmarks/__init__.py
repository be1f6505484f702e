"""What a step costs, timed: run from the repository root.

bench.py       speed and memory of one GRPO step (`python -m benchmarks.bench`), beside stock TRL's
trl_bench.py   stock TRL's GRPOTrainer step on the same model and sizes (bench.py's --vs-trl)
compare.py     bench.py's configurations side by side in one process each
estimate.py    a step's seconds per phase at the benchmark shape, from FLOP and byte counts (a roofline floor)
token_timings.py  a sampled token's parts and the head's log-probs, each beside its textbook (--token-timings)
gpu_check.sh   every GPU check in one command (`bash benchmarks/gpu_check.sh`; GPU_CHECK_TINY=1 on a CPU)
gpu_checks.py  its correctness checks as a plain script, torch and transformers only (`python -m benchmarks.gpu_checks`)
"""
