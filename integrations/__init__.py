"""The same GRPO math inside other engines, past one GPU; run from the repository root as modules.

    trl_grpo.py    OffPolicyGRPOTrainer, [A]'s off-policy GRPO in TRL's GRPOTrainer (`python -m integrations.trl_grpo`)
    verl_grpo.py   the loss and advantage registered in verl

They import the algorithm files at the top (objective, advantage) and variants/reinforce.py. TRL's own test suite run
against the trainer: tests/trl_upstream.py.
"""
