"""What running a real model needs: loading and fitting it, and the two fast paths train.py chooses in a line each.

policy.py            loading the policy (tiny, a GGUF file, any transformers causal LM), fitting it in memory
                     (bfloat16, gradient checkpointing, LoRA, micro-batch size), its optimizer, autocast
tiny.py              the built-in 1M-parameter policy and its tokenizer (its weights ship in tiny_policy/)
chunked_logprobs.py  logprobs.token_logprobs without the N x T x V logits (train.completion_logprobs)
decoding.py          rollout.sample's loop on a static KV cache, a CUDA graph on a GPU (train.sampling_loop)
compiled.py          --compile: torch.compile of the static path's sampling step and the head's chunk functions
memory.py            the memory plan: every byte of a step (weights, queue, decoders and graph pools, passes)
queue_fit.py         the queue of batches drawn ahead, in bytes, and a refusal of one that cannot fit
"""
