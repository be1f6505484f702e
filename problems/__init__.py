"""What the policy is asked and how its answers are scored, beside the built-in verifier (reward.py).

tasks.py          the tasks (arithmetic, GSM8K, word problems, MATH-style JSONL) and --dataset, read into Problems;
                  the prompts, chat template or not
prompts.py        what the loop feeds a step: the problems, a seeded prompt stream, each batch's scorer
user_rewards.py   --reward SPEC: reward functions of your own, called as TRL calls them, weighted
math_verifier.py  --task math's symbolic verifier: LaTeX answers compared with math-verify
"""
