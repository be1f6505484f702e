"""What a run keeps and how it ends: train.py calls these in a line each, around the step.

run_io.py       the run folder (--out): claiming it, config.json, metrics.jsonl, completions.jsonl, summary.json,
                final/, curves.png, TensorBoard and wandb
manifest.py     what in --out is the run's: manifest.json lists every path it wrote, the rest is the user's
checkpoint.py   atomic checkpoints: written to a temporary name, hashed, fsynced, renamed into place
resume.py       what a checkpoint holds (`run_state`) and how a resume reads it back (`restore`)
fingerprints.py what the run was trained on (each reward's source, each local data file), checked on resume
metrics.py      a step's metrics row, the progress bar, the update's statistics, the phase timers
evaluation.py   held-out evaluation, and the completions --log-completions shows
harness.py      the loop's calls between steps: begin (resume or evaluate), attempt, record, end
diagnostics.py  what a step measures beside its loss: rho' and KL(alpha || pi_k), M2, sampler_mismatch
failures.py     divergence, Ctrl-C and SIGTERM, out of memory: each ends in one line
"""
