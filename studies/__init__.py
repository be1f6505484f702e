"""The studies behind results/: each writes its tables and figures there. Run from the repository root as modules,
e.g. `python -m studies.staleness`.

    experiment.py       [A]'s on/off-policy sweep
    staleness.py        the staleness study: corrections x v x inner steps x lr
    very_stale.py       how stale can it go: a constant lag up to 256 x six corrections (M2PO, OPSM among them)
    real_staleness.py   the same on SmolLM2-135M-Instruct (LoRA)
    trl_staleness.py    stock TRL's stale sampler beside ours
    drift.py            how far alpha drifts from pi_theta per recipe, against the gap
    moved.py            how far a rerun moved a study's results
    clip_example.py     [A]'s clip acting on one token of a real run: rho, rho', the interval (docs/design.md)
    real_model_measure.py, real_model_completions.py, real_model_eval.py
                        SmolLM2's base rates, completions before and after, a checkpoint's held-out accuracy
    verifier_probe.py   the math verifier against math-verify on the shipped golds (results/verifier_probe.md)
    runner.py           what the studies share: runs as subprocesses, tables, mean and sd
"""
