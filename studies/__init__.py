"""The studies of results/: the on/off-policy sweep (experiment), the staleness study (staleness) and the
runner they share. Run from the repository root: `python -m studies.experiment`, `python -m studies.staleness`."""
