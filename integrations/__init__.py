"""The same GRPO math inside other engines: TRL (trl_grpo, trl_bench) and verl (verl_grpo). Run from the
repository root as modules, e.g. `python -m integrations.trl_grpo`; they import the top-level concept files."""
