"""The options beside [A]'s algorithm, chosen by flags; train.py's "options" section is where they enter the step.

    corrections.py   other engines' staleness corrections (AReaL's decoupled clip, TIS, MIS, at token, sequence or
                     geometric level), as the arguments they change in objective.policy_loss; how far alpha is from
                     pi_k (the rho' statistics)
    reinforce.py     [B]'s losses: REC, REC-IS, OPMD

[B]'s data shaping (AsymRE's baseline, RED-Drop, RED-Weight) is part of advantage.py's formula.
"""
